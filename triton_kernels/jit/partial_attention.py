"""InfiniGen's speculation: partial attention q~ K~^T over a subset of channels.

One program per (row b, query head hq). It writes the partial logits of the
row's n tokens and counts those above max - alpha (the paper's threshold).
"""
import triton
import triton.language as tl


@triton.jit
def partial_attention_kernel(
    q_ptr, k_ptr, cols_ptr, len_ptr, out_ptr, cnt_ptr, scale, alpha, C,
    stride_qb, stride_qh,  # q (B, H_q, Dq), unit stride on Dq
    stride_kb, stride_kh, stride_kn,  # k (B, H, N, Dk), unit stride on Dk
    stride_ob, stride_oh,  # out (B, H_q, N) float32, unit stride on N
    G: tl.constexpr, C_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // G
    n = tl.load(len_ptr + b)
    c = tl.arange(0, C_PAD)
    cmask = c < C
    col = tl.load(cols_ptr + c, mask=cmask, other=0)
    q = tl.load(q_ptr + b * stride_qb + hq * stride_qh + col, mask=cmask, other=0.0).to(tl.float32)
    rows = tl.arange(0, BLOCK_N)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)  # running max per lane
    for n0 in range(0, n, BLOCK_N):
        i = n0 + rows
        imask = i < n
        k = tl.load(k_ptr + b * stride_kb + h * stride_kh + i[:, None] * stride_kn + col[None, :],
                    mask=imask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(imask, s, float("-inf"))
        tl.store(out_ptr + b * stride_ob + hq * stride_oh + i, s, mask=imask)
        m = tl.maximum(m, s)
    top = tl.max(m, axis=0)
    tl.debug_barrier()  # the logits this program stored are read back below
    count = tl.zeros((BLOCK_N,), tl.int32)
    for n0 in range(0, n, BLOCK_N):
        i = n0 + rows
        imask = i < n
        s = tl.load(out_ptr + b * stride_ob + hq * stride_oh + i, mask=imask, other=float("-inf"))
        count += (s > top - alpha).to(tl.int32)
    tl.store(cnt_ptr + b * tl.num_programs(1) + hq, tl.sum(count, axis=0))  # counts (B, H_q) int32
