"""`vllm serve MODEL --kv-eviction infinigen` as a user types it (plus the
suite's small pool and eager mode): a real server offloads and answers;
/metrics shows the host tier took what the device tier evicted."""

import json
import os

import pytest

from vllm_kvevict.eval.server import Server


@pytest.fixture(scope="module")
def server(model_path, calibrated):  # the server finds the session's skewing file
    with Server(model_path, "--kv-eviction", "infinigen", "--kv-budget", "64",
                "--kv-swap-space", "64MiB") as srv:
        yield srv


def test_infinigen_server_evicts_to_the_host_and_frees_every_block(server, model_path):
    """What the device tier dropped (vLLM's pool, the scheduler's eviction count)
    and what the host tier took (the worker's own count of entries written to
    it): every evicted token, in every layer and KV head."""
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    per_token = cfg["num_hidden_layers"] * cfg["num_key_value_heads"]
    before = server.metric("vllm_kvevict_tokens_evicted_total")
    host0 = server.metric("vllm_kvevict_host_entries_offloaded_total")
    r = server.complete("Tell me a long story about a lighthouse keeper.", max_tokens=300,
                        ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 300
    m = server.wait_idle()
    info = [k for k in m if k.startswith("vllm_kvevict_info{")]
    assert len(info) == 1 and 'policy="infinigen"' in info[0]
    # prompt + 300 tokens seen (the last one never written), at most the
    # budget (64) left resident
    seen = r.json()["usage"]["prompt_tokens"] + 299
    evicted = server.metric("vllm_kvevict_tokens_evicted_total") - before
    assert evicted >= seen - 64
    host = server.metric("vllm_kvevict_host_entries_offloaded_total") - host0
    assert host == evicted * per_token, (host, evicted, per_token)
    assert sum(v for k, v in m.items() if k.startswith("vllm:kv_cache_usage_perc")) == 0
    bad = server.complete("hi", max_tokens=5, vllm_xargs={"kv_alpha": 1})
    assert bad.status_code == 400 and "kv_alpha" in bad.text
    assert server.healthy()
