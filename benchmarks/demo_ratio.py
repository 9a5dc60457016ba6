"""The main job's throughput, each policy against stock vLLM, as a ratio that
one lucky or unlucky run cannot make.

Every run is a fresh process running `vllm_kvevict.demo.run` (the README's
main job: 16 chat requests x 256 tokens, budget 160, block 32, in --dtype: by
default the demo's, bf16 where the CPU has avx512_bf16, else float32). Each of
--rounds rounds runs every policy once. By default the policies of a round
run together, one process each, their engine steps in turn
(benchmarks/interleave.py), and each is timed by its own steps: on this
project's VMs the machine's speed flips by 1.7x within seconds, and runs
minutes apart do not compare. --sequential runs them one after another
instead, in an order rotated by one per round, so no policy is always first
or always after the same neighbour. The table gives each policy's median
output tok/s over the rounds and the median of its per-round ratios to stock.

Interleaved, each turn starts --settle-ms after the last one ended, so the
last engine's spinning OpenMP threads (libgomp's default wait) are asleep
before the next engine steps, as they would be for a lone engine
(benchmarks/interleave.py). --settle-ms 0 shows what they cost: on the
2-core EPYC, the window policies 5-7 points more than stock.

A policy named with the suffix "@unfused" (e.g. `streaming@unfused`) runs
that policy with the plugin's CPU attention pass off
(VLLM_KVEVICT_CPU_FUSED=off: vLLM's attention in every step), for the pass's
worth in the same run.

    python benchmarks/demo_ratio.py [--rounds 3] [--policies none h2o ...] [--sequential]
                                    [--settle-ms 20] [--md OUT.md]
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

from common import RESULT_MARKER
from interleave import SETTLE_S, StepClock, run_interleaved

from vllm_kvevict.models import DTYPES, resolve_dtype

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = ("import json, sys; sys.path.insert(0, sys.argv[3]); "
         "from vllm_kvevict.demo import run, parse_args; from interleave import StepClock; "
         "a = parse_args(['--dtype', sys.argv[5]]); gated = sys.argv[2] == 'gated'; clk = []; "
         "r = run(a.model, sys.argv[1], a, "
         "(lambda e: clk.append(StepClock(e, True)) or clk[-1]) if gated else None); "
         "w = [t for t, x in zip(clk[0].times, clk[0].warm) if x] if clk else []; "
         "print(sys.argv[4] + json.dumps({**{k: r[k] for k in ('tok_s', 'tok_cpu_s', 'peak_blocks')}, "
         "'warm_s': sum(w), 'warm_steps': len(w)}), flush=True)")


UNFUSED = "@unfused"  # a policy's suffix: the same policy with the CPU attention pass off


def _argv(policy: str, gated: bool, dtype: str) -> list[str]:
    return [sys.executable, "-c", CHILD, policy.removesuffix(UNFUSED), "gated" if gated else "free",
            HERE, RESULT_MARKER, dtype]


def _env(policy: str) -> dict[str, str]:
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    if policy.endswith(UNFUSED):
        env["VLLM_KVEVICT_CPU_FUSED"] = "off"
    return env


def one(policy: str, dtype: str) -> dict:
    out = subprocess.run(_argv(policy, False, dtype), capture_output=True, text=True,
                         env=_env(policy), timeout=1200)
    line = next((x for x in out.stdout.splitlines() if x.startswith(RESULT_MARKER)), None)
    if out.returncode or line is None:
        raise RuntimeError(f"{policy} failed: {out.stderr[-2000:]}")
    return json.loads(line[len(RESULT_MARKER):])


def together(policies: list[str], settle_s: float, dtype: str) -> dict[str, dict]:
    """One round: every policy in its own process, their engine steps in turn."""
    done = run_interleaved([(_argv(p, True, dtype), _env(p)) for p in policies], settle_s=settle_s)
    for p, (res, rc, tail) in zip(policies, done):
        if rc or res is None:
            raise RuntimeError(f"{p} failed (exit {rc}): {tail[-2000:]}")
    return {p: res for p, (res, _, _) in zip(policies, done)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=["none", "h2o", "snapkv", "andpro", "streaming"])
    p.add_argument("--sequential", action="store_true",
                   help="one policy after another (rotated per round), not interleaved")
    p.add_argument("--settle-ms", type=float, default=SETTLE_S * 1e3,
                   help="interleaved: pause before each engine's turn (ms), so the last "
                        "engine's OpenMP threads stop spinning first")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the model's (auto: the demo's, bf16 with avx512_bf16, else float32)")
    p.add_argument("--md", help="also write the table here")
    args = p.parse_args(argv)
    dtype = resolve_dtype(args.dtype)
    from vllm_kvevict import cpu_kernel
    from vllm_kvevict.core.eviction.kernel_dispatch import cpu_path

    runs: dict[str, list[float]] = {k: [] for k in args.policies}
    cpu: dict[str, list[float]] = {k: [] for k in args.policies}
    warm: dict[str, list[float]] = {k: [] for k in args.policies}  # ratio to stock, per round
    t0 = time.time()
    for r in range(args.rounds):
        k = r % len(args.policies)
        order = args.policies[k:] + args.policies[:k]
        results = ({p: one(p, dtype) for p in order} if args.sequential
                   else together(order, args.settle_ms / 1e3, dtype))
        base = results.get("none")
        for policy, res in results.items():
            runs[policy].append(res["tok_s"])
            cpu[policy].append(res["tok_cpu_s"])
            # The same batch (ignore_eos) steps alike in every engine: step k is
            # warm in all of them or none, and the warm steps' times compare.
            if base and res.get("warm_steps") and res["warm_steps"] == base["warm_steps"]:
                warm[policy].append(base["warm_s"] / res["warm_s"])
            print(f"round {r + 1}: {policy:9s} {res['tok_s']:.1f} tok/s, "
                  f"{res['tok_cpu_s']:.1f} tok/CPU-s", file=sys.stderr, flush=True)
    stock = runs.get("none")
    lines = [f"command: `{' '.join([os.path.relpath(sys.executable)] + sys.argv)}`  ",
             f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, flags "
             f"`{cpu_kernel.cpu_flags()}`; scoring path: {cpu_path()}; {dtype}; {args.rounds} rounds, "
             f"{'sequential' if args.sequential else 'interleaved (each timed by its own steps)'}, "
             f"{time.time() - t0:.0f} s",
             "", "| policy | median out tok/s | runs | median ratio to stock (per round) "
             "| warm steps: median ratio (per round) | median tok per CPU-s | ratio to stock |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for policy, vals in runs.items():
        ratio = warm_ratio = cpu_ratio = ""
        if stock is not None and policy != "none":
            ratio = f"{statistics.median(v / s for v, s in zip(vals, stock)):.2f}x"
            cpu_ratio = f"{statistics.median(v / s for v, s in zip(cpu[policy], cpu['none'])):.2f}x"
            if warm[policy]:
                warm_ratio = f"{statistics.median(warm[policy]):.2f}x"
        lines.append(f"| {policy} | {statistics.median(vals):.1f} | "
                     f"{', '.join(f'{v:.1f}' for v in vals)} | {ratio} | {warm_ratio} | "
                     f"{statistics.median(cpu[policy]):.1f} | {cpu_ratio} |")
    if any(warm.values()):
        lines += ["", "warm steps: those right after the engine's own step, as every step of "
                  "a lone engine (interleaved, all but the first of each turn; benchmarks/interleave.py); "
                  "the ratio is stock's time over the policy's on those steps."]
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
