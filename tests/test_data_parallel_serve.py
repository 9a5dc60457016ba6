"""`vllm serve MODEL --kv-eviction h2o --data-parallel-size 2` on this CPU.

vLLM runs a dense model's data-parallel ranks as independent engines behind
one API server (each engine core with its own scheduler, KV pool and worker),
and the plugin loads in each. Four concurrent completions over H2O's budget
of 64 reach both engines (vLLM balances them by load): every one is served
in full, both engines compact (their workers' compaction time is on
`/metrics`), and both pools end empty. `/metrics` names each worker by
vLLM's own `engine` label beside `rank`: before it did, both workers wrote
`compaction_seconds_total{rank="0"}`, a duplicate series (Server.metrics
refuses a sample named twice).
"""

from concurrent.futures import ThreadPoolExecutor

from conftest import PROMPTS

from vllm_kvevict.eval.server import Server

COMPLETION = 120  # block 32, budget 64: compactions at the 65th and 97th written token
# One core per engine (vLLM's auto binding puts both on core 0 and reserves core 1).
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def test_serve_dp2_evicts_on_both_engines(model_path):
    with Server(model_path, "--kv-eviction", "h2o", "--kv-budget", "64",
                "--data-parallel-size", "2", env=ENV) as srv:
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(
                lambda p: srv.complete(p, max_tokens=COMPLETION, ignore_eos=True), PROMPTS[:4]))
        for r in replies:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == COMPLETION
        m = srv.wait_idle()
        requests = {k: v for k, v in m.items() if k.startswith("vllm:request_success_total{")
                    and 'finished_reason="length"' in k}
        assert sorted(v > 0 for v in requests.values()) == [True, True], requests  # both served
        assert srv.metric("vllm_kvevict_compactions_total") >= 4 * 2
        seconds = {k: v for k, v in m.items()
                   if k.startswith("vllm_kvevict_compaction_seconds_total")}
        assert sorted(seconds) == ['vllm_kvevict_compaction_seconds_total{engine="0",rank="0"}',
                                   'vllm_kvevict_compaction_seconds_total{engine="1",rank="0"}'], \
            seconds
        assert all(v > 0 for v in seconds.values()), seconds
        usage = [v for k, v in m.items() if k.startswith("vllm:kv_cache_usage_perc{")]
        assert usage == [0.0, 0.0], usage  # every block back in both engines' pools
