"""Prefix caching with eviction: a shared system prompt, stock vLLM vs each policy.

    VLLM_CPU_OMP_THREADS_BIND=0 taskset -c 0 python benchmarks/prefix_cache.py [--quick]
        [--requests 8] [--system-tokens 2048] [--budget 0.2] [--json out.json]
        [--plot out.png]

N requests share a ~2K-token system prompt (a passage of an Austen novel from
the fidelity harness's texts) and each ends with its own question. They are
sent one after the other to one engine per row, automatic prefix caching on
(vLLM's default), each engine in a fresh process (`run_fresh`), a stock
engine before the first policy and after each (a policy's TTFT is compared
with the mean of the two stock runs beside it: the machine drifts by more than
the plugin's cost over a run), same settings otherwise:

  stock        the plugin loaded, eviction off
  <policy>     --kv-eviction <policy> --kv-budget <budget>

Per request: `max_tokens=1` (so latency = time to first token), the time
spent in the plugin's per-step worker functions (benchmarks/common.py's
timers: scoring, compaction, bookkeeping; the scheduler-side block manager is
not in it) and vLLM's own
`num_cached_tokens` (the offline counterpart of the server's
`prompt_tokens_details.cached_tokens`). The first request is cold; the table
reports the median over the other N - 1. A second pass per policy runs with
the budget above every request's length and checks that 16 greedy tokens of
every request equal stock's, with the prefix hits on.

float32 by default (see ttft_modules.py: on AVX2-only CPUs bf16 prefill falls
back to torch).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

POLICIES = ("streaming", "snapkv", "andpro", "h2o")
QUESTIONS = ("Who is the first person named above?", "Where does the passage take place?",
             "Summarise the passage in one sentence.", "What does the narrator feel?",
             "Which family is described?", "What happens at the end of the passage?",
             "Name two characters above.", "Is the tone comic or serious?",
             "What season is it?", "Who speaks the most?")


def system_prompt(tokenizer, tokens: int) -> str:
    from vllm_kvevict.eval.texts import texts_dir

    ids = tokenizer.encode((texts_dir() / "austen_emma.txt").read_text(),
                           add_special_tokens=False)
    return "You answer questions about this passage.\n\n" + tokenizer.decode(
        ids[5000:5000 + tokens]).strip()


def run(model: str, name: str, extra: dict, prompts: list[str], args,
        max_tokens: int = 1) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model, enforce_eager=True, dtype=args.dtype, block_size=args.block_size,
              max_model_len=4096, kv_cache_memory_bytes=args.pool_mib << 20, seed=0,
              enable_prefix_caching=True, additional_config=extra)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(["warm up"], SamplingParams(max_tokens=1), use_tqdm=False)
    from common import install_timers  # the plugin's per-step functions

    timers = install_timers()
    rows = []
    for prompt in prompts:
        timers.reset()
        start = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        rows.append({"ttft_s": time.perf_counter() - start,
                     "plugin_s": sum(timers.seconds.values()),
                     "prompt_tokens": len(out.prompt_token_ids),
                     "cached_tokens": out.num_cached_tokens or 0,
                     "tokens": list(out.outputs[0].token_ids)})
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {"name": name, "config": extra, "rows": rows}


def in_fresh_process(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a spawned process of its own, so no engine inherits
    what an earlier one left in the process (allocator, threads, the plugin's
    per-process worker state). Also used by step_breakdown.py."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def run_fresh(*args, **kwargs) -> dict:
    return in_fresh_process(run, *args, **kwargs)


def p50(result: dict) -> float:
    """Median TTFT of a run's warm requests (all but the first), seconds."""
    return statistics.median(x["ttft_s"] for x in result["rows"][1:])


def table(results: list[dict], identical: dict[str, bool]) -> str:
    """results: stock, then each policy followed by a stock run of its own;
    a policy is compared with the mean of the stock runs on either side."""
    stocks = [r for r in results if r["name"] == "stock"]
    lines = ["| engine | prompt tokens | cached tokens / request (median, after the first) "
             "| TTFT p50 ms | vs stock (the runs either side) | plugin ms / request (p50) "
             "| cold first request ms | tokens = stock at budget >= length |",
             "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(results):
        warm = r["rows"][1:]
        cached = statistics.median(x["cached_tokens"] for x in warm)
        toks = statistics.mean(x["prompt_tokens"] for x in r["rows"])
        plugin = statistics.median(x["plugin_s"] for x in warm)
        if r["name"] == "stock":
            if r is not stocks[0]:
                continue
            ms = sorted(1000 * p50(x) for x in stocks)
            ttft = f"{statistics.median(ms):.0f} ({ms[0]:.0f}-{ms[-1]:.0f}, {len(ms)} runs)"
            rel, same = "1.00x", "(reference)"
        else:
            ttft = f"{1000 * p50(r):.0f}"
            rel = f"{p50(r) / ((p50(results[i - 1]) + p50(results[i + 1])) / 2):.2f}x"
            same = "yes" if identical.get(r["name"]) else "NO"
        lines.append(f"| {r['name']} | {toks:.0f} | {cached:.0f} | {ttft} | {rel} "
                     f"| {1000 * plugin:.1f} | {1000 * r['rows'][0]['ttft_s']:.0f} | {same} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    stock_runs = 0
    for r in results:
        label = r["name"]
        if label == "stock":
            stock_runs += 1
            label = f"stock, run {stock_runs}"
        ax.plot([1000 * x["ttft_s"] for x in r["rows"]], "o-", label=label)
    ax.set_xlabel("request (in order sent; the first is cold)")
    ax.set_ylabel("time to first token, ms")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 requests, a 512-token system prompt")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--budget", default="0.2", help="--kv-budget of the policies' first pass")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--pool-mib", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    from transformers import AutoTokenizer

    from vllm_kvevict.models import ensure_smollm2

    model = ensure_smollm2()
    n, tokens = (4, 512) if args.quick else (args.requests, args.system_tokens)
    system = system_prompt(AutoTokenizer.from_pretrained(model), tokens)
    prompts = [f"{system}\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:"
               for i in range(n)]
    policies = [x for x in args.policies.split(",") if x]
    # Stock before and after every policy: this machine drifts by more than
    # the plugin's cost between engines (stock's medians spread 76-84 ms).
    results = [run_fresh(model, "stock", {}, prompts, args)]
    for pol in policies:
        results.append(run_fresh(model, pol, {"kv_eviction": pol, "kv_budget": args.budget},
                                 prompts, args))
        results.append(run_fresh(model, "stock", {}, prompts, args))
    # Budget above every length: nothing is evicted, the prefix hits stay on.
    ref = run_fresh(model, "stock", {}, prompts, args, max_tokens=16)
    identical = {}
    for pol in policies:
        same = run_fresh(model, pol, {"kv_eviction": pol, "kv_budget": 4096}, prompts, args,
                   max_tokens=16)
        identical[pol] = [x["tokens"] for x in same["rows"]] == [x["tokens"] for x in ref["rows"]]
        for r in results:
            if r["name"] == pol:
                r["identity_cached_tokens"] = [x["cached_tokens"] for x in same["rows"]]
    print(f"\n{n} requests sharing a {tokens}-token system prompt, sent one after the "
          f"other; --kv-budget {args.budget}; block size {args.block_size}, {args.dtype}, "
          f"SmolLM2-135M, {len(os.sched_getaffinity(0))} core(s) allowed")
    print(table(results, identical))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "identical": identical}, f, indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
