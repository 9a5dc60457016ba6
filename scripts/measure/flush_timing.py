"""One H2O decode-log flush of the demo's shape through `scores.score_queries`,
and what bounds it on this CPU, one thread:

    VLLM_CPU_OMP_THREADS_BIND=0 taskset -c 0 .venv/bin/python scripts/measure/flush_timing.py [--profile]

The shape: 30 layers x 16 requests (rows), 32 logged queries each seeing
129-192 resident keys (one more per query), SmolLM2-135M's heads (9 query
heads, 3 KV heads, D 64), bf16 cache in vLLM's CPU layout, block 32.

Prints the flush's median time (10 calls after one warm-up), then the float32
logits product alone at the flush's tile size (`_GROUP_ELEMENTS` rows' worth,
so it runs from cache, as in the flush) in GFLOP/s, then whether torch offers
a bf16 x bf16 -> float32 product on CPU (which would halve that work without
rounding the logits to bf16). --profile adds torch.profiler's table of 5 flushes.
"""

import sys

import torch
import vllm._custom_ops as ops
from median_timing import median_ms

from vllm_kvevict.core.scoring import scores as scoring
from vllm_kvevict.core.layouts.cpu_layout import split_kv_cache
from vllm_kvevict.integration.cpu_backend import discover_layout

LAYERS, REQS, QUERIES, KV_HEADS, GROUP, D, BS = 30, 16, 32, 3, 3, 64, 32


def filled_cache(per_layer: int, gen: torch.Generator):
    """(layout, key cache) of a bf16 cache in vLLM's CPU `vec` layout, LAYERS x
    per_layer blocks, every slot holding a random key (written by the stock writer)."""
    kv = torch.zeros(LAYERS * per_layer, KV_HEADS, BS, 2 * D, dtype=torch.bfloat16)
    kc, vc = split_kv_cache(kv)
    keys = torch.randn(LAYERS * per_layer * BS, KV_HEADS, D, generator=gen).bfloat16()
    ops.cpu_attn_reshape_and_cache(keys, keys, kc, vc, torch.arange(keys.shape[0]), "vec")
    return discover_layout("vec", torch.bfloat16, BS, D, KV_HEADS), kc


def flush_case():
    """(score_queries arguments) for one flush of the demo's shape."""
    gen = torch.Generator().manual_seed(0)
    per_layer = 7 * REQS  # blocks per layer; each request holds 6 of them
    layout, kc = filled_cache(per_layer, gen)
    start = torch.randint(128, 160, (REQS,), generator=gen)
    visible = (start[:, None] + torch.arange(1, QUERIES + 1)[None]).repeat(LAYERS, 1)
    blocks = torch.randperm(per_layer, generator=gen)[: REQS * 6].view(REQS, 6)
    rows = (blocks[None] + (torch.arange(LAYERS) * per_layer)[:, None, None]).flatten(0, 1)
    queries = (2 * torch.randn(LAYERS * REQS, QUERIES, KV_HEADS * GROUP, D,
                               generator=gen)).bfloat16()
    out = torch.zeros(KV_HEADS, LAYERS * per_layer * BS)
    return out, layout, kc, queries, visible, rows, 0.125


def main() -> None:
    torch.set_num_threads(1)
    args = flush_case()
    print(f"flush ({LAYERS} layers x {REQS} requests x {QUERIES} queries): "
          f"{median_ms(scoring.score_queries, *args, reps=10):.1f} ms")

    keys = 192
    rows = max(1, scoring._GROUP_ELEMENTS // (KV_HEADS * GROUP * QUERIES * keys))
    q = torch.randn(rows, KV_HEADS, GROUP * QUERIES, D)
    k = torch.randn(rows, KV_HEADS, D, keys)
    flops = 2 * q.numel() * keys
    ms = median_ms(lambda: torch.matmul(q, k), reps=50)
    print(f"float32 logits, ({rows} x {KV_HEADS}) x ({GROUP * QUERIES} x {D}) x ({D} x {keys}): "
          f"{ms * 1e3:.0f} us, {flops / ms / 1e6:.1f} GFLOP/s")

    a, b = q[0, 0].bfloat16(), k[0, 0].bfloat16()
    for name, fn in (("torch.mm(bf16, bf16, out_dtype=float32)",
                      lambda: torch.mm(a, b, out_dtype=torch.float32)),
                     ("torch.bmm(bf16, bf16, out_dtype=float32)",
                      lambda: torch.bmm(a[None], b[None], out_dtype=torch.float32)),
                     ("torch.baddbmm(float32, bf16, bf16)",
                      lambda: torch.baddbmm(torch.zeros(1, *a.shape[:1], keys), a[None], b[None]))):
        try:
            fn()
            print(f"{name}: available")
        except (RuntimeError, NotImplementedError) as e:
            print(f"{name}: not on this CPU build ({str(e).splitlines()[0][:90]})")

    if "--profile" in sys.argv:
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(5):
                scoring.score_queries(*args)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
