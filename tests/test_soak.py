"""A short run of the soak (`python -m vllm_kvevict.eval.soak`, the full one is
2,400 requests) against real servers: per-request budgets, client
cancellations, prompt modules with schemas added and removed
beside the load. A short pool makes vLLM preempt now and then (2-4 times in
the modules phase's 40 requests here, none in one CI run: admission reserves a
request's budget plus a chunk, so preemption is rare by design); the tests that
force it are test_engine.py's and test_prompt_modules_engines.py's preemption
cases. After each phase vLLM's own accounting must show the pool
whole (pinned module blocks aside, then none once the schema is removed), no
response may carry another request's code word, nothing may fail, and the
engine core must be the one the phase started with."""

import pytest

from vllm_kvevict.eval import soak
from vllm_kvevict.eval.server import Server


def test_h2o_phase_on_the_shared_server(h2o_server):
    """conftest.H2O_SERVER_ARGS: budget 64, so per-request budgets are 32 or 64."""
    reqs = soak.make_requests(60, 64, cancel=0.15, seed=3)
    row = soak.run_phase("h2o", h2o_server, reqs, wave=30)
    assert soak.checks(row) == [], row
    assert row["own_budget"] > 0 and row["cancelled"] > 0 and row["tokens_evicted"] > 0, row
    assert row["completed"] + row["cancelled"] == len(reqs), row


@pytest.fixture(scope="module")
def modules_server(model_path):
    args, env = soak.PHASES["modules"]  # snapkv, a short pool
    with Server(model_path, *args, env=env) as srv:
        yield srv


def test_modules_phase_with_schema_churn_on_a_short_pool(modules_server):
    schema = soak.register_schema(modules_server, "soak", 4)
    reqs = soak.make_requests(40, 128, cancel=0.15, seed=4, schema=schema)
    row = soak.run_phase("modules", modules_server, reqs, wave=20, churn_seed=4)
    soak.remove_schema(modules_server, row, "soak")
    assert soak.checks(row) == [], row
    assert row["kv_usage_start"] > 0  # the pinned module blocks were counted
    assert row["pml"] > 0 and row["churn"]["registered"] >= 1, row
    assert row["tokens_evicted"] > 0, row  # snapkv really compacted the importers
    assert row["kv_usage_after_removal"] == 0, row
