"""Cost of one compaction on the CPU path, by phase, for a long request.

A request of `--old` resident tokens compacted to `--new` in every layer of a
SmolLM2-shaped cache (30 layers x 3 KV heads x 64, bf16, block 32, the `vec`
layout the CPU backend writes), the way `WorkerEviction._compact` does it for
h2o: gather the scores, select, `compaction.compact` (gather + write),
`move_scores`. Needs vLLM's C++ ops (the layout is discovered from the stock
writer). One core:

    VLLM_CPU_OMP_THREADS_BIND=0 taskset -c 0 .venv/bin/python benchmarks/compaction_cpu.py
"""
from __future__ import annotations

import argparse
import time

import torch

from vllm_kvevict.compaction import compact, move_scores
from vllm_kvevict.kv_layout import KVLayout, token_slots


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=int, default=4128)
    ap.add_argument("--new", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    layers, nb, h, bs, d = 30, args.old // 32 + 8, 3, 32, 64
    buf = torch.randn(layers * nb, h, bs, 2 * d).to(torch.bfloat16)  # all layers, one buffer
    layout = KVLayout.for_cache(buf[:nb], "vec")
    kc, vc = layout.split(buf)
    n_src, n_dst = -(-args.old // bs), -(-args.new // bs)
    blocks = torch.arange(n_src) + 4
    layer = torch.arange(layers)[:, None]
    src_rows = blocks[None] + layer * nb  # (L, n_src)
    src_slots = token_slots(blocks, args.old, bs)[None] + layer * nb * bs
    dst_slots = token_slots(blocks[:n_dst], args.new, bs)[None] + layer * nb * bs
    all_scores = torch.rand(h, layers * nb * bs)
    print(f"{layers} layers x {h} heads x {d}, bf16: {args.old} -> {args.new} tokens")
    print("| select ms | compact (gather + write) ms | move scores ms | total ms |")
    print("|---:|---:|---:|---:|")
    for _ in range(args.reps):
        t0 = time.perf_counter()
        scores = all_scores[:, src_slots].transpose(0, 1)  # (L, H, old)
        keep = scores.topk(args.new, dim=-1).indices.sort(dim=-1).values
        t1 = time.perf_counter()
        compact(layout, kc, vc, src_rows, src_rows[:, :n_dst], keep)
        t2 = time.perf_counter()
        move_scores(all_scores, src_slots, dst_slots, keep, old=scores)
        t3 = time.perf_counter()
        ms = [(b - a) * 1e3 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t0, t3))]
        print("| " + " | ".join(f"{x:.1f}" for x in ms) + " |")


if __name__ == "__main__":
    main()
