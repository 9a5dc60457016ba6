"""Tensor parallel 2 over vLLM's Ray executor, on this CPU (patches/ray_on_cpu.py).

The Ray run is the last engine of the plugin process tests/tp_runs.py shares
with tests/test_tensor_parallel.py (a subprocess of tests/tp_generate.py): TP 2
with `distributed_executor_backend="ray"` over a local Ray instance it starts on
loopback (127.0.0.1 only) and shuts down after, H2O on a 64-token server; it is
compared with that process's TP 1 H2O run (a 2048-token server whose requests
ask for 64 tokens: the same plans, see tests/tp_runs.py, so this comparison
checks that too). Every process of that subprocess is killed when it ends,
however it ends; float32 on Qwen2.5-Coder-0.5B (2 KV heads: one per rank), for
the reason tests/test_tensor_parallel.py gives. Checked:
- the same greedy tokens as TP 1, with the same H2O budget, evicting;
- the plugin is live in every Ray worker (each rank is a Ray actor process
  whose eviction state exists and compacts), and each worker is bound to its
  own core by VLLM_CPU_OMP_THREADS_BIND="0|1", as the `mp` executor binds,
  and sees Ray's node at 127.0.0.1;
- each rank scores its own KV head: rank r holds one head and, at every
  compaction, keeps exactly the logical positions TP 1 keeps for head r.
"""

import pytest
from tp_runs import BUDGET, MAX_TOKENS, PROMPTS, one_pass, plugin_runs


@pytest.fixture(scope="module")
def runs():
    runs = plugin_runs()
    ray = runs["h2o_ray_tp2"]
    tp2 = one_pass(ray, None)  # the server's budget: 64
    return one_pass(runs["h2o_tp1"], BUDGET), {**tp2, "workers": ray["workers"]}


def test_ray_tp2_generates_what_tp1_does(runs):
    tp1, tp2 = runs
    assert [len(ids) for ids in tp2["ids"]] == [MAX_TOKENS] * len(PROMPTS)
    assert tp2["compactions"] == tp1["compactions"] > 0  # eviction really ran
    assert tp2["ids"] == tp1["ids"]
    assert tp2["pool_whole"]  # every block back in vLLM's pool


def test_plugin_is_live_in_every_ray_worker(runs):
    _, tp2 = runs
    workers = tp2["workers"]
    assert sorted(w["rank"] for w in workers) == [0, 1]
    assert all(w["plugin"] and w["ray_actor"] for w in workers), workers
    assert len({w["pid"] for w in workers}) == 2
    assert {w["rank"]: w["cpus"] for w in workers} == {0: [0], 1: [1]}
    assert all(w["ray_node_ip"] == "127.0.0.1" for w in workers)  # Ray on loopback
    assert all(k["history"] for k in tp2["kept"])  # each rank compacted


def test_each_rank_scores_its_own_kv_head(runs):
    tp1, tp2 = runs
    (single,) = tp1["kept"]
    assert single["kv_heads"] == [2]
    by_rank = {w["rank"]: k for w, k in zip(tp2["workers"], tp2["kept"])}
    for rank, kept in by_rank.items():
        assert kept["kv_heads"] == [1]
        assert len(kept["history"]) == len(single["history"])
        for (req, length, pos), (req1, length1, pos1) in zip(kept["history"],
                                                              single["history"]):
            assert (req, length) == (req1, length1)
            assert [layer[0] for layer in pos] == [layer[rank] for layer in pos1], \
                f"rank {rank}, request {req} at length {length}"
