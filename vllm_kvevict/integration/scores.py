"""H2O score accumulation over the paged cache: the plain-torch path.

For every query token of a request, softmax(q K^T * scale) over the request's
resident keys (causal within the chunk), summed over the query heads of each
KV head's GQA group and over the queries, is added to the score of the slot
each key lives in:

    scores: (H_kv, num_blocks * BS)  float32, updated in place
    query:  (num_tokens, H_q, D)     this step's queries (new tokens only)

Decode rows (one query) are batched into one gather + einsum; prefill chunks
run per request in query tiles to bound memory.
"""

from __future__ import annotations

import torch

from vllm_kvevict.kv_layout import KVLayout

_QUERY_TILE = 256


def _row_slots(block_row: torch.Tensor, n: int, bs: int) -> torch.Tensor:
    j = torch.arange(n)
    return block_row[j // bs].long() * bs + j % bs


def accumulate_scores(scores: torch.Tensor, layout: KVLayout, key_cache: torch.Tensor,
                      query: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor,
                      slot_mapping: torch.Tensor, scale: float) -> None:
    bs = layout.block_size
    num_tokens = query.shape[0]
    # New tokens start with zero importance, whatever the slot held before.
    scores[:, slot_mapping[:num_tokens].long()] = 0.0
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    seq = seq_lens.long()
    decode = torch.nonzero(q_lens == 1).flatten()
    if decode.numel():
        _decode(scores, layout, key_cache, query, qsl[decode], seq[decode],
                block_table[decode], scale)
    for i in torch.nonzero(q_lens > 1).flatten().tolist():
        _prefill(scores, layout, key_cache, query[qsl[i]:qsl[i + 1]], int(seq[i]),
                 block_table[i], scale)


def _decode(scores, layout, key_cache, query, q_idx, seq, block_table, scale) -> None:
    bs, h = layout.block_size, layout.num_kv_heads
    nblk = int((seq.max() + bs - 1) // bs)
    keys = layout.gather_keys(key_cache, block_table, nblk).float()  # (B, H, M, D)
    b, _, m, d = keys.shape
    q = query[q_idx].float().view(b, h, -1, d)  # (B, H, G, D)
    logits = torch.einsum("bhgd,bhmd->bhgm", q, keys) * scale
    pos = torch.arange(m)
    logits.masked_fill_((pos[None, :] >= seq[:, None])[:, None, None, :], float("-inf"))
    probs = logits.softmax(dim=-1).sum(dim=2)  # (B, H, M)
    slots = block_table[:, pos // bs].long() * bs + pos % bs  # (B, M)
    valid = pos[None, :] < seq[:, None]
    flat = slots[valid]  # every (request, token) slot is distinct
    scores[:, flat] += probs.permute(1, 0, 2)[:, valid]


def _prefill(scores, layout, key_cache, q, seq_len, block_row, scale) -> None:
    bs, h = layout.block_size, layout.num_kv_heads
    nblk = (seq_len + bs - 1) // bs
    keys = layout.gather_keys(key_cache, block_row[None], nblk)[0, :, :seq_len].float()
    n, _, d = q.shape
    q = q.float().view(n, h, -1, d)
    start = seq_len - n  # physical position of the first query
    acc = torch.zeros(h, seq_len)
    kpos = torch.arange(seq_len)
    for t0 in range(0, n, _QUERY_TILE):
        qt = q[t0:t0 + _QUERY_TILE]  # (T, H, G, D)
        logits = torch.einsum("thgd,hmd->hgtm", qt, keys) * scale
        qpos = start + t0 + torch.arange(qt.shape[0])
        logits.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))
        acc += logits.softmax(dim=-1).sum(dim=(1, 2))
    scores[:, _row_slots(block_row, seq_len, bs)] += acc
