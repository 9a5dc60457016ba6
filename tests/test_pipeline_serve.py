"""`vllm serve MODEL --kv-eviction h2o --pipeline-parallel-size 2` on this CPU,
over `mp` and over Ray: it serves with eviction on both stages, fails like
stock when a stage's worker is killed, and shuts down quietly.

SmolLM2-135M (30 layers: 15 per stage), H2O at budget 64, a 200-token
completion (compacted several times), one core per stage
(VLLM_CPU_OMP_THREADS_BIND="0|1"). Per server:
- the completion is served and `/metrics` shows compactions, the worker
  time spent compacting on both stages (`compaction_seconds_total{rank}`: one
  series per worker, rank = stage x TP size + TP rank), and vLLM's KV usage back
  to 0 after it (every block back in the pool the two stages share);
- `mp`: the second stage's worker is SIGKILLed while three streams generate
  (tests/test_worker_fault.py's harness): streams end with the 500 event,
  the API server exits by itself, nothing of the server is left (the
  behaviour measured of stock vLLM there; stock eager PP 2 does not run on
  vllm-cpu 0.32, patches/pp_intermediate_tensors.py);
- Ray (a local instance the server starts, on loopback, in the server's
  session): stopped with SIGINT, the server exits and its output, which
  carries the Ray workers' own, has no nanobind "leaked" report (the plugin
  unfreezes the heap at exit in every process it loads in, see
  vllm_kvevict/__init__.py).
"""

import pytest
from test_worker_fault import KILL_AFTER, check_fault, kill_mid_run

from vllm_kvevict.eval.server import Server

H2O = ("--kv-eviction", "h2o", "--kv-budget", "64")
PP2 = ("--pipeline-parallel-size", "2")
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1",
       # Ray on loopback only (see tests/tp_generate.py); read by every Ray process.
       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
PROMPT = "Write a long story about a lighthouse keeper."


def serve_and_check(srv: Server) -> None:
    """One evicting completion; both stages compacted; the pool whole after."""
    r = srv.complete(PROMPT, max_tokens=200, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 200
    m = srv.wait_idle()
    assert srv.metric("vllm_kvevict_compactions_total") >= 3  # 210 tokens at budget 64
    seconds = {k: v for k, v in m.items()
               if k.startswith("vllm_kvevict_compaction_seconds_total")}
    assert sorted(seconds) == ['vllm_kvevict_compaction_seconds_total{rank="0"}',
                               'vllm_kvevict_compaction_seconds_total{rank="1"}'], seconds
    assert all(v > 0 for v in seconds.values()), seconds
    assert sum(v for k, v in m.items() if k.startswith("vllm:kv_cache_usage_perc")) == 0


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_serve_pp2(model_path, backend):
    with Server(model_path, *H2O, *PP2, "--distributed-executor-backend", backend,
                env=ENV) as srv:
        serve_and_check(srv)
        if backend == "mp":
            rec = kill_mid_run(srv, "worker", end_within=60.0)
            check_fault(rec, plugin=True, tp=2)  # two workers: one per stage
            assert min(rec["tokens_at_kill"]) >= KILL_AFTER
            return
        srv.stop()
        assert srv.proc.returncode is not None
        log = srv.log()
    leaks = [line for line in log.splitlines() if "nanobind" in line]
    assert "RayWorker" in log  # the Ray workers' output reached this log
    assert not leaks, f"{len(leaks)} lines, e.g. {leaks[:5]}"
