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
| ray_on_cpu             | CpuPlatform.ray_device_key, RayExecutorV2._get_actor_resource_kwargs / _init_executor, RayWorkerProc.get_node_and_physical_gpu_ids / initialize_worker |
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger("vllm_kvevict")

PATCHES = ("engine_args", "scheduler_schedule", "runner_update_states",
           "request_validation", "ray_on_cpu", "kv_manager_modules", "engine_core_modules",
           "runner_positions", "input_processor_pml")
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
