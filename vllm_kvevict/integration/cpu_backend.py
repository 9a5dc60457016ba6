"""Worker side: the attention backend that reads a compacted paged cache.

We subclass the platform's stock backend and keep its kernels. Three things
change, and only when eviction is enabled in `additional_config`:

  1. metadata: for requests that evicted, `seq_lens` become physical lengths and
     new tokens get physical slots (position - evicted); RoPE positions stay
     logical because the runner computes them before we are called.
  2. KV write: `forward_includes_kv_cache_update = True`, so the backend writes
     K/V itself with that physical slot mapping.
  3. scores: after attention, H2O scores are accumulated beside the cache
     (snapkv/andpro: the newest queries are kept for the next compaction).
     In steps whose every request evicts anyway, attention comes from the
     plugin's own pass over the cache instead, with H2O's scores in the same
     pass (integration/fused_attention.py).

With eviction disabled, the backend behaves exactly like the stock one.
On CUDA the same wrapper is built around FLASH_ATTN (see `cuda_backend`);
that path is importable without a GPU but has never run here.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_kvevict.core.layouts.cpu_layout import FP8_CACHE_DTYPES, KVLayout
from vllm_kvevict.integration.attention_common import (
    LOG_ONLY_ATTR,
    PLACEMENT_ATTR,
    SCORED_ATTR,
    evictable_spec,
    physical_metadata,
    score_step,
    write_kv,
)
from vllm_kvevict.integration import fused_attention
from vllm_kvevict.integration.offload_attention import host_decode
from vllm_kvevict.integration.settings import eviction_config
from vllm_kvevict.integration.spec import EvictableAttentionSpec
from vllm_kvevict.integration.worker import init_worker_state, worker_state


def discover_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int,
                    num_kv_heads: int) -> KVLayout:
    """The in-block layout vLLM's CPU writer uses for these shapes (cached)."""
    return KVLayout.discover(ops.cpu_attn_reshape_and_cache, isa, dtype, block_size,
                             head_size, num_kv_heads)


def layout_for_cache(kv_cache: torch.Tensor, isa: str) -> KVLayout:
    """The layout of one CPU backend layer cache ``[NB, H, BS, 2*D]`` (an fp8
    cache as its float8 view: `EvictingCPUAttentionImpl.readable`)."""
    return KVLayout.for_cache(ops.cpu_attn_reshape_and_cache, kv_cache, isa)


def check_one_group(state, layer_names) -> None:
    """Refuse a second full-attention KV cache group at startup: a compaction
    plan names one group's blocks, and the worker moves them in every layer it
    has registered (vLLM makes several such groups only for hybrid models with
    more full-attention layers than sliding-window ones per group)."""
    layers = frozenset(layer_names)
    if state.evictable_layers not in (None, layers):
        raise ValueError(
            "--kv-eviction: vLLM split this model's full-attention layers into several "
            "KV cache groups; eviction compacts one full-attention group only")
    state.evictable_layers = layers


