"""A compaction's read of the SnapKV/AnDPro query window: `QueryWindow.windows`
for 1 and 4 requests compacted together, every layer of SmolLM2-135M (30
layers, 9 query heads of 64, float32), from a ring of 24 requests' newest 32
queries. Prints the median ms of 200 reads.

    PYTHONPATH=. .venv/bin/python scripts/measure/window_read.py
    PYTHONPATH=OTHER_CHECKOUT .venv/bin/python scripts/measure/window_read.py   # A/B

Runs on one thread (`torch.set_num_threads(1)`), as a quiet A/B beside other
work; the engine reads with two.
"""
import statistics
import time

import torch

from vllm_kvevict.core.scoring.query_window import QueryWindow

LAYERS, REQUESTS, HEADS, D, PROMPT, STEPS = 30, 24, 9, 64, 256, 40


def main() -> None:
    torch.set_num_threads(1)
    ring = QueryWindow(32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    reqs = [f"r{i}" for i in range(REQUESTS)]
    placement = ring.place(reqs, [PROMPT] * REQUESTS, [PROMPT] * REQUESTS)
    for name in layers:
        ring.record(name, torch.randn(PROMPT * REQUESTS, HEADS, D), placement, 0.125)
    for s in range(STEPS):
        placement = ring.place(reqs, [1] * REQUESTS, [PROMPT + 1 + s] * REQUESTS)
        for name in layers:
            ring.record(name, torch.randn(REQUESTS, HEADS, D), placement, 0.125)
    end = PROMPT + STEPS
    for n in (1, 4):
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            q, _ = ring.windows(reqs[:n], layers, [end] * n)
            times.append(time.perf_counter() - t0)
        print(f"{n} request(s), window {tuple(q.shape)}: {1e3 * statistics.median(times):.3f} ms")


if __name__ == "__main__":
    main()
