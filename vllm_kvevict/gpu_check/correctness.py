"""Every Triton kernel against its plain-torch reference, natively on the target.

Error is ||got - ref|| / ||ref|| (float64), with the reference computed from the
same (rounded) inputs. Bounds per output:
  attention out  fp32 1e-5; fp16 3e-3; bf16 1.5e-2 (the kernel rounds P to the
                 cache dtype before P @ V, as FlashAttention does, and rounds out)
  scores, logits 1e-4 for every dtype: products of fp16/bf16 values are exact in
                 the fp32 accumulator, so scores are float32-accurate
  window scores  fp32 1e-4; fp16 5e-3; bf16 2e-2 (AnDPro rounds P and y to the
                 cache dtype for its two products)
  compaction     bit-identical (it only moves values)
Outputs are poisoned (NaN) before each run, so an unwritten element fails; the
score buffer starts non-zero, so `=` instead of `+=` fails.
"""
from __future__ import annotations

import math
import traceback

import torch

from vllm_kvevict.core.layouts.nhd_layout import NHDLayout
from vllm_kvevict.gpu_check import cases, kernel
from vllm_kvevict.gpu_check.cases import Target

OUT_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
WINDOW_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
SCORE_TOL = 1e-4


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(got).all():
        return math.inf
    den = ref.norm()
    return float((got - ref).norm() / (den if den > 0 else 1.0))


def record(kernel_name: str, config: str, dtype, fn) -> dict:
    """Run one case; a raised error is a failed case with its message."""
    rec = {"kernel": kernel_name, "config": config, "dtype": str(dtype).removeprefix("torch.")}
    try:
        rec.update(fn())
        rec["ok"] = all(rec[k] <= rec[k.replace("err", "tol")] for k in rec
                        if k.endswith("err")) and rec.get("exact", True)
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        rec.update(ok=False, error=f"{type(e).__name__}: {e}",
                   trace=traceback.format_exc(limit=4))
    return rec


