"""TARGET: vllm.platforms.cpu.CpuPlatform.ray_device_key,
        vllm.v1.executor.ray_executor_v2.RayExecutorV2._get_actor_resource_kwargs,
        vllm.v1.executor.ray_executor_v2.RayExecutorV2._init_executor,
        vllm.v1.executor.ray_executor_v2.RayWorkerProc.get_node_and_physical_gpu_ids,
        vllm.v1.executor.ray_executor_v2.RayWorkerProc.initialize_worker

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
     - a worker reports no device ids (Ray lists none for CPUs);
     - binding, as `mp` does it: MultiprocExecutor starts each worker with
       OMP_NUM_THREADS/OMP_PLACES/OMP_PROC_BIND from VLLM_CPU_OMP_THREADS_BIND
       (OMPProcessManager) and then drops the engine process to one torch
       thread; RayExecutorV2 replaces that `_init_executor` and does neither,
       so Ray workers float over all cores with whatever thread count they
       inherit, and ran several times slower than bound ones
       (docs/results.md, "Figures behind code comments"). Before the stock
       `initialize_worker`, each Ray worker pins its process to its local
       rank's CPU list from the same variable (e.g. "0|1": rank 0 on core 0,
       rank 1 on core 1; same lists and errors as `mp`, so "auto" wants a
       NUMA node per rank); after the stock `_init_executor`, the engine
       process takes one torch thread. Multi-node CPU clusters are untested:
       vLLM counts every Ray rank as local (parallel_config.local_world_size).
     Ray ships the actor class as the driver has it (checked: the patched
     methods are on the actor's class before vLLM loads plugins in the worker,
     which happens only in WorkerWrapperBase.init_worker).
UPSTREAM: a non-empty `ray_device_key` for CpuPlatform, a CPU branch in
     RayExecutorV2._get_actor_resource_kwargs (the GPU branch exists) and the
     mp executor's CPU thread binding in RayExecutorV2.
"""

from __future__ import annotations

import os

from . import mark_patched


def _bind_to_cpus(vllm_config, local_rank: int) -> None:
    """Pin this worker process to its rank's CPUs, as the mp executor does.

    vLLM's mp executor (MultiprocExecutor._init_executor) reads
    VLLM_CPU_OMP_THREADS_BIND with OMPProcessManager and starts each worker
    process with OMP_NUM_THREADS / OMP_PLACES / OMP_PROC_BIND for its local
    rank's CPU list. RayExecutorV2 overrides _init_executor without that step,
    and a Ray actor's process is already running when its rank is known, so
    the OpenMP variables would come too late: set the affinity of every thread
    of the process (threads started later, OpenMP's and gloo's, inherit it)
    and torch's thread count instead. Same CPU lists and errors as mp
    ("auto" needs a NUMA node per rank; "nobind" leaves the process alone).
    """
    import torch
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager(vllm_config)
    if manager.skip_setup:
        return
    cpus = manager.cpu_lists[local_rank]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))  # for this process's children
    torch.set_num_threads(len(cpus))


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        import ray
    except ImportError:
        return  # vLLM reports a missing Ray itself when the backend is asked for
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.torch_utils import set_torch_threads_for_runtime
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2, RayWorkerProc

    CpuPlatform.ray_device_key = "CPU"

    def _get_actor_resource_kwargs():
        return {"num_gpus": 0}

    def get_node_and_physical_gpu_ids(self):
        return ray.get_runtime_context().get_node_id(), []

    def initialize_worker(self, local_rank, env_vars, distributed_init_method,
                          driver_env_vars=None, **kwargs):
        # The environment the original is about to set up (driver's values
        # fill in, never overwrite; env_vars overwrite), first, so that
        # VLLM_CPU_OMP_THREADS_BIND is the driver's unless the node set its own.
        for key, value in (driver_env_vars or {}).items():
            os.environ.setdefault(key, value)
        os.environ.update(env_vars)
        _bind_to_cpus(self._init_kwargs["vllm_config"], local_rank)
        return initialize_worker.__kvevict_original__(
            self, local_rank, env_vars, distributed_init_method, driver_env_vars, **kwargs)

    def _init_executor(self):
        _init_executor.__kvevict_original__(self)
        set_torch_threads_for_runtime()  # as MultiprocExecutor._init_executor

    mark_patched(RayExecutorV2, "_get_actor_resource_kwargs",
                 staticmethod(_get_actor_resource_kwargs))
    mark_patched(RayWorkerProc, "get_node_and_physical_gpu_ids", get_node_and_physical_gpu_ids)
    mark_patched(RayExecutorV2, "_init_executor", _init_executor)
    mark_patched(RayWorkerProc, "initialize_worker", initialize_worker)
