"""AnDPro's window-score kernel alone (`cpu_kernel.window_projection_sums`, dense
inputs, the papers' model precision) at the steady state's compaction shapes: B rows
(layers x requests), 32 window queries x 9 query heads, 3 KV heads x n keys x 64;
its GFLOP/s over the three products, beside the same products as torch bf16 matmuls.
Run: OMP_WAIT_POLICY=passive PYTHONPATH=. .venv/bin/python scripts/measure/window_projection_rate.py"""
import time

import torch

from vllm_kvevict import cpu_kernel

torch.set_num_threads(2)
isa = cpu_kernel.isa()  # this CPU's path (avx512bf16, amx or avx2)
print(f"path {isa}, 2 threads")
for B, n in ((30, 160), (57, 160), (60, 160)):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 32, 9, 64, generator=g).bfloat16()
    k = torch.randn(B, 3, n, 64, generator=g).bfloat16()
    v = torch.randn(B, 3, n, 64, generator=g).bfloat16()
    for _ in range(5): cpu_kernel.window_projection_sums(q, k, v, 0.125, isa, split=False)
    ts = []
    for _ in range(50):
        t = time.perf_counter(); cpu_kernel.window_projection_sums(q, k, v, 0.125, isa, split=False); ts.append(time.perf_counter() - t)
    ms = sorted(ts)[len(ts) // 2] * 1e3
    flops = 3 * 2 * B * 9 * 32 * n * 64
    # torch reference shape of the same three products in bf16 GEMMs
    qh = q.permute(0, 2, 1, 3).reshape(B, 3, 3 * 32, 64)
    def tor():
        lg = torch.matmul(qh, k.transpose(-1, -2))
        e = torch.softmax(lg.float(), -1).bfloat16()
        y = torch.matmul(e, v)
        z = torch.matmul(y, v.transpose(-1, -2))
        return (e.float() * z.float()).sum(2)
    for _ in range(5): tor()
    tt = []
    for _ in range(50):
        t = time.perf_counter(); tor(); tt.append(time.perf_counter() - t)
    tms = sorted(tt)[len(tt) // 2] * 1e3
    print(f"B={B} n={n}: kernel {ms:.2f} ms ({flops / ms / 1e6:.0f} GFLOP/s); torch bf16 matmuls (no mask) {tms:.2f} ms ({flops / tms / 1e6:.0f} GFLOP/s)")
