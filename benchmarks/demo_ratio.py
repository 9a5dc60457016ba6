"""The main job's throughput, each policy against stock vLLM, as a ratio that
one lucky or unlucky run cannot make.

Every run is a fresh process running `vllm_kvevict.demo.run` (the README's
main job: 16 chat requests x 256 tokens, budget 160, block 32, bf16). Each of
--rounds rounds runs every policy once, in an order rotated by one per round,
so no policy is always first or always after the same neighbour. The table
gives each policy's median output tok/s over the rounds and the median of its
per-round ratios to stock.

    python benchmarks/demo_ratio.py [--rounds 3] [--policies none h2o ...] [--md OUT.md]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CHILD = ("import json, sys; from vllm_kvevict.demo import run, parse_args; "
         "a = parse_args([]); r = run(a.model, sys.argv[1], a); "
         "print('@@RESULT@@' + json.dumps({k: r[k] for k in ('tok_s', 'tok_cpu_s', 'peak_blocks')}))")


def one(policy: str) -> dict:
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    out = subprocess.run([sys.executable, "-c", CHILD, policy], capture_output=True, text=True,
                         env=env, timeout=1200)
    line = next((x for x in out.stdout.splitlines() if x.startswith("@@RESULT@@")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"{policy} failed: {out.stderr[-2000:]}")
    return json.loads(line[len("@@RESULT@@"):])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=["none", "h2o", "snapkv", "andpro", "streaming"])
    p.add_argument("--md", help="also write the table here")
    args = p.parse_args(argv)
    from vllm_kvevict import cpu_kernel
    from vllm_kvevict.core.eviction.kernel_dispatch import cpu_path

    runs: dict[str, list[float]] = {k: [] for k in args.policies}
    cpu: dict[str, list[float]] = {k: [] for k in args.policies}
    t0 = time.time()
    for r in range(args.rounds):
        k = r % len(args.policies)
        for policy in args.policies[k:] + args.policies[:k]:
            res = one(policy)
            runs[policy].append(res["tok_s"])
            cpu[policy].append(res["tok_cpu_s"])
            print(f"round {r + 1}: {policy:9s} {res['tok_s']:.1f} tok/s, "
                  f"{res['tok_cpu_s']:.1f} tok/CPU-s", file=sys.stderr, flush=True)
    stock = runs.get("none")
    lines = [f"command: `{' '.join([os.path.relpath(sys.executable)] + sys.argv)}`  ",
             f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, flags "
             f"`{cpu_kernel.cpu_flags()}`; scoring path: {cpu_path()}; {args.rounds} rounds, "
             f"{time.time() - t0:.0f} s",
             "", "| policy | median out tok/s | runs | median ratio to stock (per round) "
             "| median tok per CPU-s | ratio to stock |", "|---|---:|---|---:|---:|---:|"]
    for policy, vals in runs.items():
        ratio = cpu_ratio = ""
        if stock is not None and policy != "none":
            ratio = f"{statistics.median(v / s for v, s in zip(vals, stock)):.2f}x"
            cpu_ratio = f"{statistics.median(v / s for v, s in zip(cpu[policy], cpu['none'])):.2f}x"
        lines.append(f"| {policy} | {statistics.median(vals):.1f} | "
                     f"{', '.join(f'{v:.1f}' for v in vals)} | {ratio} | "
                     f"{statistics.median(cpu[policy]):.1f} | {cpu_ratio} |")
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
