"""Each kernel's time against the least time its bytes can take on this device.

Times are medians of `triton.testing.do_bench` (CUDA events) on a GPU, of
`time.perf_counter` on the dry run (the interpreter: the figures only prove the
code runs). Bytes are the unavoidable traffic, each input read once and each
output written once:
  decode attention   K + V of every visible token
  + scores           + the G x 4 bytes of scratch logits written and read back,
                     and the 4-byte score read-modify-write, per token and KV head
  window scores      K (and V for AnDPro) read twice: the kernel's two passes
  compaction         the kept K and V read and written, and their scores
  partial attention  the C partial channels of every key, the float32 logits written
"copy" is a device-to-device copy moving the same number of bytes (read +
write), timed in the same run: the ratio is how far the kernel is from the
memory system's own speed.
"""
from __future__ import annotations

import time

import torch

from vllm_kvevict.gpu_check import cases, correctness, kernel
from vllm_kvevict.gpu_check.cases import Target


def bench_ms(t: Target, fn) -> float:
    fn()
    if t.gpu:
        from triton.testing import do_bench

        torch.cuda.synchronize()
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1] * 1e3


def copy_ms(t: Target, nbytes: int) -> float:
    """A device copy that reads nbytes / 2 and writes nbytes / 2."""
    x = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device=t.device).random_()
    y = torch.empty_like(x)
    return bench_ms(t, lambda: y.copy_(x))


def row(t: Target, name, shape, fn, nbytes, note="") -> dict:
    ms = bench_ms(t, fn)
    cp = copy_ms(t, nbytes)
    return {"kernel": name, "shape": shape, "ms": ms, "bytes": nbytes,
            "gbps": nbytes / ms / 1e6, "copy_ms": cp, "copy_gbps": nbytes / cp / 1e6,
            "of_copy": cp / ms, "note": note}


