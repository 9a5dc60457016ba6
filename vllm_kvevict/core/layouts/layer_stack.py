"""A worker's layer caches, and layers stacked into one cache where they can be.

vLLM allocates every layer's KV cache as a slice of one buffer; when the slices
are equally spaced, all layers can be addressed as one cache and a compaction
moves a request's tokens in every layer at once. Shapes: NB blocks per layer,
BS tokens per block, H KV heads, D head size. vLLM-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.core.layouts.layout import KVCacheLayout


@dataclass
class LayerCache:
    kv_cache: torch.Tensor  # the backend's layer cache, e.g. CPU (NB, H, BS, 2 * D)
    layout: KVCacheLayout  # KVLayout (CPU) or NHDLayout (FlashAttention)
    scores: torch.Tensor  # (H, num_blocks * BS) float32; (H, 0) unless the recorder keeps one


@dataclass
class LayerStack:
    """Consecutive layers whose caches are equally spaced slices of one buffer,
    seen as one cache: layer l's block b is block l * num_blocks + b of
    `kv_cache`, and its score of slot s is column l * num_blocks * BS + s of
    `scores`. Compacting a request then costs one gather and one write for all
    layers instead of one per layer."""

    kv_cache: torch.Tensor  # (num_layers * num_blocks, ...) view of the buffer
    layout: KVCacheLayout
    num_layers: int
    num_blocks: int
    scores: torch.Tensor  # (H, num_layers * num_blocks * BS) float32
    names: list[str]  # the layers, in row order

    @classmethod
    def build(cls, layers: dict[str, LayerCache]) -> list["LayerStack"]:
        """One stack for all layers if their caches allow it, else one per layer.
        Re-homes the layers' score buffers into the stack's (as views)."""
        names, layers = list(layers), list(layers.values())
        kv0, lay0 = layers[0].kv_cache, layers[0].layout
        nb, step = kv0.shape[0], kv0.stride(0) * kv0.shape[0]
        uniform = all(
            lc.kv_cache.shape == kv0.shape and lc.kv_cache.stride() == kv0.stride()
            and lc.kv_cache.dtype == kv0.dtype and lc.layout == lay0
            and lc.kv_cache.untyped_storage().data_ptr() == kv0.untyped_storage().data_ptr()
            and lc.kv_cache.storage_offset() == kv0.storage_offset() + i * step
            for i, lc in enumerate(layers))
        if not uniform:
            return [cls(lc.kv_cache, lc.layout, 1, lc.kv_cache.shape[0], lc.scores, [name])
                    for name, lc in zip(names, layers)]
        n = len(layers)
        kv = kv0.as_strided((n * nb, *kv0.shape[1:]), kv0.stride(), kv0.storage_offset())
        per_layer = layers[0].scores.shape[1]
        # Layer by layer, not torch.cat: each layer's buffer is released as it
        # is copied, and on CPU the stack's pages are touched only as they are
        # filled, so resident memory peaks at the stack plus one layer's, not
        # twice the stack (memory core/eviction/footprint.py does not reserve).
        scores = layers[0].scores.new_empty(layers[0].scores.shape[0], n * per_layer)
        for i, lc in enumerate(layers):
            part = scores[:, i * per_layer:(i + 1) * per_layer]
            part.copy_(lc.scores)
            lc.scores = part
        return [cls(kv, lay0, n, nb, scores, names)]
