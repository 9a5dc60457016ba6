"""The fidelity harness: quality of each eviction policy vs the full cache, in vLLM.

    python -m vllm_kvevict.eval --config smoke --out results/eval-smoke
    python -m vllm_kvevict.eval --config full --out results/eval-full     # both models
    python -m vllm_kvevict.eval --dump-tasks tasks.json --model smollm2 --config smoke

Writes ``results.json`` (rows, see :mod:`vllm_kvevict.eval.run_vllm`),
``results.md`` and PNG plots (:mod:`vllm_kvevict.eval.report`) into ``--out``.
Texts come from the setup step (``python -m vllm_kvevict.eval.texts``);
nothing is downloaded here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM's per-engine INFO lines (dozens per engine) would bury the progress bars.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm_kvevict.core.config.flags import ALIASES
from vllm_kvevict.eval import tasks as T
from vllm_kvevict.passages import TextsMissing

MODEL_NAMES = ("smollm2", "qwen25-coder")
DEFAULT_MODELS = {"smoke": ("smollm2",), "full": MODEL_NAMES}
KV_POOL_MIB = {"smoke": 256, "full": 1024}
CHUNK_TOKENS = {"smoke": 256, "full": 512}


def _list(values: list[str] | None) -> list[str]:
    """Accept both "a b" and "a,b"."""
    return [v for item in values or [] for v in item.split(",") if v]


def model_dir(name: str) -> str:
    from vllm_kvevict.models import MODELS

    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name]()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def dump_tasks(path: str, model: str, config: str, tasks: list[str]) -> None:
    """The JSON interface of :mod:`vllm_kvevict.eval.tasks`, for other runners."""
    mdir = model_dir(model)
    instances = T.build_instances(config, load_tokenizer(mdir), tasks)
    Path(path).write_text(json.dumps(dict(model=model, model_dir=mdir, instances=instances),
                                     indent=1, ensure_ascii=False))
    print(f"{len(instances)} instances -> {path}")


def run(args, save=None, meta=None) -> list[dict]:
    """Every engine of every model; ``save(rows)`` after each engine (partial results).

    meta: filled with each model's engine settings (``meta["engines"][model]``).
    """
    from tqdm import tqdm

    from vllm_kvevict.core.config.settings import POLICIES
    from vllm_kvevict.eval import run_vllm

    policies = _list(args.policies) or list(POLICIES)  # read now: new policies join in
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; vllm_kvevict has {POLICIES}")
    budgets = [float(b) for b in _list(args.budgets)] or list(T.BUDGETS[args.config])
    tasks = _list(args.tasks) or list(T.TASKS)
    # The full cache runs once, first: the reference for agreement and "% of full".
    engines = [("none", 1.0)] + [(p, b) for p in policies if p != "none" for b in budgets]

    rows: list[dict] = []
    for model in _list(args.models) or DEFAULT_MODELS[args.config]:
        mdir = model_dir(model)
        if any(ALIASES.get(p, (p, False))[1] for p, _ in engines):  # an offload mode
            # Offload engines need the model's skewing file, which serving never
            # computes: the offline command's function, once.
            from vllm_kvevict.calibrate import calibrate

            calibrate(mdir)
        tok = load_tokenizer(mdir)
        if args.instances:  # the exact instances another runner got (--dump-tasks)
            instances = [i for i in json.loads(Path(args.instances).read_text())["instances"]
                         if i["task"] in tasks]
            tasks = [t for t in tasks if any(i["task"] == t for i in instances)]
        else:
            instances = T.build_instances(args.config, tok, tasks)
        by_task = {t: [i for i in instances if i["task"] == t] for t in tasks}
        prompts = {t: [T.prompt_ids(i, tok) for i in by_task[t]] for t in tasks}
        longest = max(len(p) + i["max_tokens"] for t in tasks
                      for p, i in zip(prompts[t], by_task[t]))
        spec = run_vllm.EngineSpec(mdir, max_model_len=-(-longest // 32) * 32,
                                   kv_pool_mib=args.kv_pool_mib or KV_POOL_MIB[args.config],
                                   chunk_tokens=args.chunk_tokens or CHUNK_TOKENS[args.config],
                                   dtype=args.dtype, prefill_cap=getattr(args, "prefill_cap", None),
                                   kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
        if meta is not None:
            meta.setdefault("engines", {})[model] = dataclasses.asdict(spec)
        bar = tqdm(total=len(engines) * len(tasks), desc=model, unit="task")
        reference = None
        for policy, budget in engines:
            bar.set_postfix_str(f"{policy} @ {budget:g}")
            before = bar.n
            try:
                got = run_vllm.run_engine(spec, model, policy, budget, by_task, prompts,
                                          reference, on_task=bar.update)
            except Exception as exc:  # one broken policy must not sink the whole sweep
                if policy == "none":
                    raise
                print(f"\n[eval] {model} {policy} @ {budget:g} failed: {exc!r}", file=sys.stderr)
                got = [dict(framework=run_vllm.FRAMEWORK, model=model, task=t, policy=policy,
                            budget=budget, query_mode="aware", score=None, n=len(by_task[t]),
                            wall_s=None, detail=dict(error=repr(exc))) for t in tasks]
                bar.update(before + len(tasks) - bar.n)
            if policy == "none":
                reference = run_vllm.agreement_reference(got)
            rows += got
            if save:
                save(rows)
        bar.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_kvevict.eval",
                                description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(T.CONFIGS), default="smoke")
    p.add_argument("--out", default=None, help="output folder (default results/eval-CONFIG)")
    p.add_argument("--models", nargs="+", help=f"{','.join(MODEL_NAMES)} "
                   "(default: smollm2; the full config runs both)")
    p.add_argument("--policies", nargs="+",
                   help="default: every policy in vllm_kvevict.core.config.settings.POLICIES")
    p.add_argument("--budgets", nargs="+", help="fractions of the request's length "
                   f"(default smoke {T.BUDGETS['smoke']}, full {T.BUDGETS['full']})")
    p.add_argument("--tasks", nargs="+", help=f"subset of {', '.join(T.TASKS)}")
    p.add_argument("--kv-pool-mib", type=int, help="KV cache per engine (default smoke 256, "
                   "full 1024)")
    p.add_argument("--chunk-tokens", type=int, help="chunked-prefill chunk "
                   "(max_num_batched_tokens; default smoke 256, full 512)")
    p.add_argument("--prefill-cap", type=int, default=None,
                   help="--kv-prefill-cap of the evicting engines (default: compress once "
                   "the prompt is complete; 0: between every prompt chunk)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="model and KV dtype of every engine (default bfloat16; float32 is "
                   "the faster one on CPUs without avx512_bf16)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e5m2"),
                   help="KV cache dtype of every engine, the full-cache reference included "
                   "(default auto: the model dtype; fp8 needs an AVX-512 CPU)")
    p.add_argument("--dump-tasks", metavar="FILE", help="write the instances as JSON and exit")
    p.add_argument("--instances", metavar="FILE", help="run the instances of a --dump-tasks "
                   "file (e.g. the subset given to the kvpress runner) instead of the config's")
    p.add_argument("--model", default="smollm2", help="model for --dump-tasks")
    args = p.parse_args(argv)

    try:
        if args.dump_tasks:
            dump_tasks(args.dump_tasks, args.model, args.config, _list(args.tasks) or list(T.TASKS))
            return 0
        out = Path(args.out or f"results/eval-{args.config}")
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        meta = dict(config=args.config, argv=sys.argv[1:] if argv is None else argv,
                    date=time.strftime("%Y-%m-%d %H:%M:%S"), host=platform.node(),
                    cpus=os.cpu_count(), complete=False)

        def save(rows):  # after every engine, so a crash keeps what was measured
            meta["wall_s"] = round(time.time() - t0, 1)
            (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1,
                                                         ensure_ascii=False))

        rows = run(args, save, meta)
    except TextsMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from vllm_kvevict.eval import report

    meta["complete"] = True
    save(rows)
    report.write_report(rows, out, meta=meta)
    print(f"wrote {out}/results.json, results.md and plots ({meta['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
