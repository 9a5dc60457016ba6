"""torch.profiler over `compaction.fill_holes`, in benchmarks/compaction_cpu.py's
default case (30 layers x 3 KV heads x 64, bf16, block 32, 4,128 -> 4,096
tokens, H2O-style top-k kept set), 10 calls after 3 warm-up calls, one thread:

    VLLM_CPU_OMP_THREADS_BIND=0 taskset -c 0 .venv/bin/python scripts/measure/fill_holes_profile.py

Prints the aten ops by self CPU time (docs/results.md quotes it).
"""

import torch
from torch.profiler import ProfilerActivity, profile

from vllm_kvevict.core.compaction import fill_holes
from vllm_kvevict.core.cpu_layout import token_slots
from vllm_kvevict.integration.cpu_backend import layout_for_cache

LAYERS, HEADS, D, BS, OLD, NEW = 30, 3, 64, 32, 4128, 4096

torch.set_num_threads(1)
nb = OLD // BS + 8
buf = torch.randn(LAYERS * nb, HEADS, BS, 2 * D).to(torch.bfloat16)
layout = layout_for_cache(buf[:nb], "vec")
kc, vc = layout.split(buf)
n_src, n_dst = -(-OLD // BS), -(-NEW // BS)
blocks = torch.arange(n_src) + 4
layer = torch.arange(LAYERS)[:, None]
src_rows = blocks[None] + layer * nb
all_scores = torch.rand(HEADS, LAYERS * nb * BS)
src_slots = token_slots(blocks, OLD, BS)[None] + layer * nb * BS
keep = all_scores[:, src_slots].transpose(0, 1).topk(NEW, dim=-1).indices


def call():
    fill_holes(layout, kc, vc, src_rows, src_rows[:, :n_dst], keep, OLD, all_scores)


for _ in range(3):
    call()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(10):
        call()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
