"""A small run of benchmarks/load.py against a real plugin server: 40 streaming
requests at once (completions and chat, some cancelled mid-stream) under H2O at
a budget that evicts. Afterwards vLLM's own accounting must show the pool whole
(`vllm:kv_cache_usage_perc` and running requests back to 0), no response may
carry another request's code word, and nothing may fail. Timings are not
asserted (they live in the benchmark's table)."""

from vllm_kvevict.eval import load


def test_load_leaves_pool_whole_and_requests_apart(h2o_server):
    """On the suite's shared h2o server (conftest.H2O_SERVER_ARGS: budget 64,
    --max-num-seqs 64)."""
    reqs = load.make_requests(40, cancel_frac=0.2, seed=1)
    assert any(r["cancel_after"] for r in reqs)
    row = load.run_against("h2o@64", h2o_server, reqs, solo=2)
    assert row["failed"] == 0, row["errors"]
    assert row["completed"] + row["cancelled"] == len(reqs)
    assert row["cancelled"] == sum(bool(r["cancel_after"]) for r in reqs)
    assert row["tokens_evicted"] > 0  # eviction really ran under load
    assert (row["kv_usage_idle"], row["running_idle"]) == (0, 0)
    assert row["mixed"] == []
    assert load.checks([row]) == []
