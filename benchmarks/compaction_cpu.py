"""Cost of one compaction on the CPU path (filling holes: O(evicted) tokens move).

A request of `--old` resident tokens compacted to `--new` in every layer of a
SmolLM2-shaped cache (30 layers x 3 KV heads x 64, bf16, block 32, the `vec`
or `amx` layout the CPU backend writes), H2O-style (the top `--new` scores per
head), by `compaction.fill_holes` (the worker's path): only the kept tokens past
`--new` move, into the evicted slots below it, through the compiled kernel
where it is built (`VLLM_KVEVICT_KERNELS=torch`: the torch fallback).

Printed: tokens moved per compaction (per layer and head, summed), the bytes
that move (K and V read and written, plus the scores), ms, and achieved GB/s;
beside them a plain copy of the same number of bytes on the same core
(`Tensor.copy_`), the bandwidth ceiling the issue compares with. Needs vLLM's
C++ ops (the layout is discovered from the stock writer). One core:

    VLLM_CPU_OMP_THREADS_BIND=0 taskset -c 0 .venv/bin/python benchmarks/compaction_cpu.py

`--profile` prints torch.profiler's aten ops of `--reps` fill_holes calls
instead (by self CPU time; docs/results.md quotes it).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_kvevict.core.eviction.compaction import fill_holes
from vllm_kvevict.core.layouts.cpu_layout import token_slots
from vllm_kvevict.integration.cpu_backend import layout_for_cache

LAYERS, HEADS, D, BS = 30, 3, 64, 32


def _best_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _copy_gbs(nbytes: int, reps: int) -> float:
    """GB/s of Tensor.copy_ moving `nbytes` (read + write counted, as below)."""
    src = torch.randn(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    ms = _best_ms(lambda: dst.copy_(src), reps)
    return 2 * src.numel() * 4 / ms / 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=int, default=4128)
    ap.add_argument("--new", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layout", default="vec", help="the CPU backend's isa: vec | amx")
    ap.add_argument("--shared", type=int, default=0,
                    help="first blocks shared (prefix hit): copied whole before holes fill")
    ap.add_argument("--profile", action="store_true", help="torch.profiler over fill_holes")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    nb = 2 * (args.old // BS) + 8
    buf = torch.randn(LAYERS * nb, HEADS, BS, 2 * D).to(torch.bfloat16)  # all layers, one buffer
    layout = layout_for_cache(buf[:nb], args.layout)
    kc, vc = layout.split(buf)
    n_src, n_dst = -(-args.old // BS), -(-args.new // BS)
    blocks = torch.arange(n_src) + 4
    layer = torch.arange(LAYERS)[:, None]
    src_rows = blocks[None] + layer * nb  # (L, n_src)
    dst_rows = src_rows[:, :n_dst].clone()
    dst_rows[:, : args.shared] += n_src  # private copies of the shared blocks
    src_slots = token_slots(blocks, args.old, BS)[None] + layer * nb * BS
    all_scores = torch.rand(HEADS, LAYERS * nb * BS)
    scores = all_scores[:, src_slots].transpose(0, 1)  # (L, H, old)
    keep = scores.topk(args.new, dim=-1).indices  # any order: fill_holes takes it so
    per_token = 2 * D * 2 + 4  # K and V in bf16, one float32 score

    def holes():
        fill_holes(layout, kc, vc, src_rows, dst_rows, keep, args.old, all_scores)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        holes()  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.reps):
                holes()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
        return
    rows = []
    for name, fn, moved in (("fill_holes", holes, int((keep >= args.new).sum())),):
        nbytes = 2 * moved * per_token  # read + write of what moves
        ms = _best_ms(fn, args.reps)
        rows.append((name, moved, nbytes, ms, nbytes / ms / 1e6, _copy_gbs(nbytes, args.reps)))
    print(f"{LAYERS} layers x {HEADS} heads x {D}, bf16, block {BS}: "
          f"{args.old} -> {args.new} tokens, median of {args.reps}, one thread")
    print("| path | tokens moved | MB moved | ms | GB/s | copy of the same bytes GB/s | share |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, moved, nbytes, ms, gbs, copy in rows:
        print(f"| {name} | {moved:,} | {nbytes / 1e6:.2f} | {ms:.2f} | {gbs:.2f} | "
              f"{copy:.1f} | {gbs / copy:.0%} |")


if __name__ == "__main__":
    main()
