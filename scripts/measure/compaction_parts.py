"""Wall time of each part of the plugin's per-step work in the README's main
job (`vllm_kvevict.demo.run`, one policy, this process), inclusive per
function: where a compaction's time goes, finer than
benchmarks/step_breakdown.py's three categories.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/measure/compaction_parts.py h2o|snapkv|andpro|...

Prints one line: label -> total ms / calls over the run (the engine in this
process: VLLM_ENABLE_V1_MULTIPROCESSING=0, else the worker's calls are not
seen). Nested labels overlap (`_compact` includes `scores`, `select`, ...).
"""
import collections
import importlib
import sys
import time

PARTS = (  # (module, owner or "", function, label)
    ("vllm_kvevict.integration.worker", "WorkerEviction", "_compact", "_compact"),
    ("vllm_kvevict.integration.worker", "WorkerEviction", "_compaction_scores", "scores"),
    ("vllm_kvevict.integration.worker", "", "fill_holes", "fill_holes"),
    ("vllm_kvevict.core.policies.base", "EvictionPolicy", "select", "select"),
    ("vllm_kvevict.integration.recorders", "StackContext", "keys", "keys"),
    ("vllm_kvevict.integration.recorders", "StackContext", "values", "values"),
    ("vllm_kvevict.integration.recorders", "StackContext", "window", "window"),
    ("vllm_kvevict.cpu_kernel", "", "window_projection_sums", "andpro kernel"),
    ("vllm_kvevict.cpu_kernel", "", "column_sums", "column_sums"),
    ("vllm_kvevict.core.policies.window", "", "finalize", "finalize"),
    ("vllm_kvevict.core.scoring.decode_log", "DecodeQueryLog", "flush", "decode flush"),
)


def main(policy: str) -> None:
    seconds, calls = collections.defaultdict(float), collections.Counter()
    for module, owner, name, label in PARTS:
        obj = importlib.import_module(module)
        obj = getattr(obj, owner) if owner else obj
        fn = getattr(obj, name)

        def timed(*a, _fn=fn, _label=label, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                seconds[_label] += time.perf_counter() - t
                calls[_label] += 1

        setattr(obj, name, timed)
    from vllm_kvevict.demo import parse_args, run

    args = parse_args([])
    r = run(args.model, policy, args, None)
    print(policy, f"{r['tok_s']:.1f} tok/s",
          {k: f"{seconds[k] * 1e3:.1f} ms / {calls[k]}" for k in seconds})


if __name__ == "__main__":
    main(sys.argv[1])
