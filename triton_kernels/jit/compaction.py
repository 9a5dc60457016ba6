"""In-place compaction of the NHD paged cache: kept tokens (and their scores) move
to the first slots of the request's destination row.

One program per (row r, KV head h, block of BLOCK_D channels) walks the
destination positions j in tiles. Overlap is safe because a plan keeps tokens
in ascending order (keep[j] >= j) and dst slot j is either src slot j or a
block no source lives in: a tile reads only positions >= its first j, which no
earlier tile wrote, and the barrier puts every read of a tile before its writes.
Programs of different (h, channel block) touch disjoint elements.
"""
import triton
import triton.language as tl


@triton.jit
def compact_kernel(
    k_ptr, v_ptr, sc_ptr, src_ptr, dst_ptr, keep_ptr, new_len, n_dst,
    stride_kb, stride_kn, stride_kh,  # key cache (NB, BS, H, D), unit stride on D
    stride_vb, stride_vn, stride_vh,
    stride_sh,  # scores (H, NB * BS), unit stride on slots
    stride_src, stride_dst, stride_keep_r, stride_keep_h,
    D: tl.constexpr, BS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    SCORES: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    dc = tl.program_id(2)
    d = dc * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    owner = (tl.arange(0, BLOCK_T) * 0 + dc) == 0  # channel block 0 moves the scores
    for j0 in range(0, n_dst, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        live = j < new_len  # kept tokens; [new_len, n_dst) of the last block is zeroed
        inb = j < n_dst
        idx = tl.load(keep_ptr + r * stride_keep_r + h * stride_keep_h + j, mask=live, other=0)
        src = tl.load(src_ptr + r * stride_src + idx, mask=live, other=0).to(tl.int64)
        m2 = live[:, None] & dmask[None, :]
        k = tl.load(k_ptr + (src // BS * stride_kb + src % BS * stride_kn + h * stride_kh)[:, None]
                    + d[None, :], mask=m2, other=0.0)
        v = tl.load(v_ptr + (src // BS * stride_vb + src % BS * stride_vn + h * stride_vh)[:, None]
                    + d[None, :], mask=m2, other=0.0)
        if SCORES:
            sc = tl.load(sc_ptr + h * stride_sh + src, mask=live & owner, other=0.0)
        tl.debug_barrier()  # every read of this tile before any write
        dst = tl.load(dst_ptr + r * stride_dst + j, mask=inb, other=0).to(tl.int64)
        w2 = inb[:, None] & dmask[None, :]
        tl.store(k_ptr + (dst // BS * stride_kb + dst % BS * stride_kn + h * stride_kh)[:, None]
                 + d[None, :], k, mask=w2)
        tl.store(v_ptr + (dst // BS * stride_vb + dst % BS * stride_vn + h * stride_vh)[:, None]
                 + d[None, :], v, mask=w2)
        if SCORES:
            tl.store(sc_ptr + h * stride_sh + dst, sc, mask=inb & owner)
        tl.debug_barrier()
