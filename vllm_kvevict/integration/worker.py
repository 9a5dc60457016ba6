"""Worker side: the score store, compaction, and the per-step physical view.

One `WorkerEviction` per worker process (one model runner per process in vLLM
V1). It is created by the first attention backend that sees eviction enabled.
At pipeline parallel it holds only its stage's layers: every stage gets the
same plans (one SchedulerOutput) and scores and compacts its own layers, so
physical lengths agree across stages by construction.

The policy says what is recorded for it each step (`policy.records`); its
recorder (integration/recorders.py) does it, and the worker calls the recorder
and the policy's `compaction_scores` without asking which policy runs. Under
Record.ATTENTION (H2O) each layer keeps a score buffer beside the KV cache (the
other recorders' buffers are empty):

    scores[layer]: (num_kv_heads, num_blocks * block_size) float32
                   accumulated attention received by the token in each slot

Scores live at the same (block, offset) slots as the KV they describe, so
compaction moves them with the KV, and a slot's score is zeroed whenever a new
token is written there (a reused block never inherits stale importance). A
request whose first blocks may be shared (prefix hit, prompt modules) keeps
the scores of those tokens in private rows until its first compaction
(core/scoring/private_scores.py), so no two requests ever add into one slot.

One file because `WorkerEviction` is one process's state, read and changed by
every step hook (begin_step, placement, compaction, metrics); what each
policy records per step and reads at a compaction is in recorders.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_kvevict.core.scoring.chunk_log import ChunkLog
from vllm_kvevict.core.eviction.compaction import fill_holes, select_and_fill_holes, slot_order
from vllm_kvevict.core.config.settings import EvictionConfig
from vllm_kvevict.core.layouts.cpu_layout import token_slots
from vllm_kvevict.core.scoring.decode_log import DECODE_DEPTH, DecodeQueryLog, StepPlacement
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
from vllm_kvevict.core.scoring.query_buffers import QueryBuffers
from vllm_kvevict.core.scoring.query_window import QueryWindow
from vllm_kvevict.integration.metrics import Snapshot
from vllm_kvevict.integration.recorders import RECORDERS, Recorder, StackContext
from vllm_kvevict.integration.offload_attention import (
    OffloadState,
    evicted_entries,
    host_tier,
)
from vllm_kvevict.integration.settings import parallel_ranks


class WorkerEviction:
    def __init__(self, cfg: EvictionConfig, block_size: int, max_drafts: int = 0) -> None:
        """max_drafts: speculative decoding's draft tokens per step (0: off)."""
        self.cfg = cfg
        self.block_size = block_size
        self.policy = make_policy(cfg.policy, cfg.sink, cfg.window)
        self.recorder: Recorder = RECORDERS[self.policy.records](self)
        self.layers: dict[str, LayerCache] = {}
        self.runner = None  # the GPUModelRunner (or subclass) of this process
        # The KV cache group the plugin compacts: 0, or a hybrid model's
        # full-attention group beside vLLM's sliding-window ones (begin_step).
        self.group_id = 0
        self.evictable_layers: frozenset[str] | None = None  # its layers (cpu_backend.check_one_group)
        self.engine = 0  # data-parallel rank: vLLM's `engine` label (init_worker_state)
        self.evicted: dict[str, int] = {}
        # req_id -> (L_all, H, P) int32 slot of each resident token, oldest first,
        # after its last compaction (fill_holes leaves slots out of order):
        # 4 bytes per resident token and head, beside 4 * D bytes of its KV.
        self.order: dict[str, torch.Tensor] = {}
        # A decode row logs its token and its drafts at once: room for a row.
        self.decode_log = DecodeQueryLog(max(DECODE_DEPTH, 1 + max_drafts))
        # What the recorders keep (empty unless the policy's recorder uses them):
        self.chunk_log = ChunkLog()  # Record.ATTENTION: short prefill chunks, scored next step
        self.private = PrivateScores()  # Record.ATTENTION: scores of shared first blocks
        # Record.QUERIES: the newest queries, with room for a step's drafts
        self.query_window = QueryWindow(cfg.window, spare=max_drafts)
        self.num_windowless = 0  # compactions whose policy asked for a window and found none
        self._stack_cache: list[LayerStack] | None = None
        self.unscored: set[str] = set()  # requests that never compact: no scoring
        # requests that compact right after their prompt (EvictionStep.evict_after_prompt)
        self.prompt_evicts: set[str] = set()
        self.arriving: set[str] = set()  # during begin_step: this step's new requests
        # Speculative decoding: this step's draft tokens per request, and the
        # logical length each request's logged queries reached with the last
        # step's drafts (checked against what was accepted: _roll_back_drafts).
        self.drafts: dict[str, int] = {}
        self.draft_ends: dict[str, int] = {}
        self.drafts_logged = self.drafts_rejected = 0  # since start
        self._step_open = False  # a begin_step not yet matched by place_queries
        self.compaction_seconds = 0.0
        # steps whose attention came from the plugin's CPU pass (fused_attention.py)
        self.cpu_pass_steps = 0
        self._snapshot: Snapshot | None = None
        self._identity: dict = {}  # the snapshot's fixed fields, set with it
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
            # Only a recorder that accumulates attention per slot gets a score
            # buffer; the others hold an empty one (no memory, same code).
            slots = self.recorder.score_slots(key_cache.shape[0] * layout.block_size)
            scores = torch.zeros(layout.num_kv_heads, slots, dtype=torch.float32,
                                 device=kv_cache.device)
            lc = LayerCache(kv_cache, layout, scores)
            self.layers[name] = lc
            self._stack_cache = None  # the layer set changed: re-stack on next use
        return lc

    def knows(self, name: str, kv_cache: torch.Tensor) -> bool:
        """The layer is registered with this very cache tensor (`layer` would
        change nothing): the per-layer fast path may skip it."""
        lc = self.layers.get(name)
        return lc is not None and lc.kv_cache is kv_cache

    # --- per step (called before the runner's _update_states) -------------------

    def begin_step(self, runner, scheduler_output) -> None:
        if runner is not self.runner:
            self.runner = runner
            self.group_id = evictable_group(getattr(runner, "kv_cache_config", None))
        self._step_open = True
        self._roll_back_drafts(scheduler_output.finished_req_ids)
        drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        self.drafts = {r: len(ids) for r, ids in drafts.items() if ids}
        step: EvictionStep | None = getattr(scheduler_output, STEP_ATTR, None)
        if step is None:
            return
        # Freed blocks may already belong to someone else: forget queries that
        # would read them. Then score what waits for requests about to move.
        for log in (self.decode_log, self.query_window, self.chunk_log):
            log.drop(step.released)
            log.drop(scheduler_output.finished_req_ids)
        for gone in (step.released, scheduler_output.finished_req_ids):
            self.unscored.difference_update(gone)
            self.prompt_evicts.difference_update(gone)
        for req_id in (*step.released, *scheduler_output.finished_req_ids):
            self.order.pop(req_id, None)  # its blocks are gone (or refilled in order)
            self.private.drop([req_id])
            if self.host is not None:  # both tiers go together
                self.host.free(req_id)
        self.unscored.update(step.unscored)
        self.prompt_evicts.update(step.evict_after_prompt)
        self.recorder.begin_step(step)
        if step.plans:
            start = time.perf_counter()  # CPU: the work; CUDA: its launch (async)
            self.arriving = {r.req_id for r in scheduler_output.scheduled_new_reqs}
            try:
                # A request that ends this step (the runner drops it below) has
                # blocks that are no longer its own to write. The scheduler makes
                # no such plan (spec.py); a KV connector that delays frees could.
                plans = [p for p in step.plans
                         if p.req_id not in scheduler_output.finished_req_ids
                         or p.req_id in self.arriving]
                for batch in self._batches(plans):
                    self._compact(batch)
            finally:
                self.arriving = set()
            self.compaction_seconds += time.perf_counter() - start
            self._write_metrics()
        self.evicted = step.evicted

    def _roll_back_drafts(self, finished) -> None:
        """Take the last step's rejected draft tokens out of the logs, before
        anything reads them: their queries are not the sequence's (H2O's
        scores and the SnapKV/AnDPro window hold the accepted tokens' only).
        The runner appended the step's accepted tokens and its new one to each
        request (vLLM's _bookkeeping_sync, in the step itself), so every token
        but the newest has its KV: what lies past that was rejected.
        finished: requests that ended (their logs are dropped whole)."""
        ends, self.draft_ends = self.draft_ends, {}
        for req_id, end in ends.items():
            req = (self.runner.requests.get(req_id)
                   if self.runner is not None and req_id not in finished else None)
            rejected = 0 if req is None else end - (req.num_tokens - 1)
            if rejected > 0:
                self.decode_log.roll_back(req_id, rejected)
                self.query_window.roll_back(req_id, rejected)
                self.drafts_rejected += rejected

    def _write_metrics(self) -> None:
        if self._snapshot is None:  # rank and path are fixed for the process: asked once
            self._snapshot = Snapshot("worker")
            self._identity = {"role": "worker", "engine": self.engine, "rank": _worker_rank(),
                              "scoring_path": cpu_path()}
        values = {**self._identity, "compaction_seconds": self.compaction_seconds,
                  "cpu_pass_steps": self.cpu_pass_steps}
        if self.offload is not None:  # offload: what the host tier took (none before it exists)
            values["host_entries_offloaded"] = self.host.stats.entries_offloaded if self.host else 0
        self._snapshot.write_soon(values)

    def count_cpu_pass_step(self) -> None:
        """A step's attention metadata chose the CPU pass: one more on
        /metrics (written at most every BUSY_INTERVAL, as the rest)."""
        self.cpu_pass_steps += 1
        self._write_metrics()

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
        return None if req_state is None else req_state.block_ids[self.group_id]

    def all_rows_diverge(self, num_reqs: int) -> bool:
        """Whether no row of the batch is held to stock vLLM's tokens: each
        request has evicted already or compacts right after its prompt."""
        if self.runner is None:
            return False
        return all(r in self.prompt_evicts or self.evicted.get(r, 0) > 0
                   for r in self.runner.input_batch.req_ids[:num_reqs])

    def scored_rows(self, num_reqs: int) -> torch.Tensor | None:
        """(num_reqs,) bool: rows whose attention must be scored; None = all."""
        if not self.unscored or self.runner is None:
            return None
        req_ids = self.runner.input_batch.req_ids[:num_reqs]
        return torch.tensor([r not in self.unscored for r in req_ids], dtype=torch.bool)

    def place_queries(self, num_reqs: int, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, logical_seq_lens: torch.Tensor,
                      scored: torch.Tensor | None, may_defer: bool = True,
                      defer_chunks: bool = True) -> StepPlacement | None:
        """Once per step, from the metadata builder: where this step's queries
        are kept (the recorder's `place`: e.g. ring cells of each request's
        newest tokens, or log slots of the decode queries and the short prefill
        chunks the chunk log takes). None when the recorder places nothing (its
        layers then record everything now), for a second builder in the same
        step or a dummy run. may_defer: queries may wait in logs (CPU);
        defer_chunks=False: prompt chunks do not (Recorder.place)."""
        if not self._step_open or self.runner is None or not self.recorder.places(may_defer):
            return None
        self._step_open = False
        qsl = query_start_loc[: num_reqs + 1].tolist()
        req_ids = self.runner.input_batch.req_ids[:num_reqs]
        logical = logical_seq_lens[:num_reqs].tolist()
        drafts = None
        if self.drafts:
            drafts = [self.drafts.get(r, 0) for r in req_ids]
            for r, d, end in zip(req_ids, drafts, logical):
                if d:
                    self.draft_ends[r] = end
                    self.drafts_logged += d
        return self.recorder.place(
            req_ids, [b - a for a, b in zip(qsl, qsl[1:])], seq_lens[:num_reqs].tolist(),
            logical, None if scored is None else scored.tolist(), defer_chunks=defer_chunks,
            drafts=drafts)

    def log_only(self, placement: StepPlacement, num_tokens: int) -> QueryBuffers | None:
        """Once per step, from the CPU builder: the buffers every layer hands its
        queries to by reference (`QueryBuffers.hold_ref`) when logging them is
        all the layers do this step (Recorder.log_only), else None. Never
        with offload: its layers also read and write the host tier."""
        if self.cfg.offload:
            return None
        return self.recorder.log_only(placement, num_tokens)

    def zero_new_slots(self, slot_mapping: torch.Tensor, num_tokens: int) -> None:
        """New tokens start with zero importance, whatever their slot held
        before: once per step for every layer (one op per layer stack), from the
        metadata builder, before any layer logs or scores this step's queries.
        slot_mapping: the step's physical slots, the first num_tokens real."""
        self.recorder.zero_new_slots(slot_mapping, num_tokens)

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

    def _batches(self, plans: list[CompactionPlan]) -> list[list[CompactionPlan]]:
        """The step's plans in batches that `_compact` runs as one.

        Requests that arrive together reach their budgets together: in the
        README's main job every step that compacts compacts 4-8 requests, all
        from the same old_len to the same new_len. A batch pays the per-call
        cost of a compaction (the Python around it, small tensor ops, a kernel
        call per part) once, with rows (request, layer) instead of (layer).
        In the main job that is only 25-30 ms of the ~450 its compactions take
        on two cores: the rest grows with the rows (docs/results.md,
        twenty-fourth session).
        Plans batch when their lengths, block counts and observation windows
        match; a request with private scores (restored per request), offload
        (its dropped KV goes to the host tier per request), a CUDA cache (the
        Triton compaction is checked one request at a time) or a policy that
        scores across rows (`EvictionPolicy.batch_requests`) runs alone."""
        stacks = self._stacks()
        if (len(plans) < 2 or not self.policy.batch_requests or self.cfg.offload
                or not stacks or stacks[0].kv_cache.device.type != "cpu"):
            return [[p] for p in plans]
        batches: dict[tuple, list[CompactionPlan]] = {}
        for p in plans:
            key: tuple = (p.old_len, p.new_len, p.recent, len(p.src_block_ids),
                          len(p.dst_block_ids),
                          self.query_window.window_len(p.req_id, p.logical_len))
            if p.req_id in self.private.tokens:
                key = (p.req_id,)
            batches.setdefault(key, []).append(p)
        return list(batches.values())

    def _compact(self, plans: list[CompactionPlan]) -> None:
        """Run a batch of plans (`_batches`: the same old_len, new_len, recent
        and block counts). A request new to this worker this step (in
        `arriving`, e.g. its KV came in through a KV connector before it was
        first scheduled) has its block row arrive with this step's output,
        already the plan's result: only the KV moves.

        The scheduler has already freed each plan's tail and counts the request
        as compacted: a plan this worker cannot run (a request it does not hold,
        no layer caches) is an inconsistency, and it fails loudly rather than
        run on with a row that still names freed blocks."""
        runner = self.runner
        for plan in plans:
            new = plan.req_id in self.arriving
            known = new or (runner is not None and plan.req_id in runner.requests)
            if not known or not self.layers:
                why = ("this worker holds no state for it" if not known
                       else "no layer cache is registered on this worker")
                raise RuntimeError(
                    f"kv eviction: compaction plan for request {plan.req_id!r} cannot run: "
                    f"{why}. The scheduler already freed its blocks past the plan's "
                    "destination, so the worker and the scheduler would disagree about the "
                    "request's blocks.")
        first_plan = plans[0]
        old_len, new_len, keep_recent = first_plan.old_len, first_plan.new_len, first_plan.recent
        num_plans, bs = len(plans), self.block_size
        src_blocks = torch.tensor([p.src_block_ids for p in plans], dtype=torch.int64)  # (P, n_src)
        dst_blocks = torch.tensor([p.dst_block_ids for p in plans], dtype=torch.int64)  # (P, n_dst)
        src = token_slots(src_blocks, old_len, bs)  # (P, old_len) slots of the old tokens
        # (L_all, H, old_len) per plan, None while its slots are in age order
        orders = [slot_order(self.order.get(p.req_id), old_len) for p in plans]
        new_order = []  # per stack: (P, L, H, new_len)
        evicted_kv = []  # offload (one plan): (k, v) per stack, (L, H, E, D)
        first = 0
        for st in self._stacks():
            # Row p * L + l of every tensor below is layer `first + l` of plans[p].
            nl, h = st.num_layers, st.layout.num_kv_heads
            layer = torch.arange(nl)[None, :, None]
            src_slots = (src[:, None] + layer * st.num_blocks * bs).flatten(0, 1)  # (P*L, old_len)
            src_rows = (src_blocks[:, None] + layer * st.num_blocks).flatten(0, 1)  # (P*L, n_src)
            dst_rows = (dst_blocks[:, None] + layer * st.num_blocks).flatten(0, 1)  # (P*L, n_dst)
            kc, vc = st.layout.split(st.kv_cache)
            # The policy sees tokens oldest first (the recent window, pooling over
            # neighbours); `rows` maps that order to slots after earlier compactions.
            rows = None
            if any(o is not None for o in orders):
                rows = torch.cat([o[first:first + nl] if o is not None else
                                  torch.arange(old_len).expand(nl, h, old_len)
                                  for o in orders])
            # Private rows exist only where the recorder opened them (per-slot
            # scores); `_batches` runs such a request alone.
            private = (self.private.stacked(first_plan.req_id, st.names, h, st.scores.device)
                       if num_plans == 1 else None)
            ctx = StackContext(self, plans, st, rows, src_rows, src_slots, private)
            scores = self._compaction_scores(ctx)  # (P*L, H, old_len)
            moved_scores = st.scores if st.scores.shape[1] else None  # a recorder's buffer
            # The common case in one compiled call: the policy keeps recent +
            # top-scored, and nothing needs the kept indices themselves.
            fused = None
            if private is None and not self.cfg.offload and self.policy.selects_top_scored():
                fused = select_and_fill_holes(st.layout, kc, vc, src_rows, dst_rows, scores,
                                              new_len, keep_recent, rows, moved_scores)
            if fused is not None:
                _, after = fused
            else:  # select, then move: torch, Triton, or the policy's own select
                keep = self.policy.select(scores.reshape(num_plans * nl * h, -1), new_len,
                                          keep_recent).view(num_plans * nl, h, new_len)
                keep_slots = keep if rows is None else rows.gather(2, keep.to(rows.device))
                if self.cfg.offload:  # read what is dropped before the kept tokens overwrite it
                    assert num_plans == 1, "offload compacts one request at a time (_batches)"
                    evicted_kv.append(evicted_entries(keep, ctx.keys(), ctx.values()))
                if use_triton(kc, st.layout):  # K, V and scores moved in place, in one kernel
                    ordered, perm = keep_slots.sort(dim=2)
                    triton_module("compaction").compact_in_place(
                        kc, vc, moved_scores, src_slots,
                        token_slots(dst_rows, dst_rows.shape[1] * bs, bs), ordered)
                    after = torch.empty_like(perm).scatter_(
                        2, perm, torch.arange(new_len, device=perm.device).expand_as(perm))
                else:  # only the kept tokens past new_len move, into the evicted slots
                    after = fill_holes(st.layout, kc, vc, src_rows, dst_rows, keep_slots,
                                       old_len, moved_scores)
                if private is not None:
                    # The kept blocks are all private now (spec.py copies shared
                    # ones): the private scores go beside the tokens.
                    restore(st.scores, private, keep, after, dst_rows, bs)
            # stays on the cache's device
            new_order.append(after.to(torch.int32).view(num_plans, nl, h, new_len))
            first += nl
        for i, plan in enumerate(plans):
            # (L_all, H, new_len), a tensor of its own: a view of one batch-wide
            # tensor would keep every plan's order alive while any one of them
            # runs (footprint.py bounds a request's order by its own tokens).
            self.order[plan.req_id] = torch.cat([o[i] for o in new_order])
            self.private.drop([plan.req_id])
            if evicted_kv:  # offload: `_batches` ran this plan alone
                tier = host_tier(self, self._stacks()[0].layout, evicted_kv[0][0].dtype)
                tier.offload(plan.req_id, torch.cat([k for k, _ in evicted_kv]),
                             torch.cat([v for _, v in evicted_kv]))
            self.recorder.compacted(plan.req_id, keep_recent)
            req_state = None if plan.req_id in self.arriving else runner.requests[plan.req_id]
            if req_state is None:  # new: the row comes with this step's output
                continue
            # The request's row is now exactly dst; this step's new blocks follow.
            req_state.block_ids[plan.group_id][:] = list(plan.dst_block_ids)
            batch = runner.input_batch
            row = batch.req_id_to_index.get(plan.req_id)
            if row is not None:
                table = batch.block_table.block_tables[plan.group_id]
                table.num_blocks_per_row[row] = 0
                table.append_row(list(plan.dst_block_ids), row)

    def _compaction_scores(self, ctx: StackContext) -> torch.Tensor:
        """(L, H, old_len) the policy's scores of one stack's resident tokens,
        oldest first (a method of its own so benchmarks time scoring apart)."""
        return self.policy.compaction_scores(ctx)


