"""Observation-window scores (SnapKV / AnDPro) for one compaction.

One program per (row b, KV head h, block of ROWS window rows); a window row is
a (query head g of h's group, window query t) pair, and query t sits at token
position N - W + t (causal). Two passes over the resident tokens:
  pass 1  online softmax statistics m, l of every row; with PROJECTION
          (AnDPro) also y = P V;
  pass 2  p = exp(s - m) / l again; adds sum_rows p to out[b, h, i] (SnapKV),
          or with PROJECTION sum_rows p * <y_row, v_i>.
Programs of one (b, h) add into the same output with atomics.
"""
import triton
import triton.language as tl


@triton.jit
def window_scores_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, scale, N, W,
    stride_qb, stride_qt, stride_qh,  # q (B, W, H_q, D), unit stride on D
    stride_kb, stride_kh, stride_kn,  # k (B, H, N, D), unit stride on D
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh,  # out (B, H, N) float32, unit stride on N
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PROJECTION: tl.constexpr,
):
    tl.static_assert(ROWS >= 16 and BLOCK_N >= 16 and D_PAD >= 16 and D_PAD >= D)
    b = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    rmask = r < G * W
    g = r // W
    t = r % W
    qpos = N - W + t  # the token each window row belongs to
    d = tl.arange(0, D_PAD)
    dmask = d < D
    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + (h * G + g)[:, None] * stride_qh
                + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    cols = tl.arange(0, BLOCK_N)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    y = tl.zeros((ROWS, D_PAD), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        i = n0 + cols
        imask = i < N
        k = tl.load(k_ptr + b * stride_kb + h * stride_kh + i[:, None] * stride_kn + d[None, :],
                    mask=imask[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (ROWS, BLOCK_N)
        s = tl.where((i[None, :] <= qpos[:, None]) & imask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if PROJECTION:
            v = tl.load(v_ptr + b * stride_vb + h * stride_vh + i[:, None] * stride_vn + d[None, :],
                        mask=imask[:, None] & dmask[None, :], other=0.0)
            y = y * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    inv = tl.where(rmask, 1.0 / l, 0.0)
    y = y * inv[:, None]  # pre-eviction outputs y_row (0 for padding rows)
    for n0 in range(0, N, BLOCK_N):
        i = n0 + cols
        imask = i < N
        k = tl.load(k_ptr + b * stride_kb + h * stride_kh + i[:, None] * stride_kn + d[None, :],
                    mask=imask[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where((i[None, :] <= qpos[:, None]) & imask[None, :], s, float("-inf"))
        p = tl.exp(s - m[:, None]) * inv[:, None]  # (ROWS, BLOCK_N), 0 for padding rows
        if PROJECTION:
            v = tl.load(v_ptr + b * stride_vb + h * stride_vh + i[:, None] * stride_vn + d[None, :],
                        mask=imask[:, None] & dmask[None, :], other=0.0)
            proj = tl.dot(y.to(v.dtype), tl.trans(v), input_precision="ieee")  # <y_row, v_i>
            p = p * proj
        tl.atomic_add(out_ptr + b * stride_ob + h * stride_oh + i, tl.sum(p, axis=0), mask=imask)
