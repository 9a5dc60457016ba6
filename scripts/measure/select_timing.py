"""H2O/SnapKV/AnDPro selection (`policies.recent_plus_top_scored`) against the
top-k-and-sort it replaced, on a stacked compaction's score rows (layers x KV
heads), one thread, median of 30 calls after one warm-up:

    taskset -c 0 .venv/bin/python scripts/measure/select_timing.py

(rows, resident tokens, budget, recent window) cases: SmolLM2's 30 x 3 rows at
4K and 8K tokens losing one 32-token block, the demo's 160-token budget, and a
4K-token request cut to a fifth (many dropped: the top-k branch).
"""

import torch
from median_timing import median_ms

from vllm_kvevict.core.policies import recent_plus_top_scored

CASES = [(90, 4128, 4096, 2048), (90, 8032, 8000, 4000), (90, 192, 160, 80),
         (90, 4128, 819, 409)]


def topk_and_sort(scores, keep, recent):
    """The previous selection: the top keep - recent older tokens, then a sort."""
    num_heads, n = scores.shape
    tail = torch.arange(n - recent, n).expand(num_heads, -1)
    heavy = torch.topk(scores[:, : n - recent], keep - recent, dim=1).indices
    return torch.cat([heavy, tail], dim=1).sort(dim=1).values


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("| rows | tokens | budget | recent | top-k + sort ms | now ms | same set |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for rows, n, keep, recent in CASES:
        scores = torch.rand(rows, n)
        same = torch.equal(topk_and_sort(scores, keep, recent),
                           recent_plus_top_scored(scores, keep, recent))
        print(f"| {rows} | {n} | {keep} | {recent} | {median_ms(topk_and_sort, scores, keep, recent):.2f}"
              f" | {median_ms(recent_plus_top_scored, scores, keep, recent):.2f} | {same} |")
