"""Read what vLLM's own accounting says about KV blocks, step by step.

Works on an in-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set
before importing vllm): `attach(llm)` wraps that engine's scheduler instance
(not the class) so every step samples the BlockPool and each manager's
`req_to_blocks`. Used by the main job, the benchmark and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def scheduler_of(llm):
    core = llm.llm_engine.engine_core
    if not hasattr(core, "engine_core"):
        raise RuntimeError("set VLLM_ENABLE_V1_MULTIPROCESSING=0 before importing vllm "
                           "to read the engine's block pool in-process")
    return core.engine_core.scheduler


@dataclass
class BlockProbe:
    scheduler: object
    steps: int = 0
    peak_used_blocks: int = 0
    running_sum: int = 0
    max_blocks_per_request: int = 0
    preemptions: int = 0
    seen: set = field(default_factory=set)

    @property
    def block_pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    def used_blocks(self) -> int:
        pool = self.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # minus the null block

    def sample(self, output) -> None:
        """Called after every schedule() with its SchedulerOutput (subclasses
        record more; `output` tells them what was scheduled)."""
        self.steps += 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.used_blocks())
        self.running_sum += len(self.scheduler.running)
        for m in self.scheduler.kv_cache_manager.coordinator.single_type_managers:
            for blocks in m.req_to_blocks.values():
                held = sum(not b.is_null for b in blocks)
                self.max_blocks_per_request = max(self.max_blocks_per_request, held)

    @property
    def mean_running(self) -> float:
        return self.running_sum / max(self.steps, 1)

    def managers(self):
        return self.scheduler.kv_cache_manager.coordinator.single_type_managers



def full_attention_manager(scheduler):
    """The one full-attention group's manager (a hybrid model's sliding-window
    groups are vLLM's alone)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    found = [m for m in scheduler.kv_cache_manager.coordinator.single_type_managers
             if isinstance(m, FullAttentionManager)]
    if len(found) != 1:
        raise RuntimeError(f"expected one full-attention KV cache group, got {len(found)}")
    return found[0]


def attach(llm, probe_cls: type[BlockProbe] = BlockProbe) -> BlockProbe:
    """A new probe on `llm`'s scheduler, sampling from the next step on. Attaching
    again (a shared engine, the next test) replaces the previous probe rather
    than stacking another wrapper on it."""
    sched = scheduler_of(llm)
    probe = probe_cls(sched)
    if "_unprobed" not in vars(sched):
        sched._unprobed = (sched.schedule, sched._preempt_request)
    schedule, preempt = sched._unprobed

    def sampled_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        probe.sample(out)  # after allocation: the step's peak
        return out

    def counted_preempt(*args, **kwargs):
        probe.preemptions += 1
        return preempt(*args, **kwargs)

    sched.schedule, sched._preempt_request = sampled_schedule, counted_preempt
    return probe
