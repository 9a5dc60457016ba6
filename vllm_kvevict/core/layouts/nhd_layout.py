"""Token reads and moves in the FlashAttention paged KV cache (pure torch, any device).

vLLM 0.32 hands every backend a layer cache with the logical shape
``[num_blocks, H, BS, 2*D]`` (K in the first D channels, V in the last D), whose
physical order is the model-wide ``KVCacheLayout`` (FlashAttention declares none,
so vLLM's default LBNHC applies: ``[BS, H, 2D]`` contiguous per block; LBHNC and
block-outer layouts only change the strides). ``flash_attn.py`` splits it as

    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)

into two ``[NB, BS, H, D]`` views, and ``reshape_and_cache_flash`` writes token
``t`` of head ``h`` to ``key_cache[slot // BS, slot % BS, h]``. Everything here
goes through those views with advanced indexing, so it holds for any stride
order. The pre-0.32 cache ``(2, NB, BS, H, D)`` (K = [0], V = [1]) is accepted too.

Same interface as the CPU ``KVLayout``, so the worker and the score path use
either one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NHDLayout:
    """Shape of one layer's FlashAttention cache; all methods take the split views."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @classmethod
    def for_cache(cls, kv_cache: torch.Tensor) -> "NHDLayout":
        """From a layer cache ``[NB, H, BS, 2D]`` (or legacy ``[2, NB, BS, H, D]``)."""
        if kv_cache.dim() == 5:
            _, _, bs, h, d = kv_cache.shape
        else:
            _, h, bs, d2 = kv_cache.shape
            assert d2 % 2 == 0, f"last dim {d2} is not K||V"
            d = d2 // 2
        return cls(bs, h, d, kv_cache.dtype)

    def split(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer cache -> (key_cache, value_cache), each a ``[NB, BS, H, D]`` view,
        exactly the tensors the FlashAttention kernel reads."""
        if kv_cache.dim() == 5:
            kc, vc = kv_cache[0], kv_cache[1]
        else:
            kc, vc = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        assert kc.shape[1:] == (self.block_size, self.num_kv_heads, self.head_size), kc.shape
        return kc, vc

    def _heads(self, blk: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        if heads is not None:
            return heads.to(blk.device, torch.long)
        return torch.arange(self.num_kv_heads, device=blk.device).view(-1, 1).expand_as(blk)

    def read_tokens(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_ids: torch.Tensor, offsets: torch.Tensor,
                    heads: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``block_ids, offsets: [H, N]`` (row h addresses head h, unless ``heads``
        names each token's head) -> (k, v), each ``[..., D]``; advanced indexing
        returns fresh copies, so callers may overwrite the source slots afterwards."""
        dev = key_cache.device
        blk, off = block_ids.to(dev, torch.long), offsets.to(dev, torch.long)
        h = self._heads(blk, heads)
        return key_cache[blk, off, h], value_cache[blk, off, h]

    def write_tokens(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_ids: torch.Tensor, offsets: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, heads: torch.Tensor | None = None) -> None:
        """Inverse of ``read_tokens``: ``k, v: [..., D]`` into the given slots
        (distinct; cast to the cache dtype)."""
        dev = key_cache.device
        blk, off = block_ids.to(dev, torch.long), offsets.to(dev, torch.long)
        h = self._heads(blk, heads)
        for cache, x in ((key_cache, k), (value_cache, v)):
            if x.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr():
                x = x.clone()  # a view of the cache itself could be clobbered mid-scatter
            cache[blk, off, h] = x.to(device=dev, dtype=cache.dtype)

    def write_blocks(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite whole (distinct) blocks: ``block_ids: [B, n]``, ``k, v:
        [B, H, n*BS, D]`` in token order, the inverse of ``gather_keys`` /
        ``gather_values``; one block-indexed copy per cache."""
        dev = key_cache.device
        blk = block_ids.to(dev, torch.long)
        (b, n), h, bs, d = blk.shape, self.num_kv_heads, self.block_size, self.head_size
        for cache, x in ((key_cache, k), (value_cache, v)):
            if x.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr():
                x = x.clone()
            x = x.to(device=dev, dtype=cache.dtype).reshape(b, h, n, bs, d)
            cache[blk.flatten()] = x.permute(0, 2, 3, 1, 4).reshape(b * n, bs, h, d)

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor,
                num_blocks: int | None) -> torch.Tensor:
        """``[B, H, num_blocks, BS, D]``, contiguous, in one gather: indexing the
        ``[NB, H, BS, D]`` view with broadcast (block, head) indices puts H in
        front of the block axis without a second permuting copy."""
        dev = cache.device
        bt = block_table[:, :num_blocks].to(dev, torch.long)  # [B, n]
        h = torch.arange(self.num_kv_heads, device=dev)
        return cache.permute(0, 2, 1, 3)[bt[:, None, :], h[None, :, None]]

    def gather_keys(self, key_cache: torch.Tensor, block_table: torch.Tensor,
                    num_blocks: int | None = None) -> torch.Tensor:
        """``block_table: [B, max_blocks]`` -> keys ``[B, H, num_blocks*BS, D]``
        (all columns when ``num_blocks`` is None) in the cache dtype, physical
        token order (padded table entries read whatever block they name: mask
        by seq_lens)."""
        g = self._gather(key_cache, block_table, num_blocks)
        return g.reshape(g.shape[0], self.num_kv_heads, -1, self.head_size)

    def gather_values(self, value_cache: torch.Tensor, block_table: torch.Tensor,
                      num_blocks: int | None = None) -> torch.Tensor:
        """Same as ``gather_keys`` for values."""
        g = self._gather(value_cache, block_table, num_blocks)
        return g.reshape(g.shape[0], self.num_kv_heads, -1, self.head_size)

    def gather_keys_t(self, key_cache: torch.Tensor, block_table: torch.Tensor,
                      num_blocks: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Keys transposed, ``[B, H, D, num_blocks*BS]`` in ``dtype``, contiguous,
        so ``q @ K^T`` is a plain matmul: one gather, then one copy that
        transposes and casts in the same pass."""
        g = self.gather_keys(key_cache, block_table, num_blocks)  # [B, H, M, D]
        out = torch.empty(g.shape[0], g.shape[1], g.shape[3], g.shape[2],
                          dtype=dtype, device=g.device)
        return out.copy_(g.transpose(2, 3))