def evictable_group(kv_cache_config) -> int:
    """Index of the KV cache group whose spec is ours (spec.py), else 0 (also
    for a runner stand-in without a config)."""
    from vllm_kvevict.integration.spec import EvictableAttentionSpec

    for i, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", ())):
        if isinstance(group.kv_cache_spec, EvictableAttentionSpec):
            return i
    return 0


def _worker_rank() -> int:
    """This worker's rank among the model's workers: pp_stage * tp_size + tp_rank
    (the TP rank at one pipeline stage), so no two workers of an engine share a
    `compaction_seconds_total{engine,rank}` series."""
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
    _STATE = (WorkerEviction(cfg, block_size, getattr(vllm_config, "num_speculative_tokens", 0))
              if cfg.enabled else None)
    if _STATE is not None:
        # The engine's data-parallel rank: vLLM runs a dense model's DP ranks
        # as independent engines (data_parallel_rank 0 in each) and keeps the
        # rank in data_parallel_index, as its own `engine` label does.
        _STATE.engine = vllm_config.parallel_config.data_parallel_index
        if cfg.offload:
            _STATE.offload = OffloadState(vllm_config.model_config.model)
        if _STATE.recorder.scoring:
            log_cpu_path_once()


def worker_state() -> WorkerEviction | None:
    """The WorkerEviction of the engine this process runs, or None."""
    return _STATE
