"""TARGET: vllm.v1.core.sched.scheduler.Scheduler.schedule

WHY: compaction plans decided by our KV manager inside `allocate_slots` must
     reach every worker in the same step, before any KV is written there.
HOW: after the stock schedule(), drain the plans of every
     EvictableAttentionManager and attach an `EvictionStep` to the
     SchedulerOutput as attribute `kv_eviction` (plain dataclasses, pickled
     with the output to mp / Ray workers). Plans of requests that were freed
     in the same step (preempted, aborted) were already dropped by the manager.
     New requests that can never exceed the budget are listed as unscored,
     those that compact right after their prompt as evict_after_prompt (never
     a pooling request: it ends with its prompt, so vLLM's attention serves
     it, as in stock vLLM, unless a short pool compacts it between chunks);
     H2O requests that start with shared blocks, with their shared length.
     Also writes the eviction counters for /metrics (integration/metrics.py).
     Before the stock schedule(), hands each manager the scheduler's requests
     (per-request budgets) and chunk size (prefill room, admission cap).
UPSTREAM: a per-manager "worker metadata" hook on SchedulerOutput, or KV
     managers allowed to emit block moves (like kv_cache_block_copies) with a
     per-head index.
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_kvevict.core.eviction.planner import evicts_after_prompt, never_compacts
    from vllm_kvevict.core.eviction.plans import STEP_ATTR, EvictionStep
    from vllm_kvevict.integration.spec import EvictableAttentionManager

    def schedule(self, *args, **kwargs):
        managers = [m for m in self.kv_cache_manager.coordinator.single_type_managers
                    if isinstance(m, EvictableAttentionManager)]
        for m in managers:  # read inside allocate_slots, during the stock schedule()
            m.requests = self.requests  # per-request budgets (extra_args)
            if m.chunk_tokens is None:  # fixed for the engine's life: once
                m.set_chunk_tokens(self.scheduler_config.max_num_batched_tokens)
        output = schedule.__kvevict_original__(self, *args, **kwargs)
        if managers:
            step = EvictionStep()
            for m in managers:
                m.drain(step)
            for new in output.scheduled_new_reqs:
                req = self.requests.get(new.req_id)
                if req is None:
                    continue
                cfg = managers[0].request_config(new.req_id)
                if never_compacts(cfg, req.num_prompt_tokens, req.max_tokens,
                                  getattr(self, "num_spec_tokens", 0)):
                    step.unscored.append(new.req_id)
                elif (req.pooling_params is None  # a pooling request never decodes
                      and evicts_after_prompt(cfg, req.num_prompt_tokens, managers[0].block_size)):
                    step.evict_after_prompt.append(new.req_id)
            setattr(output, STEP_ATTR, step)
            for m in managers:
                m.write_metrics()
        return output

    mark_patched(Scheduler, "schedule", schedule)
