"""A small run of the load benchmark (`python -m vllm_kvevict.eval.load`)
against a real plugin server: 40 streaming requests at once (completions and
chat, some cancelled mid-stream) under H2O at a budget that evicts. Afterwards
vLLM's own accounting must show the pool whole (`vllm:kv_cache_usage_perc` and
running requests back to 0), no response may carry another request's code
word, and nothing may fail. Timings are not asserted (they live in the
benchmark's table). The benchmark's comparison of solo re-sends with stock's
needs a stock server under the same load, which the suite does not start (about
a minute of one core); `load.checks` is held to made-up rows instead, which
shows each of its checks fails on bad data."""

import pytest

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
    assert row["solo_checked"] == 2  # the solo re-sends ran (compared with stock only in the benchmark)
    assert load.checks([row]) == []


def _row(name="x", **over):
    row = {"server": name, "kv_usage_idle": 0, "running_idle": 0, "mixed": [], "failed": 0,
           "errors": [], "solo_checked": 10, "solo_same": 10}
    return {**row, **over}


@pytest.mark.parametrize("bad, words", [
    ({"kv_usage_idle": 0.02}, "pool not whole"),
    ({"running_idle": 1}, "pool not whole"),
    ({"mixed": [3]}, "another request's code"),
    ({"failed": 1, "errors": ["boom"]}, "requests failed"),
])
def test_load_checks_fail_on_a_bad_row(bad, words):
    """Each per-row check fails on a row that breaks it, alone or as the plugin
    row beside a good stock row; a good row passes."""
    assert load.checks([_row()]) == []
    for rows in ([_row(**bad)], [_row("stock"), _row("h2o", **bad)]):
        failures = load.checks(rows)
        assert len(failures) == 1 and words in failures[0], failures


def test_load_checks_compare_plugin_with_stock():
    """Two rows are stock (first) and the plugin (last): the plugin fails when it
    matches its solo output more than 10 points less often than stock."""
    stock = _row("stock", solo_same=9)
    assert load.checks([stock, _row("h2o", solo_same=8)]) == []      # 80% vs 90%
    assert load.checks([stock, _row("h2o", solo_same=10)]) == []     # better than stock
    failures = load.checks([stock, _row("h2o", solo_same=7)])       # 70% vs 90%
    assert len(failures) == 1 and "solo output in 70%" in failures[0], failures
