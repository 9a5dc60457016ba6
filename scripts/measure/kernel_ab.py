"""The CPU scoring kernel of earlier commits against this checkout's, in one
process, the builds taking turns in every repetition and in reversed order
every other one (this VM's speed changes within seconds, so builds timed one
after another in fresh processes do not compare), one thread (or --threads N):

    taskset -c 0 .venv/bin/python scripts/measure/kernel_ab.py REV [REV ...] [--isa avx2]

Each REV's kernel sources (`git show REV:vllm_kvevict/cpu_kernel/...`) are built
with torch's extension tooling under the module name `kv_ab_<rev>` (an extension
is found by its module name, so two builds of one name cannot live in one
process), in ~/.cache/vllm_kvevict/kernel_ab/<rev>; the checkout's own build is
the last column. The cases, each through the public entry points:

- flush: one H2O decode-log flush of the demo's shape (flush_timing.py);
- chunk N: one N-token first prefill chunk in all 30 layers (chunk_timing.py);
- andpro n / snapkv n: the window scores of one compaction, 30 layers (B = 30),
  3 KV heads, GQA 3, D 64, w 32, bf16 (benchmarks/window_scores_cpu.py's shape);
- with --fused, the fused attention + H2O pass (`attend_add_column_sums`), one
  layer, on vLLM's vec cache in float32 and bf16: a 2,048-token causal chunk
  and a decode step of 16 rows at 2,000 keys (benchmarks/cpu_kernel.py's shapes),
  and of 50 rows at 160 keys (the steady state's step at capacity, bf16).

Prints a markdown table of median ms, and whether every build's output equals
the first's bit for bit (or its largest relative difference).
"""

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import torch
from chunk_timing import chunk_case
from flush_timing import BS, D, GROUP, KV_HEADS, flush_case

from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.scoring import scores as scoring

REPO = Path(__file__).resolve().parents[2]
KERNEL_DIR = "vllm_kvevict/cpu_kernel"


def build_rev(rev: str):
    """The kernel module of commit `rev`, built once and cached."""
    sha = subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "--short", rev], text=True).strip()
    name = f"kv_ab_{sha}"
    d = Path.home() / ".cache" / "vllm_kvevict" / "kernel_ab" / sha
    so = d / f"{name}.so"
    if not so.exists():
        d.mkdir(parents=True, exist_ok=True)
        files = subprocess.check_output(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:{KERNEL_DIR}"],
                                        text=True).split()
        for f in files:
            if f.endswith((".cpp", ".h")):
                (d / f).write_bytes(subprocess.check_output(["git", "-C", str(REPO), "show", f"{rev}:{KERNEL_DIR}/{f}"]))
        cpu_kernel.compile_source(d / cpu_kernel.SOURCE.name, d, name)
    return sha, cpu_kernel.load_extension(so, name)


def score_case(args):
    """A fresh score buffer per call, so every build adds into zeros."""
    out, *rest = args
    def run():
        s = torch.zeros_like(out)
        scoring.score_queries(s, *rest)
        return s
    return run


def window_case(kind: str, n: int, isa: str):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(shape, generator=g).bfloat16()
               for shape in ((30, 32, 9, 64), (30, 3, n, 64), (30, 3, n, 64)))
    if kind == "andpro":
        return lambda: cpu_kernel.window_projection_sums(q, k, v, 0.125, isa)
    return lambda: cpu_kernel.window_column_sums(q, k, 0.125, isa)


def fused_case(dtype: torch.dtype, r: int, nq: int, n: int):
    """One layer of the fused pass: r rows of nq causal queries (nq = 1: a
    decode step) over n keys, flush_timing's (SmolLM2's) heads and block."""
    from vllm import _custom_ops as ops

    from vllm_kvevict.core.layouts.cpu_layout import KVLayout

    h, g, d, bs, nb = KV_HEADS, GROUP, D, BS, 1024
    layout = KVLayout.discover(ops.cpu_attn_reshape_and_cache, "vec", dtype, bs, d, h)
    gen = torch.Generator().manual_seed(n)
    kc, vc = layout.split(torch.randn(nb, h, bs, 2 * d, generator=gen).to(dtype))
    # rows hold disjoint blocks, as requests do in the engine (the pass adds
    # each row's sums into its own slots; shared blocks would race)
    rows = torch.randperm(nb, generator=gen)[: r * -(-n // bs)].view(r, -1)
    q = torch.randn(r * nq, h * g, d, generator=gen).to(dtype)
    starts, seq, scored = torch.arange(0, (r + 1) * nq, nq), torch.full((r,), n), torch.ones(r, dtype=torch.bool)

    def run():
        out, acc = torch.empty_like(q), torch.zeros(h, nb * bs)
        cpu_kernel.attend_add_column_sums(out, layout, kc, vc, q, starts, seq, rows, scored, 0.125, acc)
        return torch.cat([out.float().flatten(), acc.flatten()])
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("revs", nargs="+")
    p.add_argument("--isa", default=None, help="kernel path (default: this CPU's, as cpu_kernel.isa())")
    p.add_argument("--chunk", type=int, nargs="*", default=[1024])
    p.add_argument("--n", type=int, nargs="*", default=[272, 1040])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--fused", action="store_true", help="also time the fused attention + H2O pass")
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (the kernel's)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    isa = args.isa or cpu_kernel.isa()
    builds = [build_rev(r) for r in args.revs]
    builds.append(("checkout", cpu_kernel.build()))

    cases = [("flush", score_case(flush_case()), args.reps)]
    cases += [(f"chunk {n}", score_case(chunk_case(n)), max(2, args.reps // 4)) for n in args.chunk]
    cases += [(f"{kind} {n}", window_case(kind, n, isa), args.reps) for n in args.n for kind in ("andpro", "snapkv")]
    if args.fused:
        for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            cases += [(f"fused 1 x 2048 causal {tag}", fused_case(dtype, 1, 2048, 2048), max(2, args.reps // 4)),
                      (f"fused decode 16 x 2000 {tag}", fused_case(dtype, 16, 1, 2000), args.reps)]
        cases.append(("fused decode 50 x 160 bf16", fused_case(torch.bfloat16, 50, 1, 160), 4 * args.reps))

    print(f"isa {isa}; median ms of each build, the builds taking turns; {args.threads} thread(s)\n")
    print("| case | " + " | ".join(label for label, _ in builds) + " | outputs |")
    print("|---|" + "---:|" * len(builds) + "---|")
    for name, fn, reps in cases:
        times = [[] for _ in builds]
        outs = []
        for rep in range(reps + 1):  # the first round warms up
            order = list(enumerate(builds))
            for i, (_, mod) in order[::-1] if rep % 2 else order:  # who goes first alternates
                cpu_kernel.module = lambda mod=mod: mod  # what the entry points call
                t0 = time.perf_counter()
                out = fn()
                if rep:
                    times[i].append(1e3 * (time.perf_counter() - t0))
                else:
                    outs.append((i, out))
        outs = [o for _, o in sorted(outs, key=lambda x: x[0])]
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        diff = "equal bit for bit" if same else "max rel. diff %.1e" % max(
            float(((o - outs[0]).abs() / outs[0].abs().clamp(min=1e-6)).max()) for o in outs[1:])
        cells = (f"{m:.1f}" if m >= 1 else f"{m:.3f}" for m in map(statistics.median, times))
        print(f"| {name} | " + " | ".join(cells) + f" | {diff} |")


if __name__ == "__main__":
    main()
