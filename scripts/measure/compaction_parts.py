"""Wall time of each part of a compaction in the README's main job
(`vllm_kvevict.demo.run`, one policy, this process), inclusive per function:
finer than `benchmarks/step_breakdown.py --by-function`, whose timers
(benchmarks/common.py) it uses with nested calls left in.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/measure/compaction_parts.py h2o|snapkv|andpro|...

Prints one line: part -> total ms / calls over the run (the engine in this
process: VLLM_ENABLE_V1_MULTIPROCESSING=0, else the worker's calls are not
seen). Parts overlap (`_compact` includes `scores`, `select`, ...).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common import install_timers  # noqa: E402

PARTS = (  # (module, owner or "", function, part), as common.PER_STEP
    ("vllm_kvevict.integration.worker", "WorkerEviction", "_compact", "_compact"),
    ("vllm_kvevict.integration.worker", "WorkerEviction", "_compaction_scores", "scores"),
    ("vllm_kvevict.integration.worker", "", "fill_holes", "fill_holes"),
    ("vllm_kvevict.core.policies.base", "EvictionPolicy", "select", "select"),
    ("vllm_kvevict.integration.recorders", "StackContext", "keys", "keys"),
    ("vllm_kvevict.integration.recorders", "StackContext", "values", "values"),
    ("vllm_kvevict.integration.recorders", "StackContext", "window", "window"),
    ("vllm_kvevict.cpu_kernel", "", "window_projection_sums", "andpro kernel"),
    ("vllm_kvevict.cpu_kernel", "", "window_projection_paged", "andpro kernel, in place"),
    ("vllm_kvevict.cpu_kernel", "", "column_sums", "column_sums"),
    ("vllm_kvevict.core.policies.window", "", "finalize", "finalize"),
    ("vllm_kvevict.core.scoring.decode_log", "DecodeQueryLog", "flush", "decode flush"),
)


def main(policy: str) -> None:
    timers = install_timers(PARTS, exclusive=False)
    from vllm_kvevict.demo import parse_args, run

    args = parse_args([])
    r = run(args.model, policy, args, None)
    calls = {part: timers.calls[name] for _, _, name, part in PARTS}
    print(policy, f"{r['tok_s']:.1f} tok/s",
          {k: f"{v * 1e3:.1f} ms / {calls[k]}" for k, v in timers.seconds.items()})


if __name__ == "__main__":
    main(sys.argv[1])
