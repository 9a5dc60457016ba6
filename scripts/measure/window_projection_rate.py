"""AnDPro's window-score kernel alone (`cpu_kernel.window_projection_sums`,
dense inputs, the papers' model precision: split=False) at the steady state's
compaction shapes, beside the plain-torch path the engine runs without the
kernel (`window_scores.raw_scores_torch(..., projection=True)`, float32):

    OMP_WAIT_POLICY=passive PYTHONPATH=. .venv/bin/python scripts/measure/window_projection_rate.py

Rows B = layers x requests compacted together (30 layers x 1-2 requests),
32 window queries x 9 query heads, 3 KV heads x 160 keys x 64 (SmolLM2-135M,
budget 160). GFLOP/s counts the three products (Q K^T, E V, Y V^T).
"""

import torch
from median_timing import median_ms

from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.scoring.window_scores import raw_scores_torch

WINDOW, Q_HEADS, KV_HEADS, D, SCALE = 32, 9, 3, 64, 0.125


def main() -> None:
    torch.set_num_threads(2)
    isa = cpu_kernel.isa()  # this CPU's path (avx512bf16, amx or avx2)
    print(f"path {isa}, 2 threads")
    for rows, n in ((30, 160), (57, 160), (60, 160)):
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(rows, WINDOW, Q_HEADS, D, generator=gen).bfloat16()
        k, v = (torch.randn(rows, KV_HEADS, n, D, generator=gen).bfloat16() for _ in range(2))
        flops = 3 * 2 * rows * Q_HEADS * WINDOW * n * D
        kernel = median_ms(cpu_kernel.window_projection_sums, q, k, v, SCALE, isa, False, reps=50)
        torch_path = median_ms(raw_scores_torch, q, k, v, SCALE, True, reps=20)
        print(f"B={rows} n={n}: kernel {kernel:.2f} ms ({flops / kernel / 1e6:.0f} GFLOP/s); "
              f"torch path {torch_path:.2f} ms ({flops / torch_path / 1e6:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
