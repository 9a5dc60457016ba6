"""Triton kernels vs their torch paths: time, achieved GB/s, % of the memory-bandwidth peak.

Needs only torch + Triton (no vLLM), so it runs on the lent GPU machine:

    python benchmarks/kernels.py --out results/gpu/kernels_gpu.md         # CUDA
    TRITON_INTERPRET=1 python benchmarks/kernels.py --smoke --device cpu  # CPU check

Each row first checks the kernel against its torch reference in the cache
dtype (fp16/bf16 on GPU), then times both. Bytes are the unavoidable traffic:
  decode attention   K + V of every resident token (scores add G x 8 + 8 bytes
                     per token and KV head: the scratch logits and the score RMW)
  window scores      K (and V for andpro) read twice: two passes
  compaction         kept K, V read + written, scores read + written
  partial attention  the C partial channels of every key, the logits written
Peak = the better of the card's datasheet figure and a measured device copy.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATASHEET_GBS = {"H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H200": 4800, "A100": 2039}


def load_kernels():
    """The launcher modules, installed or from a bare checkout (the GPU machine
    has no vLLM and no install of ours): `vllm_kvevict.gpu_check.kernel`."""
    sys.path.insert(0, str(ROOT))
    from vllm_kvevict.gpu_check import kernel

    return {n: kernel(n) for n in ("paged_attention", "window", "compaction", "partial_attention")}


def bench(fn, device, reps):
    """Median seconds per call."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        from triton.testing import do_bench
        return do_bench(fn, warmup=5, rep=max(reps * 5, 50), return_mode="median") / 1e3
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def copy_peak(device):
    """Measured device-to-device copy bandwidth, GB/s (read + write)."""
    if device.type != "cuda":
        return None
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / bench(lambda: y.copy_(x), device, 20) / 1e9