def check_windows(cfg, spec, layer_names, vllm_config) -> None:
    """Refuse, at startup, a KV cache group eviction cannot serve. Eviction
    compacts the full-attention group and leaves sliding-window layers to
    vLLM's hybrid KV cache manager (their window bounds their KV already). It
    cannot evict where vLLM has put windowed layers in a full-attention group
    (`--disable-hybrid-kv-cache-manager`: a window read over compacted slots
    would span other tokens), and has nothing to evict where every layer is
    windowed."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    def windowed(names=None) -> list[bool]:
        layers = get_layers_from_vllm_config(vllm_config, Attention, names)
        return [getattr(layer.impl, "sliding_window", -1) not in (-1, None)
                for layer in layers.values()]

    if cfg.offload and any(windowed()):
        raise ValueError(
            "--kv-eviction infinigen / --kv-swap-space: KV offload does not support "
            "models with sliding-window layers (its KV connector turns vLLM's hybrid "
            "KV cache manager off); evict without offload (e.g. --kv-eviction h2o)")
    if isinstance(spec, SlidingWindowSpec):
        if all(windowed()):
            raise ValueError(
                "--kv-eviction: every attention layer of this model is sliding-window, "
                "so vLLM already holds at most a window of KV per layer and there is "
                "nothing to evict; serve it without --kv-eviction")
    elif any(windowed(layer_names)):
        raise ValueError(
            "--kv-eviction: this model's sliding-window layers share a KV cache group "
            "with its full-attention layers (--disable-hybrid-kv-cache-manager, or vLLM "
            "turned the hybrid KV cache manager off); eviction compacts the "
            "full-attention layers only and needs vLLM's hybrid KV cache manager to "
            "keep the windowed ones apart: drop --disable-hybrid-kv-cache-manager")


class EvictingCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        state = worker_state()
        evictable = isinstance(kv_cache_spec, EvictableAttentionSpec)
        if state is not None:
            check_windows(state.cfg, kv_cache_spec, layer_names, vllm_config)
            if evictable:
                check_one_group(state, layer_names)
        # A sliding-window group (hybrid models) is vLLM's: its manager drops
        # what leaves the window, and its metadata stays logical.
        self.state = state if evictable else None

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        logical = common_attn_metadata
        if self.state is None:
            return super().build(common_prefix_len, logical, fast_build)
        cm = physical_metadata(self.state, logical, self.block_size, on_host=True)
        metadata = super().build(common_prefix_len, cm, fast_build)
        scored = self.state.scored_rows(cm.num_reqs)
        fuse = fused_attention.wanted(self, self.state, cm)
        # A step whose scores come from the pass (H2O): the recorder places no row.
        in_pass = fuse and fused_attention.records(self.state)
        placed = torch.zeros(cm.num_reqs, dtype=torch.bool) if in_pass else scored
        placement = self.state.place_queries(cm.num_reqs, cm.query_start_loc_cpu,
                                             cm.seq_lens[: cm.num_reqs].cpu(),
                                             logical.seq_lens[: cm.num_reqs].cpu(), placed,
                                             defer_chunks=not in_pass)
        log_only = None
        fused = fused_attention.plan(self, self.state, cm, placement, scored) if fuse else None
        if fused is not None:
            self.state.count_cpu_pass_step()
        if placement is not None:  # the layers only log (or the pass scores): zero new slots here, once
            self.state.zero_new_slots(cm.slot_mapping, cm.num_actual_tokens)
            if fused is None or not fused.records:
                log_only = self.state.log_only(placement, cm.num_actual_tokens)
        setattr(metadata, fused_attention.FUSED_ATTR, fused)
        setattr(metadata, PLACEMENT_ATTR, placement)
        setattr(metadata, LOG_ONLY_ATTR, log_only)
        setattr(metadata, SCORED_ATTR, scored)
        return metadata


class EvictingCPUAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config()
        cfg = eviction_config(vllm_config)
        # Model init runs inside the config context; later hooks (customize_spec)
        # do not, so the process's eviction state is created here.
        init_worker_state(vllm_config, cfg, vllm_config.cache_config.block_size)
        if cfg.enabled and (self.alibi_slopes is not None or self.logits_soft_cap
                            or self.sinks is not None):
            raise ValueError("--kv-eviction supports plain causal attention only "
                             "(no ALiBi, soft-cap or sinks)")
        # A sliding-window layer of a hybrid model (Gemma 3, gpt-oss-style
        # alternation) already holds at most its window: vLLM's sliding-window
        # manager frees the rest, so the layer runs as stock and eviction works
        # on the full-attention layers, where the KV grows with the context.
        self.evicts = self.sliding_window == -1
        # An fp8 cache is uint8 bytes to vLLM; the plugin reads it as float8.
        self.kv_view_dtype = FP8_CACHE_DTYPES.get(self.kv_cache_dtype)
        self._kv_view: torch.Tensor | None = None

    def readable(self, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(the cache as the plugin reads it, the logits' scale). An fp8 cache
        (`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`: uint8 bytes holding
        float8 values over a per-layer k_scale / v_scale) is viewed as its
        float8 dtype, so gathers decode it and moves copy its bytes, and
        k_scale joins the softmax scale: logits = scale * q . (k_scale * k).
        v_scale is left out: it scales a layer's values, and so every score of
        AnDPro's projection in a (layer, head), alike, which keeps the same
        tokens. The view is made once per cache tensor (`WorkerEviction.knows`
        compares by identity)."""
        if self.kv_view_dtype is None:
            return kv_cache, self.scale
        view = self._kv_view
        if view is None or view.data_ptr() != kv_cache.data_ptr() or view.shape != kv_cache.shape:
            view = self._kv_view = kv_cache.view(self.kv_view_dtype)
        return view, self.scale * layer._k_scale_float

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:
            return output
        write_kv(self, layer, key, value, kv_cache, attn_metadata)
        if not self.evicts:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        make_layout = lambda kv: layout_for_cache(kv, layer.isa)  # noqa: E731
        fused = getattr(attn_metadata, fused_attention.FUSED_ATTR, None)
        if fused is not None and self.attn_type == AttentionType.DECODER:
            out = fused_attention.attend(self, layer, query, kv_cache, attn_metadata, output,
                                         fused, make_layout)
            if fused.records:  # the pass added the step's scores: nothing else to record
                return out  # (`wanted` refuses offload)
        else:
            out = super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                  output, output_scale, output_block_scale)
        state = worker_state()
        if state is None:
            return out
        kv_cache, scale = self.readable(layer, kv_cache)
        known = state.knows(layer.layer_name, kv_cache)
        if known and not state.recorder.scoring and not state.cfg.offload:
            # The policy records nothing (streaming: it keeps tokens by age) and
            # the layer is registered: nothing for this layer to do.
            return out
        log = getattr(attn_metadata, LOG_ONLY_ATTR, None)
        if log is not None and self.attn_type == AttentionType.DECODER and known:
            # All this step asks of the layer is its queries (decided once, by
            # the builder): no per-layer dispatch (QueryBuffers.hold_ref).
            log.hold_ref(layer.layer_name, query[: attn_metadata.num_actual_tokens], scale)
            return out
        score_step(self, layer, query, kv_cache, attn_metadata, make_layout, scale)
        if state.host is not None and state.cfg.offload:
            lc = state.layer(layer.layer_name, kv_cache, make_layout)
            host_decode(state, layer, query, kv_cache, attn_metadata, output, lc.layout)
        return out


class EvictingCPUAttentionBackend(CPUAttentionBackend):
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return EvictingCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return EvictingCPUMetadataBuilder

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        return evictable_spec(spec)
