"""Window scores of one compaction on the CPU path: torch float32 against the
compiled kernel, per instruction path, for AnDPro (`window_projection_sums`)
and, beside it, SnapKV (`window_column_sums`).

The demo's shape: all 30 layers of a SmolLM2-135M request in one call (B = 30),
3 KV heads, GQA 3, head size 64, the papers' window w = 32, bf16 (the float32
torch path widens them itself), n resident tokens. One core:

    taskset -c 1 .venv/bin/python benchmarks/window_scores_cpu.py [--n 272 1040] [--reps 20]

Each cell: the median of --reps calls after one warm-up, ms (x torch: torch's
ms / the kernel's), torch and each path taking turns in every repetition;
paths the CPU lacks are left out. AnDPro's avx512bf16 column is the default,
model-dtype precision (E and Y rounded to bf16), "avx512bf16 split" its
float32-accurate variant (VLLM_KVEVICT_SCORE_PRECISION=float32); amx always
splits. torch.set_num_threads(1).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

B, H, G, D, W = 30, 3, 3, 64, 32


def median_ms(fns: dict, reps: int) -> dict:
    """Median ms per call of each function, the functions taking turns in every
    repetition (a busy machine slows them alike)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {name: statistics.median(t) for name, t in times.items()}


def torch_scores(kind: str, raw_scores_torch):
    """The float32 torch path of `kind` (window_scores.raw_scores_torch)."""
    return lambda q, k, v, s: raw_scores_torch(q, k, v, s, projection=kind == "andpro")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[272, 1040])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from vllm_kvevict import cpu_kernel
    from vllm_kvevict.core.eviction.kernel_dispatch import cpu_path
    from vllm_kvevict.core.scoring.window_scores import raw_scores_torch

    mod = cpu_kernel.module()
    if mod is None:
        raise SystemExit(cpu_path())
    # (column, isa, split): each path as it runs by default (split False: on
    # avx512bf16 AnDPro's E and Y rounded to bf16; amx splits regardless), and
    # avx512bf16's float32-accurate split beside it.
    paths = []
    for i in cpu_kernel.ISAS:
        if mod.supports(i):
            paths.append((i, i, False))
            if i == "avx512bf16":
                paths.append(("avx512bf16 split", i, True))
    kernels = {"andpro": lambda q, k, v, s, i, split: cpu_kernel.window_projection_sums(
                   q, k, v, s, i, split=split),
               "snapkv": lambda q, k, v, s, i, split: cpu_kernel.window_column_sums(q, k, s, i)}
    cols = ["scores", "n", "torch fp32 ms", *(f"{c} ms (x torch)" for c, _, _ in paths)]
    lines = ["| " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * (len(cols) - 2)]
    gen = torch.Generator().manual_seed(0)
    for n in args.n:
        q = torch.randn(B, W, H * G, D, generator=gen).bfloat16()
        k = torch.randn(B, H, n, D, generator=gen).bfloat16()
        v = torch.randn(B, H, n, D, generator=gen).bfloat16()
        for kind in ("andpro", "snapkv"):
            ref = torch_scores(kind, raw_scores_torch)
            fns = {"torch": lambda: ref(q, k, v, D ** -0.5)}
            for col, isa, split in paths:
                if kind == "andpro" or col == isa:  # snapkv has no split
                    fns[col] = lambda isa=isa, split=split: kernels[kind](q, k, v, D ** -0.5, isa, split)
            ms = median_ms(fns, args.reps)
            cells = [f"{ms[c]:.2f} ({ms['torch'] / ms[c]:.1f}x)" if c in ms else "" for c, _, _ in paths]
            lines.append(f"| {kind} | {n} | {ms['torch']:.2f} | " + " | ".join(cells) + " |")
            print(lines[-1], file=sys.stderr, flush=True)
    head = [f"command: `{' '.join(['taskset -c ' + ','.join(map(str, sorted(os.sched_getaffinity(0)))), os.path.relpath(sys.executable)] + sys.argv)}`  ",
            f"CPU: {platform.processor() or platform.machine()}, flags `{cpu_kernel.cpu_flags()}`; "
            f"1 thread; B={B} layers, H={H}, G={G}, D={D}, w={W}, bf16; median of {args.reps}", ""]
    print("\n".join(head + lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
