"""What every KV cache layout offers: the one interface the worker, the score
path and compaction use to read and move tokens in a paged cache.

Two implementations: `cpu_layout.KVLayout` (vLLM's CPU cache, ISA-packed
inside each block, discovered from vLLM's own writer) and
`nhd_layout.NHDLayout` (FlashAttention's ``[NB, BS, H, D]``). Shapes:
NB blocks, BS tokens per block, H KV heads, D head size, B requests.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVCacheLayout(Protocol):
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def split(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cache -> (key_cache, value_cache) views."""

    def read_tokens(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_ids: torch.Tensor, offsets: torch.Tensor,
                    heads: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``block_ids, offsets: [H, N]`` (row h is head h, unless ``heads``
        names each token's head) -> (k, v) ``[..., D]``, fresh copies."""

    def write_tokens(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_ids: torch.Tensor, offsets: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor,
                     heads: torch.Tensor | None = None) -> None:
        """Inverse of ``read_tokens`` into distinct slots, cast to the cache dtype."""

    def write_blocks(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Whole blocks ``block_ids: [B, n]`` from ``k, v: [B, H, n*BS, D]``."""

    def gather_keys(self, key_cache: torch.Tensor, block_table: torch.Tensor,
                    num_blocks: int | None = None) -> torch.Tensor:
        """``block_table: [B, max_blocks]`` -> ``[B, H, num_blocks*BS, D]``."""

    def gather_keys_t(self, key_cache: torch.Tensor, block_table: torch.Tensor,
                      num_blocks: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Keys transposed for ``q @ K^T``: ``[B, H, D, num_blocks*BS]`` in ``dtype``."""

    def gather_values(self, value_cache: torch.Tensor, block_table: torch.Tensor,
                      num_blocks: int | None = None) -> torch.Tensor:
        """``block_table: [B, max_blocks]`` -> ``[B, H, num_blocks*BS, D]``."""
