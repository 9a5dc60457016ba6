"""The one compaction path: move each head's kept tokens to a request's first slots.

vLLM-free; works through a layout adapter (`KVLayout` for the CPU cache,
`NHDLayout` for FlashAttention's), so every backend moves tokens, and the
scores that travel with them, the same way. Rows are batched: the worker
compacts one request in every layer at once when the layers' caches are
slices of one buffer (row l = layer l, blocks offset by l * num_blocks).
"""

from __future__ import annotations

import torch


def compact(layout, key_cache: torch.Tensor, value_cache: torch.Tensor,
            src_blocks: torch.Tensor, dst_blocks: torch.Tensor, keep: torch.Tensor,
            gathered: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Gather, per row and KV head, the kept tokens and write them in order to
    slots [0, new_len) of that row's destination blocks.

    src_blocks: (B, n_src) int64 blocks holding each row's old tokens
    dst_blocks: (B, n_dst) int64, n_dst = ceil(new_len / BS); may equal src
                blocks (everything is read before anything is written)
    keep:       (B, H, new_len) int64 ascending token indices into the old row

    gathered:   (K, V) of src_blocks, each (B, H, n_src*BS, D), when the caller
                already gathered them (to score the tokens)

    Whole blocks are written: slots of the last destination block past
    new_len are zeroed (nothing valid lives there; the next tokens go there).
    """
    b, h, new_len = keep.shape
    bs, d = layout.block_size, layout.head_size
    # The worker builds block ids on the CPU; the cache may live on a GPU.
    src_blocks, dst_blocks = src_blocks.to(key_cache.device), dst_blocks.to(key_cache.device)
    keep = keep.to(key_cache.device)
    n_src, n_dst = src_blocks.shape[1], dst_blocks.shape[1]
    if gathered is None:
        gathered = (layout.gather_keys(key_cache, src_blocks, n_src),  # (B, H, n_src*BS, D)
                    layout.gather_values(value_cache, src_blocks, n_src))
    k, v = gathered
    # NOTE: one row gather (index_select of D-element rows) instead of an
    # element-wise gather along the token axis: measured 5x faster on CPU
    # (21 vs 104 ms for 30 layers x 3 heads x 4096 tokens x 64 bf16).
    n = k.shape[2]
    rows = torch.zeros(b, h, n_dst * bs, dtype=torch.int64, device=keep.device)
    rows[:, :, :new_len] = keep + n * torch.arange(b * h, device=keep.device).view(b, h, 1)
    new_k = k.reshape(-1, d).index_select(0, rows.flatten()).view(b, h, n_dst * bs, d)
    new_v = v.reshape(-1, d).index_select(0, rows.flatten()).view(b, h, n_dst * bs, d)
    new_k[:, :, new_len:] = 0  # the rest of the last block (padding rows read row 0)
    new_v[:, :, new_len:] = 0
    layout.write_blocks(key_cache, value_cache, dst_blocks, new_k, new_v)


def move_scores(scores: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                keep: torch.Tensor, old: torch.Tensor | None = None) -> None:
    """Move per-slot scores along with their tokens.

    scores: (H, S) float32; src_slots: (B, old_len); dst_slots: (B, new_len);
    keep: (B, H, new_len) as for `compact`; old: (B, H, old_len) the scores
    at src_slots when the caller already gathered them (to pick `keep`).
    """
    dev = scores.device
    if old is None:
        old = scores[:, src_slots.to(dev)].transpose(0, 1)
    moved = old.gather(2, keep.to(dev))
    scores[:, dst_slots.to(dev)] = moved.transpose(0, 1)