def rand(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


# ---------------------------------------------------------------- paged attention + scores

def paged_inputs(t: Target, dtype, gqa, bs, d, lengths, h=2, seed=0, scatter=True):
    dev = t.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    max_blocks = max(cases.blocks_for(n, bs) for n in lengths)
    num_blocks = len(lengths) * max_blocks + 3
    kv = rand((num_blocks, h, bs, 2 * d), dtype, dev, gen)
    kc, vc = kv.transpose(1, 2).split(d, dim=-1)  # NHDLayout.split: (NB, BS, H, D) views
    order = (torch.randperm(num_blocks, generator=gen, device=dev) if scatter
             else torch.arange(num_blocks, device=dev))
    table = order[: len(lengths) * max_blocks].view(len(lengths), max_blocks).int()
    rows = torch.arange(len(lengths), device=dev)
    visible = torch.tensor(lengths, device=dev, dtype=torch.int32)
    q = rand((len(lengths), h * gqa, d), dtype, dev, gen)
    return kc, vc, table, rows, visible, q


def dense_paged_ref(q, kc, vc, table, rows, visible, scale, weight=None, chunk=8):
    """Float64 attention + score increment on the target device, vectorised over
    queries (the loop reference is too slow at 32 x 4,096 x 40 heads; this one is
    itself checked against the loop reference in `check_dense_reference`)."""
    t, hq, d = q.shape
    nb, bs, h, _ = kc.shape
    g = hq // h
    out = torch.zeros(t, hq, d, dtype=torch.float64, device=q.device)
    delta = torch.zeros(h, nb * bs, dtype=torch.float64, device=q.device)
    n = int(visible.max())
    nblk = cases.blocks_for(n, bs)
    for t0 in range(0, t, chunk):
        sl = slice(t0, t0 + chunk)
        bt = table[rows[sl].long(), :nblk].long()  # (c, nblk)
        c = bt.shape[0]
        slots = (bt[..., None] * bs + torch.arange(bs, device=q.device)).reshape(c, -1)
        k = kc[bt].reshape(c, nblk * bs, h, d).double()
        v = vc[bt].reshape(c, nblk * bs, h, d).double()
        logits = torch.einsum("chgd,cnhd->chgn", q[sl].view(c, h, g, d).double(), k) * scale
        hidden = torch.arange(nblk * bs, device=q.device)[None] >= visible[sl, None]
        logits.masked_fill_(hidden[:, None, None], -math.inf)
        p = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # an empty request: all zero
        out[sl] = torch.einsum("chgn,cnhd->chgd", p, v).reshape(c, hq, d)
        w = torch.ones(c, device=q.device, dtype=torch.float64) if weight is None \
            else weight[sl].double()
        add = (p.sum(2) * w[:, None, None]).permute(1, 0, 2).reshape(h, -1)  # (H, c * n)
        delta.index_add_(1, slots.flatten(), add)
    return out, delta


def paged_case(t: Target, dtype, gqa, bs, d, lengths, write_out=True, dense=False, h=2,
               unique_rows=False, keys_per_step=None):
    pa = kernel("paged_attention")
    kc, vc, table, rows, visible, q = paged_inputs(t, dtype, gqa, bs, d, lengths, h=h)
    scale = d ** -0.5
    weight = torch.ones(len(lengths), device=t.device)
    if len(lengths) > 3:
        weight[3] = 0.0  # one unscored query
    before = torch.rand(h, kc.shape[0] * bs, device=t.device) * 1e-3
    scores = before.clone()
    out = torch.full_like(q, math.nan)
    pa.paged_attention_scores(q, kc, vc, table, rows, visible, scale, scores=scores,
                              score_weight=weight, out=out if write_out else None,
                              write_out=write_out, max_visible=max(lengths),
                              unique_rows=unique_rows, keys_per_step=keys_per_step)
    if dense:
        ref_out, ref_delta = dense_paged_ref(q, kc, vc, table, rows, visible, scale, weight)
    else:
        ref_out, ref_delta = kernel("reference").paged_attention_scores_ref(
            q.cpu(), kc.cpu(), vc.cpu(), table.cpu(), rows.cpu(), visible.cpu(), scale,
            weight.cpu())
    res = {"scores_err": rel_err(scores - before, ref_delta), "scores_tol": SCORE_TOL}
    if write_out:
        res.update(out_err=rel_err(out, ref_out), out_tol=OUT_TOL[dtype])
    return res


def check_dense_reference(t: Target) -> dict:
    """The float64 dense reference equals the loop reference (reference.py)."""
    def run():
        kc, vc, table, rows, visible, q = paged_inputs(t, torch.float32, 3, 16, 32,
                                                       [0, 1, 15, 16, 37, 77])
        w = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5], device=t.device)
        a_out, a_delta = dense_paged_ref(q, kc, vc, table, rows, visible, 0.3, w, chunk=4)
        b_out, b_delta = kernel("reference").paged_attention_scores_ref(
            q.cpu(), kc.cpu(), vc.cpu(), table.cpu(), rows.cpu(), visible.cpu(), 0.3, w.cpu())
        return {"out_err": rel_err(a_out, b_out), "out_tol": 1e-6,
                "scores_err": rel_err(a_delta, b_delta), "scores_tol": 1e-6}
    return record("dense reference (float64) vs loop reference", "GQA 3, BS 16, D 32",
                  torch.float32, run)


def paged_checks(t: Target) -> list[dict]:
    recs = [check_dense_reference(t)]
    for dtype in t.dtypes:
        for gqa, bs, d in cases.matrix(t, cases.PAGED, cases.PAGED_DRY):
            lengths = [0, 1, bs - 1, bs, 2 * bs + 5, 77]  # empty, single token, ragged
            for write_out in (True, False) if dtype == torch.float16 else (True,):
                name = "paged attention + scores" if write_out else "paged scores only"
                recs.append(record(name, f"GQA {gqa}, BS {bs}, D {d}", dtype,
                                   lambda: paged_case(t, dtype, gqa, bs, d, lengths, write_out)))
    recs.append(record("paged attention + scores, unique rows (no atomics)", "GQA 3, BS 16, D 64",
                       t.dtypes[-1], lambda: paged_case(t, t.dtypes[-1], 3, 16, 64,
                                                        [0, 1, 15, 16, 37, 77], unique_rows=True)))
    for keys in (16, 32, 64):  # keys per step (default 128) across block boundaries
        for bs in (16, 128):
            recs.append(record(f"paged attention + scores, {keys} keys per step",
                               f"GQA 3, BS {bs}, D 64", t.dtypes[-1],
                               lambda: paged_case(t, t.dtypes[-1], 3, bs, 64,
                                                  [0, 1, bs - 1, bs, 2 * bs + 5, 77, 300],
                                                  keys_per_step=keys)))
    s = cases.big(t)
    for unique in (False, True):
        recs.append(record(
            "paged attention + scores" + (", unique rows (no atomics)" if unique else ""),
            shape_name(t, "decode"), s["dtype"],
            lambda: paged_case(t, s["dtype"], s["group"], s["block"], s["head_size"],
                               [s["ctx"]] * s["batch"], dense=True, h=s["heads"],
                               unique_rows=unique)))
    return recs