def paged_setup(batch, ctx, h, g, d, bs, dtype, device):
    nblk = -(-ctx // bs)
    kv = torch.randn(batch * nblk + 1, h, bs, 2 * d, device=device, dtype=dtype)
    kc, vc = kv.transpose(1, 2).split(d, dim=-1)  # NHDLayout.split: (NB, BS, H, D) views
    table = torch.randperm(batch * nblk, device=device).view(batch, nblk).int()
    q = torch.randn(batch, h * g, d, device=device, dtype=dtype)
    rows = torch.arange(batch, device=device)
    visible = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    scores = torch.zeros(h, kv.shape[0] * bs, device=device)
    return kc, vc, table, q, rows, visible, scores


def row_decode(k, cfg, dtype, device, reps):
    b, ctx, h, g, d, bs = cfg
    kc, vc, table, q, rows, vis, scores = paged_setup(b, ctx, h, g, d, bs, dtype, device)
    pa = k["paged_attention"].paged_attention_scores
    both = lambda: pa(q, kc, vc, table, rows, vis, d ** -0.5, scores=scores, max_visible=ctx)  # noqa: E731
    attn = lambda: pa(q, kc, vc, table, rows, vis, d ** -0.5, max_visible=ctx)  # noqa: E731
    only = lambda: pa(q, kc, vc, table, rows, vis, d ** -0.5, scores=scores,  # noqa: E731
                      write_out=False, max_visible=ctx)
    slots = (table.long()[:, :, None] * bs + torch.arange(bs, device=device)).flatten(1)

    def torch_path():  # the plugin's torch path: gather the blocks, attend and score densely
        kk = kc[table.long()].flatten(1, 2).transpose(1, 2).float()  # (B, H, ctx, D)
        vv = vc[table.long()].flatten(1, 2).transpose(1, 2).float()
        p = torch.softmax(q.float().view(b, h, g, d) @ kk.transpose(-1, -2) * d ** -0.5, -1)
        scores.index_add_(1, slots.flatten(), p.sum(2).transpose(0, 1).reshape(h, -1))
        return p @ vv  # (B, H, G, D)
    err = check_decode(k, kc, vc, table, q, rows, vis, d, dtype)
    kv_bytes = 2 * b * ctx * h * d * kc.element_size()
    score_bytes = b * ctx * h * (8 * g + 8)
    t_attn, t_both = bench(attn, device, reps), bench(both, device, reps)
    t_only, t_torch = bench(only, device, reps), bench(torch_path, device, reps)
    shape = f"B={b} ctx={ctx} H={h} G={g} D={d} BS={bs}"
    return [("decode attention only", shape, t_attn, t_torch, kv_bytes, err),
            ("decode attention + scores (fused)", shape, t_both, t_torch, kv_bytes + score_bytes,
             err, f"+{(t_both / t_attn - 1) * 100:.1f}% over attention only"),
            ("decode scores only (K, no V)", shape, t_only, t_torch,
             kv_bytes // 2 + score_bytes, err)]


def check_decode(k, kc, vc, table, q, rows, vis, d, dtype):
    from vllm_kvevict.triton_kernels.reference import paged_attention_scores_ref
    n = min(4, q.shape[0])
    s = torch.zeros(kc.shape[2], kc.shape[0] * kc.shape[1], device=kc.device)
    out = k["paged_attention"].paged_attention_scores(
        q[:n], kc, vc, table, rows[:n], vis[:n], d ** -0.5, scores=s)
    ref_out, ref_s = paged_attention_scores_ref(q[:n].cpu(), kc.cpu(), vc.cpu(), table.cpu(),
                                                rows[:n].cpu(), vis[:n].cpu(), d ** -0.5)
    return max(float((out.float().cpu() - ref_out).abs().max()),
               float((s.cpu() - ref_s).abs().max()))


def row_window(k, cfg, kind, dtype, device, reps):
    from vllm_kvevict.core.scoring.window_scores import raw_scores_torch
    b, n, h, g, d, w = cfg
    q = torch.randn(b, w, h * g, d, device=device, dtype=dtype)
    kk = torch.randn(b, h, n, d, device=device, dtype=dtype)
    vv = torch.randn(b, h, n, d, device=device, dtype=dtype)
    f = k["window"].window_raw_scores
    proj = kind == "andpro"  # the value projection (AnDPro), else attention sums (SnapKV)
    ref = raw_scores_torch(q.cpu().float(), kk.cpu().float(), vv.cpu().float(), d ** -0.5, proj)
    got = f(q, kk, vv, d ** -0.5, projection=proj).cpu()
    err = float(((got - ref).abs() / ref.abs().amax(-1, keepdim=True)).max())  # relative to row max
    tensors = 2 if proj else 1
    byts = 2 * tensors * b * h * n * d * kk.element_size()
    t = bench(lambda: f(q, kk, vv, d ** -0.5, projection=proj), device, reps)
    t_ref = bench(lambda: raw_scores_torch(q, kk, vv, d ** -0.5, proj), device, reps)
    return [(f"window scores ({kind})", f"rows={b} n={n} H={h} G={g} D={d} w={w}", t, t_ref,
             byts, err)]


def row_compaction(k, cfg, dtype, device, reps):
    from vllm_kvevict.core.eviction.compaction import fill_holes
    from vllm_kvevict.core.layouts.nhd_layout import NHDLayout
    rows, old_len, new_len, h, d, bs = cfg
    n_src, n_dst = -(-old_len // bs), -(-new_len // bs)
    kv = torch.randn(rows * n_src + 1, h, bs, 2 * d, device=device, dtype=dtype)
    layout = NHDLayout.for_cache(kv)
    kc, vc = layout.split(kv)
    src_blocks = torch.arange(rows * n_src, device=device).view(rows, n_src)
    pos = torch.arange(old_len, device=device)
    src = src_blocks[:, pos // bs] * bs + pos % bs
    full = torch.arange(n_dst * bs, device=device)
    dst = src_blocks[:, full // bs] * bs + full % bs
    keep = torch.rand(rows, h, old_len, device=device).topk(new_len, dim=-1).indices.sort(-1).values
    scores = torch.rand(h, kv.shape[0] * bs, device=device)
    f = k["compaction"].compact_in_place
    # Same plan applied again and again: the work per call is identical.
    t = bench(lambda: f(kc, vc, scores, src, dst, keep), device, reps)
    # The torch path: fill_holes (what the worker runs without the kernel).
    t_ref = bench(lambda: fill_holes(layout, kc, vc, src_blocks, src_blocks[:, :n_dst], keep,
                                     old_len, scores), device, reps)
    byts = 2 * rows * h * new_len * (2 * d * kc.element_size() + 4)
    return [("compaction in place", f"rows={rows} {old_len}->{new_len} H={h} D={d} BS={bs}",
             t, t_ref, byts, 0.0)]


def row_partial(k, cfg, dtype, device, reps):
    b, n, h, g, c = cfg
    q = torch.randn(b, h * g, c, device=device, dtype=dtype)
    kk = torch.randn(b, h, n, c, device=device, dtype=dtype)  # InfiniGen's partial key cache
    cols = torch.arange(c, device=device)
    lengths = torch.full((b,), n, device=device)
    f = k["partial_attention"].partial_attention
    t = bench(lambda: f(q, kk, cols, lengths, 4.0), device, reps)
    def torch_path():
        s = torch.einsum("bhgc,bhnc->bhgn", q.float().view(b, h, g, c), kk.float())
        return (s > s.amax(-1, keepdim=True) - 4.0).sum(-1)
    t_ref = bench(torch_path, device, reps)
    byts = b * h * n * c * kk.element_size() + b * h * g * n * 4 * 2
    return [("partial attention + threshold", f"B={b} n={n} H={h} G={g} C={c}", t, t_ref,
             byts, 0.0)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter check)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else getattr(torch, args.dtype)
    k = load_kernels()
    if args.smoke:
        decode, window, comp, part, reps = ((2, 40, 2, 3, 32, 16), (2, 40, 2, 3, 32, 8),
                                            (2, 40, 20, 2, 32, 16), (2, 40, 2, 3, 16), 1)
    else:
        decode, window, comp, part, reps = ((64, 4096, 8, 4, 128, 16), (32, 4096, 8, 4, 128, 32),
                                            (32, 4112, 2048, 8, 128, 16),
                                            (64, 4096, 8, 4, 38), args.reps)
    rows = row_decode(k, decode, dtype, device, reps)
    for kind in ("snapkv", "andpro"):
        rows += row_window(k, window, kind, dtype, device, reps)
    rows += row_compaction(k, comp, dtype, device, reps)
    rows += row_partial(k, part, dtype, device, reps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    measured = copy_peak(device)
    sheet = next((v for key, v in DATASHEET_GBS.items() if key in name), None)
    peak = max(x for x in (measured, sheet, 0) if x is not None) or None
    lines = [f"device: {name}; dtype {dtype}; datasheet {sheet} GB/s; measured copy "
             f"{measured and round(measured)} GB/s; {time.strftime('%Y-%m-%d')}", "",
             "| kernel | shape | Triton ms | torch ms | speedup | GB/s | % of peak | max err | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name_, shape, t, t_ref, byts, err, *note in rows:
        gbs = byts / t / 1e9
        pct = f"{gbs / peak * 100:.0f}%" if peak else "-"
        lines.append(f"| {name_} | {shape} | {t * 1e3:.3f} | {t_ref * 1e3:.3f} | "
                     f"{t_ref / t:.1f}x | {gbs:.0f} | {pct} | {err:.2e} | {''.join(note)} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
