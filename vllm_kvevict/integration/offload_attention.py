"""Worker side of InfiniGen offload: the host tier wired into compaction and
decode attention (the vLLM-free parts are in vllm_kvevict/core/offload/decode_attention.py).

  evicted_entries  at compaction, the K/V of the tokens the resident policy
                   drops, gathered before the kept ones overwrite them
  check_skewing    at engine-config time, before any worker: the skewing
                   file exists and fits the model, else startup stops naming
                   `python -m vllm_kvevict.calibrate` (calibrate.py)
  host_tier        the worker's HostTier, made on first use: the model's
                   skewing, loaded from that file (never computed in a
                   worker), this rank's KV heads, a pool of --kv-swap-space bytes
                   (K/V blocks and partial keys together)
  host_decode      after the stock kernel has attended the resident cache,
                   decode rows of requests with host entries are attended
                   again over resident + host entries, and replace the stock
                   rows. Entries come from the prefetch the KV connector made
                   for this layer (offload_connector.py) or, when speculation
                   missed them, from the host tier on demand
  host_prefetch    the connector's speculation for the next layer
  OffloadState     the worker's offload state, one object
                   (WorkerEviction.offload; None unless offload is on)

Selection in host_decode uses the layer's own query; the paper's prediction
from layer i-1's input only decides what is prefetched (offload.py says why).
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

import torch

from vllm_kvevict.core.offload.host_tier import HostTier
from vllm_kvevict.core.offload.decode_attention import Fetched, decode_attention, speculate
from vllm_kvevict.integration.settings import parallel_ranks

logger = logging.getLogger("vllm_kvevict")


def layer_index(name: str) -> int:
    """'model.layers.7.self_attn.attn' -> 7."""
    m = re.search(r"\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"cannot tell the layer index of {name!r}")
    return int(m.group(1))


def check_skewing(vllm_config, cfg):
    """The skewing file the workers will load (skewing_store.locate), checked against
    the model. Runs in the engine's create_engine_config, before any worker
    starts, so a missing or wrong file stops startup with the command to run."""
    from vllm_kvevict.core.offload import skewing_store

    mc = vllm_config.model_config
    path = skewing_store.locate(mc.model, cfg.partial, cfg.skewing)
    skewing_store.check_file(path, mc.get_total_num_hidden_layers(),
                             mc.get_total_num_kv_heads(), mc.get_head_size(), cfg.partial)
    logger.info("vllm_kvevict: InfiniGen skewing %s", path)
    return path


@dataclass
class OffloadState:
    """What a worker keeps for offload between and within steps."""

    model_dir: str  # whose skewing file host_tier loads
    tier: HostTier | None = None  # made on first use (host_tier)
    # The connector's speculation for the layer about to run: (row ids, fetched).
    prefetched: tuple[list[str], Fetched] | None = None
    decode_rows: DecodeRows | None = None  # the step's rows with host entries


def host_tier(state, layout, dtype: torch.dtype) -> HostTier:
    """The worker's host tier, made on first use. Loads the skewing file and
    never computes it: that loads the whole model (calibrate.py does it offline)."""
    off = state.offload
    if off.tier is None:
        from vllm_kvevict.core.offload import skewing, skewing_store

        cfg = state.cfg
        path = skewing_store.locate(off.model_dir, cfg.partial, cfg.skewing)
        sk = skewing.Skewing.load(path).packed()
        h_total, h = sk.num_kv_heads, layout.num_kv_heads
        first = (parallel_ranks()[2] * h) % h_total  # this TP rank's KV heads
        a = sk.a[:, first:first + h]
        # K/V blocks and their partial keys share the budget (host_tier.py).
        capacity = HostTier.capacity_for(cfg.swap_bytes, sk.num_layers, h, layout.block_size,
                                         layout.head_size, sk.num_partial, dtype)
        off.tier = HostTier(capacity, cfg.host_victim, a, sk.num_partial, layout.block_size,
                            dtype, pin_memory=torch.cuda.is_available())
        logger.info("vllm_kvevict: host tier of %d blocks (%.2f GiB with partial keys), "
                    "%d partial channels", capacity, off.tier.nbytes / 2**30, sk.num_partial)
    return off.tier


def evicted_entries(keep: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The tokens compaction drops. keep: (L, H, new_len) kept indices into the
    old tokens; k, v: (L, H, old_len, D). Returns k, v (L, H, E, D), E =
    old_len - new_len, in old order."""
    num_layers, h, old_len, d = k.shape
    dropped = torch.ones(num_layers, h, old_len, dtype=torch.bool)
    dropped.scatter_(2, keep.cpu(), False)
    idx = torch.arange(old_len).expand(num_layers, h, -1)[dropped].view(num_layers, h, -1)
    idx = idx.to(k.device)[..., None].expand(-1, -1, -1, d)
    return k.gather(2, idx), v.gather(2, idx)


