"""What the CPU and CUDA attention wrappers share, free of either backend.

  physical_view    attention metadata with physical seq_lens / slot mapping
  physical_metadata  the same, for the rows of the worker's current batch
  evictable_spec   the KV spec swap that gives the scheduler our block manager
  write_kv         the backend's own KV write, at the physical slots
  score_step       what the policy's recorder keeps of this step's queries, after
                   attention (integration/recorders.py: H2O's scores, the
                   window policies' queries, nothing for streaming)
  fused_decode     all-decode steps on the Triton path under a recorder that
                   fuses decode (accumulated attention): attention and scores in
                   one pass over K and V, instead of the stock kernel + score_step
  host_lens        the step's lengths as vLLM keeps them on the host

Host-device synchronisations (tests/test_cuda_syncs.py counts them): none of
these reads a GPU value on the host. What Python control flow needs comes from
vLLM's host copies (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound``, exact
without async scheduling, which eviction turns off) and the worker state's own
per-request counts; small host tensors go up with `kernel_dispatch.upload`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch
from vllm.v1.attention.backend import AttentionType

from vllm_kvevict.core.eviction.kernel_dispatch import triton_module, upload, use_triton
from vllm_kvevict.core.scoring.scores import zero_new_slots
from vllm_kvevict.integration.worker import worker_state

PLACEMENT_ATTR = "kvevict_decode_placement"  # set on a step's attention metadata
SCORED_ATTR = "kvevict_scored_rows"  # (num_reqs,) bool, or None for all rows
# QueryBuffers taking every layer's queries by reference this step, or None
# (CPU builder: WorkerEviction.log_only)
LOG_ONLY_ATTR = "kvevict_log_only"
HOST_ATTR = "kvevict_host_lens"  # HostLens of the step (CUDA builder)


class HostLens(NamedTuple):
    """A step's lengths on the host, as the metadata's device tensors hold them."""
    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32, vLLM's query_start_loc_cpu
    seq_lens: torch.Tensor | None  # (num_reqs,) seq_lens (physical in a physical
    # view), or None when vLLM gave no host copy (then readers read the device)


def host_lens(cm) -> HostLens:
    """The host copies CommonAttentionMetadata carries; reads nothing from the GPU."""
    return HostLens(cm.query_start_loc_cpu, cm.seq_lens_cpu_upper_bound)


def physical_view(cm, evicted: torch.Tensor, block_size: int, on_host: bool = False):
    """CommonAttentionMetadata with physical seq_lens and slot_mapping (and
    their host copy seq_lens_cpu_upper_bound, and max_seq_len).

    evicted: (num_reqs,) int32 host tensor, logical - physical per batch row.
    New tokens of row i occupy physical positions [S_i - q_i, S_i).
    No sync: the device tensors are computed on the device (`_physical_slots`);
    max_seq_len comes from the host copy of the lengths, read from the device
    only if vLLM gave none.
    on_host: the metadata's tensors are host tensors (the CPU backend): the
    slots are computed in numpy (`_physical_slots_host`).
    """
    num_reqs, n = cm.num_reqs, cm.num_actual_tokens
    if int(cm.query_start_loc_cpu[num_reqs]) != n:  # host values: free
        raise ValueError(f"physical_view: {n} tokens but query_start_loc ends at "
                         f"{int(cm.query_start_loc_cpu[num_reqs])} (padded metadata?)")
    slots_of = _physical_slots_host if on_host else _physical_slots
    seq, slots = slots_of(cm, evicted, block_size)
    slot_mapping = cm.slot_mapping.clone()
    slot_mapping[:n] = slots
    seq_lens = cm.seq_lens.clone()
    seq_lens[:num_reqs] = seq
    host = cm.seq_lens_cpu_upper_bound
    if host is not None:
        host = host.clone()
        host[:num_reqs] -= evicted.to(host.dtype)
        max_seq_len = int(host[:num_reqs].max())
    else:  # no host copy (not from vLLM's runner): one read of the device
        max_seq_len = int(seq.max())
    # _num_computed_tokens_cache: a value derived from logical lengths must not survive.
    return replace(cm, seq_lens=seq_lens, slot_mapping=slot_mapping, max_seq_len=max_seq_len,
                   seq_lens_cpu_upper_bound=host, _num_computed_tokens_cache=None)


def _physical_slots(cm, evicted: torch.Tensor, block_size: int):
    """`physical_view`'s (num_reqs,) physical lengths and (n,) physical slots
    of the step's new tokens, computed where the metadata's tensors live
    without a sync (`evicted` uploaded asynchronously, repeat_interleave told
    its size)."""
    num_reqs, n = cm.num_reqs, cm.num_actual_tokens
    dev = cm.seq_lens.device
    seq = cm.seq_lens[:num_reqs] - upload(evicted, dev)
    qsl = cm.query_start_loc[: num_reqs + 1].long()
    q_lens = qsl[1:] - qsl[:-1]
    row = torch.repeat_interleave(torch.arange(num_reqs, device=dev), q_lens, output_size=n)
    pos = (seq.long() - q_lens)[row] + torch.arange(n, device=dev) - qsl[:-1][row]
    return seq, cm.block_table_tensor[row, pos // block_size].long() * block_size + pos % block_size


def _physical_slots_host(cm, evicted: torch.Tensor, block_size: int):
    """`_physical_slots` for host tensors (the CPU backend), in numpy: the same
    few index operations cost a third as much there as in torch (0.04 against
    0.12 ms a step at 50 rows), whose repeat_interleave opens an OpenMP region
    (a wake-up of sleeping threads) for a 50-element index."""
    num_reqs = cm.num_reqs
    qsl = cm.query_start_loc_cpu[: num_reqs + 1].numpy()
    seq = cm.seq_lens[:num_reqs].numpy() - evicted.numpy()
    q_lens = np.diff(qsl)
    row = np.repeat(np.arange(num_reqs), q_lens)
    pos = (seq - q_lens)[row] + (np.arange(len(row)) - qsl[:-1][row])
    blocks = cm.block_table_tensor.numpy()[row, pos // block_size].astype(np.int64)
    return torch.from_numpy(seq), torch.from_numpy(blocks * block_size + pos % block_size)


def physical_metadata(state, cm, block_size: int, on_host: bool = False):
    """The builder's step: `cm` as is when no row of the batch has evicted,
    else its `physical_view` (on_host: the CPU backend's host tensors)."""
    evicted = state.evicted_per_row(cm.num_reqs)
    return cm if evicted is None else physical_view(cm, evicted, block_size, on_host)


def evictable_spec(spec):
    """Swap a full-attention spec for the evictable one when eviction is on."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_kvevict.integration.spec import EvictableAttentionSpec

    state = worker_state()
    if state is None or type(spec) is not FullAttentionSpec:
        return spec
    cfg = state.cfg
    fields = {f: getattr(spec, f) for f in spec.__dataclass_fields__}
    return EvictableAttentionSpec(**fields, eviction=cfg)


def write_kv(impl, layer, key, value, kv_cache, attn_metadata) -> None:
    """The backend owns the KV write (forward_includes_kv_cache_update), with the
    metadata's physical slot mapping; layers that share an earlier layer's cache
    write nothing, as in the stock path."""
    n = attn_metadata.num_actual_tokens
    if key is not None and value is not None and impl.kv_sharing_target_layer_name is None:
        impl.do_kv_cache_update(layer, key[:n], value[:n], kv_cache,
                                attn_metadata.slot_mapping[:n])


def score_step(impl, layer, query, kv_cache, attn_metadata, make_layout,
               scale: float | None = None) -> None:
    """Register the layer's cache with the worker state and hand this step's
    queries to the policy's recorder (integration/recorders.py), with the
    placement the builder made for them (CPU logs, the query ring) if any.
    ``scale``: the logits' scale (default the layer's softmax scale)."""
    state = worker_state()
    if state is None or impl.attn_type != AttentionType.DECODER:
        return
    n = attn_metadata.num_actual_tokens
    lc = state.layer(layer.layer_name, kv_cache, make_layout)
    state.recorder.record(layer.layer_name, lc, query[:n], kv_cache,
                          impl.scale if scale is None else scale, attn_metadata,
                          getattr(attn_metadata, PLACEMENT_ATTR, None),
                          getattr(attn_metadata, SCORED_ATTR, None),
                          getattr(attn_metadata, HOST_ATTR, None) or HostLens(None, None))


def fused_decode(impl, layer, query, kv_cache, attn_metadata, output, make_layout) -> bool:
    """Attention output and H2O scores of an all-decode step from one Triton
    kernel (`triton_kernels.paged_attention`), written into `output`
    (num_tokens, H_q, D). Returns False, doing nothing, when the step is not
    such a step (prefill rows, a recorder that does not fuse decode, decode
    log, torch path, private score rows)."""
    state = worker_state()
    if (state is None or impl.attn_type != AttentionType.DECODER
            or not state.recorder.fuses_decode or attn_metadata.max_query_len != 1
            or getattr(attn_metadata, PLACEMENT_ATTR, None) is not None):
        return False
    lc = state.layer(layer.layer_name, kv_cache, make_layout)
    n = attn_metadata.num_actual_tokens
    if not use_triton(query, lc.layout) or state.private_rows(layer.layer_name, lc, n):
        return False  # private score rows (shared first blocks): the torch path
    key_cache, value_cache = lc.layout.split(kv_cache)
    zero_new_slots(lc.scores, attn_metadata.slot_mapping, n)
    rows = getattr(attn_metadata, SCORED_ATTR, None)
    weight = None if rows is None else upload(rows[:n].to(torch.float32), query.device)
    triton_module("paged_attention").paged_attention_scores(
        query[:n], key_cache, value_cache, attn_metadata.block_table,
        torch.arange(n, device=query.device), attn_metadata.seq_lens[:n], impl.scale,
        scores=lc.scores, score_weight=weight, out=output[:n].view(n, *query.shape[1:]),
        max_visible=attn_metadata.max_seq_len,
        unique_rows=True)  # one query per request, no private (shared) rows: no atomics
    return True
