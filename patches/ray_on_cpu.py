"""TARGET: vllm.platforms.cpu.CpuPlatform.ray_device_key,
        vllm.v1.executor.ray_executor_v2.RayExecutorV2._get_actor_resource_kwargs,
        vllm.v1.executor.ray_executor_v2.RayWorkerProc.get_node_and_physical_gpu_ids

WHY: vLLM's CPU platform refuses the Ray executor ("current platform cpu does
     not support ray"): its `ray_device_key` is empty, which every Ray code path
     reads as "no Ray". Yet nothing in the executor needs an accelerator: a CPU
     worker is a process bound to its own cores, exactly what the `mp` executor
     already runs. Serving on CPU clusters, and testing the plugin's Ray path on
     this CPU-only machine, need it.
HOW: only on the CPU platform, for vLLM 0.32's default Ray executor
     (RayExecutorV2; the older compiled-graph executor is left alone):
     - `ray_device_key = "CPU"`: each rank's placement-group bundle is
       {"CPU": 1}, so a tensor-parallel group packs onto one machine's cores
       (or spreads over nodes) the way GPU bundles do;
     - the worker actor takes no extra resources of its own (it runs inside its
       bundle's reserved CPU): the stock code would pass the key through
       `resources=`, which Ray rejects for "CPU" ("use num_cpus");
     - a worker reports no device ids (Ray lists none for CPUs); each rank then
       binds its cores from VLLM_CPU_OMP_THREADS_BIND by local rank (e.g.
       "0|1" for TP 2), which the executor copies to every worker, as with `mp`.
UPSTREAM: a non-empty `ray_device_key` for CpuPlatform and a CPU branch in
     RayExecutorV2._get_actor_resource_kwargs (the GPU branch exists).
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        import ray
    except ImportError:
        return  # vLLM reports a missing Ray itself when the backend is asked for
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2, RayWorkerProc

    CpuPlatform.ray_device_key = "CPU"

    def _get_actor_resource_kwargs():
        return {"num_gpus": 0}

    def get_node_and_physical_gpu_ids(self):
        return ray.get_runtime_context().get_node_id(), []

    mark_patched(RayExecutorV2, "_get_actor_resource_kwargs",
                 staticmethod(_get_actor_resource_kwargs))
    mark_patched(RayWorkerProc, "get_node_and_physical_gpu_ids", get_node_and_physical_gpu_ids)
