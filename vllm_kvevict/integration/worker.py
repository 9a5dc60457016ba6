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

from dataclasses import dataclass

import torch

from vllm_kvevict.config import EvictionConfig
from vllm_kvevict.integration.plans import STEP_ATTR, CompactionPlan, EvictionStep
from vllm_kvevict.kv_layout import KVLayout, split_kv_cache
from vllm_kvevict.policies import make_policy


@dataclass
class LayerCache:
    kv_cache: torch.Tensor  # (num_blocks, H, BS, 2 * D), ISA-packed
    layout: KVLayout
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

    # --- registration ---------------------------------------------------------

    def layer(self, name: str, kv_cache: torch.Tensor, isa: str) -> LayerCache:
        lc = self.layers.get(name)
        if lc is None or lc.kv_cache.data_ptr() != kv_cache.data_ptr():
            nb, h, bs, d2 = kv_cache.shape
            layout = KVLayout.discover(isa, kv_cache.dtype, bs, d2 // 2, h)
            lc = LayerCache(kv_cache, layout, torch.zeros(h, nb * bs, dtype=torch.float32))
            self.layers[name] = lc
        return lc

    # --- per step (called before the runner's _update_states) -------------------

    def begin_step(self, runner, scheduler_output) -> None:
        self.runner = runner
        step: EvictionStep | None = getattr(scheduler_output, STEP_ATTR, None)
        if step is None:
            return
        for plan in step.plans:
            self._compact(plan)
        self.evicted = step.evicted
        for req_id in scheduler_output.finished_req_ids:
            self.kept.pop(req_id, None)

    def evicted_per_row(self, num_reqs: int) -> torch.Tensor | None:
        """(num_reqs,) int32 offsets logical - physical in batch order, or None."""
        if not self.evicted or self.runner is None:
            return None
        req_ids = self.runner.input_batch.req_ids[:num_reqs]
        ev = [self.evicted.get(r, 0) for r in req_ids]
        return torch.tensor(ev, dtype=torch.int32) if any(ev) else None

    # --- compaction -------------------------------------------------------------

    def _slots(self, block_ids, n: int) -> torch.Tensor:
        """(n,) flat slot ids of the first n tokens of a block row."""
        bs = self.block_size
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        j = torch.arange(n)
        return blocks[j // bs] * bs + j % bs

    def _compact(self, plan: CompactionPlan) -> None:
        runner = self.runner
        req_state = runner.requests.get(plan.req_id) if runner else None
        if req_state is None or not self.layers:
            return
        src = self._slots(plan.src_block_ids, plan.old_len)
        dst = self._slots(plan.dst_block_ids, plan.new_len)
        bs = self.block_size
        keep_recent = self.cfg.recent_tokens(plan.new_len, plan.logical_len)
        kept_positions = []
        prev = self.kept.get(plan.req_id)
        logical = self._logical_positions(prev, plan)
        for li, lc in enumerate(self.layers.values()):
            h = lc.scores.shape[0]
            scores = lc.scores[:, src]  # (H, old_len)
            keep = self.policy.select(scores, plan.new_len, keep_recent)  # (H, new_len)
            s_slot = src[keep]
            d_slot = dst.expand(h, -1)
            kc, vc = split_kv_cache(lc.kv_cache)
            k, v = lc.layout.read_tokens(kc, vc, s_slot // bs, s_slot % bs)
            lc.layout.write_tokens(kc, vc, d_slot // bs, d_slot % bs, k, v)
            lc.scores.scatter_(1, d_slot, scores.gather(1, keep))
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
