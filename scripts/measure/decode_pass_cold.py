"""The fused decode pass as the engine meets it: keys and values cold. The
memory-short steady state's step at capacity (50 rows x 130-160 keys,
SmolLM2's 3 KV heads x 3 queries x 64 dims, blocks of 32, bf16), over 30
layers of their own 256-block pool (189 MB in all, six times this L3), each
layer after a 7 MB weight GEMM as the model's linear layers run between
attention calls. A layer's blocks were last read 29 layers ago, as in the
engine (scripts/measure/pass_cold_hot.py times the same in the engine).

    OMP_WAIT_POLICY=passive PYTHONPATH=. .venv/bin/python scripts/measure/decode_pass_cold.py [REV ...] [--hot]

Each REV's kernel (built by kernel_ab.build_rev) and the checkout's take turns
per sweep of the 30 layers, the order reversed every other sweep; --hot times
a second call of each layer right after the first instead (the data in
cache). `VLLM_KVEVICT_CPU_ISA=avx2` times the AVX2 path. Prints the median
us per layer call and whether each build's output equals the first's, and
beside them a floor: `torch.index_select` copying the same blocks (all the
bytes the pass reads, 6 MB a layer) out of the pool, timed the same way.
"""

import argparse
import os
import statistics
import time

import torch
from kernel_ab import build_rev
from vllm import _custom_ops as ops

from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.layouts.cpu_layout import KVLayout

LAYERS, BLOCKS, KV_HEADS, GROUP, D, BS, ROWS, BLOCKS_PER_ROW = 30, 256, 3, 3, 64, 32, 50, 5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("revs", nargs="*")
    p.add_argument("--hot", action="store_true", help="time a second call of each layer instead")
    p.add_argument("--sweeps", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    builds = [build_rev(r) for r in args.revs] + [("checkout", cpu_kernel.build())]

    layout = KVLayout.discover(ops.cpu_attn_reshape_and_cache, "vec", torch.bfloat16, BS, D, KV_HEADS)
    gen = torch.Generator().manual_seed(0)
    pools = [torch.randn(BLOCKS, KV_HEADS, BS, 2 * D, generator=gen).bfloat16() for _ in range(LAYERS)]
    caches = [layout.split(pool) for pool in pools]
    # rows hold disjoint blocks, anywhere in the pool, as requests do after a while
    tables = [torch.randperm(BLOCKS, generator=gen)[: ROWS * BLOCKS_PER_ROW].view(ROWS, -1).contiguous()
              for _ in range(LAYERS)]
    seq = torch.randint(BS * (BLOCKS_PER_ROW - 1) + 2, BS * BLOCKS_PER_ROW + 1, (ROWS,), generator=gen)
    starts, unscored = torch.arange(ROWS + 1), torch.zeros(ROWS, dtype=torch.bool)
    q = torch.randn(ROWS, KV_HEADS * GROUP, D, generator=gen).bfloat16()
    weights = [torch.randn(3 * 1536, 576, generator=gen).bfloat16() for _ in range(LAYERS)]
    x = torch.randn(ROWS, 576).bfloat16()
    no_scores = torch.zeros(KV_HEADS, 0)

    gathered = torch.empty(ROWS * BLOCKS_PER_ROW, *pools[0].shape[1:], dtype=torch.bfloat16)
    floor = "index_select (floor)"
    times = {name: [] for name, _ in builds} | {floor: []}
    first_out = {}
    for sweep in range(args.sweeps + 1):  # sweep 0 warms up
        for name, mod in (builds if sweep % 2 else builds[::-1]) + [(floor, None)]:
            cpu_kernel.module = lambda mod=mod: mod  # what the entry point calls
            total = 0.0
            for layer in range(LAYERS):
                torch.nn.functional.linear(x, weights[layer])
                kc, vc = caches[layer]
                out = torch.empty_like(q)
                for call in range(2 if args.hot else 1):
                    t0 = time.perf_counter()
                    if mod is None:
                        torch.index_select(pools[layer], 0, tables[layer].flatten(), out=gathered)
                    else:
                        cpu_kernel.attend_add_column_sums(out, layout, kc, vc, q, starts, seq, tables[layer],
                                                          unscored, 0.125, no_scores)
                    elapsed = time.perf_counter() - t0
                total += elapsed
                if sweep == 0 and layer == 0 and mod is not None:
                    first_out[name] = out.clone()
            if sweep:
                times[name].append(total / LAYERS * 1e6)

    ref = first_out[builds[0][0]]
    isa = os.environ.get("VLLM_KVEVICT_CPU_ISA") or cpu_kernel.isa()
    print(f"isa {isa}; {'hot (second call)' if args.hot else 'cold'}; {args.threads} thread(s); median us per layer call\n")
    print("| build | us/call | min | output |")
    print("|---|---:|---:|---|")
    for name, ts in times.items():
        same = "-" if name == floor else "equal to the first" if torch.equal(first_out[name], ref) else "DIFFERS"
        print(f"| {name} | {statistics.median(ts):.0f} | {min(ts):.0f} | {same} |")


if __name__ == "__main__":
    main()
