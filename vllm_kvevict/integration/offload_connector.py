"""The KV connector that carries InfiniGen's per-layer prefetch.

vLLM calls the configured KV connector around every attention layer
(model_executor/layers/attention/kv_transfer_utils.py): wait_for_layer_load
before the layer, save_kv_layer after it. With offload on, patches/engine_args
configures this connector, and its hooks pipeline layers as in the paper's
Figure 8:

  start_load_kv        step start: drop last step's prefetches; on first use,
                       hook the model's attention modules to keep their input
  save_kv_layer(i)     layer i has run. Predict layer i+1's query from layer
                       i's attention input x_i: x_i W_Q(i+1), RoPE at the
                       token's position. Select with it and fetch those host
                       entries (offload.speculate): the prefetch
  wait_for_layer_load  layer i+1 is next: hand its prefetch to the backend,
                       which attends with it (offload_attention.host_decode)
  wait_for_save        nothing to wait for: on CPU both tiers are host memory
                       and every copy above is synchronous

Evicted KV reaches the host tier at compaction (worker._compact), between
steps: compaction overwrites the blocks before the next forward, so the copy
cannot wait for a per-layer hook. The scheduler side has nothing to load:
no external prefix hits, empty metadata.

The input hook is a Python forward pre-hook, so offload runs the model eagerly
(patches/engine_args.py sets enforce_eager). Models whose attention modules
lack qkv_proj / rotary_emb (Llama, Qwen2 and Mistral have them) still decode
correctly: nothing is prefetched and every entry is fetched on demand.
"""
from __future__ import annotations

import logging
import re

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from vllm_kvevict.integration.offload_attention import host_prefetch, layer_index
from vllm_kvevict.integration.worker import worker_state

logger = logging.getLogger("vllm_kvevict")

CONNECTOR_NAME = "KVEvictHostTier"


class _StepMetadata(KVConnectorMetadata):
    """Nothing crosses from scheduler to worker; vLLM only runs the per-layer
    hooks while some metadata is bound."""


class InputCapture:
    """Forward pre-hooks that keep each attention module's (positions, input)
    of the current step, and the weights to predict a layer's query from them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules: dict[int, torch.nn.Module] = {}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, module in model.named_modules():
            m = re.search(r"layers\.(\d+)\.self_attn$", name)
            if m and all(hasattr(module, a) for a in ("qkv_proj", "rotary_emb", "q_size",
                                                       "head_dim")):
                i = int(m.group(1))
                self.modules[i] = module
                module.register_forward_pre_hook(self._hook(i), with_kwargs=True)
        if not self.modules:
            logger.warning("vllm_kvevict: no attention module with qkv_proj/rotary_emb found; "
                           "offload fetches every selected entry on demand")

    def _hook(self, i: int):
        def keep(module, args, kwargs):
            positions = kwargs.get("positions", args[0] if args else None)
            hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
            if positions is not None and hidden is not None:
                self.inputs[i] = (positions, hidden)
        return keep

    def predictor(self, prev: int, layer: int):
        """A function tokens (R,) -> (R, H_q, D): layer `layer`'s post-RoPE
        queries of those tokens computed from layer `prev`'s attention input
        (the paper's partial-query input), or None. The projection is the
        module's own qkv_proj call: on CPU vLLM repacks the weight for its
        GEMM kernels and leaves `weight` empty."""
        attn, got = self.modules.get(layer), self.inputs.get(prev)
        if attn is None or got is None:
            return None
        positions, hidden = got

        def predict(tokens: torch.Tensor) -> torch.Tensor:
            qkv, _ = attn.qkv_proj(hidden[tokens])
            q = qkv[:, :attn.q_size]
            q, _ = attn.rotary_emb.forward_native(positions[tokens], q, None)
            return q.reshape(q.shape[0], -1, attn.head_dim)

        return predict


class HostTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._capture: InputCapture | None = None
        self._prefetched: dict[int, tuple] = {}  # layer -> (row ids, Fetched)

    # --- scheduler side: no external KV ------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return _StepMetadata()

    # --- worker side --------------------------------------------------------

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._prefetched.clear()
        state = worker_state()
        if state is None or state.runner is None or state.offload is None:
            return
        state.offload.prefetched = None
        if self._capture is None:
            self._capture = InputCapture(state.runner.get_model())
        self._capture.inputs.clear()

    def wait_for_layer_load(self, layer_name: str) -> None:
        state = worker_state()
        if state is not None and state.offload is not None:
            state.offload.prefetched = self._prefetched.pop(layer_index(layer_name), None)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        state = worker_state()
        if (state is None or state.host is None or not state.host.requests
                or self._capture is None):
            return
        i = layer_index(layer_name)
        nxt = state.layers.get(layer_name.replace(f".{i}.", f".{i + 1}.", 1))
        predict = self._capture.predictor(i, i + 1)
        if nxt is None or predict is None:
            return
        attn = self._capture.modules[i + 1]
        scale = float(getattr(attn, "scaling", attn.head_dim ** -0.5))
        got = host_prefetch(state, i + 1, predict, nxt.kv_cache, attn_metadata, nxt.layout,
                            scale)
        if got is not None:
            self._prefetched[i + 1] = got

    def wait_for_save(self) -> None:
        return None


def register() -> None:
    """Make the connector known to vLLM's factory (every process; idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, "HostTierConnector")
