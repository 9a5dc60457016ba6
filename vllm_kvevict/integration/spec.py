"""Scheduler side: a KV cache spec whose manager frees evicted blocks.

`EvictableAttentionSpec` is what our attention backend's `customize_spec`
returns when eviction is on; importing this module registers it with vLLM's
spec registry (the public extension point), so the engine core, which
unpickles the spec, builds an `EvictableAttentionManager` for that group.

The manager is vLLM's FullAttentionManager with one idea added: a request
holds `logical - evicted` physical tokens. Block needs are computed from the
physical length, and `remove_skipped_blocks` (called by `allocate_slots`
before every allocation) is the compaction point: core/eviction/blocks.py
decides, from plain values read here, whether the request compacts and which
blocks go back to vLLM's BlockPool, get private copies or leave the prefix
cache; `_apply` carries that out on the BlockPool. Plans wait in `pending`
until the scheduler step is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from vllm_kvevict.core.config.settings import EvictionConfig
from vllm_kvevict.core.eviction.blocks import (Block, BlockDecision, PoolView, RequestState,
                                               compaction_point, decide_blocks)
from vllm_kvevict.core.eviction.plans import CompactionPlan, EvictionStep
from vllm_kvevict.core.policies import make_policy
from vllm_kvevict.integration.metrics import BUSY_INTERVAL, Snapshot
from vllm_kvevict.integration.module_store import layout_of


@dataclass(frozen=True, kw_only=True)
class EvictableAttentionSpec(FullAttentionSpec):
    # The engine's eviction settings: frozen, so hashable and picklable.
    eviction: EvictionConfig = EvictionConfig()

    @classmethod
    def merge(cls, specs: list["EvictableAttentionSpec"]) -> "EvictableAttentionSpec":
        # FullAttentionSpec.merge rebuilds the spec field by field; keep ours.
        assert len({s.eviction for s in specs}) == 1, "layers disagree on eviction"
        return replace(super().merge(specs), eviction=specs[0].eviction)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        """A request needs at most its budget's blocks + one prefill chunk: it holds
        its whole prompt only while the pool has room, and is compacted between
        chunks when not (planner.py), so a pool smaller than max_model_len can
        still serve max_model_len."""
        full = super().max_memory_usage_bytes(vllm_config)
        cap = admission_blocks(self.eviction, self.block_size,
                               vllm_config.scheduler_config.max_num_batched_tokens)
        return full if cap is None else min(full, cap * self.page_size_bytes)


def admission_blocks(cfg: EvictionConfig, block_size: int, chunk: int) -> int | None:
    """Blocks a request needs at most (its budget's blocks + one chunk), or None
    where that is its whole length (fractional budgets; offload keeps prompts
    whole). Startup sizes the pool with it, and admission must use the same
    bound: vLLM's scheduler admits a request only when its whole sequence fits
    (scheduler_reserve_full_isl), so without it a prompt longer than the free
    pool, which eviction would serve, waited forever."""
    if not cfg.enabled or not isinstance(cfg.budget, int) or cfg.offload:
        return None
    return cdiv(cfg.block_cap(cfg.budget, block_size) + chunk, block_size)


class EvictableAttentionManager(FullAttentionManager):
    def set_chunk_tokens(self, chunk: int) -> None:
        """The scheduler's chunk (max_num_batched_tokens), from
        patches/scheduler_schedule.py: how much a prefill may add next, and
        with it the admission cap vLLM's own get_num_blocks_to_allocate applies
        (the attribute it reads for sliding-window specs)."""
        self.chunk_tokens = chunk
        self.max_admission_blocks_per_request = admission_blocks(self.cfg, self.block_size, chunk)

    def __init__(self, kv_cache_spec: EvictableAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.cfg = kv_cache_spec.eviction
        self.evicted: dict[str, int] = {}  # req_id -> logical - physical
        self.pending: list[CompactionPlan] = []
        self.released: list[str] = []  # freed since the last drain()
        # H2O's scores live per physical slot: a request that starts with shared
        # blocks scores their tokens in private rows, which workers open when
        # told (EvictionStep.shared_prefix; core/scoring/private_scores.py).
        self.scores_per_slot = make_policy(self.cfg.policy, self.cfg.sink,
                                           self.cfg.window).records.per_slot
        self.shared_prefix: dict[str, int] = {}  # since the last drain()
        self.num_compactions = 0
        self.num_tokens_evicted = 0
        self.num_blocks_freed = 0  # returned to the BlockPool's free queue
        self.num_prefill_fallbacks = 0  # compactions between prompt chunks
        self.chunk_tokens: int | None = None  # set_chunk_tokens
        # The scheduler's live requests (set by patches/scheduler_schedule.py):
        # their SamplingParams.extra_args may carry a per-request budget.
        self.requests: dict[str, Any] = {}
        self._request_cfg: dict[str, EvictionConfig] = {}
        self._snapshot: Snapshot | None = None

    def request_config(self, request_id: str) -> EvictionConfig:
        """The server's settings with this request's kv_budget / kv_recent
        applied (validated at admission by patches/request_validation.py)."""
        cfg = self._request_cfg.get(request_id)
        if cfg is None:
            req = self.requests.get(request_id)
            extra = getattr(getattr(req, "sampling_params", None), "extra_args", None)
            cfg = self.cfg.for_request(extra, self.block_size) if extra else self.cfg
            if (layout_of(req) or {}).get("pin"):
                cfg = replace(cfg, policy="none")  # a module is encoded whole, once
            self._request_cfg[request_id] = cfg
        return cfg

    # --- physical lengths ---------------------------------------------------

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence, total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   **kwargs) -> int:
        ev = self.evicted.get(request_id, 0)
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens - ev, new_computed_blocks,
            total_computed_tokens - ev, num_local_computed_tokens - ev,
            num_tokens_main_model - ev, **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int, *args, **kwargs):
        ev = self.evicted.get(request_id, 0)
        return super().allocate_new_blocks(
            request_id, num_tokens - ev, num_tokens_main_model - ev, *args, **kwargs)

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence,
                                  num_local_computed_tokens: int, *args, **kwargs) -> None:
        """vLLM attaching a request's prefix hit (or imported prompt modules,
        patches/kv_manager_modules.py) as its first blocks."""
        super().add_local_computed_blocks(request_id, new_computed_blocks,
                                          num_local_computed_tokens, *args, **kwargs)
        if self.scores_per_slot and num_local_computed_tokens > 0:
            self.shared_prefix[request_id] = num_local_computed_tokens

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        # Once compacted, a request's blocks no longer hold its token prefix:
        # registering them for prefix caching would serve wrong KV to others.
        # Until then every policy shares prompts as stock vLLM does.
        if self.evicted.get(request.request_id, 0) == 0:
            super().cache_blocks(request, num_tokens, *args, **kwargs)

    def pop_blocks_for_free(self, request_id: str):
        self.evicted.pop(request_id, None)
        self._request_cfg.pop(request_id, None)
        self.shared_prefix.pop(request_id, None)
        self.pending = [p for p in self.pending if p.req_id != request_id]
        self.released.append(request_id)
        blocks = super().pop_blocks_for_free(request_id)
        self.write_metrics()
        return blocks

    # --- eviction -------------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """vLLM's hook before every allocation: the compaction point. The
        decision is core/eviction/blocks.py's; this reads the request's row and
        the pool into it and applies the answer to the BlockPool."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        req = self.requests.get(request_id)
        # vLLM's _connector_finished (offload configures a KV connector) asks for
        # a request it is finishing: a plan made now would compact blocks being
        # freed, or reach the workers with a request they drop that step.
        state = RequestState(
            num_blocks=len(blocks), logical=processed_computed_tokens,
            evicted=self.evicted.get(request_id, 0), num_prompt_tokens=num_prompt_tokens,
            has_plan=any(p.req_id == request_id for p in self.pending),
            finishing=req is not None and req.is_finished(),
            # Speculative decoding: the drafts vLLM is about to schedule (it
            # may trim them, never add) are written with the step's token.
            new_tokens=1 + len(getattr(req, "spec_token_ids", None) or ()))
        pool = PoolView(num_free=self.block_pool.get_num_free_blocks(),
                        other_requests=len(self.req_to_blocks) - 1,
                        chunk_tokens=self.chunk_tokens)
        cfg = self.request_config(request_id)
        target = compaction_point(cfg, state, pool, self.block_size)
        if target is None:
            return
        row = [Block(b.block_id, b.ref_cnt, b.block_hash is not None) for b in blocks]
        decision = decide_blocks(row, state.physical, target, self.block_size, pool.num_free)
        if decision is not None:  # None: no room for private copies yet, retry next step
            self._apply(request_id, blocks, state, cfg, decision)

    def _apply(self, request_id: str, blocks: list, state: RequestState,
               cfg: EvictionConfig, d: BlockDecision) -> None:
        """Carry out `d` on vLLM's BlockPool, in blocks.py's order: copies from
        the blocks free now, then the tail freed, then the in-place blocks out
        of the prefix cache, then the copies swapped in."""
        pool, held = self.block_pool, {b.block_id: b for b in blocks}
        fresh = pool.get_new_blocks(d.num_new_blocks) if d.num_new_blocks else []
        del blocks[d.keep:]
        pool.free_blocks([held[i] for i in d.free_ids])
        for i in d.uncache_ids:
            pool._maybe_evict_cached_block(held[i])
        for row, blk, old in zip(d.copy_rows, fresh, d.release_ids):
            pool.free_blocks([held[old]])
            blocks[row] = blk
        self.num_cached_block[request_id] = 0
        self.evicted[request_id] = state.evicted + d.tokens_evicted
        self.num_compactions += 1
        self.num_tokens_evicted += d.tokens_evicted
        self.num_blocks_freed += d.blocks_freed
        self.num_prefill_fallbacks += state.in_prefill
        self.pending.append(CompactionPlan(
            req_id=request_id, group_id=self.kv_cache_group_id,
            src_block_ids=d.src_block_ids,
            dst_block_ids=d.dst_block_ids([b.block_id for b in fresh]),
            old_len=d.old_len, new_len=d.new_len, logical_len=state.logical,
            recent=cfg.recent_tokens(d.new_len, state.logical)))

    def write_metrics(self) -> None:
        """Cumulative counters and resident tokens for /metrics (integration/metrics.py).
        Called after every schedule() and whenever a request's blocks are freed,
        so an idle engine shows what it holds now; while requests run, at most
        every BUSY_INTERVAL seconds (the values change every step)."""
        if self._snapshot is None:
            self._snapshot = Snapshot(f"scheduler-g{self.kv_cache_group_id}")
        if self.req_to_blocks and not self._snapshot.due(BUSY_INTERVAL):
            return
        logical = physical = 0
        for rid in self.req_to_blocks:
            req = self.requests.get(rid)
            if req is not None:
                logical += req.num_computed_tokens
                physical += req.num_computed_tokens - self.evicted.get(rid, 0)
        config = {"policy" if k == "kv_eviction" else k.removeprefix("kv_"): v
                  for k, v in self.cfg.to_dict().items()}
        config["recent"] = self.cfg.recent_in_force(self.block_size)  # not None when defaulted
        self._snapshot.write({
            "role": "scheduler", "group": self.kv_cache_group_id, "config": config,
            "tokens_evicted": self.num_tokens_evicted, "compactions": self.num_compactions,
            "blocks_freed": self.num_blocks_freed,
            "prefill_fallbacks": self.num_prefill_fallbacks,
            "logical_tokens": logical, "physical_tokens": physical})

    def drain(self, step: EvictionStep) -> None:
        """Move what workers must learn this step into `step`: the compaction
        plans, the requests released and the shared prefixes since the last
        drain, and every request's evicted count."""
        step.plans.extend(self.pending)
        step.released.extend(self.released)
        step.shared_prefix.update(self.shared_prefix)
        step.evicted.update({r: n for r, n in self.evicted.items() if n})
        self.pending, self.released, self.shared_prefix = [], [], {}


KVCacheSpecRegistry._ensure_registered()  # built-ins first: registration is one-shot
KVCacheSpecRegistry.register(EvictableAttentionSpec, EvictableAttentionManager,
                             uniform_type_base_spec=FullAttentionSpec)
