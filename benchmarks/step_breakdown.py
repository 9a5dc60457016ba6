"""Where the plugin's time goes in the README's main job (the demo's batch),
or in the memory-short throughput benchmark.

    VLLM_CPU_OMP_THREADS_BIND=0 taskset -c 0 python benchmarks/step_breakdown.py \\
        [--policies none h2o snapkv andpro streaming] [--repeats 1] [--json out.json]
    python benchmarks/step_breakdown.py --by-function --policies h2o snapkv andpro
    python benchmarks/step_breakdown.py --workload short   # ~1 min per policy, both cores
    python benchmarks/step_breakdown.py --workload steady --dtype float32 --by-function
    python benchmarks/step_breakdown.py --workload steady --steady-steps 1600 --by-function

`--workload demo` (default) runs `vllm_kvevict.demo`'s offline batch (16
chat requests x 256 greedy tokens, budget 160, block 32, bf16, memory ample);
`--workload short` runs `benchmarks/throughput.py`'s memory-short
configuration (64 x (256 + 512) tokens, an 8K-token pool, budget 160, recent
64); `--workload steady` the same pool with its steady-state arrivals (one
every 2 steps, seeded 256-768 output tokens; 4-5 min a policy on 2 cores).
`--dtype` sets the model's dtype for short/steady (default bfloat16). Each policy runs once per round, in a fresh process, with `benchmarks/common.py`'s timers around the plugin's
per-step functions (exclusive time, nested calls subtracted), and prints per
policy: output tok/s, the batch's wall time, and the seconds spent in

  scoring      score_step (per layer: log this step's queries, zero new
               slots, score what cannot wait), the decode-log and chunk-log
               flushes (H2O), the window scores of a compaction (SnapKV/AnDPro)
  compaction   WorkerEviction._compact (selection + moving KV and scores)
  bookkeeping  begin_step / place_queries / physical_metadata /
               remove_skipped_blocks

"none" is the plugin loaded with eviction off (the demo's first row). The
difference between a policy's wall time and none's that the three columns do
not explain is the "other" column (the physical view, metrics, noise).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

from common import CATEGORIES, PER_STEP

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def memory_short_config(policy: str, workload: str = "short", dtype: str = "bfloat16",
                        steady_steps: int | None = None) -> dict:
    """throughput.run_config's memory-short configuration under `policy`:
    lockstep ("short") or steady arrivals ("steady"), with steady_steps the
    open workload (arrivals until that step, every request stopped there)."""
    import math

    from vllm_kvevict.models import ensure_smollm2

    cfg = dict(model=ensure_smollm2(), block_size=32, max_model_len=1024,
               dtype=dtype, recent=64, prompt_len=256, warmup=True,
               no_prefix_caching=False, table="constrained", policy=policy,
               budget=None if policy == "none" else 160, num_requests=64,
               output_len=512, pool_tokens=8192, repeats=1)
    if workload == "steady":
        cfg.update(workload="steady", arrival_gap=2)
        if steady_steps:  # as throughput.py --steady-steps: never a dry queue before it
            cfg.update(steady_steps=steady_steps,
                       num_requests=math.ceil(steady_steps / cfg["arrival_gap"]))
    return cfg


def one(policy: str, workload: str = "demo", by_function: bool = False,
        dtype: str = "bfloat16", steady_steps: int | None = None) -> dict:
    """The workload under `policy` with timers, in this (fresh) process;
    by_function: one category per timed function (its name), not three."""
    from common import install_timers

    from vllm_kvevict.models import ensure_smollm2

    timers = install_timers([(m, o, n, n if by_function else c) for m, o, n, c in PER_STEP])
    start = time.perf_counter()
    if workload in ("short", "steady"):
        import throughput

        result = throughput.run_config(memory_short_config(policy, workload, dtype, steady_steps))
        tok_s, wall_s = result["out_tok_s"], result["wall_s"]
    else:
        from vllm_kvevict.demo import run

        from vllm_kvevict.demo import parse_args

        args = parse_args([])  # the demo's defaults (budget 160, block 32, 16 x 256)
        tok_s = run(ensure_smollm2(), policy, args)["tok_s"]
        wall_s = args.requests * args.max_tokens / tok_s
    return {"policy": policy, "workload": workload, "tok_s": tok_s, "wall_s": wall_s,
            "seconds": dict(timers.seconds), "calls": dict(timers.calls),
            "process_s": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", nargs="+", default=["none", "h2o", "snapkv", "andpro",
                                                     "streaming"])
    p.add_argument("--repeats", type=int, default=1, help="rounds over the policies")
    p.add_argument("--workload", choices=("demo", "short", "steady"), default="demo",
                   help="the demo's batch (memory ample) or throughput.py's memory-short run "
                        "(lockstep or steady state)")
    p.add_argument("--dtype", default="bfloat16", help="model dtype of short/steady")
    p.add_argument("--steady-steps", type=int, default=None,
                   help="steady: keep arrivals coming until this step and stop there "
                        "(throughput.py --steady-steps); default: drain 64 requests")
    p.add_argument("--by-function", action="store_true",
                   help="also print each timed function's exclusive ms / calls")
    p.add_argument("--json")
    args = p.parse_args()
    from prefix_cache import in_fresh_process

    rows = [in_fresh_process(one, policy, args.workload, args.by_function, args.dtype,
                             args.steady_steps)
            for _ in range(args.repeats) for policy in args.policies]
    if args.by_function:
        for r in rows:
            print(r["policy"], f"{r['wall_s']:.2f} s:", ", ".join(
                f"{k} {v * 1e3:.0f} ms / {r['calls'][k]}" for k, v in r["seconds"].items()))
        category = {n: c for _, _, n, c in PER_STEP}  # back to the three for the table
        for r in rows:
            r["by_function"], folded = r["seconds"], defaultdict(float)
            for name, sec in r["by_function"].items():
                folded[category[name]] += sec
            r["seconds"] = dict(folded)
    none_wall = min((r["wall_s"] for r in rows if r["policy"] == "none"), default=None)
    print("| policy | out tok/s | wall s | vs none | scoring s | compaction s | "
          "bookkeeping s | other s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        sec = [r["seconds"].get(c, 0.0) for c in CATEGORIES]
        extra = "-" if none_wall is None else f"{r['wall_s'] - none_wall - sum(sec):+.2f}"
        rel = "-" if none_wall is None else f"{none_wall / r['wall_s']:.2f}x"
        print(f"| {r['policy']} | {r['tok_s']:.1f} | {r['wall_s']:.2f} | {rel} | "
              + " | ".join(f"{x:.2f}" for x in sec) + f" | {extra} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
