"""InfiniGen's offline query/key skewing (Lee et al., OSDI 2024, sections 4.2-4.3).

One forward pass over sample text collects every layer's queries. Per layer
and KV head, the queries of the query heads sharing that KV head (GQA) are
stacked into one (G * T, D) matrix Q = U S V^T, and the skewing matrix is
A = V (D x D, orthogonal). Then Q A = U S: a few channels of the skewed
queries carry most of the magnitude, and q~ k~^T = q A A^T k^T = q k^T exactly.
The partial channels are the top `fraction` (30 %) by the column sums of
|Q~| + |K~| (paper, "Prefill stage"; with GQA the query sums are averaged over
the group so queries and keys weigh as in the paper's multi-head case).

RoPE. The paper folds A into W_Q and W_K (:func:`fold_into_weights`), which is
exact only without rotary embeddings (OPT): RoPE rotates q and k by
position-dependent angles *after* the projection, and R_m A != A R_m. For RoPE
models (Llama, Qwen; SmolLM2 here) A therefore applies to the post-RoPE
queries and keys (:func:`skew_queries`, :func:`skew_keys`), and the SVD runs on
post-RoPE queries. Attention is unchanged either way.

Kernel layout. ``triton_kernels.partial_attention`` takes one channel list for
every head. :meth:`Skewing.packed` permutes each head's columns of A so that
its partial channels come first (a column permutation of an orthogonal matrix
is orthogonal, so q~ k~^T is still exact): then the partial channels are
``arange(C)`` for every head and the partial key cache is ``k~[..., :C]``.

Everything here is tensors in, tensors out, with no vLLM import. What
touches a Hugging Face model (collecting queries and keys, computing and caching
a skewing) is offline tooling and lives in :mod:`vllm_kvevict.calibrate`: a
serving engine never computes a skewing: `skewing_store` finds the file
(written once by ``python -m vllm_kvevict.calibrate MODEL``) and checks it
against the model; workers only load it.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT_VERSION = "1"
DEFAULT_FRACTION = 0.3
DEFAULT_CALIBRATION = dict(doc="austen_emma", seed=0, n_tokens=1024)


# ---------------------------------------------------------------------------
# Tensor operations
# ---------------------------------------------------------------------------

def skew_matrix(q: torch.Tensor) -> torch.Tensor:
    """(N, D) query matrix -> A (D, D) float32 orthogonal: V of Q = U S V^T.

    Column j of A is the j-th right singular vector, so (Q A)[:, j] = U[:, j] S_j
    and the columns of Q A are in decreasing magnitude. Signs are fixed so the
    largest entry of each column is positive (the SVD's sign is arbitrary).
    """
    if q.dim() != 2:
        raise ValueError(f"expected a (N, D) query matrix, got {tuple(q.shape)}")
    n, d = q.shape
    # full_matrices only when N < D (then V has D - N null-space columns too):
    # with N >> D the full U would be N x N.
    _, _, vh = torch.linalg.svd(q.double(), full_matrices=n < d)
    a = vh.T  # (D, D)
    idx = a.abs().argmax(dim=0)
    sign = torch.sign(a[idx, torch.arange(a.shape[1])])
    sign[sign == 0] = 1
    return (a * sign).float()


def _group(hq: int, h: int) -> int:
    if h <= 0 or hq % h:
        raise ValueError(f"{hq} query heads are not a multiple of {h} KV heads")
    return hq // h


def skew_queries(q: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Skewed queries: head j times A[j // G].

    q: (..., H_q, T, D) post-RoPE queries (or pre-RoPE for non-RoPE models)
    a: (H, D, D) one skewing matrix per KV head
    returns (..., H_q, T, D) in q's dtype
    """
    g = _group(q.shape[-3], a.shape[0])
    a_q = a.to(q.dtype).repeat_interleave(g, dim=0)  # (H_q, D, D)
    return q @ a_q


def skew_keys(k: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Skewed keys: k (..., H, T, D), a (H, D, D) -> (..., H, T, D)."""
    if k.shape[-3] != a.shape[0]:
        raise ValueError(f"k has {k.shape[-3]} KV heads, A has {a.shape[0]}")
    return k @ a.to(k.dtype)


def num_partial(head_dim: int, fraction: float = DEFAULT_FRACTION) -> int:
    """Partial channels per head: round(fraction * D), at least 1."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return max(1, min(head_dim, int(round(fraction * head_dim))))


def column_importance(q_skewed: torch.Tensor, k_skewed: torch.Tensor) -> torch.Tensor:
    """Per KV head and channel, sum over rows of |Q~| (averaged over the GQA
    group) + |K~|.

    q_skewed: (H_q, T, D), k_skewed: (H, T_k, D) -> (H, D) float32
    """
    hq, _, d = q_skewed.shape
    h = k_skewed.shape[0]
    g = _group(hq, h)
    qs = q_skewed.float().abs().sum(dim=1).view(h, g, d).mean(dim=1)
    return qs + k_skewed.float().abs().sum(dim=1)


def select_columns(q_skewed: torch.Tensor, k_skewed: torch.Tensor,
                   fraction: float = DEFAULT_FRACTION) -> torch.Tensor:
    """The partial channels: (H_q, T, D), (H, T_k, D) -> (H, C) int64, most
    important first (C = :func:`num_partial`)."""
    imp = column_importance(q_skewed, k_skewed)
    return imp.topk(num_partial(imp.shape[1], fraction), dim=1).indices


def fold_into_weights(w_q: torch.Tensor, w_k: torch.Tensor, a: torch.Tensor,
                      b_q: torch.Tensor | None = None, b_k: torch.Tensor | None = None):
    """The paper's Eq. 2 for models without rotary embeddings (OPT): fold A
    into the projection weights, so that the skewed projections give
    q~ = q A and k~ = k A per head.

    w_q: (H_q * D, hidden), w_k: (H * D, hidden)  nn.Linear weights (out, in)
    a:   (H, D, D)  per KV head (query head j uses A[j // G])
    b_q: (H_q * D,), b_k: (H * D,) optional biases
    returns (w_q~, w_k~, b_q~, b_k~), same shapes (biases None when not given).

    With RoPE the folded weights change attention (q is rotated after the
    projection): use :func:`skew_queries` / :func:`skew_keys` post-RoPE instead.
    """
    h, d, _ = a.shape
    hq = w_q.shape[0] // d
    g = _group(hq, h)
    a_q = a.to(w_q.dtype).repeat_interleave(g, dim=0)  # (H_q, D, D)
    a_k = a.to(w_k.dtype)
    # q_j = x W_j^T (W_j: rows of head j)  =>  q_j A = x (A^T W_j)^T
    wq = (a_q.transpose(1, 2) @ w_q.view(hq, d, -1)).reshape(w_q.shape)
    wk = (a_k.transpose(1, 2) @ w_k.view(h, d, -1)).reshape(w_k.shape)
    bq = None if b_q is None else (b_q.view(hq, 1, d) @ a_q).reshape(b_q.shape)
    bk = None if b_k is None else (b_k.view(h, 1, d) @ a_k).reshape(b_k.shape)
    return wq, wk, bq, bk


# ---------------------------------------------------------------------------
# Decode-time prediction (paper Fig. 10), for a packed skewing
# ---------------------------------------------------------------------------

def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the Llama / GPT-NeoX layout (halves rotated):
    x (..., D) with cos, sin broadcastable to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def partial_queries(x: torch.Tensor, w_q: torch.Tensor, a: torch.Tensor, num_partial: int,
                    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                    b_q: torch.Tensor | None = None) -> torch.Tensor:
    """InfiniGen's speculated query of layer i from layer i-1's attention input.

    x:    (B, hidden) attention input of layer i-1 (after its input norm)
    w_q:  (H_q * D, hidden) layer i's query weight (b_q: its bias, optional)
    a:    (H, D, D) layer i's *packed* skewing (:meth:`Skewing.packed`)
    cos, sin: (B, D) the rotary tables at each row's position (None: no RoPE)
    returns (B, H_q, C) skewed partial queries, C = ``num_partial``
    """
    d = a.shape[-1]
    q = torch.nn.functional.linear(x, w_q, b_q).view(x.shape[0], -1, d)  # (B, H_q, D)
    if cos is not None:
        q = rope(q, cos[:, None, :], sin[:, None, :])
    return skew_queries(q[:, :, None, :], a)[:, :, 0, :num_partial]


def partial_keys(k: torch.Tensor, a: torch.Tensor, num_partial: int) -> torch.Tensor:
    """The partial skewed key cache: post-RoPE keys (..., H, T, D) with a
    packed skewing ``a`` (H, D, D) -> (..., H, T, C)."""
    return skew_keys(k, a)[..., :num_partial]


def partial_attention_torch(q: torch.Tensor, k: torch.Tensor, cols: torch.Tensor | None,
                            lengths: torch.Tensor, alpha: float, scale: float = 1.0):
    """Batched torch equivalent of ``triton_kernels.partial_attention`` (same
    arguments and results; ``reference.partial_attention_ref`` is the
    one-head-at-a-time definition it is tested against).

    q (B, H_q, Dq), k (B, H, N, Dk), cols (C,) or None (all channels; then
    Dq == Dk), lengths (B,) ->
    logits (B, H_q, N) float32 (-inf past each length), counts (B, H_q) int32
    """
    b, hq, _ = q.shape
    h, n = k.shape[1], k.shape[2]
    g = _group(hq, h)
    if cols is None:  # every channel of q and k (an already partial cache)
        qc, kc = q.float(), k.float()
    else:
        cols = cols.long()
        qc, kc = q[..., cols].float(), k[..., cols].float()
    logits = torch.matmul(qc.view(b, h, g, -1), kc.transpose(2, 3)).view(b, hq, n) * scale
    lengths = lengths.to(k.device).long()
    if n and int(lengths.min()) < n:
        valid = torch.arange(n, device=k.device)[None] < lengths[:, None]
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    if n == 0:
        return logits, torch.zeros(b, hq, dtype=torch.int32, device=q.device)
    top = logits.max(dim=-1, keepdim=True).values
    counts = (logits > top - alpha).sum(dim=-1).to(torch.int32)
    return logits, counts


def speculate(q_partial: torch.Tensor, k_partial: torch.Tensor, lengths: torch.Tensor,
              alpha: float, scale: float, budget: int | None = None) -> list[torch.Tensor]:
    """The tokens to prefetch: partial logits, keep those above max - alpha,
    the mean count over the heads for every head, at most ``budget``.

    q_partial: (B, H_q, C), k_partial: (B, H, N, C), lengths: (B,)
    returns per row b a (H_q, k_b) int64 tensor of token indices in [0, lengths[b]),
    highest partial logit first.

    Runs the Triton kernel (``triton_kernels.partial_attention``) where
    :func:`vllm_kvevict.core.eviction.kernel_dispatch.use_triton` says so (CUDA), else
    :func:`partial_attention_torch`.
    """
    from vllm_kvevict.core.eviction.kernel_dispatch import triton_module, use_triton

    if use_triton(q_partial):
        cols = torch.arange(q_partial.shape[-1], device=q_partial.device)
        logits, counts = triton_module("partial_attention").partial_attention(
            q_partial, k_partial, cols, lengths, alpha, scale)
    else:
        logits, counts = partial_attention_torch(q_partial, k_partial, None, lengths, alpha,
                                                 scale)
    picked = triton_module("partial_attention").speculated_tokens(logits, counts, lengths)
    return picked if budget is None else [p[:, :budget] for p in picked]


# ---------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------

@dataclass
class Skewing:
    """Per-layer, per-KV-head skewing matrices and partial channels.

    a:    (L, H, D, D) float32, orthogonal; skewed q~ = q A, k~ = k A
    cols: (L, H, C) int64 partial channels of the skewed space, most important first
    meta: str -> str provenance (model dir, config hash, calibration)
    """

    a: torch.Tensor
    cols: torch.Tensor
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.a.dim() != 4 or self.a.shape[-1] != self.a.shape[-2]:
            raise ValueError(f"a must be (L, H, D, D), got {tuple(self.a.shape)}")
        if self.cols.dim() != 3 or self.cols.shape[:2] != self.a.shape[:2]:
            raise ValueError(f"cols must be (L, H, C) matching a, got {tuple(self.cols.shape)}")

    @property
    def num_layers(self) -> int:
        return self.a.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.a.shape[1]

    @property
    def head_dim(self) -> int:
        return self.a.shape[2]

    @property
    def num_partial(self) -> int:
        return self.cols.shape[2]

    @property
    def is_packed(self) -> bool:
        return bool((self.cols == torch.arange(self.num_partial)).all())

    def packed(self) -> "Skewing":
        """The same skewing with each head's columns of A permuted so that its
        partial channels are the first C (then ``cols[l, h] == arange(C)``,
        one channel list for every head, as the partial-attention kernel takes)."""
        nl, h, d, _ = self.a.shape
        c = self.num_partial
        a = torch.empty_like(self.a)
        for li in range(nl):
            for hi in range(h):
                first = self.cols[li, hi]
                rest = torch.ones(d, dtype=torch.bool)
                rest[first] = False
                perm = torch.cat([first, rest.nonzero().flatten()])
                a[li, hi] = self.a[li, hi][:, perm]
        cols = torch.arange(c).expand(nl, h, c).contiguous()
        return Skewing(a, cols, dict(self.meta, packed="1"))

    @staticmethod
    def identity(num_layers: int, num_kv_heads: int, head_dim: int,
                 fraction: float = DEFAULT_FRACTION) -> "Skewing":
        """No skewing (A = I) with the first C channels: the paper's
        "w/o skewing" ablation needs importance-chosen channels instead, see
        :func:`compute_skewing` with ``skew=False``."""
        c = num_partial(head_dim, fraction)
        a = torch.eye(head_dim).expand(num_layers, num_kv_heads, head_dim, head_dim).clone()
        cols = torch.arange(c).expand(num_layers, num_kv_heads, c).contiguous()
        return Skewing(a, cols, {"kind": "identity"})

    def save(self, path: str | os.PathLike) -> None:
        """Write a safetensors file (atomically: temp file + rename)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            save_file({"a": self.a.contiguous(), "cols": self.cols.contiguous()}, tmp,
                      metadata={str(k): str(v) for k, v in self.meta.items()})
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Skewing":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            return cls(f.get_tensor("a"), f.get_tensor("cols"), meta)


# ---------------------------------------------------------------------------
# Hugging Face model: collect queries and keys, compute, cache
# ---------------------------------------------------------------------------

def skewing_from_qk(qk: list[tuple[torch.Tensor, torch.Tensor]],
                    fraction: float = DEFAULT_FRACTION, skew: bool = True,
                    meta: dict | None = None) -> Skewing:
    """Per layer (q (H_q, T, D), k (H, T, D)) -> :class:`Skewing`.

    ``skew=False`` keeps A = I but still picks the partial channels by
    |Q| + |K| (the paper's "w/o skewing" ablation, Fig. 13)."""
    a_layers, col_layers = [], []
    for q, k in qk:
        hq, t, d = q.shape
        h = k.shape[0]
        g = _group(hq, h)
        if skew:
            # the G query heads of KV head i, stacked: (G * T, D)
            a = torch.stack([skew_matrix(q[i * g:(i + 1) * g].reshape(g * t, d))
                             for i in range(h)])
        else:
            a = torch.eye(d).expand(h, d, d).clone()
        cols = select_columns(skew_queries(q, a), skew_keys(k, a), fraction)
        a_layers.append(a)
        col_layers.append(cols)
    return Skewing(torch.stack(a_layers), torch.stack(col_layers), dict(meta or {}))
