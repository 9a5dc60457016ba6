"""Tensor parallel size 2 on CPU (`mp` executor) gives the same greedy tokens as
size 1, with the same eviction policy and budget.

Model: Qwen2.5-Coder-0.5B-Instruct (14 query / 2 KV heads, so each of the two
ranks holds one KV head; SmolLM2's 3 KV heads do not split over 2 ranks).

dtype float32, on purpose: in bfloat16, stock vLLM 0.32 (plugin disabled) already
generates different greedy tokens at TP 2 than at TP 1 (measured on conftest.PROMPTS,
which these runs used until 2026-12-01: 3 of the 4 prompts differ, from their 2nd, 5th
and 40th tokens), most likely
because each row-parallel layer (o_proj, down_proj) rounds its partial sum to bf16 before the
all-reduce adds the two, where TP 1 rounds one full sum; the bf16 logits then
flip near-ties (at the 2nd token of the first prompt, TP 1 has " l" and " keeper"
at exactly the same logprob, -1.4159; TP 2 has -1.416 and -1.3535). The plugin
follows stock exactly there too: at budget >= length it gives stock's tokens at
TP 1 and at TP 2 in bf16, and with eviction its TP 1 vs TP 2 tokens part at the
same positions as stock's (measured, not repeated here to keep this file near 3
minutes). In float32, stock TP 1 and TP 2 agree token for token on this machine,
which `test_stock_vllm_tp2_equals_tp1_in_float32` checks first, so a difference
left in the other tests is the plugin's.

What runs where (tests/tp_runs.py; every engine in a subprocess of
tests/tp_generate.py, since VLLM_CPU_OMP_THREADS_BIND and VLLM_PLUGINS must be
set before the process's first engine): one plugin process, shared with
tests/test_ray.py, runs H2O at TP 1 and at TP 2 (`mp`) on a 2048-token server
whose requests ask for a 64-token budget (`kv_budget` in SamplingParams
.extra_args; the same plans as a 64-token server, see tests/tp_runs.py), the TP 2
engine then generating again at the server's budget (>= length: no eviction);
and last Ray (test_ray.py). One stock process (plugin not loaded) runs TP 1 and
TP 2. The `slow` tier adds StreamingLLM at TP 1 and TP 2 on a 64-token server
(a third process; why it repeats H2O's TP 2 path: tests/tp_runs.py). The engine core is
in-process there, so the scheduler-side managers' counters (compactions, evicted
tokens, per pass) and vLLM's BlockPool are read.
"""

import pytest
from tp_runs import (
    BLOCK,
    BUDGET,
    PROMPTS,
    one_pass,
    plugin_runs,
    stock_runs,
    streaming_runs,
)

from vllm_kvevict.core.eviction.planner import max_blocks_per_request

# (policy, tp) -> (run in tp_runs.PLUGIN_RUNS, its pass): budget 64 per request
# for H2O, the server's 64 for StreamingLLM; "h2o full": budget >= length.
PASSES = {("h2o", 1): ("h2o_tp1", BUDGET), ("h2o", 2): ("h2o_tp2", BUDGET),
          ("h2o full", 2): ("h2o_tp2", None),
          ("streaming", 1): ("streaming_tp1", None), ("streaming", 2): ("streaming_tp2", None)}


@pytest.fixture(scope="module")
def plugin():
    def run(policy, tp):  # a run that failed fails only the tests that read it
        name, budget = PASSES[policy, tp]
        runs = streaming_runs() if policy == "streaming" else plugin_runs()
        return one_pass(runs[name], budget)
    return run


@pytest.fixture(scope="module")
def stock():
    return stock_runs()


def test_stock_vllm_tp2_equals_tp1_in_float32(stock):
    """The premise: without the plugin, TP 2 and TP 1 agree (float32)."""
    assert stock["tp2"]["ids"] == stock["tp1"]["ids"]


@pytest.mark.parametrize("policy", ["h2o", pytest.param("streaming", marks=pytest.mark.slow)])
def test_tp2_equals_tp1_under_eviction(plugin, policy):
    """Same policy and budget: identical greedy tokens at TP 1 and TP 2, through
    several compactions per request that really returned blocks to vLLM's pool."""
    tp1, tp2 = plugin(policy, 1), plugin(policy, 2)
    for run in (tp1, tp2):
        # 101-106 tokens per request at budget 64: compactions at the 65th and 97th written token.
        assert run["compactions"] >= 2 * len(PROMPTS)
        assert run["evicted"] >= 2 * len(PROMPTS) * BLOCK
        assert run["max_blocks"] <= max_blocks_per_request(BUDGET, BLOCK)
        assert run["pool_whole"]
    assert (tp2["compactions"], tp2["evicted"]) == (tp1["compactions"], tp1["evicted"])
    assert tp2["ids"] == tp1["ids"]


def test_tp2_plugin_equals_stock_without_eviction_and_eviction_changes_tokens(plugin, stock):
    """At TP 2, budget >= length: the plugin's own KV write, attention and scoring
    on one KV head per rank give stock vLLM's tokens exactly (the same engine as
    the TP 2 H2O run, generating again without a per-request budget). At budget 64
    the tokens differ from stock: the workers really attend to fewer keys."""
    full = plugin("h2o full", 2)
    assert full["compactions"] == full["evicted"] == 0
    assert full["ids"] == stock["tp2"]["ids"]
    assert plugin("h2o", 2)["ids"] != stock["tp2"]["ids"]


@pytest.mark.slow
def test_streaming_tp2_evicts_other_tokens_than_h2o(plugin, stock):
    """StreamingLLM keeps other tokens than H2O (so its tokens differ from both
    stock's and H2O's at budget 64)."""
    h2o, streaming = plugin("h2o", 2)["ids"], plugin("streaming", 2)["ids"]
    assert streaming != stock["tp2"]["ids"]
    assert h2o != streaming
