"""Per-request budgets (SamplingParams.extra_args / OpenAI `vllm_xargs`), offline.

A request may ask for less resident KV than the server's --kv-budget. Checked
through vLLM's own accounting: the most blocks one request holds, read from the
scheduler's KV manager (`BlockProbe`); and the metrics snapshot the scheduler
writes for /metrics agrees with the manager's counters.

The engine is the suite's shared h2o engine (conftest.engine_settings: server
budget 256), so counters are compared before and after this file's requests.
"""

import pytest
from conftest import PROMPTS, SERVER_BUDGET, engine_settings

from vllm_kvevict.core.eviction.planner import max_blocks_per_request
from vllm_kvevict.integration.metrics import EvictionCollector
from vllm_kvevict.probe import attach

MAX_TOKENS = 200  # prompts are 9-28 tokens: 209-228 per request, under 256


@pytest.fixture
def llm(engines):
    return engines.get(**engine_settings("h2o"))


@pytest.fixture(scope="module")
def at_64(engines):
    """The tokens of a budget-64 run, once: every refused request below must leave
    the engine producing exactly these."""
    return _run(engines.get(**engine_settings("h2o")), {"kv_budget": 64})[1]


def _run(llm, extra_args=None):
    from vllm import SamplingParams

    probe = attach(llm)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            extra_args=extra_args)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return probe, [o.outputs[0].token_ids for o in outs]


def _refuse(llm, extra, match=None):
    """A 4-token request with `extra_args=extra`, which vLLM's own checks refuse."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=match):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, extra_args=extra),
                     use_tqdm=False)


def _samples():
    return {(s.name, tuple(s.labels.items())): s.value
            for m in EvictionCollector().collect() for s in m.samples}


def test_request_budget_bounds_its_blocks_and_shows_in_metrics(llm):
    (manager,) = attach(llm).managers()
    compactions0 = manager.num_compactions
    probe, _ = _run(llm)  # fits the server budget: never compacts
    assert probe.max_blocks_per_request > max_blocks_per_request(64, 32)
    assert manager.num_compactions == compactions0

    probe, ids = _run(llm, {"kv_budget": 64, "kv_recent": 16})
    assert probe.max_blocks_per_request <= max_blocks_per_request(64, 32)
    assert manager.num_compactions > compactions0 and manager.num_blocks_freed > 0
    assert all(len(t) == MAX_TOKENS for t in ids)

    m = _samples()
    (info,) = [dict(labels) for name, labels in m if name == "vllm_kvevict_info"]
    assert info["policy"] == "h2o" and info["budget"] == str(SERVER_BUDGET)
    # The default in force, not "None": half of what a compaction keeps (the
    # budget less one 32-token block of room).
    assert info["recent"] == str((SERVER_BUDGET - 32) // 2)
    assert m[("vllm_kvevict_tokens_evicted_total", ())] == manager.num_tokens_evicted > 0
    assert m[("vllm_kvevict_blocks_freed_total", ())] == manager.num_blocks_freed
    assert m[("vllm_kvevict_compactions_total", ())] == manager.num_compactions
    assert m[("vllm_kvevict_compaction_seconds_total", (("engine", "0"), ("rank", "0")))] > 0
    # Idle engine: nothing resident, logically or physically.
    assert m[("vllm_kvevict_resident_tokens", (("kind", "logical"),))] == 0
    assert m[("vllm_kvevict_resident_tokens", (("kind", "physical"),))] == 0


BAD_REQUESTS = [
    ({"kv_budget": 8}, "below one KV block"),
    ({"kv_budget": 4096}, "server's --kv-budget"),
    ({"kv_budget": "lots"}, "token count"),
    ({"kv_budget": 64, "kv_recent": 128}, "must not exceed"),
    ({"kv_eviction": "streaming"}, "policy is a server setting"),
]


@pytest.mark.parametrize("extra, match", BAD_REQUESTS)
def test_bad_request_budget_is_refused_and_holds_nothing(llm, at_64, extra, match):
    """`at_64` is taken before the first refusal: the reference of the last test."""
    probe = attach(llm)
    _refuse(llm, extra, match)
    assert probe.used_blocks() == 0  # nothing left behind in vLLM's pool


def test_engine_serves_on_after_every_refused_request(llm, at_64):
    """After all of BAD_REQUESTS above (same file, same engine, run first), the
    engine produces exactly the tokens it produced before them and its pool ends
    empty: a refusal that changed any state would show here (one check for the
    five refusals: each such run is 4 x 200 tokens)."""
    for extra, match in BAD_REQUESTS:  # again, so this test stands alone too
        _refuse(llm, extra, match)
    probe, after = _run(llm, {"kv_budget": 64})
    assert after == at_64  # the engine serves on, same tokens
    assert probe.used_blocks() == 0  # nothing left behind in vLLM's pool


def test_fraction_server_refuses_more_at_admission(model_path):
    """--kv-budget 0.2 (issue 20 #6): vLLM's admission step (InputProcessor
    .process_inputs -> _validate_params, patched by patches/request_validation.py)
    refuses a request asking 0.99 or 10**9 with VLLMValidationError naming the
    field, the value and the server's budget; 0.1 passes. No engine: the
    processor is built from the same engine config an engine would get."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.exceptions import VLLMValidationError
    from vllm.plugins import load_general_plugins
    from vllm.v1.engine.input_processor import InputProcessor

    load_general_plugins()
    vllm_config = EngineArgs(model_path, block_size=32, max_model_len=2048, enforce_eager=True,
                             additional_config={"kv_eviction": "h2o", "kv_budget": 0.2}
                             ).create_engine_config()
    processor = InputProcessor(vllm_config)

    def admit(i, extra):
        return processor.process_inputs(f"r{i}", {"prompt_token_ids": [1, 2, 3]},
                                        SamplingParams(max_tokens=4, extra_args=extra),
                                        supported_tasks=("generate",))

    for i, asked in enumerate((0.99, 10**9)):
        with pytest.raises(VLLMValidationError,
                           match=rf"kv_budget {asked!r}\b.*server's --kv-budget 0\.2") as err:
            admit(i, {"kv_budget": asked})
        assert err.value.parameter == "vllm_xargs"
    assert admit(2, {"kv_budget": 0.1}).sampling_params.extra_args == {"kv_budget": 0.1}


