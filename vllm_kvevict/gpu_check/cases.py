"""What a check run covers: the config matrix and the sizes, per target.

A `Target` is where the checks run: a CUDA GPU (native Triton, the sizes the
issue names) or the CPU dry run (Triton's interpreter: tiny shapes, no bf16).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    device: torch.device
    dtypes: tuple[torch.dtype, ...]
    dry: bool

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"


def target(dry_run: bool) -> Target:
    if dry_run:
        return Target(torch.device("cpu"), (torch.float32, torch.float16), True)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to check on CPU")
    return Target(torch.device("cuda"), (torch.float32, torch.float16, torch.bfloat16), False)


# Llama-2-13B: 40 layers, 40 KV heads (MHA), head size 128, fp16 weights; the
# issue's serving point: block 16, 4K-token requests, batch 32. Kernels run one
# layer at a time, so one layer's cache is allocated (2.7 GB); a step is 40 of them.
LLAMA2_13B = dict(layers=40, heads=40, group=1, head_size=128, block=16, ctx=4096, batch=32,
                  dtype=torch.float16)
TINY = dict(layers=2, heads=2, group=1, head_size=32, block=16, ctx=80, batch=3,
            dtype=torch.float16)


def big(t: Target) -> dict:
    return TINY if t.dry else LLAMA2_13B


# The matrix the CPU tests cover (GQA 1/3/7, blocks 16/32/128, fp32/fp16, D 32),
# widened on a GPU to bf16 and the head sizes served models use. Not the full
# product: every value of each axis appears with every dtype (each config is a
# separate Triton compile).
PAGED = [  # (gqa, block, head_size)
    (1, 16, 32), (3, 32, 64), (7, 128, 128), (3, 16, 128), (4, 16, 64), (1, 128, 64)]
PAGED_DRY = [(1, 16, 32), (3, 32, 32), (7, 128, 32), (3, 16, 16)]
WINDOW = [  # (gqa, window, resident tokens, head_size)
    (1, 1, 1, 32), (3, 8, 50, 64), (7, 32, 300, 128), (4, 32, 1000, 128)]
WINDOW_DRY = [(1, 1, 1, 32), (3, 8, 50, 32), (7, 32, 130, 32)]
COMPACTION = [  # (block, old_len, new_len, head_size)
    (16, 100, 37, 64), (32, 64, 64, 128), (128, 300, 129, 128), (16, 40, 0, 64), (16, 1, 1, 32)]
COMPACTION_DRY = [(16, 100, 37, 32), (32, 64, 64, 32), (128, 300, 129, 16), (16, 40, 0, 32)]
PARTIAL = [(1, 64, 19), (3, 128, 38), (7, 128, 38)]  # (gqa, head_size, partial channels)
PARTIAL_DRY = [(1, 32, 10), (3, 64, 19), (7, 32, 10)]


def matrix(t: Target, full, dry):
    return dry if t.dry else full


def blocks_for(n: int, bs: int) -> int:
    return max(1, math.ceil(n / bs))