def decode_rows(t: Target, s: dict, dtype, label: str) -> list[dict]:
    b, ctx, h, g, d, bs = s["batch"], s["ctx"], s["heads"], s["group"], s["head_size"], s["block"]
    kc, vc, table, rows, vis, q = correctness.paged_inputs(t, dtype, g, bs, d, [ctx] * b, h=h)
    pa = kernel("paged_attention").paged_attention_scores
    scores = torch.zeros(h, kc.shape[0] * bs, device=t.device)
    out = torch.empty_like(q)
    scale = d ** -0.5
    kv_bytes = 2 * b * ctx * h * d * kc.element_size()
    score_bytes = b * ctx * h * (8 * g + 8)
    shape = f"{label}: B {b}, ctx {ctx}, H {h}, G {g}, D {d}, BS {bs}, " \
        + str(dtype).removeprefix("torch.")
    attn = row(t, "decode attention only", shape,
               lambda: pa(q, kc, vc, table, rows, vis, scale, out=out, max_visible=ctx), kv_bytes)
    fused = row(t, "decode attention + H2O scores (fused)", shape,
                lambda: pa(q, kc, vc, table, rows, vis, scale, scores=scores, out=out,
                           max_visible=ctx), kv_bytes + score_bytes)
    over = (fused["ms"] / attn["ms"] - 1) * 100
    fused["note"] = f"{over:+.1f}% over attention only (atomic adds)"
    unique = row(t, "decode attention + H2O scores (fused), unique rows: no atomics", shape,
                 lambda: pa(q, kc, vc, table, rows, vis, scale, scores=scores, out=out,
                            max_visible=ctx, unique_rows=True), kv_bytes + score_bytes)
    unique["note"] = f"{(unique['ms'] / attn['ms'] - 1) * 100:+.1f}% over attention only"
    steps = []
    for keys in (16, 32, 64):  # keys per step of the walk, against KEYS_PER_STEP (128)
        a = row(t, f"decode attention only, {keys} keys per step", shape,
                lambda: pa(q, kc, vc, table, rows, vis, scale, out=out, max_visible=ctx,
                           keys_per_step=keys), kv_bytes)
        f = row(t, f"decode attention + H2O scores (fused), unique rows, {keys} keys per step",
                shape, lambda: pa(q, kc, vc, table, rows, vis, scale, scores=scores, out=out,
                                  max_visible=ctx, unique_rows=True, keys_per_step=keys),
                kv_bytes + score_bytes)
        f["note"] = f"{(f['ms'] / a['ms'] - 1) * 100:+.1f}% over attention only at {keys}"
        steps += [a, f]
    if "layers" in s:
        fused["note"] += f"; x{s['layers']} layers = {fused['ms'] * s['layers']:.2f} ms per step"
    only = row(t, "decode H2O scores only (K, no V)", shape,
               lambda: pa(q, kc, vc, table, rows, vis, scale, scores=scores, write_out=False,
                          max_visible=ctx), kv_bytes // 2 + score_bytes)
    # torch's SDPA over the same keys laid out densely (what a contiguous,
    # unpaged cache would allow): the bar for plain decode attention here.
    kd = kc[table.long()].reshape(b, -1, h, d)[:, :ctx].transpose(1, 2).contiguous()
    vd = vc[table.long()].reshape(b, -1, h, d)[:, :ctx].transpose(1, 2).contiguous()
    qd = q.view(b, h * g, 1, d)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    dense = row(t, "torch SDPA, dense unpaged K/V (no scores)", shape,
                lambda: sdpa(qd, kd, vd, scale=scale, enable_gqa=g > 1), kv_bytes)
    fused["note"] += f"; {fused['ms'] / dense['ms']:.2f}x torch SDPA's time"
    unique["note"] += f"; {unique['ms'] / dense['ms']:.2f}x torch SDPA's time"
    return [attn, fused, unique, *steps, only, dense]


def window_rows(t: Target, s: dict) -> list[dict]:
    b, n, h, g, d, dtype = s["batch"], s["ctx"], s["heads"], s["group"], s["head_size"], s["dtype"]
    w = min(32, n)
    q = torch.randn(b, w, h * g, d, device=t.device).to(dtype)
    k = torch.randn(b, h, n, d, device=t.device).to(dtype)
    v = torch.randn(b, h, n, d, device=t.device).to(dtype)
    f = kernel("window").window_raw_scores
    shape = f"B {b}, n {n}, H {h}, G {g}, D {d}, w {w}, {dtype}".replace("torch.", "")
    return [row(t, f"window scores ({kind})", shape,
                lambda: f(q, k, v, d ** -0.5, projection=projection),
                2 * (2 if projection else 1) * b * h * n * d * k.element_size())
            for kind, projection in (("snapkv", False), ("andpro", True))]


def compaction_rows(t: Target, s: dict) -> list[dict]:
    bs, d, h, rows, dtype = s["block"], s["head_size"], s["heads"], s["batch"], s["dtype"]
    old, new = s["ctx"] + bs, s["ctx"] // 2
    kc, vc, scores, src, dst, keep, *_ = correctness.compaction_inputs(
        t, dtype, bs, old, new, d, h=h, rows=rows, cow=False)
    f = kernel("compaction").compact_in_place
    nbytes = 2 * rows * h * new * (2 * d * kc.element_size() + 4)
    shape = f"{rows} rows, {old} -> {new}, H {h}, D {d}, BS {bs}, {dtype}".replace("torch.", "")
    # The same plan applied again and again: the same work each call. Device
    # index tensors here (the worker's are host-built: see the syncs section).
    return [row(t, "compaction in place", shape, lambda: f(kc, vc, scores, src, dst, keep),
                nbytes, "device-side slot plans")]


def partial_rows(t: Target, s: dict) -> list[dict]:
    b, n, h, g, d, dtype = s["batch"], s["ctx"], s["heads"], s["group"], s["head_size"], s["dtype"]
    c = max(1, round(0.3 * d))
    q = torch.randn(b, h * g, c, device=t.device).to(dtype)
    k = torch.randn(b, h, n, c, device=t.device).to(dtype)  # InfiniGen's partial key cache
    cols = torch.arange(c, device=t.device)
    lengths = torch.full((b,), n, device=t.device)
    f = kernel("partial_attention").partial_attention
    shape = f"B {b}, n {n}, H {h}, G {g}, C {c}, {dtype}".replace("torch.", "")
    nbytes = b * h * n * c * k.element_size() + b * h * g * n * 4
    return [row(t, "partial attention + count", shape,
                lambda: f(q, k, cols, lengths, 4.0), nbytes)]


GQA_8B = dict(batch=32, ctx=4096, heads=8, group=4, head_size=128, block=16,
              dtype=torch.bfloat16)  # Llama-3-8B's attention: 8 KV heads, 32 query heads


def run(t: Target) -> list[dict]:
    s = cases.big(t)
    label = "tiny" if t.dry else "Llama-2-13B"
    rows = decode_rows(t, s, s["dtype"], label)
    if not t.dry:
        rows += decode_rows(t, GQA_8B, GQA_8B["dtype"], "Llama-3-8B")
    rows += window_rows(t, s) + compaction_rows(t, s) + partial_rows(t, s)
    if t.gpu:
        torch.cuda.empty_cache()
    return rows
