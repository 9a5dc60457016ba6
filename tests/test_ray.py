"""Tensor parallel 2 over vLLM's Ray executor, on this CPU (patches/ray_on_cpu.py).

One subprocess (tests/tp_generate.py) runs TP 1 and then TP 2 with
`distributed_executor_backend="ray"` over a local Ray instance it starts on
loopback (127.0.0.1 only) and shuts down after; every process of that run is
killed when it ends, however it ends; float32 on Qwen2.5-Coder-0.5B (2 KV heads:
one per rank), for the reason tests/test_tensor_parallel.py gives. Checked:
- the same greedy tokens as TP 1, with the same H2O budget, evicting;
- the plugin is live in every Ray worker (each rank is a Ray actor process
  whose eviction state exists and compacts), and each worker is bound to its
  own core by VLLM_CPU_OMP_THREADS_BIND="0|1", as the `mp` executor binds,
  and sees Ray's node at 127.0.0.1;
- each rank scores its own KV head: rank r holds one head and, at every
  compaction, keeps exactly the logical positions TP 1 keeps for head r.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import PROMPTS

HERE = os.path.dirname(__file__)
MAX_TOKENS = 100
RUNS = [{"tp": 1, "policy": "h2o", "budget": 32},
        {"tp": 2, "policy": "h2o", "budget": 32, "backend": "ray"}]


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (Ray gives its workers their own
    process groups, but they stay in the session of the process that started Ray)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture(scope="module")
def runs():
    from vllm_kvevict.models import ensure_qwen25_coder

    # Own session: the engine, Ray (started in there, on loopback) and its
    # workers all carry the session id of this child, and are killed below
    # whatever happened, so no Ray process outlives the test even if the run
    # fails or times out (a killed Ray driver leaves Ray's agents behind).
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "tp_generate.py"), ensure_qwen25_coder(),
         json.dumps(RUNS), "--dtype", "float32", "--max-tokens", str(MAX_TOKENS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        stdout, stderr = proc.communicate(json.dumps(PROMPTS), timeout=600)
    finally:
        _kill_session(proc.pid)
        proc.wait()
    assert proc.returncode == 0, stderr[-5000:]
    tp1, tp2 = json.loads(stdout.split("RESULT=")[-1])
    return tp1, tp2


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
