"""Observation-window scores (SnapKV, AnDPro): the fast batched path, vLLM-free.

At a compaction, the last `w` queries of a request (its observation window)
look at every resident token; a token's score says how much those queries
need it. Both policies share the window attention

    a[t, i] = softmax_i(q_t . k_i * scale)    query t sees tokens i <= its own

and differ in what they sum over the window t and the query heads g of a KV
head's GQA group (one score per KV head):

    snapkv  s_i = sum_{g,t} a[t, i]                          (Li et al. 2024)
    andpro  s_i = sum_{g,t} a[t, i] * <y_t, v_i>,  y_t = sum_j a[t, j] v_j
            the projection of each weighted value on the pre-eviction output
            (AnDPro, section 3.3, theta = y and b = 0; Algorithm 1)

then smooth them the same way (`finalize`): max-pooling over neighbouring
tokens (kernel 7), sums over chunks of 4 tokens (AnDPro's chunking: a chunk's
score is the projection of its summed weighted values, i.e. the sum of its
tokens' scores), and the window itself and the first token always kept. Under
a budget smaller than two windows only half the budget is kept as recent
tokens; the older window tokens then compete on their (causal) scores.

`attention_sums` and `value_projection` compute the raw scores, each on the
path `core/eviction/kernel_dispatch.py` picks; `finalize` smooths them; the
policies (core/policies/snapkv.py, andpro.py) put the two together.

Shapes: q (B, w, H_q, D) the window queries in token order; k, v (B, H, n, D)
the resident keys/values in logical order, the last w of which are the
window's own tokens. B is any batch of rows (layers of one request here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_kvevict.core.eviction.kernel_dispatch import (cpu_kernel_isa, cpu_projection_isa,
                                                        projection_precision, triton_module,
                                                        use_triton)

POOL_KERNEL = 7  # AnDPro appendix B.3 (and SnapKV's kernel for max pooling)
CHUNK = 4  # AnDPro section 3.4 / Algorithm 1 chunk size

# Bound the (B, H, G, w, n) float32 attention of one tile to about 8 MB, so the
# passes over it run in cache rather than DRAM (docs/results.md, "Figures
# behind code comments").
_TILE_ELEMENTS = 1 << 21


def window_attention(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, w, H_q, D), (B, H, n, D) -> (B, H, G * w, n) float32 probabilities,
    row g * w + t for query head g of the group and window query t; causal:
    query t (the token at resident index n - w + t) sees [0, n - w + t]."""
    b, w, hq, d = q.shape
    h, n = k.shape[1], k.shape[2]
    g = hq // h
    # One (G * w, D) x (D, n) product per (B, H): broadcasting K over the group
    # instead made torch copy it G times.
    qg = (q.to(torch.float32) * scale).view(b, w, h, g, d).permute(0, 2, 3, 1, 4)
    logits = torch.matmul(qg.reshape(b, h, g * w, d), k.to(torch.float32).transpose(-1, -2))
    # Only the window's own w columns hold future tokens: mask those alone, not
    # an (n, n) causal mask over every column.
    col = torch.arange(w, device=q.device)
    future = col[None, :] > col[:, None]  # (w, w): [t, i] window token i after query t
    logits.view(b, h, g, w, n)[..., n - w:].masked_fill_(future, float("-inf"))
    # softmax, not exp by hand: torch's exp slows down ~10x on the denormals
    # that far-below-max logits produce; the softmax kernel does not.
    return logits.softmax(dim=-1)


def attention_sums(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, H, n) float32 SnapKV raw scores: the window's attention summed per
    token over the window queries and the group's query heads. The Triton
    kernel where `vllm_kvevict.core.eviction.kernel_dispatch` picks it (CUDA),
    the compiled CPU kernel's column sums where it is built, else torch."""
    if use_triton(q):
        return triton_module("window").window_raw_scores(q.to(k.dtype), k, k, scale,
                                                         projection=False)
    isa = cpu_kernel_isa(q, k)
    if isa is not None:
        from vllm_kvevict import cpu_kernel

        return cpu_kernel.window_column_sums(q, k, scale, isa)
    return raw_scores_torch(q, k, k, scale, projection=False)


def value_projection(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """(B, H, n) float32 AnDPro raw scores: sum_{g,t} a[t, i] <y_t, v_i>. The
    Triton kernel where `kernel_dispatch` picks it (CUDA), the compiled CPU
    kernel where it picks that (`cpu_projection_isa`: AMX, bf16), else torch.
    On the kernel's avx512bf16 path, `projection_precision()` says whether E
    and Y are rounded to bf16 (model, the default) or carried as float32."""
    if use_triton(q):
        return triton_module("window").window_raw_scores(q.to(k.dtype), k, v, scale,
                                                         projection=True)
    isa = cpu_projection_isa(q, k, v)
    if isa is not None:
        from vllm_kvevict import cpu_kernel

        return cpu_kernel.window_projection_sums(q, k, v, scale, isa,
                                                 split=projection_precision() == "float32")
    return raw_scores_torch(q, k, v, scale, projection=True)


def raw_scores_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     projection: bool = False) -> torch.Tensor:
    """The plain-torch raw window scores, tiled over B (the Triton kernel's
    reference): the attention sums (SnapKV), or with `projection` the value
    projection (AnDPro).

    AnDPro's sum over (g, t) is a matrix product rather than an elementwise
    pass: sum_t a[t, i] <y_t, v_i> = <(A^T Y)_i, v_i> (no (G*w, n) projection
    matrix)."""
    b, w, hq, _ = q.shape
    h, n = k.shape[1], k.shape[2]
    out = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    tile = max(1, _TILE_ELEMENTS // max(1, hq * w * n))
    for b0 in range(0, b, tile):
        sl = slice(b0, b0 + tile)
        a = window_attention(q[sl], k[sl], scale)  # (b, H, G*w, n)
        if projection:
            vf = v[sl].to(torch.float32)  # (b, H, n, D)
            y = torch.matmul(a, vf)  # (b, H, G*w, D) pre-eviction outputs
            out[sl] = (torch.matmul(a.transpose(-1, -2), y) * vf).sum(dim=-1)
        else:
            out[sl] = a.sum(dim=2)
    return out


def finalize(scores: torch.Tensor, recent: int, pool: int = POOL_KERNEL,
             chunk: int = CHUNK) -> torch.Tensor:
    """(B, H, n) raw scores -> selection scores: the n - recent older tokens
    max-pooled then summed per chunk (every token of a chunk gets the chunk's
    score, so top-k takes chunks whole except at the cut); the `recent` newest
    tokens (the window, in the papers) and the first token get +inf."""
    b, h, n = scores.shape
    m = n - recent
    out = torch.full_like(scores, float("inf"))
    if m <= 0:
        return out
    old = scores[..., :m].reshape(b * h, 1, m)
    if pool > 1:
        old = F.max_pool1d(old, pool, stride=1, padding=pool // 2)
    if chunk > 1:
        padded = F.pad(old, (0, -m % chunk))
        sums = padded.view(b * h, -1, chunk).sum(dim=-1)
        old = sums.repeat_interleave(chunk, dim=-1)[..., :m]
    out[..., :m] = old.view(b, h, m)
    out[..., 0] = float("inf")
    return out
