"""What the CPU and CUDA attention wrappers share, free of either backend.

  eviction_config  the EvictionConfig of the engine being built
  physical_view    attention metadata with physical seq_lens / slot mapping
  evictable_spec   the KV spec swap that gives the scheduler our block manager
"""

from __future__ import annotations

from dataclasses import replace

import torch
from vllm.config import get_current_vllm_config

from vllm_kvevict.config import EvictionConfig
from vllm_kvevict.integration.worker import worker_state


def eviction_config(vllm_config=None) -> EvictionConfig:
    vllm_config = vllm_config or get_current_vllm_config()
    return EvictionConfig.from_dict(vllm_config.additional_config or {})


def physical_view(cm, evicted: torch.Tensor, block_size: int):
    """CommonAttentionMetadata with physical seq_lens and slot_mapping.

    evicted: (num_reqs,) int32, logical - physical per batch row.
    New tokens of row i occupy physical positions [S_i - q_i, S_i).
    """
    num_reqs, n = cm.num_reqs, cm.num_actual_tokens
    dev = cm.seq_lens.device
    seq = cm.seq_lens[:num_reqs] - evicted.to(dev)
    qsl = cm.query_start_loc[: num_reqs + 1].long()
    q_lens = qsl[1:] - qsl[:-1]
    row = torch.repeat_interleave(torch.arange(num_reqs, device=dev), q_lens)
    pos = (seq.long() - q_lens)[row] + torch.arange(n, device=dev) - qsl[:-1][row]
    slots = cm.block_table_tensor[row, pos // block_size].long() * block_size + pos % block_size
    slot_mapping = cm.slot_mapping.clone()
    slot_mapping[:n] = slots
    seq_lens = cm.seq_lens.clone()
    seq_lens[:num_reqs] = seq
    # _num_computed_tokens_cache: a value derived from logical lengths must not survive.
    return replace(cm, seq_lens=seq_lens, slot_mapping=slot_mapping,
                   max_seq_len=int(seq.max()), _num_computed_tokens_cache=None)


def evictable_spec(spec):
    """Swap a full-attention spec for the evictable one when eviction is on."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_kvevict.integration.spec import EvictableAttentionSpec

    state = worker_state()
    if state is None or type(spec) is not FullAttentionSpec:
        return spec
    cfg = state.cfg
    fields = {f: getattr(spec, f) for f in spec.__dataclass_fields__}
    return EvictableAttentionSpec(**fields, eviction=tuple(sorted(cfg.to_dict().items())))
