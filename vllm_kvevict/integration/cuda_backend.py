"""Worker side on CUDA: the eviction wrapper around vLLM 0.32's FLASH_ATTN.

Registered as ``AttentionBackendEnum.CUSTOM`` (``backend_select.register_cuda_backend``)
and chosen by the engine when ``--kv-eviction`` is on. It makes the same changes
as the CPU wrapper in ``cpu_backend.py``, and keeps the stock FlashAttention kernels:

  1. metadata: the builder gives requests that evicted physical ``seq_lens`` /
     ``slot_mapping`` / ``max_seq_len`` (``physical_view``) before the stock
     build, so FA's scheduler metadata is computed from physical lengths too;
  2. KV write: ``forward_includes_kv_cache_update = True``; ``forward`` calls
     the stock ``do_kv_cache_update`` (``reshape_and_cache_flash``) with the
     metadata's (physical) slot mapping;
  3. scores: after attention, H2O scores are accumulated beside the cache,
     read through ``NHDLayout`` (the cache is ``[NB, H, BS, 2D]``, any stride order).
     On the Triton path (`vllm_kvevict.core.eviction.kernel_dispatch`) an all-decode H2O step skips
     the stock kernel: `fused_decode` computes the output and the scores in one
     pass over K and V; other steps use the stock kernel, then the Triton score
     kernel for their decode rows.

No host-device sync in a step (builder and forward): Python control flow reads
vLLM's host copies of the lengths, passed to the forward as ``HOST_ATTR``
(tests/test_cuda_syncs.py pins the count).

Two more things only matter on a GPU: the builder reports no CUDA-graph support
while eviction is on (the physical view and the score pass are eager Python,
and full graphs would replay the logical metadata buffers), so vLLM falls back
to piecewise graphs with attention run eagerly; and it never reuses metadata
across KV groups (``update_block_table`` would put back the logical slots).

This module imports on the CPU-only vllm build (flash_attn.py has no CUDA
imports at module level; its kernels are bound only when available), so it is
unit-tested here; it has never run on a GPU.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionCGSupport

try:
    from vllm.v1.attention.backends.flash_attn import (
        FlashAttentionBackend,
        FlashAttentionImpl,
        FlashAttentionMetadataBuilder,
    )
except ImportError as e:  # keep the reason: the caller decides whether it matters
    raise ImportError(f"vllm_kvevict's CUDA backend needs vLLM's FlashAttention "
                      f"backend module, which does not import here: {e}") from e

from vllm_kvevict.core.scoring.decode_log import StepPlacement
from vllm_kvevict.core.eviction.kernel_dispatch import upload
from vllm_kvevict.core.layouts.nhd_layout import NHDLayout
from vllm_kvevict.integration.attention_common import (
    HOST_ATTR,
    PLACEMENT_ATTR,
    SCORED_ATTR,
    evictable_spec,
    fused_decode,
    host_lens,
    physical_metadata,
    score_step,
    write_kv,
)
from vllm_kvevict.integration.settings import eviction_config
from vllm_kvevict.integration.worker import init_worker_state, worker_state


class EvictingFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.state = worker_state()
        if self.state is not None:
            # Reused metadata gets the group's logical slot mapping back.
            self.supports_update_block_table = False

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if eviction_config(vllm_config).enabled:
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        logical = common_attn_metadata
        if self.state is None:
            return super().build(common_prefix_len, logical, fast_build)
        cm = physical_metadata(self.state, logical, self.block_size)
        metadata = super().build(common_prefix_len, cm, fast_build)
        scored = self.state.scored_rows(cm.num_reqs)
        host = host_lens(cm)  # the forward's Python reads these, not the device tensors
        setattr(metadata, SCORED_ATTR, scored)
        setattr(metadata, HOST_ATTR, host)
        # Queries placed by the recorder (the window policies' ring); accumulated
        # attention is scored in its own step here (no decode log on CUDA).
        if self.state.recorder.places(may_defer=False):
            placement = self.state.place_queries(
                cm.num_reqs, host.query_start_loc, _on_host(cm.seq_lens, host.seq_lens),
                _on_host(logical.seq_lens, host_lens(logical).seq_lens), scored,
                may_defer=False)
            if placement is not None:  # uploaded once for all layers
                dev = cm.query_start_loc.device
                placement = StepPlacement(upload(placement.tokens, dev),
                                          upload(placement.cells, dev))
            setattr(metadata, PLACEMENT_ATTR, placement)
        return metadata


def _on_host(device_lens: torch.Tensor, host: torch.Tensor | None) -> torch.Tensor:
    """vLLM's host copy of some lengths, or (none given) a read of the device's."""
    return device_lens.cpu() if host is None else host


class EvictingFlashAttentionImpl(FlashAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config()
        cfg = eviction_config(vllm_config)
        # Model init runs inside the config context; the state is made here, as on CPU.
        init_worker_state(vllm_config, cfg, vllm_config.cache_config.block_size)
        # On CUDA the block size is final only after model load
        # (update_block_size_for_backend), so it is read when the cache arrives.
        self.cache_config = vllm_config.cache_config
        if cfg.enabled and (self.alibi_slopes is not None or self.logits_soft_cap
                            or tuple(self.sliding_window) != (-1, -1)
                            or self.sinks is not None or self.dcp_world_size > 1
                            or is_quantized_kv_cache(self.kv_cache_dtype)):
            raise ValueError("--kv-eviction supports plain causal attention only (no "
                             "ALiBi, soft-cap, sliding window, sinks, DCP or fp8 KV cache)")

    def _layout(self, kv_cache: torch.Tensor) -> NHDLayout:
        """NHDLayout of this layer's cache, checked against the block size that
        compaction uses (it addresses slots as manager block * BS + offset)."""
        layout = NHDLayout.for_cache(kv_cache)
        sizes = {layout.block_size, self.cache_config.block_size, worker_state().block_size}
        if len(sizes) > 1:
            raise ValueError(f"--kv-eviction needs one block size; kernel blocks "
                             f"{layout.block_size}, --block-size "
                             f"{self.cache_config.block_size}, eviction state "
                             f"{worker_state().block_size}")
        return layout

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # profiling run: the stock path zero-fills
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        write_kv(self, layer, key, value, kv_cache, attn_metadata)
        if fused_decode(self, layer, query, kv_cache, attn_metadata, output, self._layout):
            return output
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata,
                              output, output_scale, output_block_scale)
        score_step(self, layer, query, kv_cache, attn_metadata, self._layout)
        return out


class EvictingFlashAttentionBackend(FlashAttentionBackend):
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        # Attention.__init__ maps this name back through AttentionBackendEnum[...];
        # CUSTOM is the member whose registered class is this one.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return EvictingFlashAttentionImpl

    @staticmethod
    def get_builder_cls():
        return EvictingFlashAttentionMetadataBuilder

    @classmethod
    def customize_spec(cls, spec):
        return evictable_spec(super().customize_spec(spec))
