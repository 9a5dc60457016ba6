"""Ledger of every monkeypatch this plugin applies to vLLM 0.32.

One module per patched symbol. Each declares TARGET, WHY, HOW, UPSTREAM (the
upstream change that would let us delete it) and `apply()`, which keeps the
original, delegates to it, and refuses to patch twice.

| module                 | target                                        |
|------------------------|-----------------------------------------------|
| engine_args            | EngineArgs.add_cli_args / from_cli_args / create_engine_config |
| scheduler_schedule     | Scheduler.schedule                            |
| runner_update_states   | GPUModelRunner._update_states                 |
| request_validation     | InputProcessor._validate_params               |
| kv_manager_modules     | KVCacheManager.get_computed_blocks / free     |
| engine_core_modules    | EngineCore.kvevict_modules (added) / .preprocess_add_request |
| runner_positions       | GPUModelRunner._prepare_inputs                |
| input_processor_pml    | InputProcessor.process_inputs / .assign_request_id |
| async_llm_pml          | AsyncLLM.add_request (PML expanded off the event loop) |
| tokenize_truncation    | TokenizeParams.apply_pre_tokenization (truncation of a PML prompt refused) |
| ray_on_cpu             | CpuPlatform.ray_device_key, RayExecutorV2._get_actor_resource_kwargs / _init_executor, RayWorkerProc.get_node_and_physical_gpu_ids / initialize_worker |
| pp_intermediate_tensors | GPUModelRunner.sync_and_gather_intermediate_tensors (CPU: eager pipeline parallel) |
| cpu_seeded_sampling    | GPUModelRunner._sample / _bookkeeping_sync (CPU: a seeded request's chunked prompt killed the engine) |
| metrics_registry       | prometheus_client.multiprocess.MultiProcessCollector, as vLLM's /metrics builds it (the eviction series with several API servers) |
| worker_memory          | CPUWorker / Worker.determine_available_memory (an auto-sized cache leaves room for eviction's buffers) |
| dispatcher_scan        | vllm.triton_utils.dispatcher's `vars` (an engine after an n-gram speculative one failed to start: llvmlite's wrapper) |
| cpu_shm_unlink         | _CPUSHMDistributed._init_cpu_shm (CPU TP/PP: shared-memory segments unlinked once mapped; a killed engine's no longer blocks a Ray engine's start) |

vLLM internals used outside this folder (no patch: read, called, subclassed or
stamped; each may break on a vLLM upgrade, so each is listed here, and
tests/test_import_graph.py fails on a private name used there but not here):

| where                         | internal                                  | why |
|-------------------------------|-------------------------------------------|-----|
| integration/spec.py           | FullAttentionManager (subclassed: get_num_blocks_to_allocate, allocate_new_blocks, add_local_computed_blocks, cache_blocks, remove_skipped_blocks, pop_blocks_for_free, req_to_blocks, num_cached_block) | the block manager that frees evicted blocks and learns of prefix hits |
| integration/spec.py           | max_admission_blocks_per_request (set)    | vLLM's admission cap, read for sliding-window specs; ours for budgets |
| integration/spec.py           | BlockPool._maybe_evict_cached_block       | a kept block is rewritten by compaction: its prefix-cache hash must go first |
| integration/spec.py           | KVCacheSpecRegistry._ensure_registered    | registration is one-shot: the built-in specs must be registered before ours |
| integration/offload_connector.py | KVConnectorFactory._registry           | register_connector raises on a second registration; register() runs per process |
| integration/module_store.py   | KVCacheManager._kvevict_modules (stamped) | one prompt-module store per KV cache manager, created on first use |
| integration/prompt_modules.py | BaseRenderer._executor                    | the tokenizer thread: PML work runs there, off the event loop, never racing vLLM's tokenization |
| integration/prompt_modules.py | ParallelConfig._api_process_count (read)  | how many API server processes front the engines: the schema registry is one per process |
| integration/worker.py         | GPUModelRunner.requests[id].block_ids, .input_batch.req_ids | which blocks a request holds and the batch's row order |
| integration/worker.py         | SchedulerOutput.scheduled_spec_decode_tokens, GPUModelRunner.requests[id].num_tokens (read) | a step's speculative drafts, and how many the verifier accepted (every token but the newest has its KV) |
| integration/spec.py           | Request.spec_token_ids (read)             | the drafts vLLM is about to schedule: the compaction leaves room for them |
| integration/cpu_backend.py, cuda_backend.py | kvevict_decode_placement, kvevict_scored_rows, kvevict_host_lens (stamped on attention metadata) | the step's row placement for the score path, built once per step |
| integration/cpu_backend.py    | Attention._k_scale_float (read)          | an fp8 cache's key scale, folded into the logits' scale as vLLM's CPU backend passes it to its kernels |
| probe.py (the demo, the harness, tests, benchmarks) | Scheduler.schedule / _preempt_request wrapped on one instance, _unprobed (stamped) | sample vLLM's own block accounting each step |
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger("vllm_kvevict")

PATCHES = ("engine_args", "scheduler_schedule", "runner_update_states",
           "request_validation", "ray_on_cpu", "kv_manager_modules", "engine_core_modules",
           "runner_positions", "input_processor_pml", "async_llm_pml", "tokenize_truncation",
           "pp_intermediate_tensors", "cpu_seeded_sampling",
           "metrics_registry", "worker_memory", "dispatcher_scan", "cpu_shm_unlink")
_applied: set[str] = set()


def mark_patched(owner, name: str, wrapper) -> None:
    """Install `wrapper` as owner.name, keeping the original on the wrapper."""
    original = owner.__dict__[name]
    if hasattr(getattr(original, "__func__", original), "__kvevict_original__"):
        raise RuntimeError(f"{owner.__name__}.{name} is already patched")
    # staticmethod/classmethod wrappers: the inner function carries the handle.
    getattr(wrapper, "__func__", wrapper).__kvevict_original__ = original
    setattr(owner, name, wrapper)
    logger.debug("vllm_kvevict patched %s.%s", owner.__name__, name)


def apply_all() -> None:
    for name in PATCHES:
        if name in _applied:
            continue
        importlib.import_module(f"{__name__}.{name}").apply()
        _applied.add(name)
