"""H2O/SnapKV/AnDPro selection (`policies.recent_plus_top_scored`) against the
top-k-and-sort it replaced, and, with the hole plan that follows it at a
compaction, the torch selection + the compiled `plan_hole_moves` against the
compiled kernel's `select_hole_moves` (both in one call), on a stacked
compaction's score rows (layers x KV heads), one thread, median of 30 calls
after one warm-up:

    taskset -c 0 .venv/bin/python scripts/measure/select_timing.py

(rows, resident tokens, budget, recent window) cases: SmolLM2's 30 x 3 rows at
4K and 8K tokens losing one 32-token block, the demo's 160-token budget, the
steady workload's compaction (160 -> 128 tokens, recent 64; 2 requests), and
a 4K-token request cut to a fifth (many dropped: the kept are found).
"""

import torch
from median_timing import median_ms

from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.policies import recent_plus_top_scored

BS, HEADS = 32, 3
CASES = [(90, 4128, 4096, 2048), (90, 8032, 8000, 4000), (90, 192, 160, 80),
         (180, 160, 128, 64), (90, 4128, 819, 409)]


def topk_and_sort(scores, keep, recent):
    """The previous selection: the top keep - recent older tokens, then a sort."""
    num_heads, n = scores.shape
    tail = torch.arange(n - recent, n).expand(num_heads, -1)
    heavy = torch.topk(scores[:, : n - recent], keep - recent, dim=1).indices
    return torch.cat([heavy, tail], dim=1).sort(dim=1).values


def blocks(rows: int, n: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows / H, ceil(n / BS)) distinct source blocks; the first ceil(keep / BS) stay."""
    n_src = -(-n // BS)
    src = torch.randperm(rows // HEADS * n_src).view(rows // HEADS, n_src)
    return src, src[:, : -(-keep // BS)].clone()


def torch_select_then_plan(mod, scores, keep, recent, src, dst):
    kept = recent_plus_top_scored(scores, keep, recent).view(src.shape[0], HEADS, keep)
    return mod.plan_hole_moves(kept, scores.shape[1], src, dst, BS)


def compiled(mod, scores, keep, recent, src, dst):
    return mod.select_hole_moves(scores.view(src.shape[0], HEADS, -1), keep, recent,
                                 torch.empty(0, dtype=torch.int64), src, dst, BS)


if __name__ == "__main__":
    torch.set_num_threads(1)
    mod = cpu_kernel.module()
    print("| rows | tokens | budget | recent | top-k + sort ms | now ms | same set "
          "| select + plan ms | compiled ms | same plan |")
    print("|---:|---:|---:|---:|---:|---:|---|---:|---:|---|")
    for rows, n, keep, recent in CASES:
        scores = torch.rand(rows, n)
        same = torch.equal(topk_and_sort(scores, keep, recent),
                           recent_plus_top_scored(scores, keep, recent))
        line = (f"| {rows} | {n} | {keep} | {recent} | {median_ms(topk_and_sort, scores, keep, recent):.2f}"
                f" | {median_ms(recent_plus_top_scored, scores, keep, recent):.2f} | {same} |")
        if mod is None:
            print(line + " - | - | (kernel not built) |")
            continue
        src, dst = blocks(rows, n, keep)
        a = torch_select_then_plan(mod, scores, keep, recent, src, dst)
        b = compiled(mod, scores, keep, recent, src, dst)
        same_plan = all(torch.equal(x, y) for x, y in zip(a, b[:-1]))
        print(line + f" {median_ms(torch_select_then_plan, mod, scores, keep, recent, src, dst):.2f}"
              f" | {median_ms(compiled, mod, scores, keep, recent, src, dst):.2f} | {same_plan} |")