def shape_name(t: Target, what: str) -> str:
    s = cases.big(t)
    label = "tiny" if t.dry else "Llama-2-13B"
    return (f"{label} {what}: batch {s['batch']}, ctx {s['ctx']}, {s['heads']} KV heads, "
            f"GQA {s['group']}, D {s['head_size']}, BS {s['block']}")


# ---------------------------------------------------------------- window scores

def window_case(t: Target, projection: bool, dtype, gqa, w, n, d, b=2, h=2):
    from vllm_kvevict.core.scoring.window_scores import raw_scores_torch
    gen = torch.Generator(device=t.device).manual_seed(2)
    q = rand((b, w, h * gqa, d), dtype, t.device, gen)
    # Strided k/v: the first n tokens of a longer buffer, as the worker passes them.
    k = rand((b, h, n + 7, d), dtype, t.device, gen)[:, :, :n]
    v = rand((b, h, n + 7, d), dtype, t.device, gen)[:, :, :n]
    got = kernel("window").window_raw_scores(q, k, v, d ** -0.5, projection=projection)
    ref = torch.cat([raw_scores_torch(q[i:i + 1].double(), k[i:i + 1].double(),
                                      v[i:i + 1].double(), d ** -0.5, projection)
                     for i in range(b)])
    return {"scores_err": rel_err(got, ref), "scores_tol": WINDOW_TOL[dtype]}


def window_checks(t: Target) -> list[dict]:
    recs = []
    for dtype in t.dtypes:
        for kind, projection in WINDOW_KINDS:
            for gqa, w, n, d in cases.matrix(t, cases.WINDOW, cases.WINDOW_DRY):
                recs.append(record(f"window scores ({kind})", f"GQA {gqa}, w {w}, n {n}, D {d}",
                                   dtype, lambda: window_case(t, projection, dtype, gqa, w, n, d)))
    s = cases.big(t)
    for kind, projection in WINDOW_KINDS:
        recs.append(record(f"window scores ({kind})", shape_name(t, "compaction") + ", w 32",
                           s["dtype"], lambda: window_case(
                               t, projection, s["dtype"], s["group"], min(32, s["ctx"]),
                               s["ctx"], s["head_size"], b=s["batch"], h=s["heads"])))
    return recs


# The window kernel's two modes, as the reports name them (the policy each serves).
WINDOW_KINDS = (("snapkv", False), ("andpro", True))


# ---------------------------------------------------------------- compaction

