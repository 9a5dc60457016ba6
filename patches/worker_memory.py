"""TARGET: vllm.v1.worker.cpu_worker.CPUWorker.determine_available_memory and
        vllm.v1.worker.gpu_worker.Worker.determine_available_memory

WHY: without an explicit KV cache size, vLLM gives the KV cache all the memory
     its check finds (CPU: `--gpu-memory-utilization` of RAM less the worker's
     resident memory after a warm-up; CUDA: that fraction of device memory less
     a profiled peak). Eviction's buffers are allocated after that check: H2O's
     score buffer alone is 2 / (head_size x cache element bytes) of the cache
     (1/64 in bf16), the slot orders as much again, the query logs grow with
     the requests (core/eviction/footprint.py). On the 24 GiB CPU machine a plain
     `vllm serve SmolLM2 --kv-eviction h2o` got 20.56 GiB of cache, the worker
     reached 23.1 GB resident at its first 1,900-token request and the kernel's
     OOM killer took it (stock, the same way: 21.63 GB, 0.43 GiB free).
HOW: when eviction (or offload) is on and the size is vLLM's own (no
     --kv-cache-memory-bytes, no VLLM_CPU_KVCACHE_SPACE), give the cache
     `cache_share` of vLLM's figure: the cache and everything the worker holds
     beside it at full occupancy (per slot, per request row for max_num_seqs
     requests, fixed; on CPU the offload pool too) fit in what vLLM measured.
     The shapes come from this worker's own KV cache spec (its layers, KV heads,
     page size) and the model config (query heads, dtype). An explicit size is
     left alone: it is the cache's, and the log says what comes on top; on CPU,
     where vLLM checks an explicit size against free memory, the footprint
     joins that check (startup stops, naming the flags, rather than the OOM
     killer stopping the worker later).
UPSTREAM: a hook for attention backends / KV managers to declare memory they
     allocate per KV slot and per request, charged before the cache is sized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm_kvevict.core.eviction.footprint import Footprint, cache_share, footprint
from vllm_kvevict.integration.settings import eviction_config

from . import mark_patched

logger = logging.getLogger("vllm.kvevict")  # prints with vLLM's own lines


@dataclass(frozen=True)
class Split:
    """The last sizing in this process: what vLLM found, what the cache got."""
    available: int  # vLLM's auto-sized figure (bytes)
    cache: int      # the cache's share of it
    slot_bytes: int  # one cache slot, every layer of this worker
    footprint: Footprint
    max_requests: int


last_split: Split | None = None


def _footprint(worker, cfg) -> tuple[int, Footprint]:
    """(bytes per cache slot, what eviction holds beside the cache), from the
    worker's attention layers' specs."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import AttentionSpec

    specs = [s for s in worker.model_runner.get_kv_cache_spec().values()
             if isinstance(s, AttentionSpec)]
    if not specs:
        return 0, Footprint(0, 0, 0)
    model, parallel = worker.model_config, worker.parallel_config
    slot_bytes = sum(s.page_size_bytes // s.block_size for s in specs)
    fp = footprint(cfg, num_layers=len(specs), num_kv_heads=max(s.num_kv_heads for s in specs),
                   num_q_heads=model.get_num_attention_heads(parallel),
                   head_size=max(s.head_size for s in specs),
                   query_bytes=model.dtype.itemsize,
                   on_cpu=current_platform.is_cpu(),
                   drafts=getattr(worker.vllm_config, "num_speculative_tokens", 0))
    return slot_bytes, fp


def _free_cpu_memory() -> int:
    """Available memory on the worker's memory node, read as vLLM's CPU worker
    reads it for its own check of an explicit size."""
    from vllm.v1.worker import cpu_worker

    node = cpu_worker.get_allowed_cpu_list()[0].numa_node
    return cpu_worker.get_memory_node_info(node).available_memory


def _sized(worker, available: int) -> int:
    from vllm.platforms import current_platform

    global last_split
    cfg = eviction_config(worker.vllm_config)
    if not (cfg.enabled or cfg.offload):
        return available
    slot_bytes, fp = _footprint(worker, cfg)
    max_requests = worker.vllm_config.scheduler_config.max_num_seqs
    if not slot_bytes:
        return available
    if worker.cache_config.kv_cache_memory_bytes is not None:
        extra = fp.bytes(available // slot_bytes, max_requests)
        free = _free_cpu_memory() if current_platform.is_cpu() else None
        if free is not None and available + extra > free:
            # vLLM checked the cache alone against this figure; it is still free
            # (the cache is allocated after this returns).
            raise ValueError(
                f"The KV cache you sized ({available / 2**30:.2f} GiB: --kv-cache-memory-bytes "
                f"or VLLM_CPU_KVCACHE_SPACE) and the {extra / 2**30:.2f} GiB eviction holds "
                f"beside it ({cfg.as_flags()}) exceed the {free / 2**30:.2f} GiB of memory "
                "available: size the cache smaller, or leave it to vLLM, which then leaves "
                "room for both")
        logger.info("vllm_kvevict: eviction holds up to %.2f GiB beside the %.2f GiB "
                    "KV cache you sized", extra / 2**30, available / 2**30)
        return available
    share = cache_share(available, slot_bytes, fp, max_requests)
    last_split = Split(available, share, slot_bytes, fp, max_requests)
    logs = fp.logs(max_requests)
    logger.info("vllm_kvevict: of the %.2f GiB vLLM found for the KV cache, %.2f GiB "
                "stay for eviction's buffers (per-slot scores and orders; %.2f GiB of query "
                "logs for --max-num-seqs %d%s)", available / 2**30, (available - share) / 2**30,
                logs / 2**30, max_requests, "; the offload pool" if cfg.offload and fp.fixed else "")
    return share


def apply() -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    for cls in (CPUWorker, Worker):
        def determine_available_memory(self, _cls=cls) -> int:
            original = _cls.__dict__["determine_available_memory"].__kvevict_original__
            return _sized(self, original(self))

        mark_patched(cls, "determine_available_memory", determine_available_memory)