# Issue 38: every per-request value parses to the validation error (400), never
# to another exception (a 500): "²".isdigit() is True and int("²") raises, a
# 400-digit integer overflows math.isfinite (vLLM refuses integers past 64 bits
# first, here), thousands of digits overflow int().
MALFORMED = [
    ("kv_prefill_cap", "²"), ("kv_prefill_cap", "³"), ("kv_prefill_cap", "¹⁰"),
    ("kv_prefill_cap", "½"), ("kv_prefill_cap", "①"), ("kv_prefill_cap", "٣"),
    ("kv_prefill_cap", "-1"), ("kv_prefill_cap", "1.5"), ("kv_prefill_cap", "0x10"),
    ("kv_prefill_cap", "9" * 5000), ("kv_prefill_cap", 10**400), ("kv_prefill_cap", -1),
    ("kv_prefill_cap", 2.5), ("kv_prefill_cap", True), ("kv_prefill_cap", [64]),
    ("kv_prefill_cap", float("nan")),
    ("kv_budget", "²"), ("kv_budget", "-²"), ("kv_budget", "+-64"), ("kv_budget", "nan"),
    ("kv_budget", "inf"), ("kv_budget", "-inf"), ("kv_budget", "1e400"),
    ("kv_budget", "1e400%"), ("kv_budget", "%"), ("kv_budget", "0"), ("kv_budget", "9" * 5000),
    ("kv_budget", 10**400), ("kv_budget", -10**400), ("kv_budget", float("inf")),
    ("kv_budget", float("nan")), ("kv_budget", None), ("kv_budget", {"a": 1}),
    ("kv_budget", True), ("kv_budget", "1/2"),
    ("kv_recent", "²"), ("kv_recent", 10**400),
]


@pytest.fixture(scope="module")
def processor(model_path):
    """vLLM's admission step (InputProcessor.process_inputs -> _validate_params,
    patched by patches/request_validation.py) for an h2o server of budget 256,
    built from the engine config an engine would get; no engine."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.v1.engine.input_processor import InputProcessor

    load_general_plugins()
    return InputProcessor(EngineArgs(
        model_path, block_size=32, max_model_len=2048, enforce_eager=True,
        additional_config={"kv_eviction": "h2o", "kv_budget": SERVER_BUDGET}
    ).create_engine_config())


@pytest.mark.parametrize("key, value", MALFORMED, ids=[f"{k}={v!r}"[:40] for k, v in MALFORMED])
def test_malformed_values_are_the_validation_error(processor, key, value):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as err:
        processor.process_inputs("r", {"prompt_token_ids": [1, 2, 3]},
                                 SamplingParams(max_tokens=4, extra_args={key: value}),
                                 supported_tasks=("generate",))
    if err.value.parameter == "extra_args":  # vLLM's own bound on integers, checked first
        assert abs(value) > 2**63, err.value
    else:
        assert err.value.parameter == "vllm_xargs" and key in str(err.value), err.value
