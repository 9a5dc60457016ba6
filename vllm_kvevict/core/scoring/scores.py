"""H2O score accumulation over the paged cache: the plain-torch path.

For every query token of a request, softmax(q K^T * scale) over the keys it
can see (the request's resident keys, causal within a prefill chunk), summed
over the query heads of each KV head's GQA group and over the queries, is added
to the score of the slot each key lives in:

    scores: (H_kv, num_blocks * BS)  float32, updated in place

`score_queries` is the one kernel: R requests x Q queries each, against one
gather of each request's keys. Prefill chunks call it per request; decode
queries call it either at once (`accumulate_scores`) or, on CPU, in batches of
up to 32 steps through `DecodeQueryLog` (the gather dominates the cost of one
decode query, so scoring several against one gather is far cheaper).

On CUDA neither reads a GPU value on the host: the lengths that drive the
Python (which rows, how many keys, masks) are host tensors, and what the GPU
needs of them goes up with `kernels.upload` (tests/test_cuda_syncs.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_kvevict.core.layouts.cpu_layout import token_slots
from vllm_kvevict.core.eviction.kernel_dispatch import cpu_kernel_isa, triton_module, upload, use_triton

# Bound the (R, H, T*G, keys) float32 logits of one tile to about 8 MB: the
# passes over a tile (mask, softmax, the weighted column sum) then run in cache
# (measured on this 2-core EPYC: 64 MB tiles spent most of their time in DRAM).
_TILE_ELEMENTS = 1 << 21
# Rows (requests, or layer x request pairs of a stacked flush) are grouped so a
# group's logits stay near 2 MB: decode flushes of 30 stacked layers x 16
# requests ran fastest there (24.6 vs 28.7 ms per flush at 8 MB groups per
# layer; the demo's workload, this 2-core EPYC).
_GROUP_ELEMENTS = 1 << 19
# At most 64 queries per tile. A causal chunk's tile computes every logit up to
# its last query's horizon and masks the triangle beyond each earlier query's:
# one tile for a whole 256-token chunk computes the full square. 64-query tiles
# compute about 5/8 of it (one thread, 30 layers, bf16 cache: a 256-token chunk
# 48.2 -> 33.3 ms, a 1,024-token one 448 -> 332 ms; 32-query tiles no better;
# scripts/measure/chunk_timing.py). Decode flushes (<= 32 queries) are unchanged.
_MAX_TILE_QUERIES = 64


def score_queries(scores: torch.Tensor, layout, key_cache: torch.Tensor,
                  queries: torch.Tensor, visible: torch.Tensor,
                  block_rows: torch.Tensor, scale: float,
                  private: Sequence[torch.Tensor | None] | None = None) -> None:
    """Add each query's attention over its visible keys into their slots.

    queries:    (R, Q, H_q, D) any float dtype
    visible:    (R, Q) int64 host tensor (a device one is read back once);
                query (r, t) sees physical positions [0, visible[r, t]);
                0 marks padding, which adds nothing
    block_rows: (R, nblk) block ids covering max(visible[r]) tokens of row r
    private:    per row, None or (H, n): row r's scores of its first n
                positions go there instead of to their (shared) slots
                (core/scoring/private_scores.py)

    Per tile of queries, only the keys some query of the tile sees are scored
    (causal prefill: about half the logits), and the sums over queries and
    query heads are one matrix-vector product per tile (w^T softmax, w the
    queries' 0/1 weights).
    """
    bs = layout.block_size
    r, nq, hq, d = queries.shape
    dev = scores.device
    visible = visible.long().cpu()  # the masks below are decided on the host
    block_rows = upload(block_rows, dev)
    m = block_rows.shape[1] * bs
    isa = cpu_kernel_isa(queries, key_cache, layout)
    if isa is not None:  # the compiled kernel reads the paged cache itself
        from vllm_kvevict import cpu_kernel

        if private is None or all(p is None for p in private):
            # no shared blocks among the rows: the kernel adds into the slots
            cpu_kernel.add_column_sums(scores, layout, key_cache, queries, visible,
                                       block_rows, scale, isa)
            return
        acc = cpu_kernel.column_sums(layout, key_cache, queries, visible, block_rows, scale, isa)
    else:
        # Rows in groups whose keys and logits fit in cache (_GROUP_ELEMENTS), so
        # each group's keys are read from cache.
        per_row = hq * nq * m
        rows = max(1, min(r, _GROUP_ELEMENTS // max(1, per_row)))
        acc = torch.cat([
            _column_sums(layout, key_cache, queries[r0:r0 + rows], visible[r0:r0 + rows],
                         block_rows[r0:r0 + rows], scale)
            for r0 in range(0, r, rows)])  # (R, H, M)
    # The (row, key) pairs some query reaches, listed on the host: indexing with
    # a boolean mask on the GPU would read its count back.
    reach = torch.arange(m)[None, :] < visible.max(dim=1).values[:, None]  # (R, M) host
    for i, row in enumerate(private or ()):
        if row is not None:
            n = min(row.shape[1], m)
            row[:, :n] += acc[i, :, :n]  # keys past a row's horizon summed 0
            reach[i, :n] = False
    reach_r, reach_m = reach.nonzero(as_tuple=True)
    reach_r, reach_m = upload(reach_r, dev), upload(reach_m, dev)
    slots = token_slots(block_rows, m, bs)
    scores.index_add_(1, slots[reach_r, reach_m], acc.transpose(0, 1)[:, reach_r, reach_m])


def _column_sums(layout, key_cache: torch.Tensor, queries: torch.Tensor,
                 visible: torch.Tensor, block_rows: torch.Tensor, scale: float) -> torch.Tensor:
    """(R, H, M) float32: the summed softmax rows of score_queries' arguments."""
    h = layout.num_kv_heads
    r, nq, hq, d = queries.shape
    g = hq // h
    dev = key_cache.device
    kt = layout.gather_keys_t(key_cache, block_rows, block_rows.shape[1])  # (R, H, D, M)
    m = kt.shape[-1]
    pos = torch.arange(m, device=dev)
    # Padding sees key 0 (a finite softmax) and is then weighted by 0.
    seen = visible.clamp(min=1)
    weight = None if bool((visible > 0).all()) else (visible > 0).to(torch.float32)
    acc = torch.zeros(r, h, 1, m, device=dev)
    t0 = 0
    while t0 < nq:
        # As many queries as fit a tile at the widest horizon they reach.
        hi = int(seen[:, t0:].max())
        t = max(1, min(nq - t0, _MAX_TILE_QUERIES, _TILE_ELEMENTS // max(1, r * hq * hi)))
        horizon = seen[:, t0:t0 + t]
        hi, lo = int(horizon.max()), int(horizon.min())
        q = queries[:, t0:t0 + t].to(torch.float32) * scale
        q = q.view(r, t, h, g, d).permute(0, 2, 1, 3, 4).reshape(r, h, t * g, d)
        e = torch.matmul(q, kt[..., :hi])  # (R, H, T*G, hi) logits
        if lo < hi:  # keys past a query's horizon (the last few, or causal in a chunk)
            hidden = pos[lo:hi] >= upload(horizon, dev)[..., None]  # (R, T, hi - lo)
            # Added as a 0 / -inf bias: with the mask broadcast over heads, the
            # add alone runs about twice as fast on CPU as a masked_fill_ (a
            # 256-token chunk's scoring 31.0 -> 29.7 ms; a decode flush within noise).
            bias = torch.zeros(hidden.shape, device=dev).masked_fill_(hidden, float("-inf"))
            e.view(r, h, t, g, hi)[..., lo:].add_(bias[:, None, :, None])
        # softmax, not exp by hand: torch's own exp slows down ~10x on the
        # denormals that far-below-max logits produce; the softmax kernel does not.
        p = e.softmax(dim=-1)
        if weight is None:
            w = torch.ones(r, h, 1, t * g, device=dev)
        else:  # padding queries weigh 0
            w = upload(weight[:, t0:t0 + t], dev)[:, None, :, None].expand(r, h, t, g)
            w = w.reshape(r, h, 1, t * g)
        acc[..., :hi] += torch.matmul(w, p)  # (R, H, 1, hi): the column sums
        t0 += t
    return acc.squeeze(2)


def zero_new_slots(scores: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int) -> None:
    """New tokens start with zero importance, whatever their slot held before.
    scores: (H_kv, slots); slot_mapping: the step's slots, the first num_tokens real.
    (index_fill_: half the cost of an indexed assignment, once per layer and step.)"""
    scores.index_fill_(1, slot_mapping[:num_tokens].long(), 0.0)


def accumulate_scores(scores: torch.Tensor, layout, key_cache: torch.Tensor,
                      query: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor,
                      slot_mapping: torch.Tensor, scale: float,
                      decode: bool = True, rows: torch.Tensor | None = None,
                      query_start_loc_cpu: torch.Tensor | None = None,
                      seq_lens_cpu: torch.Tensor | None = None,
                      private: Sequence[torch.Tensor | None] | None = None) -> None:
    """Score one step's queries from attention metadata (physical seq_lens).

    query: (num_tokens, H_q, D) this step's new tokens. decode=False leaves the
    single-query rows to a `DecodeQueryLog`; rows: (num_reqs,) bool host
    tensor, score only these requests (None: all). query_start_loc_cpu /
    seq_lens_cpu: host copies of the two (vLLM's, from the CUDA builder); each
    one missing is read from its device tensor (a sync on a GPU). private:
    per batch row, as for `score_queries` (rows with one take the torch path).
    """
    num_tokens = query.shape[0]
    dev = query.device
    zero_new_slots(scores, slot_mapping, num_tokens)
    qsl = (query_start_loc if query_start_loc_cpu is None else query_start_loc_cpu).long().cpu()
    q_lens = qsl[1:] - qsl[:-1]
    seq = (seq_lens if seq_lens_cpu is None else seq_lens_cpu)[: len(q_lens)].long().cpu()
    wanted = torch.ones_like(q_lens, dtype=torch.bool) if rows is None else rows.cpu()
    has_private = torch.tensor([p is not None for p in private or [None] * len(q_lens)],
                               dtype=torch.bool)
    if decode:
        rows = torch.nonzero((q_lens == 1) & wanted).flatten()  # host
        fused = rows[~has_private[rows]] if use_triton(query, layout) else rows[:0]
        if fused.numel():  # one pass, no gather
            triton_module("paged_attention").paged_attention_scores(
                query[upload(qsl[fused], dev)], key_cache, key_cache, block_table,
                upload(fused, dev), upload(seq[fused], dev), scale, scores=scores,
                write_out=False, max_visible=int(seq[fused].max()),
                # One query per request, and rows with shared blocks (private
                # scores) are not among them: no two programs add to one slot.
                unique_rows=True)
            rows = rows[has_private[rows]]
        if rows.numel():
            nblk = -(-int(seq[rows].max()) // layout.block_size)
            score_queries(scores, layout, key_cache, query[upload(qsl[rows], dev)][:, None],
                          seq[rows, None], block_table[upload(rows, block_table.device), :nblk],
                          scale, None if private is None else [private[i] for i in rows.tolist()])
    for i in torch.nonzero((q_lens > 1) & wanted).flatten().tolist():
        n, s = int(q_lens[i]), int(seq[i])
        nblk = -(-s // layout.block_size)
        visible = torch.arange(s - n + 1, s + 1)[None]  # causal within the chunk
        score_queries(scores, layout, key_cache, query[qsl[i]:qsl[i + 1]][None],
                      visible, block_table[i:i + 1, :nblk], scale,
                      None if private is None else [private[i]])
