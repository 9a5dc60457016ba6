"""One prefill chunk's H2O scoring through `scores.score_queries`, at the
query-tile cap `scores._MAX_TILE_QUERIES` and at others, one thread:

    VLLM_CPU_OMP_THREADS_BIND=0 taskset -c 0 .venv/bin/python scripts/measure/chunk_timing.py

The shape: a request's first chunk of N tokens (every query sees the keys up to
itself), in every layer of SmolLM2-135M at once (30 layers, 9 query heads, 3 KV
heads, D 64; bf16 cache in vLLM's CPU layout, block 32), as the chunk log scores
it. Prints the median of 5 calls per (N, cap); "none" is one tile per chunk as
far as `_TILE_ELEMENTS` allows (the code before the cap).
"""

import torch
from flush_timing import BS, D, GROUP, KV_HEADS, LAYERS, filled_cache
from median_timing import median_ms

from vllm_kvevict.core.scoring import scores as scoring


def chunk_case(n: int):
    """(score_queries arguments) for one n-token first chunk in every layer."""
    gen = torch.Generator().manual_seed(0)
    per_layer = -(-n // BS)
    layout, kc = filled_cache(per_layer, gen)
    rows = (torch.arange(per_layer)[None] + (torch.arange(LAYERS) * per_layer)[:, None])
    visible = torch.arange(1, n + 1)[None].repeat(LAYERS, 1)
    queries = (2 * torch.randn(LAYERS, n, KV_HEADS * GROUP, D, generator=gen)).bfloat16()
    out = torch.zeros(KV_HEADS, LAYERS * per_layer * BS)
    return out, layout, kc, queries, visible, rows, 0.125


def main() -> None:
    torch.set_num_threads(1)
    default = scoring._MAX_TILE_QUERIES
    caps = [("none", 1 << 30), ("128", 128), (f"{default} (default)", default), ("32", 32)]
    print("| chunk tokens | " + " | ".join(f"cap {name} ms" for name, _ in caps) + " |")
    print("|---:|" + "---:|" * len(caps))
    try:
        for n in (256, 1024):
            args = chunk_case(n)
            times = []
            for _, cap in caps:
                scoring._MAX_TILE_QUERIES = cap
                times.append(median_ms(scoring.score_queries, *args, reps=5))
            print(f"| {n} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
    finally:
        scoring._MAX_TILE_QUERIES = default


if __name__ == "__main__":
    main()
