"""The one compaction path: move each head's kept tokens to a request's first slots.

vLLM-free; works through a layout adapter (`KVLayout` for the CPU cache,
`NHDLayout` for FlashAttention's), so every backend moves tokens, and the
scores that travel with them, the same way.
"""

from __future__ import annotations

import torch


def compact(layout, key_cache: torch.Tensor, value_cache: torch.Tensor,
            scores: torch.Tensor | None, src_blocks: torch.Tensor,
            dst_blocks: torch.Tensor, keep: torch.Tensor) -> None:
    """Gather, per KV head, the kept tokens and write them in order to slots
    [0, new_len) of `dst_blocks`.

    src_blocks: (n_src,) int64 blocks holding the request's old tokens
    dst_blocks: (n_dst,) int64, n_dst = ceil(new_len / BS); may equal src
                blocks (everything is read before anything is written)
    keep:       (H, new_len) int64 ascending token indices into the old row
    scores:     (H, NB * BS) float32 per-slot scores, moved alongside, or None

    Whole blocks are written: slots of the last destination block past
    new_len are zeroed (nothing valid lives there; the next tokens go there).
    """
    h, new_len = keep.shape
    # The worker builds block ids on the CPU; the cache may live on a GPU.
    src_blocks, dst_blocks = src_blocks.to(key_cache.device), dst_blocks.to(key_cache.device)
    bs, d = layout.block_size, layout.head_size
    n_src, n_dst = src_blocks.numel(), dst_blocks.numel()
    k = layout.gather_keys(key_cache, src_blocks[None], n_src)[0]  # (H, n_src*BS, D)
    v = layout.gather_values(value_cache, src_blocks[None], n_src)[0]
    idx = keep[..., None].expand(-1, -1, d)
    new_k = k.new_zeros(h, n_dst * bs, d)
    new_v = v.new_zeros(h, n_dst * bs, d)
    new_k[:, :new_len] = k.gather(1, idx)
    new_v[:, :new_len] = v.gather(1, idx)
    layout.write_blocks(key_cache, value_cache, dst_blocks, new_k, new_v)
    if scores is not None:
        pos = torch.arange(n_src * bs, device=scores.device)
        src_slots = src_blocks[pos // bs] * bs + pos % bs
        moved = scores[:, src_slots].gather(1, keep)
        dst_slots = dst_blocks[pos[:new_len] // bs] * bs + pos[:new_len] % bs
        scores[:, dst_slots] = moved
