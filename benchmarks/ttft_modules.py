"""Time to first token: stock vLLM without and with prefix caching vs prompt modules.

    VLLM_CPU_OMP_THREADS_BIND=0 taskset -c 0 python benchmarks/ttft_modules.py [--quick]
        [--dtype float32] [--json out.json] [--plot out.png]

Eight documents (consecutive ~880-token passages of an Austen novel, from the
fidelity harness's texts) form one schema, one module each. For 2, 4 and 8
documents per prompt, a few prompts pick documents in random order (so
automatic prefix caching misses past the first document) and end with a
question. Each prompt is sent alone (`max_tokens=1`, so latency = TTFT) to
three engines, one after the other in this process, same settings otherwise:

  no-APC    stock vLLM, --no-enable-prefix-caching (the plugin loaded, eviction off)
  APC       stock vLLM with automatic prefix caching (vLLM's default)
  modules   APC on, the schema registered; the same documents as PML imports

The plain prompt is the documents joined by newlines plus the question, so its
token count matches the module prompt's. The `same` row sends one 8-document
prompt twice and times the second send (a full prefix hit for APC).

float32 by default: on AVX2-only CPUs (no AVX512-BF16/AMX) vLLM-cpu's bf16
linear falls back to torch and prefill is several times slower than fp32,
which would inflate every saving measured here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from xml.sax.saxutils import escape

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

QUESTION = "\nQuestion: who is mentioned first in these passages? Answer:"


def documents(tokenizer, n: int, tokens: int) -> list[str]:
    from vllm_kvevict.eval.texts import texts_dir

    text = (texts_dir() / "austen_emma.txt").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    start = 5000  # past the title pages
    return [tokenizer.decode(ids[start + i * tokens: start + (i + 1) * tokens]).strip()
            for i in range(n)]


def prompts(docs: list[str], sizes: list[int], per_size: int, seed: int) -> list[tuple]:
    """(size, names in order) per prompt; size 'same' repeats one prompt."""
    rng = random.Random(seed)
    out = [(k, rng.sample(range(len(docs)), k)) for k in sizes for _ in range(per_size)]
    return out + [("same", list(range(len(docs))))]


def plain(docs, order) -> str:
    return "\n".join(docs[i] for i in order) + QUESTION


def pml(order) -> str:
    return f'<prompt schema="bench">{"".join(f"<d{i}/>" for i in order)}{escape(QUESTION)}</prompt>'


def run(model: str, kind: str, docs, cases, args) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_kvevict.integration import prompt_modules as pm

    llm = LLM(model, enforce_eager=True, dtype=args.dtype, block_size=args.block_size,
              max_model_len=8192, kv_cache_memory_bytes=args.pool_mib << 20, seed=0,
              enable_prefix_caching=kind != "no-APC")
    sp = SamplingParams(max_tokens=1, temperature=0)
    result = {"kind": kind, "register_s": None, "documents": len(docs), "rows": []}
    if kind == "modules":
        body = "".join(f'<module name="d{i}">{escape(d)}</module>' for i, d in enumerate(docs))
        start = time.perf_counter()
        pm.register_schema(llm, f'<schema name="bench">{body}</schema>')
        result["register_s"] = time.perf_counter() - start
    llm.generate(["warm up"], sp, use_tqdm=False)
    for size, order in cases:
        prompt = pml(order) if kind == "modules" else plain(docs, order)
        if size == "same":
            llm.generate([prompt], sp, use_tqdm=False)  # the first send fills the cache
        start = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        result["rows"].append({"size": size, "ttft_s": time.perf_counter() - start,
                               "prompt_tokens": len(out.prompt_token_ids),
                               "cached_tokens": out.num_cached_tokens or 0})
    if kind == "modules":
        pm.remove_schema(llm, "bench")
    llm.llm_engine.engine_core.shutdown()
    gc.collect()
    return result


def table(results: list[dict]) -> str:
    by = {r["kind"]: r for r in results}
    sizes = list(dict.fromkeys(row["size"] for row in results[0]["rows"]))
    lines = ["| docs / prompt | prompt tokens | no-APC ms | APC ms | modules ms "
             "| modules tokens reused | vs no-APC | vs APC |", "|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        med = {k: statistics.median(x["ttft_s"] for x in r["rows"] if x["size"] == size)
               for k, r in by.items()}
        rows = [x for x in by["modules"]["rows"] if x["size"] == size]
        toks = statistics.mean(x["prompt_tokens"] for x in by["APC"]["rows"] if x["size"] == size)
        reused = statistics.mean(x["cached_tokens"] for x in rows)
        lines.append(f"| {size} | {toks:.0f} | {1000 * med['no-APC']:.0f} | {1000 * med['APC']:.0f} "
                     f"| {1000 * med['modules']:.0f} | {reused:.0f} "
                     f"| {med['no-APC'] / med['modules']:.1f}x | {med['APC'] / med['modules']:.1f}x |")
    lines.append(f"\nRegistering the schema (encoding its {by['modules']['documents']} "
                 f"documents once): {by['modules']['register_s']:.1f} s")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        pts = sorted((x["prompt_tokens"], 1000 * x["ttft_s"]) for x in r["rows"]
                     if x["size"] != "same")
        ax.plot(*zip(*pts), "o-", label=r["kind"])
    ax.set_xlabel("prompt tokens (documents in random order)")
    ax.set_ylabel("time to first token, ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 and 4 documents of 300 tokens")
    p.add_argument("--per-size", type=int, default=3, help="prompts per row")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--pool-mib", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    from transformers import AutoTokenizer

    from vllm_kvevict.models import ensure_smollm2

    model = ensure_smollm2()
    n, tokens, sizes = (4, 300, [2, 4]) if args.quick else (8, 880, [2, 4, 8])
    docs = documents(AutoTokenizer.from_pretrained(model), n, tokens)
    cases = prompts(docs, sizes, 1 if args.quick else args.per_size, args.seed)
    results = [run(model, kind, docs, cases, args) for kind in ("no-APC", "APC", "modules")]
    print(f"\nTTFT, median of {args.per_size if not args.quick else 1} prompts per row, "
          f"block size {args.block_size}, {args.dtype}, SmolLM2-135M, "
          f"{len(os.sched_getaffinity(0))} core(s) allowed")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
