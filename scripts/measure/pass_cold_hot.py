"""The CPU attention pass in the engine, cold against hot: every layer's call of
`cpu_kernel.attend_add_column_sums` made twice in a row, each timed, over
StreamingLLM's open steady workload (throughput.py's memory-short pool, budget
160, 50 running; StreamingLLM because its pass scores no row, so a second call
writes the same output and adds nothing). The first call reads the layer's
keys and values as the engine finds them, a step after it last touched them;
the second finds them in cache. The difference is the price of reading them.

    OMP_WAIT_POLICY=passive PYTHONPATH=. .venv/bin/python scripts/measure/pass_cold_hot.py [STEPS]

STEPS (default 400) is throughput.py's --steady-steps: arrivals every second
step until then. The doubled calls slow the run; only the two sums mean
anything.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(steps: int) -> None:
    import throughput
    from step_breakdown import memory_short_config

    from vllm_kvevict import cpu_kernel

    real = cpu_kernel.attend_add_column_sums
    first = second = 0.0
    calls = 0

    def twice(*args):
        nonlocal first, second, calls
        t0 = time.perf_counter()
        real(*args)
        t1 = time.perf_counter()
        real(*args)
        first, second, calls = first + t1 - t0, second + time.perf_counter() - t1, calls + 1

    cpu_kernel.attend_add_column_sums = twice  # looked up at call time (fused_attention.attend)
    # throughput.py's steady command runs every engine at --max-num-seqs 50
    throughput.run_config(dict(memory_short_config("streaming", "steady", steady_steps=steps),
                               max_num_seqs=50))
    if not calls:
        raise SystemExit("the pass never ran (VLLM_KVEVICT_CPU_FUSED=off, or no kernel built)")
    print(f"{calls} calls (layer x step): first {first / calls * 1e6:.0f} us, "
          f"second {second / calls * 1e6:.0f} us a call")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
