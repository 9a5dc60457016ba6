"""The compiled CPU scoring kernel against the torch path, at the shapes the
engine scores: decode-log flushes (rows = layer x request, 32 queries each)
and causal prefill chunks, SmolLM2-135M's heads (3 KV heads, GQA 3, D 64),
block 32, in vLLM's bf16 cache layouts (`amx` on AMX CPUs, `vec` elsewhere).

    python benchmarks/cpu_kernel.py [--threads 1] [--reps 5] [--dtype bf16] [--layout vec]
                                    [--md OUT.md]

Each cell is the median of --reps calls after one warm-up, ms; GMAC/s counts
the logits' multiply-adds (queries x visible keys x D) only. Paths the CPU
lacks are left out. Both sides score the same keys read from the same paged
cache (the torch path gathers them first, as it does in the engine).

The last columns are vLLM's own CPU attention (`cpu_attention_with_kv_cache`,
the kernel stock vLLM runs) over the same queries, visible keys and cache, and
the best scoring path's time over it: what scoring costs at the price of the
attention it sits beside (issue 35's title). The flush shapes' 32 queries a
row are 32 decode steps in the engine; here they go to vLLM's kernel as one
32-query non-causal chunk, the same logits.

For the prefill shapes, the fused pass (`attend_add_column_sums`: attention
and H2O's column sums in one pass, what the engine runs for prompt chunks of
requests that evict anyway; integration/fused_attention.py) against what it
replaces, vLLM's attention plus the best scoring path ("-" for the flush
shapes). It reads vLLM's `vec` layout (bf16: `vec` on AVX-512 BF16 CPUs, else
the avx2 path; float32: the avx2 path) and, on the AVX-512 BF16 path, its
`amx` layout, the one vLLM attends with AMX tiles on AMX CPUs (the engine
does not plan the pass there: integration/fused_attention.reads says why;
`--layout vec` times vLLM's `vec` kernel and layout on such a CPU instead).
A second table times one layer of a decode step the same way: vLLM's
attention plus the scoring kernel's share of a flush, against the pass
(which reads a decode row's keys and values in place). "pass, no rows
scored" is the same pass with `score_rows` all false: attention alone, what
the engine runs for SnapKV, AnDPro and StreamingLLM (whose scores do not
come from it).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

H, G, D, BS = 3, 3, 64, 32
SHAPES = [  # (name, rows, queries per row, keys, causal)
    ("flush 16 req x 30 layers @ 192", 480, 32, 192, False),
    ("flush 8 req x 30 layers @ 1,024", 240, 32, 1024, False),
    ("flush 1 req x 30 layers @ 4,096", 30, 32, 4096, False),
    ("flush 1 req x 30 layers @ 8,000", 30, 32, 8000, False),
    ("prefill chunk 256 @ 4,096 (1 layer)", 1, 256, 4096, True),
    ("prefill 2,048 causal (1 layer)", 1, 2048, 2048, True),
]


DECODE_SHAPES = [  # (name, requests, keys): one layer of one decode step
    ("16 req @ 200 (the main job)", 16, 200),
    ("50 req @ 160 (steady pool, 20%)", 50, 160),
    ("17 req @ 480", 17, 480),
    ("32 req @ 1,024", 32, 1024),
    ("8 req @ 3,000", 8, 3000),
    ("1 req @ 8,000", 1, 8000),
]
FLUSH = 32  # decode queries a decode-log flush scores at once in the engine


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def medians_ms(fns, reps: int) -> list[float]:
    """Median ms of each call, the calls taking turns rep by rep (after one
    warm-up each), so a machine that speeds up or slows down moves them together."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t0))
    return [sorted(ts)[len(ts) // 2] for ts in times]


def vllm_attention(ops, isa: str, q: torch.Tensor, kc, vc, rows: torch.Tensor, n: int,
                   causal: bool):
    """vLLM's CPU attention for r requests of nq queries each (q: (r, nq, H*G, D)),
    each over its n keys in blocks `rows` (r, nblk); causal: query t sees
    n - nq + 1 + t keys, as `vis` says for the scoring side. Returns the call
    to time and the (r * nq, H*G, D) tensor it writes: the scheduler metadata
    is built once, as vLLM builds it once a step for every layer."""
    r, nq, qh, d = q.shape
    qsl = torch.arange(0, (r + 1) * nq, nq, dtype=torch.int32)
    sl = torch.full((r,), n, dtype=torch.int32)
    md = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=r, num_heads=qh, num_kv_heads=H, head_dim=d, seq_lens=sl, dtype=q.dtype,
        query_start_loc=qsl, causal=causal, sliding_window_size=-1, isa=isa,
        enable_kv_split=False)
    flat = q.reshape(r * nq, qh, d)
    out, table = torch.empty_like(flat), rows.to(torch.int32)
    return (lambda: ops.cpu_attention_with_kv_cache(
        query=flat, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
        seq_lens=sl, scale=d**-0.5, causal=causal, alibi_slopes=None, sliding_window=-1,
        block_table=table, softcap=0.0, scheduler_metadata=md, s_aux=None)), out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16",
                   help="the model's and cache's dtype (f32: what AVX2-only CPUs run natively)")
    p.add_argument("--layout", choices=("auto", "vec"), default="auto",
                   help="vLLM's cache layout and attention: auto is what vLLM picks (`amx` for "
                        "bf16 on AMX CPUs, else `vec`); vec forces its `vec` kernel on an AMX "
                        "CPU, the layout the fused pass reads, to set the pass against AMX "
                        "attention")
    p.add_argument("--md", help="also write the table here")
    args = p.parse_args(argv)
    args.torch_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.set_num_threads(args.threads)

    from vllm import _custom_ops as ops

    from vllm_kvevict import cpu_kernel
    from vllm_kvevict.core.scoring import scores
    from vllm_kvevict.core.layouts.cpu_layout import KVLayout
    from vllm_kvevict.core.eviction.kernel_dispatch import cpu_path

    mod = cpu_kernel.module()
    if mod is None:
        raise SystemExit(cpu_path())
    paths = [i for i in cpu_kernel.ISAS if mod.supports(i)]
    layout_isa = "amx" if torch.cpu._is_amx_tile_supported() and args.layout == "auto" else "vec"
    dtype = args.torch_dtype
    if dtype == torch.float32:  # the bf16 paths take bf16 caches only
        layout_isa, paths = "vec", [i for i in paths if i == "avx2"]
    layout = KVLayout.discover(ops.cpu_attn_reshape_and_cache, layout_isa, dtype, BS, D, H)
    gen = torch.Generator().manual_seed(0)
    nb = 4096
    kv = torch.randn(nb, H, BS, 2 * D, generator=gen).to(dtype)
    kc, _ = layout.split(kv)
    vc = layout.split(kv)[1]
    cols = ["shape", "torch ms", *(f"{i} ms (x torch)" for i in paths), "best GMAC/s",
            "vLLM attention ms", "best scoring / vLLM attention", "fused pass ms",
            "fused / (attention + scoring)", "pass, no rows scored ms", "no rows scored / vLLM attention"]
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for name, r, nq, n, causal in SHAPES:
        nblk = -(-n // BS)
        rows = torch.stack([torch.randperm(nb, generator=gen)[:nblk] for _ in range(r)])
        q = torch.randn(r, nq, H * G, D, generator=gen).to(dtype)
        vis = (torch.arange(n - nq + 1, n + 1).expand(r, nq) if causal
               else torch.full((r, nq), n)).contiguous()
        macs = int(vis.sum()) * H * G * D
        t_torch = median_ms(lambda: scores._column_sums(layout, kc, q, vis, rows, 0.125), args.reps)
        cells, best = [], float("inf")
        for isa in paths:
            t = median_ms(lambda: cpu_kernel.column_sums(layout, kc, q, vis, rows, 0.125, isa),
                          args.reps)
            best = min(best, t)
            cells.append(f"{t:.2f} ({t_torch / t:.1f}x)")
        t_attn = median_ms(vllm_attention(ops, layout_isa, q, kc, vc, rows, n, causal)[0], args.reps)
        fused = "- | - | - | -"
        if causal and cpu_kernel.fuses_attention(layout, dtype):
            flat, out = q.reshape(r * nq, H * G, D), torch.empty(r * nq, H * G, D, dtype=dtype)
            acc = torch.zeros(H, nb * BS)
            starts, seq = torch.arange(0, (r + 1) * nq, nq), torch.full((r,), n)
            t_f = median_ms(lambda: cpu_kernel.attend_add_column_sums(
                out, layout, kc, vc, flat, starts, seq, rows, torch.ones(r, dtype=torch.bool),
                0.125, acc), args.reps)
            t_0 = median_ms(lambda: cpu_kernel.attend_add_column_sums(
                out, layout, kc, vc, flat, starts, seq, rows, torch.zeros(r, dtype=torch.bool),
                0.125, acc), args.reps)
            fused = f"{t_f:.2f} | {t_f / (t_attn + best):.2f} | {t_0:.2f} | {t_0 / t_attn:.2f}"
        lines.append(f"| {name} | {t_torch:.2f} | " + " | ".join(cells) +
                     f" | {macs / best / 1e6:.0f} | {t_attn:.2f} | {best / t_attn:.2f} | {fused} |")
        print(lines[-1], file=sys.stderr, flush=True)
    if cpu_kernel.fuses_attention(layout, dtype):
        lines += decode_table(args, ops, cpu_kernel, layout, layout_isa, kc, vc, nb, gen, paths)
    head = [f"command: `{' '.join([os.path.relpath(sys.executable)] + sys.argv)}`  ",
            f"CPU: {platform.processor() or platform.machine()}, flags `{cpu_kernel.cpu_flags()}`"
            f"; {args.threads} thread(s); vLLM cache layout `{layout_isa}`, {args.dtype}; "
            f"fused pass: {fused_path(cpu_kernel, layout, dtype)}; "
            f"median of {args.reps}", ""]
    text = "\n".join(head + lines)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    return 0


def fused_path(cpu_kernel, layout, dtype) -> str:
    """The fused pass's path on this layout (amx: decode rows on tiles), or "-"."""
    if not cpu_kernel.fuses_attention(layout, dtype):
        return "-"
    return cpu_kernel._pass_path(layout, dtype, os.environ.get("VLLM_KVEVICT_CPU_ISA"))[0]


def decode_table(args, ops, cpu_kernel, layout, layout_isa, kc, vc, nb, gen, paths) -> list[str]:
    """One layer of a decode step, scored: vLLM's attention plus the scoring
    kernel's share of a decode-log flush (FLUSH queries a row at once, / FLUSH)
    against the fused pass, which reads the step's keys and values in place."""
    cols = ["decode step (1 layer)", "vLLM attention ms", "scoring ms / step (flush / 32)",
            "fused pass ms", "fused / vLLM attention", "fused / (attention + scoring)",
            "pass, no rows scored ms", "no rows scored / vLLM attention"]
    lines = ["", "| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for name, r, n in DECODE_SHAPES:
        nblk = -(-n // BS)
        # disjoint blocks, as requests hold in the engine: the scored pass adds
        # each row's sums into its own slots (shared blocks would race)
        rows = torch.randperm(nb, generator=gen)[: r * nblk].view(r, nblk)
        q = torch.randn(r, 1, H * G, D, generator=gen).to(args.torch_dtype)
        qf = torch.randn(r, FLUSH, H * G, D, generator=gen).to(args.torch_dtype)
        vis = torch.full((r, FLUSH), n)
        t_score = min(median_ms(lambda: cpu_kernel.column_sums(layout, kc, qf, vis, rows, 0.125, isa),
                                args.reps) for isa in paths) / FLUSH
        out, acc = torch.empty(r, H * G, D, dtype=args.torch_dtype), torch.zeros(H, nb * BS)
        starts, seq = torch.arange(r + 1), torch.full((r,), n)
        ones, zeros = torch.ones(r, dtype=torch.bool), torch.zeros(r, dtype=torch.bool)
        t_attn, t_f, t_0 = medians_ms([  # in turns: the ratios are what this table is for
            vllm_attention(ops, layout_isa, q, kc, vc, rows, n, True)[0],
            lambda: cpu_kernel.attend_add_column_sums(out, layout, kc, vc, q[:, 0], starts, seq,
                                                      rows, ones, 0.125, acc),
            lambda: cpu_kernel.attend_add_column_sums(out, layout, kc, vc, q[:, 0], starts, seq,
                                                      rows, zeros, 0.125, acc)], args.reps)
        lines.append(f"| {name} | {t_attn:.3f} | {t_score:.3f} | {t_f:.3f} | {t_f / t_attn:.2f}"
                     f" | {t_f / (t_attn + t_score):.2f} | {t_0:.3f} | {t_0 / t_attn:.2f} |")
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


if __name__ == "__main__":
    sys.exit(main())
