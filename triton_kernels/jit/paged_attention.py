"""Paged attention over the NHD cache that also emits H2O scores, in one pass over K and V.

One program per (query token t, KV head h). It walks the request's keys once,
TILE keys per step (each key's block looked up in the block table, so a step
may span blocks):
  pass 1  s = q_g . k_i * scale for the G query heads of h (online softmax, out = P V),
          and parks the raw logits s in a scratch row (G x 4 bytes per key);
  pass 2  re-reads only the scratch (not K): p_g(i) = exp(s_g(i) - m_g) / l_g,
          adds sum_g p_g(i) to scores[h, slot(i)].
So scoring costs G x 8 + 8 bytes per (key, KV head) on top of attention's 2 x D x
elem bytes of K and V, instead of a second read of K. ATOMIC: the score adds
are atomic unless the caller promises no two programs share a slot (one
query per request): plain adds took a third off the scoring overhead on an H100.
"""
import triton
import triton.language as tl


@triton.jit
def paged_attention_scores_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, row_ptr, vis_ptr, w_ptr, out_ptr, scores_ptr, s_ptr,
    scale,
    stride_qt, stride_qh,  # query (T, H_q, D), unit stride on D
    stride_kb, stride_kn, stride_kh,  # key cache (NB, BS, H, D), unit stride on D
    stride_vb, stride_vn, stride_vh,
    stride_bt,  # block table (R, max_blocks)
    stride_ot, stride_oh,  # out (T, H_q, D)
    stride_sh,  # scores (H, NB * BS)
    stride_st, stride_sk, stride_sg,  # scratch (T, H, G, L)
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr,
    WRITE_OUT: tl.constexpr, SCORE: tl.constexpr, ATOMIC: tl.constexpr = True,
    TILE: tl.constexpr = 16,
):
    tl.static_assert(G_PAD >= 16 and G_PAD >= G and D_PAD >= 16 and D_PAD >= D and TILE >= 16)
    t = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(row_ptr + t)
    n = tl.load(vis_ptr + t)  # keys this query sees: physical positions [0, n)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    i = tl.arange(0, TILE)  # keys per step of either walk, across block boundaries
    gmask = g < G
    dmask = d < D
    q = tl.load(q_ptr + t * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full((G_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), tl.float32)
    for j in range(0, tl.cdiv(n, TILE)):
        pos = j * TILE + i
        seen = pos < n
        # Each key's block, looked up per key: a tile may span several blocks.
        blk = tl.load(bt_ptr + row * stride_bt + pos // BS, mask=seen, other=0).to(tl.int64)
        off = pos % BS
        kv_mask = seen[:, None] & dmask[None, :]
        k = tl.load(k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_kn + h * stride_kh
                    + d[None, :], mask=kv_mask, other=0.0)
        # Native-dtype dot with fp32 accumulation, as FlashAttention does;
        # "ieee" only matters for fp32 caches (no TF32 rounding).
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (G_PAD, TILE)
        s = tl.where(seen[None, :], s, float("-inf"))
        if SCORE:
            tl.store(s_ptr + t * stride_st + h * stride_sk + g[:, None] * stride_sg + pos[None, :],
                     s, mask=gmask[:, None] & seen[None, :])
        if WRITE_OUT:
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vn
                        + h * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m = m_new
        else:  # scores only: the softmax statistics, no V
            m_new = tl.maximum(m, tl.max(s, axis=1))
            l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
            m = m_new
    if WRITE_OUT:
        safe = tl.where(l > 0, l, 1.0)
        o = acc / safe[:, None]
        tl.store(out_ptr + t * stride_ot + (h * G + g)[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    if SCORE:
        tl.debug_barrier()  # the scratch this program stored is read back below
        w = tl.load(w_ptr + t)  # 0: this query's attention is not scored
        inv = tl.where(gmask & (l > 0), 1.0 / tl.where(l > 0, l, 1.0), 0.0) * w
        m_safe = tl.where(gmask, m, 0.0)
        for j in range(0, tl.cdiv(n, TILE)):
            pos = j * TILE + i
            seen = pos < n
            blk = tl.load(bt_ptr + row * stride_bt + pos // BS, mask=seen, other=0).to(tl.int64)
            s = tl.load(s_ptr + t * stride_st + h * stride_sk + g[:, None] * stride_sg + pos[None, :],
                        mask=gmask[:, None] & seen[None, :], other=float("-inf"))
            p = tl.exp(s - m_safe[:, None]) * inv[:, None]
            p = tl.where(gmask[:, None] & seen[None, :], p, 0.0)
            ptr = scores_ptr + h * stride_sh + blk * BS + pos % BS
            if ATOMIC:  # another query of the same request may add to these slots
                tl.atomic_add(ptr, tl.sum(p, axis=0), mask=seen)
            else:  # the caller promises one query per request: a plain read-modify-write
                tl.store(ptr, tl.load(ptr, mask=seen) + tl.sum(p, axis=0), mask=seen)
