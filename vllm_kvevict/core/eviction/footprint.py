"""What eviction holds beside vLLM's KV cache, and the cache's share of an
auto-sized memory budget. vLLM-free.

Without `--kv-cache-memory-bytes` (or VLLM_CPU_KVCACHE_SPACE), vLLM sizes the
KV cache to fill what its memory check leaves: on CPU `--gpu-memory-utilization`
of RAM less the worker's resident memory after a warm-up forward, on CUDA that
fraction of device memory less a profiled forward's peak. The plugin's worker
allocates its buffers after that check, so on a CPU sized by vLLM they pushed
the worker past its share and the kernel's OOM killer took it at the first
long request (docs/results.md, twenty-eighth session). What the worker holds
(integration/worker.py and the logs it keeps), per layer of this worker:

  per cache slot (a token's place in a block), per KV head:
    4 bytes  the slot order of a compacted request's resident tokens (int32;
             every policy that compacts; a request's order covers at most
             its resident tokens)
    4 bytes  H2O's accumulated attention (float32), Record.ATTENTION, one
             for every slot of the cache
  per request row (the logs grow by doubling: at most 2 x max_num_seqs rows):
    --kv-window (SnapKV/AnDPro) or, on CPU, DECODE_DEPTH (H2O's decode log)
    queries of H_q x D in the model's dtype; the decode log's visible
    lengths (DECODE_DEPTH int64, once, not per layer). With k speculative
    drafts a step, the window keeps k spare queries (a rollback must leave
    --kv-window accepted ones) and the decode log is at least 1 + k deep
  fixed:
    on CPU, CHUNK_TOKENS deferred prefill queries (H2O), H_q x D each
    on CPU, the offload host tier (--kv-swap-space): host memory is the
    cache's own memory there
(On CUDA H2O scores every query in its own step: no decode or chunk log.)

Not bounded here: a prefix-hit request's private score rows (H_kv floats per
shared token until its first compaction) and a compaction's transient gather
(vLLM's warm-up forward left room of that order for activations).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvevict.core.config.settings import EvictionConfig
from vllm_kvevict.core.policies import make_policy
from vllm_kvevict.core.policies.base import Record
from vllm_kvevict.core.scoring.chunk_log import CHUNK_TOKENS
from vllm_kvevict.core.scoring.decode_log import DECODE_DEPTH

ROWS_PER_REQUEST = 2  # the logs' rows grow by doubling (query_buffers.py)


@dataclass(frozen=True)
class Footprint:
    per_slot: int     # bytes per cache slot, all of the worker's layers
    per_request: int  # bytes per request row, all layers
    fixed: int

    def logs(self, max_requests: int) -> int:
        """The query logs' rows for `max_requests` requests at once."""
        return ROWS_PER_REQUEST * self.per_request * max_requests

    def bytes(self, slots: int, max_requests: int) -> int:
        """At most this much beside a cache of `slots` slots serving
        `max_requests` requests at once."""
        return self.per_slot * slots + self.logs(max_requests) + self.fixed


def footprint(cfg: EvictionConfig, *, num_layers: int, num_kv_heads: int, num_q_heads: int,
              head_size: int, query_bytes: int, on_cpu: bool, drafts: int = 0) -> Footprint:
    """What the worker holds beside its KV cache under `cfg` (the module
    docstring's table). Heads are this worker's (tensor-parallel shards);
    on_cpu: the CPU backend (H2O's queries wait in logs; host memory is the
    cache's); drafts: speculative decoding's tokens a step (worker.py sizes
    the window and the decode log by them)."""
    host = cfg.swap_bytes if cfg.offload and on_cpu else 0
    if not cfg.enabled:
        return Footprint(0, 0, host)
    records = make_policy(cfg.policy, cfg.sink, cfg.window).records
    per_head = 4 + (4 if records is Record.ATTENTION else 0)
    query = num_layers * num_q_heads * head_size * query_bytes
    logs = records is Record.ATTENTION and on_cpu  # the decode and chunk logs
    decode_depth = max(DECODE_DEPTH, 1 + drafts)
    depth = cfg.window + drafts if records is Record.QUERIES else decode_depth if logs else 0
    chunk = CHUNK_TOKENS if logs else 0
    visible = decode_depth * 8 if logs else 0
    return Footprint(per_slot=num_layers * num_kv_heads * per_head,
                     per_request=depth * query + visible, fixed=chunk * query + host)


def cache_share(available: int, slot_bytes: int, fp: Footprint, max_requests: int) -> int:
    """The bytes of `available` to give the KV cache, whose slots cost
    `slot_bytes` each (all layers), so that the cache and what eviction holds
    beside it fit together: share + fp.bytes(share // slot_bytes, max_requests)
    <= available. Raises ValueError where nothing is left for the cache."""
    rest = available - fp.bytes(0, max_requests)
    share = rest * slot_bytes // (slot_bytes + fp.per_slot) if rest > 0 else 0
    if share < slot_bytes:
        raise ValueError(
            f"KV cache eviction needs {fp.bytes(0, max_requests) / 2**30:.2f} GiB beside the "
            f"KV cache (query logs for {max_requests} requests, deferred prefill queries, "
            f"the offload pool), more than the {available / 2**30:.2f} GiB vLLM found for "
            "the cache: raise --gpu-memory-utilization (on CPU: the fraction of RAM), "
            "lower --max-num-seqs or --kv-swap-space, or size the cache with "
            "--kv-cache-memory-bytes")
    return share


def held_bytes(root: object, exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct tensor storages reachable from `root` through this
    package's objects and plain containers (nothing of vLLM's is entered),
    storages whose data_ptr is in `exclude` (the KV cache) left out: what a
    worker's eviction state really holds, to hold to `Footprint.bytes`."""
    import torch

    seen: set[int] = set()
    storages: dict[int, int] = {}
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in exclude:
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif type(obj).__module__.startswith("vllm_kvevict."):
            todo.extend(getattr(obj, "__dict__", {}).values())
            todo.extend(getattr(obj, name) for name in getattr(type(obj), "__slots__", ())
                        if hasattr(obj, name))
    return sum(storages.values())
