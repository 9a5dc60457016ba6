"""The least time exact H2O scoring can take on this CPU, against issue 19's
allowances (results/scaling/scaling.json, or the file given: stock's own times from
the same run as the plugin's). One thread:

    VLLM_CPU_OMP_THREADS_BIND=0 taskset -c 0 .venv/bin/python scripts/measure/scoring_floor.py [SCALING.json]

H2O adds, per query, softmax(q K^T) over every resident key to the keys'
scores. Whatever computes it must at least (1) form every logit, D multiply-adds
each, and (2) take one exp per logit. The floor below is those two alone, each
at the best rate this core reaches with torch: the logits as one large batched
float32 product (no gather, no mask, no Python between calls), the exp as
torch's softmax over cache-sized rows (a max, an exp and a sum per element; the
softmax kernel is torch's fastest exp on CPU). Nothing else a real
implementation needs (gathering keys from the paged cache, causal masks,
summing columns, writing scores back) is counted, so a real implementation is
slower than this floor.

Beside it, the same floor with the logits from a bf16 product at torch's bf16
rate: what a kernel that multiplies in bf16 and accumulates in float32 could
reach (torch 2.13 on CPU has none: it rounds a bf16 product's output to bf16,
see flush_timing.py).

Allowances: decode, 10% of stock's mean decode step at that point plus what
the plugin saved there by attending fewer tokens (it compacts back to the
budget, stock grows; the negative "other" of scaling.md, 0 where positive);
prefill, 0.3 x stock's prefill (plugin <= 1.3x stock; the same tokens).
"""

import json
import os
import sys

import torch
from median_timing import median_ms

LAYERS, Q_HEADS, KV_HEADS, D = 30, 9, 3, 64  # SmolLM2-135M, the benchmarks' model
HERE = os.path.dirname(os.path.abspath(__file__))
SCALING = os.path.join(HERE, "..", "..", "results", "scaling", "scaling.json")  # or argv[1]


def product_rate(dtype: torch.dtype) -> float:
    """Multiply-adds per second (x 2 = FLOP/s) of the best of a few batched
    logits shapes: (KV heads, G*T queries, D) x (KV heads, D, keys)."""
    best = 0.0
    for batch, rows, keys in ((27, 96, 192), (27, 96, 512), (24, 96, 1024), (24, 288, 1024),
                              (24, 288, 4096), (24, 96, 8192)):
        q = torch.randn(batch, rows, D, dtype=dtype)
        k = torch.randn(batch, D, keys, dtype=dtype)
        ms = median_ms(torch.matmul, q, k, reps=20)
        best = max(best, q.numel() * keys / ms * 1e3)
    return best


def exp_rate() -> float:
    """Elements per second of float32 softmax over rows that stay in cache."""
    x = torch.randn(256, 4096)
    return x.numel() / median_ms(torch.softmax, x, -1, reps=50) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    mac32, mac16, exps = product_rate(torch.float32), product_rate(torch.bfloat16), exp_rate()
    print(f"this core, one thread: float32 logits {2 * mac32 / 1e9:.0f} GFLOP/s, "
          f"bf16 logits {2 * mac16 / 1e9:.0f} GFLOP/s, softmax {exps / 1e9:.2f} G elements/s\n")

    def floor_s(logits: float, mac: float) -> float:
        return logits * D / mac + logits / exps

    with open(sys.argv[1] if len(sys.argv) > 1 else SCALING) as f:
        runs = json.load(f)["results"]
    stock = {(r["batch"], r["ctx"]): r for r in runs if r["policy"] == "none" and r["ok"]}
    plugin = {(r["batch"], r["ctx"]): r for r in runs if r["policy"] == "h2o" and r["ok"]}
    decode, prefill = [], []
    for key in sorted(plugin):
        s, p = stock[key], plugin[key]
        logits = key[0] * LAYERS * Q_HEADS * p["resident"]
        saved = max(0.0, sum(p["breakdown_ms"].values()) - (p["mean_ms"] - s["mean_ms"]))
        decode.append((*key, s["mean_ms"], s["mean_ms"] / 10 + saved, p["breakdown_ms"]["scoring"],
                       1e3 * floor_s(logits, mac32), 1e3 * floor_s(logits, mac16)))
        logits = key[0] * LAYERS * Q_HEADS * key[1] * (key[1] + 1) / 2
        prefill.append((*key, s["prefill_s"], 0.3 * s["prefill_s"], p["prefill_s"] - s["prefill_s"],
                        floor_s(logits, mac32), floor_s(logits, mac16)))
    table("Decode (one query per request per step, against its resident keys):",
          ("stock ms/step", "allowance ms (10% + saved)", "plugin scoring ms",
           "floor ms, float32", "floor ms, bf16 product"), decode)
    print()
    table("Prefill (every prompt token's query against the keys before it):",
          ("stock s", "allowance s (0.3x)", "plugin extra s",
           "floor s, float32", "floor s, bf16 product"), prefill)


def table(title: str, columns: tuple[str, ...], rows: list[tuple]) -> None:
    """A markdown table of (batch, ctx, then one float per column) rows."""
    print(f"{title}\n")
    print("| batch | ctx | " + " | ".join(columns) + " |")
    print("|---:|---:|" + "---:|" * len(columns))
    for batch, ctx, *values in rows:
        print(f"| {batch} | {ctx} | " + " | ".join(f"{v:.1f}" for v in values) + " |")


if __name__ == "__main__":
    main()
