"""`vllm serve` with eviction on against stock `vllm serve`, as a new user runs them.

Issue 35's "tried as a new user would": a server with memory to spare, a
budget that evicts little (`--kv-budget 0.9`), concurrent completions. Every
other ratio benchmark steps engines in one process; this one goes through the
whole server (API process, engine core, worker, OpenAI routes), vLLM's own KV
sizing and, by default, its compiled mode. Per round, each configuration gets a
fresh server, one untimed warm-up request, then each workload (N concurrent
requests of P prompt tokens, --max-tokens out, greedy, ignore_eos); the order
of configurations reverses every other round. A policy's ratio is its output
tokens/s over stock's in the same round; the table gives the median of the
rounds and each round's ratio.

    python benchmarks/serve_ratio.py                       # stock, h2o, snapkv, andpro, streaming at 0.9
    python benchmarks/serve_ratio.py --rounds 3 --workloads 16x512 8x3000
    python benchmarks/serve_ratio.py --policies h2o --budget 1024 --eager --plot serve.png
    python benchmarks/serve_ratio.py --policies h2o --unfused   # + each policy with the CPU pass off

`--common` (default `--gpu-memory-utilization 0.85`) goes to every server:
vLLM's own startup check wants 0.92 of RAM free when the worker starts, which a
24 GiB machine misses by ~0.2 GiB on some starts, stock included (README).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time

from common import SERVE_FLAGS, git_head, make_prompts, parse_workload, run_workload, typed_server

from vllm_kvevict.integration.metrics import BUSY_INTERVAL


def run_server(model: str, flags: list[str], env: dict, workloads: dict, warmup: list[int],
               max_tokens: int) -> dict:
    """One fresh server (`env` added to its environment): start, warm up, each
    workload in turn, stop."""
    srv = typed_server(model, flags, stock="--kv-eviction" not in flags)
    srv.env.update(env)
    t0 = time.perf_counter()
    with srv:
        row = {"startup_s": round(time.perf_counter() - t0)}
        run_workload(srv, [warmup], 8)
        evicted0 = srv.metric("vllm_kvevict_tokens_evicted_total")
        pass0 = srv.metric("vllm_kvevict_cpu_pass_steps_total")
        for name, prompts in workloads.items():
            row[name] = run_workload(srv, prompts, max_tokens)
        time.sleep(BUSY_INTERVAL + 0.5)  # the plugin's processes write counters at most this often
        row["evicted"] = srv.metric("vllm_kvevict_tokens_evicted_total") - evicted0
        row["pass_steps"] = srv.metric("vllm_kvevict_cpu_pass_steps_total") - pass0
        log = srv.log()
    row["path"] = next((line.split("CPU tensors: ", 1)[1].split(";")[0]
                        for line in log.splitlines() if "scoring on CPU tensors: " in line), "")
    return row


def ratios(runs: list[dict], workload: str) -> dict[str, list[float]]:
    """Per configuration, its tokens/s over stock's in the same round, by round."""
    stock = {r["round"]: r[workload]["tok_s"] for r in runs if r["config"] == "stock"}
    out: dict[str, list[float]] = {}
    for r in runs:
        out.setdefault(r["config"], []).append(r[workload]["tok_s"] / stock[r["round"]])
    return out


def plot(runs: list[dict], workloads: list[str], path: str) -> None:
    """Bars: each configuration's median ratio to stock per workload, rounds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 3.5), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        by = ratios(runs, w)
        names = list(by)
        ax.bar(names, [statistics.median(by[n]) for n in names], color="#8aa9d6")
        for i, n in enumerate(names):
            ax.plot([i] * len(by[n]), by[n], "k.", ms=5)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{w} prompt tokens")
        ax.set_ylabel("output tok/s vs stock (same round)")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--policies", nargs="+", default=["h2o", "snapkv", "andpro", "streaming"])
    ap.add_argument("--budget", default="0.9", help="--kv-budget of every policy server")
    ap.add_argument("--workloads", nargs="+", default=["16x512", "8x3000"],
                    help="NxP: N concurrent requests of P prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--common", default=SERVE_FLAGS,
                    help="flags every server gets (stock too)")
    ap.add_argument("--eager", action="store_true", help="add --enforce-eager everywhere")
    ap.add_argument("--unfused", action="store_true",
                    help="also run each policy with VLLM_KVEVICT_CPU_FUSED=off (vLLM's "
                         "attention for requests that evict anyway, H2O's scores apart)")
    ap.add_argument("--json", help="write every run here")
    ap.add_argument("--plot", help="write the ratios as a bar chart here (PNG)")
    args = ap.parse_args()
    if args.model is None:
        from vllm_kvevict.models import ensure_smollm2

        args.model = ensure_smollm2()
    common = shlex.split(args.common) + (["--enforce-eager"] if args.eager else [])
    configs = {"stock": (common, {})}  # name -> (flags, environment)
    for p in args.policies:
        configs[p] = ([*common, "--kv-eviction", p, "--kv-budget", args.budget], {})
    if args.unfused:
        for p in args.policies:
            configs[f"{p}-unfused"] = (configs[p][0], {"VLLM_KVEVICT_CPU_FUSED": "off"})
    workloads, offset = {}, 0
    for w in args.workloads:
        n, length = parse_workload(w)
        workloads[w] = make_prompts(args.model, n, length, seed_offset=offset)
        offset += 7  # no two workloads share a first block (prefix caching is on)
    warmup = make_prompts(args.model, 1, 64, seed_offset=3)[0]
    runs = []
    for r in range(args.rounds):
        order = list(configs) if r % 2 == 0 else list(configs)[::-1]
        for name in order:
            row = {"round": r, "config": name, **run_server(args.model, *configs[name], workloads,
                                                           warmup, args.max_tokens)}
            print(json.dumps(row), file=sys.stderr, flush=True)
            runs.append(row)
    print(f"# vllm serve, memory ample: policies at --kv-budget {args.budget} vs stock, "
          f"{args.rounds} rounds (commit {git_head()})\n")
    print(f"flags for every server: `{' '.join(common)}`; {args.max_tokens} tokens out, greedy\n")
    if args.unfused:
        print("POLICY-unfused: that policy with VLLM_KVEVICT_CPU_FUSED=off\n")
    head = ["config"] + [f"{w} tok/s (median)" for w in workloads] + \
           [f"{w} vs stock (rounds)" for w in workloads] + ["tokens evicted (mean)",
                                                              "steps in the CPU pass (mean)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    by = {w: ratios(runs, w) for w in workloads}
    for name in configs:
        mine = [r for r in runs if r["config"] == name]
        cells = [name]
        cells += [f"{statistics.median(r[w]['tok_s'] for r in mine):.1f}" for w in workloads]
        for w in workloads:
            cells.append(f"**{statistics.median(by[w][name]):.2f}x** "
                         f"({', '.join(f'{x:.2f}' for x in by[w][name])})")
        cells.append(f"{statistics.mean(r['evicted'] for r in mine):.0f}")
        cells.append(f"{statistics.mean(r['pass_steps'] for r in mine):.0f}")
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    if args.plot:
        plot(runs, list(workloads), args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
