"""TARGET: vllm.v1.worker.gpu_model_runner.GPUModelRunner._update_states
        (inherited by the CPU model runner)

WHY: a compaction must run before anything else writes KV in this step: the
     blocks the scheduler just freed may already be handed to another request
     (zeroed, CoW-copied or written by its forward pass). The worker's block
     row of the compacted request must also shrink before this step's new
     blocks are appended to it.
HOW: run WorkerEviction.begin_step(runner, scheduler_output) first, then the
     original _update_states.
UPSTREAM: a "pre-update" hook for KV managers' worker-side block operations.
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_kvevict.integration.worker import worker_state

    def _update_states(self, scheduler_output):
        state = worker_state()
        if state is not None:
            state.begin_step(self, scheduler_output)
        return _update_states.__kvevict_original__(self, scheduler_output)

    mark_patched(GPUModelRunner, "_update_states", _update_states)
