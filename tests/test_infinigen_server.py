"""`vllm serve MODEL --kv-eviction infinigen` as a user types it (plus the
suite's small pool and eager mode): a real server offloads and answers."""

import pytest
from vllm_kvevict.eval.server import Server


@pytest.fixture(scope="module")
def server(model_path, calibrated):  # the server finds the session's skewing file
    with Server(model_path, "--kv-eviction", "infinigen", "--kv-budget", "64",
                "--kv-swap-space", "64MiB") as srv:
        yield srv


def test_infinigen_server_evicts_to_the_host_and_frees_every_block(server):
    before = server.metric("vllm_kvevict_tokens_evicted_total")
    r = server.complete("Tell me a long story about a lighthouse keeper.", max_tokens=300,
                        ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 300
    m = server.wait_idle()
    info = [k for k in m if k.startswith("vllm_kvevict_info{")]
    assert len(info) == 1 and 'policy="infinigen"' in info[0]
    # prompt + 300 tokens seen (the last one never written), at most
    # budget + block - 1 = 95 left resident
    seen = r.json()["usage"]["prompt_tokens"] + 299
    assert server.metric("vllm_kvevict_tokens_evicted_total") - before >= seen - 95
    assert sum(v for k, v in m.items() if k.startswith("vllm:kv_cache_usage_perc")) == 0
    bad = server.complete("hi", max_tokens=5, vllm_xargs={"kv_alpha": 1})
    assert bad.status_code == 400 and "kv_alpha" in bad.text
    assert server.healthy()
