"""Worker side: the score store, compaction, and the per-step physical view.

One `WorkerEviction` per worker process (one model runner per process in vLLM
V1). It is created by the first attention backend that sees eviction enabled.
At pipeline parallel it holds only its stage's layers: every stage gets the
same plans (one SchedulerOutput) and scores and compacts its own layers, so
physical lengths agree across stages by construction.

Per layer it keeps a score buffer beside the KV cache (H2O only; the other
policies' buffers are empty):

    scores[layer]: (num_kv_heads, num_blocks * block_size) float32
                   accumulated attention received by the token in each slot

Scores live at the same (block, offset) slots as the KV they describe, so
compaction moves them with the KV, and a slot's score is zeroed whenever a new
token is written there (a reused block never inherits stale importance). A
request whose first blocks may be shared (prefix hit, prompt modules) keeps
the scores of those tokens in private rows until its first compaction
(core/scoring/private_scores.py), so no two requests ever add into one slot.

One file because `WorkerEviction` is one process's state, read and changed by
every step hook (begin_step, placement, compaction, metrics); it splits by
concern once policies own their scoring and blocks are decided in the core.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_kvevict.core.scoring.chunk_log import ChunkLog
from vllm_kvevict.core.eviction.compaction import by_age, fill_holes, slot_order
from vllm_kvevict.core.config.settings import EvictionConfig
from vllm_kvevict.core.layouts.cpu_layout import token_slots
from vllm_kvevict.core.scoring.decode_log import DecodeQueryLog, StepPlacement
from vllm_kvevict.core.offload.host_tier import HostTier
from vllm_kvevict.core.eviction.kernel_dispatch import (
    cpu_path,
    log_cpu_path_once,
    triton_module,
    use_triton,
)
from vllm_kvevict.core.layouts.layer_stack import LayerCache, LayerStack
from vllm_kvevict.core.eviction.plans import STEP_ATTR, CompactionPlan, EvictionStep
from vllm_kvevict.core.policies import make_policy
from vllm_kvevict.core.scoring.private_scores import PrivateScores, restore
from vllm_kvevict.core.scoring.query_window import QueryWindow
from vllm_kvevict.integration.metrics import Snapshot
from vllm_kvevict.integration.offload_attention import (
    OffloadState,
    evicted_entries,
    host_tier,
)
from vllm_kvevict.integration.settings import parallel_ranks


class WorkerEviction:
    def __init__(self, cfg: EvictionConfig, block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.policy = make_policy(cfg.policy, cfg.sink, cfg.window)
        self.layers: dict[str, LayerCache] = {}
        self.runner = None  # the GPUModelRunner (or subclass) of this process
        self.evicted: dict[str, int] = {}
        # req_id -> (L_all, H, P) int32 slot of each resident token, oldest first,
        # after its last compaction (fill_holes leaves slots out of order):
        # 4 bytes per resident token and head, beside 4 * D bytes of its KV.
        self.order: dict[str, torch.Tensor] = {}
        self.decode_log = DecodeQueryLog()
        self.chunk_log = ChunkLog()  # h2o: short prefill chunks, scored next step
        self.private = PrivateScores()  # h2o: scores of shared first blocks
        self.query_window = QueryWindow(cfg.window)  # used by snapkv/andpro only
        self.num_windowless = 0  # snapkv/andpro compactions that found no window
        self._stack_cache: list[LayerStack] | None = None
        self.unscored: set[str] = set()  # requests that never compact: no scoring
        self.arriving: set[str] = set()  # during begin_step: this step's new requests
        self._step_open = False  # a begin_step not yet matched by place_queries
        self.compaction_seconds = 0.0
        self._snapshot: Snapshot | None = None
        # Offload (InfiniGen): integration/offload_attention.py, set at init.
        self.offload: OffloadState | None = None

    @property
    def host(self) -> HostTier | None:
        """The offload host tier, once made (None without offload)."""
        return None if self.offload is None else self.offload.tier

    # --- registration ---------------------------------------------------------

    def layer(self, name: str, kv_cache: torch.Tensor,
              make_layout: Callable[[torch.Tensor], Any]) -> LayerCache:
        """The layer's cache, layout and score buffer (made on first sight)."""
        lc = self.layers.get(name)
        if lc is None or lc.kv_cache.data_ptr() != kv_cache.data_ptr():
            layout = make_layout(kv_cache)
            # The kernel's block size is final only once caches exist (on CUDA
            # vLLM may change it after model load): trust the cache.
            self.block_size = layout.block_size
            key_cache, _ = layout.split(kv_cache)
            # Only a policy that accumulates attention per slot (h2o) gets a
            # score buffer; the others hold an empty one (no memory, same code).
            slots = key_cache.shape[0] * layout.block_size if self.policy.needs_scores else 0
            scores = torch.zeros(layout.num_kv_heads, slots, dtype=torch.float32,
                                 device=kv_cache.device)
            lc = LayerCache(kv_cache, layout, scores)
            self.layers[name] = lc
            self._stack_cache = None  # the layer set changed: re-stack on next use
        return lc

    # --- per step (called before the runner's _update_states) -------------------

    def begin_step(self, runner, scheduler_output) -> None:
        self.runner = runner
        self._step_open = True
        step: EvictionStep | None = getattr(scheduler_output, STEP_ATTR, None)
        if step is None:
            return
        # Freed blocks may already belong to someone else: forget queries that
        # would read them. Then score what waits for requests about to move.
        for log in (self.decode_log, self.query_window, self.chunk_log):
            log.drop(step.released)
            log.drop(scheduler_output.finished_req_ids)
        self.unscored.difference_update(step.released)
        self.unscored.difference_update(scheduler_output.finished_req_ids)
        for req_id in (*step.released, *scheduler_output.finished_req_ids):
            self.order.pop(req_id, None)  # its blocks are gone (or refilled in order)
            self.private.drop([req_id])
            if self.host is not None:  # both tiers go together
                self.host.free(req_id)
        self.unscored.update(step.unscored)
        if self.policy.needs_scores:
            for req_id, n in step.shared_prefix.items():
                if req_id not in self.unscored:
                    self.private.open(req_id, n)
        self.chunk_log.flush(self._stacks(), self._block_ids, self._private_of)
        self.decode_log.flush([p.req_id for p in step.plans], self._stacks(), self._block_ids,
                              self._private_of)
        if step.plans:
            start = time.perf_counter()  # CPU: the work; CUDA: its launch (async)
            self.arriving = {r.req_id for r in scheduler_output.scheduled_new_reqs}
            try:
                for plan in step.plans:
                    if (plan.req_id in scheduler_output.finished_req_ids
                            and plan.req_id not in self.arriving):
                        # It ends this step (the runner drops it below): its blocks
                        # are no longer this request's to write. The scheduler makes
                        # no such plan (spec.py); a KV connector that delays frees could.
                        continue
                    self._compact(plan)
            finally:
                self.arriving = set()
            self.compaction_seconds += time.perf_counter() - start
            self._write_metrics()
        self.evicted = step.evicted

    def _write_metrics(self) -> None:
        if self._snapshot is None:
            self._snapshot = Snapshot("worker")
        values = {"role": "worker", "rank": _worker_rank(), "scoring_path": cpu_path(),
                  "compaction_seconds": self.compaction_seconds}
        if self.offload is not None:  # offload: what the host tier took (none before it exists)
            values["host_entries_offloaded"] = self.host.stats.entries_offloaded if self.host else 0
        self._snapshot.write(values)

    def _private_of(self, req_id: str, layer: str, st: LayerStack) -> torch.Tensor | None:
        return self.private.of(req_id, layer, st.layout.num_kv_heads, st.scores.device)

    def private_rows(self, layer: str, lc: LayerCache,
                     num_reqs: int) -> list[torch.Tensor | None] | None:
        """Per batch row, its private scores in `layer`, or None (PrivateScores.batch)."""
        if not self.private.tokens or self.runner is None:
            return None
        return self.private.batch(self.runner.input_batch.req_ids[:num_reqs], num_reqs, layer,
                                  lc.layout.num_kv_heads, lc.scores.device)

    def _block_ids(self, req_id: str) -> list[int] | None:
        req_state = self.runner.requests.get(req_id) if self.runner else None
        return None if req_state is None else req_state.block_ids[0]

    def scored_rows(self, num_reqs: int) -> torch.Tensor | None:
        """(num_reqs,) bool: rows whose attention must be scored; None = all."""
        if not self.unscored or self.runner is None:
            return None
        req_ids = self.runner.input_batch.req_ids[:num_reqs]
        return torch.tensor([r not in self.unscored for r in req_ids], dtype=torch.bool)

    def place_queries(self, num_reqs: int, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, logical_seq_lens: torch.Tensor,
                      scored: torch.Tensor | None) -> StepPlacement | None:
        """Once per step, from the metadata builder: where this step's queries
        are kept. snapkv/andpro: ring cells of each request's newest tokens
        (logical positions). h2o (CPU): log slots of the scored decode queries
        (physical seq_lens), and the short prefill chunks the chunk log takes.
        None otherwise (h2o then scores everything now),
        e.g. for a second builder in the same step or a dummy run."""
        if not self._step_open or self.runner is None:
            return None
        if self.policy.window:
            self._step_open = False
            qsl = query_start_loc[: num_reqs + 1].tolist()
            return self.query_window.place(
                self.runner.input_batch.req_ids[:num_reqs],
                [b - a for a, b in zip(qsl, qsl[1:])], logical_seq_lens[:num_reqs].tolist(),
                None if scored is None else scored.tolist())
        if not self.policy.needs_scores:
            return None
        self._step_open = False
        if self.decode_log.full():
            self.decode_log.flush_all(self._stacks(), self._block_ids, self._private_of)
        qsl = query_start_loc[: num_reqs + 1].tolist()
        q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
        req_ids = self.runner.input_batch.req_ids[:num_reqs]
        seq, keep = seq_lens[:num_reqs].tolist(), None if scored is None else scored.tolist()
        placement = self.decode_log.place(req_ids, q_lens, seq, keep)
        placement.defer(self.chunk_log.place(req_ids, q_lens, seq, keep), q_lens, keep)
        return placement

    def zero_new_slots(self, slot_mapping: torch.Tensor, num_tokens: int) -> None:
        """New tokens start with zero importance, whatever their slot held
        before: once per step for every layer (one op per layer stack), from the
        metadata builder, before any layer logs or scores this step's queries.
        slot_mapping: the step's physical slots, the first num_tokens real."""
        if not self.policy.needs_scores or not self.layers:
            return  # no layer yet: its score buffer will be made zeroed
        slots = slot_mapping[:num_tokens].long()
        for st in self._stacks():
            per_layer = st.num_blocks * self.block_size
            cols = slots[None] + per_layer * torch.arange(st.num_layers, device=slots.device)[:, None]
            st.scores.index_fill_(1, cols.flatten(), 0.0)

    def evicted_per_row(self, num_reqs: int) -> torch.Tensor | None:
        """(num_reqs,) int32 offsets logical - physical in batch order, or None."""
        if not self.evicted or self.runner is None:
            return None
        req_ids = self.runner.input_batch.req_ids[:num_reqs]
        ev = [self.evicted.get(r, 0) for r in req_ids]
        return torch.tensor(ev, dtype=torch.int32) if any(ev) else None

    # --- compaction -------------------------------------------------------------

    def _stacks(self) -> list["LayerStack"]:
        """The layers as few `LayerStack`s as possible: one when every layer's
        cache is an equally spaced slice of one buffer (vLLM allocates them so
        on CPU), else one per layer. Built once the layers are known."""
        if self._stack_cache is None and self.layers:
            self._stack_cache = LayerStack.build(self.layers)
        return self._stack_cache or []

    def _compact(self, plan: CompactionPlan) -> None:
        """Run one plan. A request new to this worker this step (in `arriving`,
        e.g. its KV came in through a KV connector before it was first
        scheduled) has its block row arrive with this step's output, already the
        plan's result: only the KV moves.

        The scheduler has already freed the plan's tail and counts the request
        as compacted: a plan this worker cannot run (a request it does not hold,
        no layer caches) is an inconsistency, and it fails loudly rather than
        run on with a row that still names freed blocks."""
        runner = self.runner
        new = plan.req_id in self.arriving
        req_state = None if new or runner is None else runner.requests.get(plan.req_id)
        if (req_state is None and not new) or not self.layers:
            why = ("this worker holds no state for it" if req_state is None and not new
                   else "no layer cache is registered on this worker")
            raise RuntimeError(
                f"kv eviction: compaction plan for request {plan.req_id!r} cannot run: {why}. "
                "The scheduler already freed its blocks past the plan's destination, so "
                "the worker and the scheduler would disagree about the request's blocks.")
        bs = self.block_size
        src_blocks = torch.tensor(plan.src_block_ids, dtype=torch.int64)
        dst_blocks = torch.tensor(plan.dst_block_ids, dtype=torch.int64)
        src = token_slots(src_blocks, plan.old_len, bs)  # (old_len,) slots of the old tokens
        keep_recent = plan.recent
        order = slot_order(self.order.get(plan.req_id), plan.old_len)  # (L_all, H, old_len)
        new_order = []
        evicted_kv = []  # offload: (k, v) per stack, (L, H, E, D)
        first = 0
        for st in self._stacks():
            # Row l of every tensor below is layer `first + l` of this stack.
            layer = torch.arange(st.num_layers)[:, None]
            src_slots = src[None] + layer * st.num_blocks * bs  # (L, old_len)
            src_rows = src_blocks[None] + layer * st.num_blocks  # (L, n_src)
            dst_rows = dst_blocks[None] + layer * st.num_blocks  # (L, n_dst)
            kc, vc = st.layout.split(st.kv_cache)
            rows = None if order is None else order[first:first + st.num_layers]
            # The policy sees tokens oldest first (the recent window, pooling over
            # neighbours); `rows` maps that order to slots after earlier compactions.
            kv = private = None
            if self.policy.window or self.cfg.offload:
                kv = tuple(by_age(x[:, :, : plan.old_len], rows) for x in (
                    st.layout.gather_keys(kc, src_rows, src_rows.shape[1]),
                    st.layout.gather_values(vc, src_rows, src_rows.shape[1])))
            if self.policy.window:
                scores = self._window_scores(plan, st, keep_recent, *kv)
            elif self.policy.needs_scores:
                scores = by_age(st.scores[:, src_slots].transpose(0, 1), rows)  # (L, H, old_len)
                private = self.private.stacked(plan.req_id, st.names, st.layout.num_kv_heads,
                                               scores.device)
                if private is not None:  # never compacted yet: slot order is age order
                    assert rows is None
                    n = min(private.shape[2], plan.old_len)
                    scores[..., :n] = private[..., :n]
            else:  # streaming: the kept set depends on age only
                scores = torch.zeros(st.num_layers, st.layout.num_kv_heads, plan.old_len)
            num_layers, h, _ = scores.shape
            keep = self.policy.select(scores.reshape(num_layers * h, -1), plan.new_len,
                                      keep_recent).view(num_layers, h, plan.new_len)
            keep_slots = keep if rows is None else rows.gather(2, keep.to(rows.device))
            if self.cfg.offload:  # read what is dropped before the kept tokens overwrite it
                evicted_kv.append(evicted_entries(keep, *kv))
            if use_triton(kc, st.layout):  # K, V and scores moved in place, in one kernel
                ordered, perm = keep_slots.sort(dim=2)
                triton_module("compaction").compact_in_place(
                    kc, vc, st.scores if self.policy.needs_scores else None, src_slots,
                    token_slots(dst_rows, dst_rows.shape[1] * bs, bs), ordered)
                after = torch.empty_like(perm).scatter_(
                    2, perm, torch.arange(plan.new_len, device=perm.device).expand_as(perm))
            else:  # only the kept tokens past new_len move, into the evicted slots
                after = fill_holes(st.layout, kc, vc, src_rows, dst_rows, keep_slots,
                                   plan.old_len,
                                   st.scores if self.policy.needs_scores else None)
            if private is not None:
                # The kept blocks are all private now (spec.py copies shared
                # ones): the private scores go beside the tokens.
                restore(st.scores, private, keep, after, dst_rows, bs)
            new_order.append(after.to(torch.int32))  # stays on the cache's device
            first += num_layers
        self.order[plan.req_id] = torch.cat(new_order)
        self.private.drop([plan.req_id])
        if evicted_kv:
            tier = host_tier(self, self._stacks()[0].layout, evicted_kv[0][0].dtype)
            tier.offload(plan.req_id, torch.cat([k for k, _ in evicted_kv]),
                         torch.cat([v for _, v in evicted_kv]))
        self.query_window.compacted(plan.req_id, keep_recent)
        if req_state is None:  # new: the row comes with this step's output
            return
        # The request's row is now exactly dst; this step's new blocks follow.
        req_state.block_ids[plan.group_id][:] = list(plan.dst_block_ids)
        batch = runner.input_batch
        row = batch.req_id_to_index.get(plan.req_id)
        if row is not None:
            table = batch.block_table.block_tables[plan.group_id]
            table.num_blocks_per_row[row] = 0
            table.append_row(list(plan.dst_block_ids), row)

    def _window_scores(self, plan: CompactionPlan, st: LayerStack, recent: int,
                       k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(L, H, old_len) snapkv/andpro scores of the request's resident tokens
        from its window queries; k, v: (L, H, old_len, D), oldest token first.
        Without a window (nothing logged, e.g. a prompt served from elsewhere)
        every older token scores 0: the first and the recent tokens are kept."""
        win = self.query_window.window(plan.req_id, st.names, plan.logical_len)
        if win is None:
            self.num_windowless += 1
            scores = torch.zeros(k.shape[:3], device=k.device)
            scores[..., 0] = float("inf")
            return scores
        q, scale = win
        return self.policy.scores(q.to(k.device), k, v, scale, recent)


def _worker_rank() -> int:
    """This worker's rank among the model's workers: pp_stage * tp_size + tp_rank
    (the TP rank at one pipeline stage), so no two workers of an engine share a
    `compaction_seconds_total{rank}` series."""
    stage, tp_size, tp_rank = parallel_ranks()
    return stage * tp_size + tp_rank


_STATE: WorkerEviction | None = None
_OWNER: object | None = None


def init_worker_state(vllm_config, cfg: EvictionConfig, block_size: int) -> None:
    """Bind the process's state to the engine being built (model init).

    A process runs one model runner at a time, but tests and scripts build
    engines one after another: the newest engine's settings win, and an engine
    without eviction clears the state.
    """
    global _STATE, _OWNER
    if _OWNER is vllm_config:
        return
    _OWNER = vllm_config
    _STATE = WorkerEviction(cfg, block_size) if cfg.enabled else None
    if _STATE is not None:
        if cfg.offload:
            _STATE.offload = OffloadState(vllm_config.model_config.model)
        if _STATE.policy.needs_scores or _STATE.policy.window:
            log_cpu_path_once()


def worker_state() -> WorkerEviction | None:
    """The WorkerEviction of the engine this process runs, or None."""
    return _STATE