def compaction_inputs(t: Target, dtype, bs, old_len, new_len, d, h=3, rows=2, cow=True, seed=3):
    dev = t.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    n_src, n_dst = math.ceil(old_len / bs), math.ceil(new_len / bs)
    num_blocks = rows * n_src + rows * n_dst + 2
    kv = rand((num_blocks, h, bs, 2 * d), dtype, dev, gen)
    kc, vc = kv.transpose(1, 2).split(d, dim=-1)
    perm = torch.randperm(num_blocks, generator=gen, device=dev)
    src_blocks = perm[: rows * n_src].view(rows, n_src)
    dst_blocks = src_blocks[:, :n_dst].clone()  # in place: the row keeps its first blocks
    if cow and n_dst:  # a shared kept block gets a private copy
        dst_blocks[:, 0] = perm[rows * n_src: rows * n_src + rows]
    keep = torch.rand(rows, h, old_len, generator=gen, device=dev).argsort(-1)[..., :new_len]
    keep = keep.sort(-1).values
    scores = torch.rand(h, num_blocks * bs, generator=gen, device=dev)
    pos = torch.arange(old_len, device=dev)
    src = src_blocks[:, pos // bs] * bs + pos % bs
    full = torch.arange(n_dst * bs, device=dev)
    dst = dst_blocks[:, full // bs] * bs + full % bs
    return kc, vc, scores, src, dst, keep, src_blocks, dst_blocks


def compaction_case(t: Target, dtype, bs, old_len, new_len, d, h=3, rows=2):
    kc, vc, scores, src, dst, keep, *_ = compaction_inputs(t, dtype, bs, old_len, new_len, d,
                                                          h=h, rows=rows)
    want = [x.clone() for x in (kc, vc, scores)]
    layout = NHDLayout(bs, h, d, kc.dtype)
    kernel("reference").compact_ref(layout, *want, src, dst, keep)  # on the device: same values
    # As the worker passes them: slot plans built on the host, keep on the device.
    kernel("compaction").compact_in_place(kc, vc, scores, src.cpu(), dst.cpu(), keep)
    exact = all(torch.equal(a, b) for a, b in zip((kc, vc, scores), want))
    return {"exact": exact, "mismatched": int(sum((a != b).sum() for a, b in
                                                  zip((kc, vc, scores), want)))}


def compaction_checks(t: Target) -> list[dict]:
    recs = []
    for dtype in t.dtypes:
        for bs, old, new, d in cases.matrix(t, cases.COMPACTION, cases.COMPACTION_DRY):
            recs.append(record("compaction in place", f"BS {bs}, {old} -> {new}, D {d}, CoW",
                               dtype, lambda: compaction_case(t, dtype, bs, old, new, d)))
    s = cases.big(t)
    old = s["ctx"] + s["block"]
    recs.append(record("compaction in place", shape_name(t, "compaction") + f", {old} -> "
                       f"{s['ctx'] // 2}", s["dtype"], lambda: compaction_case(
                           t, s["dtype"], s["block"], old, s["ctx"] // 2, s["head_size"],
                           h=s["heads"], rows=s["batch"])))
    return recs


# ---------------------------------------------------------------- partial attention

def partial_case(t: Target, dtype, gqa, d, c, b=4, h=2, n=150, lengths=None):
    gen = torch.Generator(device=t.device).manual_seed(6)
    q = rand((b, h * gqa, d), dtype, t.device, gen)
    k = rand((b, h, n, d), dtype, t.device, gen)
    cols = torch.randperm(d, generator=gen, device=t.device)[:c]
    lengths = torch.tensor(lengths or [n, 0, 1, 77][:b], device=t.device)
    alpha, scale = 4.0, 0.125
    logits, counts = kernel("partial_attention").partial_attention(q, k, cols, lengths,
                                                                  alpha, scale)
    ref_logits, ref_counts = kernel("reference").partial_attention_ref(
        q.cpu().double(), k.cpu().double(), cols.cpu(), lengths.cpu(), alpha, scale)
    finite = torch.isfinite(ref_logits)
    same_inf = torch.equal(torch.isfinite(logits.cpu()), finite)
    got = logits.cpu().masked_fill(~finite, 0.0)
    # A count may differ only by logits within rounding of the max - alpha cut.
    cut = ref_logits.amax(-1, keepdim=True) - alpha
    near = ((ref_logits - cut).abs() < 1e-4 * ref_logits.abs().amax(-1, keepdim=True)).sum(-1)
    counts_ok = bool(((counts.cpu() - ref_counts).abs() <= near).all())
    return {"logits_err": rel_err(got, ref_logits.masked_fill(~finite, 0.0)),
            "logits_tol": SCORE_TOL, "exact": same_inf and counts_ok}


def partial_checks(t: Target) -> list[dict]:
    recs = []
    for dtype in t.dtypes:
        for gqa, d, c in cases.matrix(t, cases.PARTIAL, cases.PARTIAL_DRY):
            recs.append(record("partial attention + count", f"GQA {gqa}, D {d}, C {c}", dtype,
                               lambda: partial_case(t, dtype, gqa, d, c)))
    s = cases.big(t)
    c = max(1, round(0.3 * s["head_size"]))
    recs.append(record("partial attention + count", shape_name(t, "decode") + f", C {c}",
                       s["dtype"], lambda: partial_case(
                           t, s["dtype"], s["group"], s["head_size"], c, b=s["batch"],
                           h=s["heads"], n=s["ctx"], lengths=[s["ctx"]] * s["batch"])))
    return recs


def run(t: Target) -> list[dict]:
    return paged_checks(t) + window_checks(t) + compaction_checks(t) + partial_checks(t)
