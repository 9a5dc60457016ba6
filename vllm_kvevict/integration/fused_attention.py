"""CPU steps in which no request is held to stock vLLM's tokens: attention
from the plugin's own pass over the paged cache
(`cpu_kernel.attend_add_column_sums`, cpu_kernel/fused_attention.h) instead
of vLLM's, with H2O's scores added in the same pass (instead of the scoring
kernel after attention). Other policies take the pass for attention alone
(no row scored): on an AVX2 EPYC in float32 it ran 0.68-0.83x of vLLM's
attention on prompt chunks and 0.54-1.00x on decode steps
(benchmarks/cpu_kernel.py, "pass, no rows scored"); SnapKV/AnDPro's layers
still log their queries for the window, as in any step.

H2O's contract is the attention each query pays each key, so its scoring is
attention's logits once more: at long prompts (served, 8 x 3,000 tokens)
vLLM's attention took 50% of the worker's time and the scoring kernel 11.5%;
at decode every layer hands its queries to the decode log, flushed through
the kernel later. The pass computes the logits once, float32-accurate as the
scoring kernel does, and takes the exps for both the column sums and P V
(prefill, two threads: 0.5x vLLM's attention plus the scoring kernel; decode
rows, which it reads in place: 0.6-1.0x vLLM's attention alone;
benchmarks/cpu_kernel.py). An H2O step that takes it scores every scored
row in the pass: its layers log nothing (a step with speculative drafts
takes the pass for attention alone, `records`).

Why only steps whose every request diverges from stock anyway: the pass's
output is as accurate as vLLM's (tests/test_fused_attention.py) but not bit
for bit the same, and the plugin promises stock's tokens wherever nothing is
evicted. A request that compacts right after its prompt (a prompt over its
budget, or any fractional budget under 1 that its prompt's blocks exceed) or
has evicted already differs from stock from its second token on; its first
token comes from the fused prompt and could differ where a bf16 rounding
tips an argmax. Requests within their budget never take the pass, and
neither does any step they are in.

Decided once per step by the metadata builder (`wanted`, then `plan`), for
all its layers:
  - no request holds private (shared-block) scores, and offload is off;
  - vLLM runs its vec / vec16 CPU attention on a bf16 or float32 model and
    cache (`cpu_kernel.fused_isa`: AVX-512 BF16 for bf16 where the CPU has it,
    else AVX2 + FMA), with no sliding window, ALiBi, soft-cap or sinks (the
    backend refuses those); or its amx attention (bf16 on AMX CPUs), for
    H2O only, whose steps the pass runs on AMX tiles there (`wanted`);
  - VLLM_KVEVICT_CPU_FUSED is `on` (the default; `off` keeps vLLM's
    attention everywhere, for comparisons).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.config.env import env_choice
from vllm_kvevict.core.eviction import kernel_dispatch
from vllm_kvevict.integration.worker import worker_state

FUSED_ATTR = "kvevict_fused"  # a FusedStep on the step's attention metadata, or None


class FusedStep(NamedTuple):
    """The step's rows as the pass reads them (host tensors, made once per step)."""
    starts: torch.Tensor  # (R + 1,) int64 query_start_loc
    seq: torch.Tensor  # (R,) int64 physical lengths
    blocks: torch.Tensor  # (R, nblk) int64 block table, nblk covering every row
    score_rows: torch.Tensor  # (R,) bool: the rows whose scores the pass adds
    records: bool  # the pass is the step's recording (H2O): the layers log nothing


def enabled() -> bool:
    """VLLM_KVEVICT_CPU_FUSED on (the default; or off), and the compiled kernel
    not turned off (VLLM_KVEVICT_KERNELS=torch turns the pass off with it)."""
    return (env_choice("VLLM_KVEVICT_CPU_FUSED", ("on", "off")) == "on"
            and kernel_dispatch.mode() != "torch")


