"""Plain-torch references for the kernels, written from the definitions, one
token or row at a time (slow and obvious on purpose). The window-score
kernel's reference is the torch path itself, `vllm_kvevict.core.scoring.window_scores.raw_scores`,
which tests/window_reference.py checks against the papers' loops."""
from __future__ import annotations

import torch


def slots_of(block_table_row: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """(max_blocks,) block ids -> (n,) slots block * BS + offset of positions [0, n)."""
    pos = torch.arange(n)
    return block_table_row[pos // block_size].long() * block_size + pos % block_size


def paged_attention_scores_ref(query, key_cache, value_cache, block_table, query_rows,
                               visible, scale, score_weight=None):
    """Same arguments as `paged_attention.paged_attention_scores` (CPU tensors).
    Returns out (T, H_q, D) float32 and the score increment (H, NB * BS) float32."""
    t, hq, d = query.shape
    nb, bs, h, _ = key_cache.shape
    g = hq // h
    out = torch.zeros(t, hq, d)
    delta = torch.zeros(h, nb * bs)
    for i in range(t):
        n = int(visible[i])
        if n == 0:
            continue
        slots = slots_of(block_table[int(query_rows[i])], n, bs)
        k = key_cache[slots // bs, slots % bs].float()  # (n, H, D)
        v = value_cache[slots // bs, slots % bs].float()
        w = 1.0 if score_weight is None else float(score_weight[i])
        for kv in range(h):
            q = query[i, kv * g:(kv + 1) * g].float()  # (G, D)
            p = torch.softmax(q @ k[:, kv].T * scale, dim=-1)  # (G, n)
            out[i, kv * g:(kv + 1) * g] = p @ v[:, kv]
            delta[kv, slots] += w * p.sum(dim=0)
    return out, delta


def compact_ref(key_cache, value_cache, scores, src_slots, dst_slots, keep):
    """Out-of-place `compaction.compact_in_place`: read every kept token first,
    then write. Modifies the given tensors."""
    nb, bs, h, d = key_cache.shape
    new_len = keep.shape[2]
    for r in range(keep.shape[0]):
        for kv in range(h):
            src = src_slots[r, keep[r, kv]].long()  # (new_len,)
            k = key_cache[src // bs, src % bs, kv].clone()
            v = value_cache[src // bs, src % bs, kv].clone()
            s = scores[kv, src].clone() if scores is not None else None
            dst = dst_slots[r].long()
            key_cache[dst // bs, dst % bs, kv] = 0
            value_cache[dst // bs, dst % bs, kv] = 0
            key_cache[dst[:new_len] // bs, dst[:new_len] % bs, kv] = k
            value_cache[dst[:new_len] // bs, dst[:new_len] % bs, kv] = v
            if scores is not None:
                scores[kv, dst] = 0
                scores[kv, dst[:new_len]] = s


def partial_attention_ref(q, k, cols, lengths, alpha, scale=1.0):
    """Same arguments as `partial_attention.partial_attention`: logits of the
    channels `cols` only, and per (row, head) the count of logits > max - alpha."""
    b, hq, _ = q.shape
    h, n = k.shape[1], k.shape[2]
    g = hq // h
    logits = torch.full((b, hq, n), float("-inf"))
    counts = torch.zeros(b, hq, dtype=torch.int32)
    cols = cols.long()
    for r in range(b):
        m = int(lengths[r])
        for head in range(hq):
            if m == 0:
                continue
            s = k[r, head // g, :m][:, cols].float() @ q[r, head, cols].float() * scale
            logits[r, head, :m] = s
            counts[r, head] = int((s > s.max() - alpha).sum())
    return logits, counts
