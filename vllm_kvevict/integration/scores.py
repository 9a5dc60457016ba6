"""H2O score accumulation over the paged cache: the plain-torch path.

For every query token of a request, softmax(q K^T * scale) over the keys it
can see (the request's resident keys, causal within a prefill chunk), summed
over the query heads of each KV head's GQA group and over the queries, is added
to the score of the slot each key lives in:

    scores: (H_kv, num_blocks * BS)  float32, updated in place

`score_queries` is the one kernel: R requests x Q queries each, against one
gather of each request's keys. Prefill chunks call it per request; decode
queries call it either at once (`accumulate_scores`) or, on CPU, in batches of
up to 16 steps through `DecodeQueryLog` (the gather dominates the cost of one
decode query, so scoring several against one gather is far cheaper).

On CUDA neither reads a GPU value on the host: the lengths that drive the
Python (which rows, how many keys, masks) are host tensors, and what the GPU
needs of them goes up with `kernels.upload` (tests/test_cuda_syncs.py).
"""

from __future__ import annotations

import torch

from vllm_kvevict.kernels import triton_module, upload, use_triton
from vllm_kvevict.kv_layout import token_slots

# Bound the (R, H, Q*G, M) float32 logits of one tile to about 64 MB.
_TILE_ELEMENTS = 1 << 24


def score_queries(scores: torch.Tensor, layout, key_cache: torch.Tensor,
                  queries: torch.Tensor, visible: torch.Tensor,
                  block_rows: torch.Tensor, scale: float) -> None:
    """Add each query's attention over its visible keys into their slots.

    queries:    (R, Q, H_q, D) any float dtype
    visible:    (R, Q) int64 host tensor (a device one is read back once);
                query (r, t) sees physical positions [0, visible[r, t]);
                0 marks padding, which adds nothing
    block_rows: (R, nblk) block ids covering max(visible[r]) tokens of row r
    """
    bs, h = layout.block_size, layout.num_kv_heads
    r, nq, hq, d = queries.shape
    g = hq // h
    dev = scores.device
    visible = visible.long().cpu()  # the masks below are decided on the host
    block_rows = upload(block_rows, dev)
    kt = layout.gather_keys_t(key_cache, block_rows, block_rows.shape[1])  # (R, H, D, M)
    m = kt.shape[-1]
    pos = torch.arange(m, device=dev)
    # Padding sees key 0 (a finite softmax) and is then weighted by 0.
    seen = visible.clamp(min=1)
    # Keys before every query's horizon need no mask: only mask from there on
    # (decode queries of similar-length requests differ in the last few keys).
    m0 = int(seen.min())
    hidden = pos[m0:] >= upload(seen, dev)[..., None]  # (R, Q, M - m0)
    weight = (None if bool((visible > 0).all())
              else upload((visible > 0).to(torch.float32), dev))
    acc = torch.zeros(r, h, m, device=dev)
    tile = max(1, _TILE_ELEMENTS // max(1, r * hq * m))
    for t0 in range(0, nq, tile):
        q = queries[:, t0:t0 + tile].to(torch.float32) * scale
        t = q.shape[1]
        q = q.view(r, t, h, g, d).permute(0, 2, 1, 3, 4).reshape(r, h, t * g, d)
        logits = torch.matmul(q, kt).view(r, h, t, g, m)
        logits[..., m0:].masked_fill_(hidden[:, None, t0:t0 + t, None, :], float("-inf"))
        probs = logits.softmax(dim=-1).sum(dim=3)  # (R, H, T, M)
        if weight is not None:
            probs *= weight[:, None, t0:t0 + t, None]
        acc += probs.sum(dim=2)
    # The (row, key) pairs some query reaches, listed on the host: indexing with
    # a boolean mask on the GPU would read its count back.
    reach_r, reach_m = (torch.arange(m)[None, :] < visible.max(dim=1).values[:, None]).nonzero(
        as_tuple=True)
    reach_r, reach_m = upload(reach_r, dev), upload(reach_m, dev)
    slots = token_slots(block_rows, m, bs)
    scores.index_add_(1, slots[reach_r, reach_m], acc.transpose(0, 1)[:, reach_r, reach_m])


def accumulate_scores(scores: torch.Tensor, layout, key_cache: torch.Tensor,
                      query: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor,
                      slot_mapping: torch.Tensor, scale: float,
                      decode: bool = True, rows: torch.Tensor | None = None,
                      query_start_loc_cpu: torch.Tensor | None = None,
                      seq_lens_cpu: torch.Tensor | None = None) -> None:
    """Score one step's queries from attention metadata (physical seq_lens).

    query: (num_tokens, H_q, D) this step's new tokens. decode=False leaves the
    single-query rows to a `DecodeQueryLog`; rows: (num_reqs,) bool host
    tensor, score only these requests (None: all). query_start_loc_cpu /
    seq_lens_cpu: host copies of the two (vLLM's, from the CUDA builder); each
    one missing is read from its device tensor (a sync on a GPU).
    """
    num_tokens = query.shape[0]
    dev = query.device
    # New tokens start with zero importance, whatever the slot held before.
    scores[:, slot_mapping[:num_tokens].long()] = 0.0
    qsl = (query_start_loc if query_start_loc_cpu is None else query_start_loc_cpu).long().cpu()
    q_lens = qsl[1:] - qsl[:-1]
    seq = (seq_lens if seq_lens_cpu is None else seq_lens_cpu)[: len(q_lens)].long().cpu()
    wanted = torch.ones_like(q_lens, dtype=torch.bool) if rows is None else rows.cpu()
    if decode:
        rows = torch.nonzero((q_lens == 1) & wanted).flatten()  # host
        if rows.numel() and use_triton(query, layout):  # one pass, no gather
            triton_module("paged_attention").paged_attention_scores(
                query[upload(qsl[rows], dev)], key_cache, key_cache, block_table,
                upload(rows, dev), upload(seq[rows], dev), scale, scores=scores,
                write_out=False, max_visible=int(seq[rows].max()))
        elif rows.numel():
            nblk = -(-int(seq[rows].max()) // layout.block_size)
            score_queries(scores, layout, key_cache, query[upload(qsl[rows], dev)][:, None],
                          seq[rows, None], block_table[upload(rows, block_table.device), :nblk],
                          scale)
    for i in torch.nonzero((q_lens > 1) & wanted).flatten().tolist():
        n, s = int(q_lens[i]), int(seq[i])
        nblk = -(-s // layout.block_size)
        visible = torch.arange(s - n + 1, s + 1)[None]  # causal within the chunk
        score_queries(scores, layout, key_cache, query[qsl[i]:qsl[i + 1]][None],
                      visible, block_table[i:i + 1, :nblk], scale)
