"""Worker side: the score store, compaction, and the per-step physical view.

One `WorkerEviction` per worker process (one model runner per process in vLLM
V1). It is created by the first attention backend that sees eviction enabled.

Per layer it keeps a score buffer beside the KV cache:

    scores[layer]: (num_kv_heads, num_blocks * block_size) float32
                   accumulated attention received by the token in each slot

Scores live at the same (block, offset) slots as the KV they describe, so
compaction moves them with the KV, and a slot's score is zeroed whenever a new
token is written there (a reused block never inherits stale importance).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvevict.compaction import compact
from vllm_kvevict.config import EvictionConfig
from vllm_kvevict.integration.decode_log import DecodeQueryLog, StepPlacement
from vllm_kvevict.integration.plans import STEP_ATTR, CompactionPlan, EvictionStep
from vllm_kvevict.policies import make_policy


@dataclass
class LayerCache:
    kv_cache: torch.Tensor  # the backend's layer cache, e.g. CPU (NB, H, BS, 2 * D)
    layout: Any  # KVLayout (CPU) or NHDLayout (FlashAttention): split/read/write/gather
    scores: torch.Tensor  # (H, num_blocks * BS) float32


@dataclass
class KeptRecord:
    """Which logical positions each (layer, head) slot holds after compaction;
    the oracle that tests compare with a dense reference. (L, H, new_len) int64."""
    positions: torch.Tensor
    logical_len: int


class WorkerEviction:
    def __init__(self, cfg: EvictionConfig, block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.policy = make_policy(cfg.policy, cfg.sink)
        self.layers: dict[str, LayerCache] = {}
        self.runner = None  # the GPUModelRunner (or subclass) of this process
        self.evicted: dict[str, int] = {}
        self.kept: dict[str, KeptRecord] = {}
        self.record_kept = False  # tests turn this on
        self.decode_log = DecodeQueryLog()
        self._step_open = False  # a begin_step not yet matched by place_decode_queries

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
            slots = key_cache.shape[0] * layout.block_size
            scores = torch.zeros(layout.num_kv_heads, slots, dtype=torch.float32,
                                 device=kv_cache.device)
            lc = LayerCache(kv_cache, layout, scores)
            self.layers[name] = lc
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
        self.decode_log.drop(step.released)
        self.decode_log.drop(scheduler_output.finished_req_ids)
        self.decode_log.flush([p.req_id for p in step.plans], self.layers, self._block_ids)
        for plan in step.plans:
            self._compact(plan)
        self.evicted = step.evicted
        for req_id in scheduler_output.finished_req_ids:
            self.kept.pop(req_id, None)

    def _block_ids(self, req_id: str) -> list[int] | None:
        req_state = self.runner.requests.get(req_id) if self.runner else None
        return None if req_state is None else req_state.block_ids[0]

    def place_decode_queries(self, num_reqs: int, query_start_loc: torch.Tensor,
                             seq_lens: torch.Tensor) -> StepPlacement | None:
        """Once per step, from the metadata builder (physical seq_lens): log
        slots for this step's decode queries, or None (score everything now),
        e.g. for a second builder in the same step or a dummy run."""
        if not self._step_open or self.runner is None or not self.policy.needs_scores:
            return None
        self._step_open = False
        if self.decode_log.full():
            self.decode_log.flush_all(self.layers, self._block_ids)
        qsl = query_start_loc[: num_reqs + 1].tolist()
        q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
        req_ids = self.runner.input_batch.req_ids[:num_reqs]
        return self.decode_log.place(req_ids, q_lens, seq_lens[:num_reqs].tolist())

    def evicted_per_row(self, num_reqs: int) -> torch.Tensor | None:
        """(num_reqs,) int32 offsets logical - physical in batch order, or None."""
        if not self.evicted or self.runner is None:
            return None
        req_ids = self.runner.input_batch.req_ids[:num_reqs]
        ev = [self.evicted.get(r, 0) for r in req_ids]
        return torch.tensor(ev, dtype=torch.int32) if any(ev) else None

    # --- compaction -------------------------------------------------------------

    def _compact(self, plan: CompactionPlan) -> None:
        runner = self.runner
        req_state = runner.requests.get(plan.req_id) if runner else None
        if req_state is None or not self.layers:
            return
        bs = self.block_size
        src_blocks = torch.tensor(plan.src_block_ids, dtype=torch.int64)
        dst_blocks = torch.tensor(plan.dst_block_ids, dtype=torch.int64)
        j = torch.arange(plan.old_len)
        src = src_blocks[j // bs] * bs + j % bs  # (old_len,) slots of the old tokens
        keep_recent = self.cfg.recent_tokens(plan.new_len, plan.logical_len)
        kept_positions = []
        prev = self.kept.get(plan.req_id)
        logical = self._logical_positions(prev, plan)
        for li, lc in enumerate(self.layers.values()):
            h = lc.scores.shape[0]
            keep = self.policy.select(lc.scores[:, src], plan.new_len, keep_recent)
            kc, vc = lc.layout.split(lc.kv_cache)
            compact(lc.layout, kc, vc, lc.scores, src_blocks, dst_blocks, keep)
            if self.record_kept:
                pos = logical[li] if logical.dim() == 3 else logical.expand(h, -1)
                kept_positions.append(pos.gather(1, keep))
        if self.record_kept:
            self.kept[plan.req_id] = KeptRecord(torch.stack(kept_positions), plan.logical_len)
        # The request's row is now exactly dst; this step's new blocks follow.
        req_state.block_ids[plan.group_id][:] = list(plan.dst_block_ids)
        batch = runner.input_batch
        row = batch.req_id_to_index.get(plan.req_id)
        if row is not None:
            table = batch.block_table.block_tables[plan.group_id]
            table.num_blocks_per_row[row] = 0
            table.append_row(list(plan.dst_block_ids), row)

    def _logical_positions(self, prev: KeptRecord | None, plan: CompactionPlan):
        """Logical position held by each of the old_len slots: (L, H, n) or (n,)."""
        if not self.record_kept:
            return torch.empty(0)
        if prev is None:
            return torch.arange(plan.old_len)
        fresh = torch.arange(prev.logical_len, plan.logical_len)
        fresh = fresh.expand(*prev.positions.shape[:2], -1)
        full = torch.cat([prev.positions, fresh], dim=2)
        return full[:, :, : plan.old_len]


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


def worker_state() -> WorkerEviction | None:
    """The WorkerEviction of the engine this process runs, or None."""
    return _STATE
