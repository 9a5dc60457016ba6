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


def compact_ref(layout, key_cache, value_cache, scores, src_slots, dst_slots, keep):
    """Ordered compaction from its definition, one (row, KV head) at a time,
    through any KV layout (`core/layouts/layout.py`): the kept tokens
    keep[r, h] (ascending indices into the row's old tokens at src_slots[r]),
    with their scores, land in order in dst_slots[r, :new_len]; the rest of
    dst_slots[r] is zeroed. Reads a head's kept tokens before writing them, so
    dst may overlap src. The reference for `triton_kernels/compaction.py` and,
    up to where each kept token ends, for the worker's `fill_holes`.

    src_slots: (R, >= old_len), dst_slots: (R, >= new_len) int slots
    block * BS + offset; keep: (R, H, new_len); scores: (H, NB * BS) or None.
    Modifies the given tensors."""
    bs, h = layout.block_size, keep.shape[1]
    new_len = keep.shape[2]
    for r in range(keep.shape[0]):
        row, dst = src_slots[r].long().cpu(), dst_slots[r].long().cpu()
        for kv in range(h):
            src = row[keep[r, kv].long().cpu()]
            head = torch.full_like(src, kv)
            k, v = layout.read_tokens(key_cache, value_cache, src // bs, src % bs, heads=head)
            s = scores[kv, src.to(scores.device)].clone() if scores is not None else None
            every = torch.full_like(dst, kv)
            zeros = torch.zeros(dst.numel(), layout.head_size)
            layout.write_tokens(key_cache, value_cache, dst // bs, dst % bs, zeros, zeros,
                                heads=every)
            kept = dst[:new_len]
            layout.write_tokens(key_cache, value_cache, kept // bs, kept % bs, k, v,
                                heads=head)
            if scores is not None:
                scores[kv, dst.to(scores.device)] = 0
                scores[kv, kept.to(scores.device)] = s


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
