"""`vllm serve MODEL --kv-eviction h2o --data-parallel-size 2` on this CPU,
with the prompt-module routes and one API server.

vLLM runs a dense model's data-parallel ranks as independent engines (each
engine core with its own scheduler, KV pool and worker), and the plugin loads
in each. A schema is registered (its modules encoded on one engine), then
four concurrent completions over H2O's budget of 64, two of them PML prompts
importing its modules, reach both engines (vLLM balances them by load): every
one is served in full (an engine that did not encode a module computes it at
the schema's positions), both engines compact (their workers' compaction time
is on `/metrics`), and both pools end empty but for the pinned module blocks,
which go back when the schema is removed.

`/metrics` names each worker by vLLM's own `engine` label beside `rank`:
before it did, both workers wrote `compaction_seconds_total{rank="0"}`, a
duplicate series (Server.metrics refuses a sample named twice). Prompt
modules need `--api-server-count 1` here: vLLM's default with DP 2 is two API
servers, which the plugin refuses with the routes loaded
(tests/test_unsupported_settings.py), as each would hold its own registry.
"""

from concurrent.futures import ThreadPoolExecutor

import requests
from conftest import PROMPTS

from vllm_kvevict.eval.server import Server

COMPLETION = 120  # block 32, budget 64: compactions at the 65th and 97th written token
# One core per engine (vLLM's auto binding puts both on core 0 and reserves core 1).
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_PLUGINS": "kvevict,kvevict_modules"}
SCHEMA = ('<schema name="city">You are a guide.'
          '<module name="paris">Paris is the capital of France. The Louvre, the largest art '
          'museum in the world, stands on the right bank of the Seine.</module>'
          '<module name="rome">Rome is the capital of Italy. The Colosseum held fifty '
          'thousand spectators.</module></schema>')
PML = ['<prompt schema="city"><rome/><paris/>Which museum is the largest? Answer:</prompt>',
       '<prompt schema="city"><paris/>Tell me about the Seine.</prompt>']


def test_serve_dp2_evicts_on_both_engines(model_path):
    with Server(model_path, "--kv-eviction", "h2o", "--kv-budget", "64",
                "--data-parallel-size", "2", "--api-server-count", "1", env=ENV) as srv:
        r = requests.post(srv.url + "/v1/kvevict/schemas", json={"pml": SCHEMA}, timeout=300)
        assert r.status_code == 200, r.text
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(
                lambda p: srv.complete(p, max_tokens=COMPLETION, ignore_eos=True),
                PML + PROMPTS[:2]))
        for r in replies:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == COMPLETION
        m = srv.metrics()
        requests_done = {k: v for k, v in m.items() if k.startswith("vllm:request_success_total{")
                         and 'finished_reason="length"' in k}
        assert sorted(v > 0 for v in requests_done.values()) == [True, True], requests_done
        assert srv.metric("vllm_kvevict_compactions_total") >= 4 * 2
        seconds = {k: v for k, v in m.items()
                   if k.startswith("vllm_kvevict_compaction_seconds_total")}
        assert sorted(seconds) == ['vllm_kvevict_compaction_seconds_total{engine="0",rank="0"}',
                                   'vllm_kvevict_compaction_seconds_total{engine="1",rank="0"}'], \
            seconds
        assert all(v > 0 for v in seconds.values()), seconds
        r = requests.delete(srv.url + "/v1/kvevict/schemas/city", timeout=60)
        assert r.status_code == 200, r.text
        m = srv.wait_idle()
        usage = [v for k, v in m.items() if k.startswith("vllm:kv_cache_usage_perc{")]
        assert usage == [0.0, 0.0], usage  # every block back in both engines' pools