class DecodeRows:
    """The decode rows of this step whose requests have host entries.

    tokens (R,) their query rows; seq (R,) resident lengths with the current
    token; ids their request ids; table (R, nblk) their block tables.
    Use ``of_step``: every layer of a step shares one attention metadata, and
    host entries change only between steps, so one instance serves them all."""

    @classmethod
    def of_step(cls, state, attn_metadata, layout) -> "DecodeRows":
        off = state.offload
        rows = off.decode_rows
        if rows is None or rows.metadata is not attn_metadata:
            rows = off.decode_rows = cls(state, attn_metadata, layout)
        return rows

    def __init__(self, state, attn_metadata, layout) -> None:
        self.metadata = attn_metadata  # held, so `is` above cannot match a reused id
        self.ids: list[str] = []
        host = state.offload.tier
        if host is None or not host.requests or state.runner is None:
            return
        qsl = attn_metadata.query_start_loc.cpu()
        num_reqs = qsl.shape[0] - 1
        req_ids = state.runner.input_batch.req_ids[:num_reqs]
        rows = [i for i, r in enumerate(req_ids)
                if r in host.requests and int(qsl[i + 1] - qsl[i]) == 1]
        if not rows:
            return
        rows_t = torch.tensor(rows)
        self.ids = [req_ids[i] for i in rows]
        self.tokens = qsl[rows_t].long()
        self.seq = attn_metadata.seq_lens[: num_reqs].cpu()[rows_t]
        self.nblk = -(-int(self.seq.max()) // layout.block_size)
        self.table = attn_metadata.block_table[rows_t.to(attn_metadata.block_table.device)]
        total = torch.tensor([int(s) + host.num_entries(r)
                              for s, r in zip(self.seq.tolist(), self.ids)])
        self.total = total  # (R,) resident + host tokens
        self.cap = (total.float() * state.cfg.attend_cap).ceil().long()

    def resident(self, kv_cache, layout) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (R, H, S, D) of one layer's resident cache."""
        key_cache, value_cache = layout.split(kv_cache)
        return (layout.gather_keys(key_cache, self.table, self.nblk),
                layout.gather_values(value_cache, self.table, self.nblk))


def host_decode(state, layer, query, kv_cache, attn_metadata, output, layout) -> None:
    """Replace the output rows of decode requests that have host entries."""
    rows = DecodeRows.of_step(state, attn_metadata, layout)
    off = state.offload
    prefetched, off.prefetched = off.prefetched, None  # this layer's, used once
    if not rows.ids:
        return
    if prefetched is not None and prefetched[0] != rows.ids:
        prefetched = None  # made for other rows: cannot happen within one step
    k_res, v_res = rows.resident(kv_cache, layout)
    hq, d = query.shape[1], query.shape[2]
    i = layer_index(layer.layer_name)
    # Layer 0 attends its full cache, as in the paper: no layer before it to
    # speculate from, and its attention is the least skewed.
    alpha, cap = (math.inf, rows.total) if i == 0 else (state.cfg.alpha, rows.cap)
    out = decode_attention(off.tier, rows.ids, i, query[rows.tokens], k_res, v_res,
                           rows.seq, alpha, cap, _scale(layer, d),
                           None if prefetched is None else prefetched[1])
    output.view(-1, hq, d)[rows.tokens] = out.to(output.dtype)


def host_prefetch(state, layer: int, predict, kv_cache, attn_metadata, layout, scale: float):
    """Speculate layer `layer` for this step's rows and fetch ahead.

    predict: tokens (R,) -> (R, H_q, D) predicted post-RoPE queries. Returns
    (row ids, offload.Fetched) or None when no row needs it.
    The current token's K is not in the cache yet (its layer has not run),
    so speculation sees the resident cache without it, as in the paper."""
    rows = DecodeRows.of_step(state, attn_metadata, layout)
    if not rows.ids:
        return None
    k_res, _ = rows.resident(kv_cache, layout)
    fetched = speculate(state.offload.tier, rows.ids, layer, predict(rows.tokens), k_res,
                        rows.seq - 1, state.cfg.alpha, rows.cap, scale)
    return rows.ids, fetched


def _scale(layer, head_dim: int) -> float:
    impl = getattr(layer, "impl", None)
    return float(getattr(impl, "scale", head_dim ** -0.5))