def reads(builder) -> bool:
    """Whether the pass may take the steps of this builder's layers: vLLM's
    vec / vec16 layouts of a bf16 or float32 model and cache, or its amx
    layout (bf16 on AMX CPUs) where the kernel's path is amx (AMX tiles;
    `wanted` takes it there for H2O only); head sizes the kernel takes, a
    path for the dtype on this CPU, and the pass switched on."""
    layout_read = builder.isa in ("vec", "vec16") or (
        builder.isa == "amx" and cpu_kernel.isa() == "amx"
        and cpu_kernel.fused_isa(builder.dtype) == "avx512bf16")
    return (layout_read and builder.kv_cache_dtype == "auto"
            and cpu_kernel.fused_pass_runs(builder.dtype, builder.head_dim, builder.block_size)
            and enabled())


def wanted(builder, state, cm) -> bool:
    """Before the step's queries are placed: whether it takes the pass.
    cm: the physical CommonAttentionMetadata of the step."""
    if state.private.tokens or state.cfg.offload or not reads(builder):
        return False
    # On vLLM's amx layout (bf16, AMX CPUs) only a policy whose scores come
    # from the pass (H2O): its tiles (fused_attention_amx.h) took 0.54-0.61x
    # vLLM's AMX attention plus the scoring kernel on prompt chunks and
    # 0.86-1.02x on decode steps, but attention alone 0.94-1.13x vLLM's
    # (2-core Xeon, benchmarks/cpu_kernel.py, results/xeon/cpu_kernel_amx.md).
    if builder.isa == "amx" and not records(state):
        return False
    return state.all_rows_diverge(cm.num_reqs)


def records(state) -> bool:
    """Whether a step that takes the pass gets its recording from it (H2O's
    scores): then the recorder places none of the step's queries
    (`place_queries` with no row scored), so no decode query waits in the
    decode log and no chunk in the chunk log. Otherwise the layers record as
    in any step (SnapKV/AnDPro log their queries; StreamingLLM records
    nothing). A step with speculative drafts takes the pass for attention
    alone: H2O logs its rows' queries and scores the accepted ones next step,
    where the pass would score every draft now, rejected ones included."""
    return state.recorder.fuses_cpu_step and not state.drafts


def plan(builder, state, cm, placement, scored: torch.Tensor | None) -> FusedStep | None:
    """After placing a step that `wanted` the pass: its FusedStep, or None
    where the pass would record but the recorder placed nothing (a second
    builder in the step, a dummy run: the layers then score every row
    themselves, after vLLM's attention). scored: H2O's rows to score (None:
    all); a pass that does not record scores no row."""
    in_pass = records(state)
    if in_pass and placement is None:
        return None
    n = cm.num_reqs
    seq = cm.seq_lens[:n].long().cpu()
    nblk = -(-int(seq.max()) // builder.block_size)
    blocks = cm.block_table_tensor[:n, :nblk].long().cpu()
    if not in_pass:
        rows = torch.zeros(n, dtype=torch.bool)
    else:
        rows = torch.ones(n, dtype=torch.bool) if scored is None else scored
    return FusedStep(cm.query_start_loc_cpu[: n + 1].long(), seq, blocks, rows, in_pass)


def attend(impl, layer, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata,
           output: torch.Tensor, step: FusedStep, make_layout) -> torch.Tensor:
    """Run the pass for one layer into `output` (num_tokens, H_q * D), the
    scored rows' scores into the layer's score buffer ((H, 0) for a policy
    that keeps none: then no row is scored). The kernel refuses a
    cache it cannot read (`reads` keeps those from being planned)."""
    lc = worker_state().layer(layer.layer_name, kv_cache, make_layout)
    n = attn_metadata.num_actual_tokens
    hq, d = query.shape[1], query.shape[2]
    key_cache, value_cache = lc.layout.split(kv_cache)
    cpu_kernel.attend_add_column_sums(output[:n].view(n, hq, d), lc.layout, key_cache, value_cache,
                                      query[:n], step.starts, step.seq, step.blocks,
                                      step.score_rows, impl.scale, lc.scores)
    return output
