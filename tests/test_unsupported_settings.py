"""Settings eviction does not support stop startup naming the flag (issue 20 #7).

With eviction or offload on (--kv-eviction other than none, --kv-swap-space):
  --speculative-config (or --spec-method/--spec-model/--spec-tokens)
                              n-gram drafts start with eviction alone on the CPU
                              backend at one pipeline stage, with at most
                              block_size - 2 draft tokens (what they do there:
                              tests/test_speculative_decoding.py); refused with offload
                              (its host decode handles 1-token rows only), for a
                              method that drafts with a model (it reads the KV
                              eviction compacts), at PP > 1, and on CUDA
  --pipeline-parallel-size>1  with offload only (InfiniGen predicts a layer from the
                              layer before it, on another stage at a stage's first
                              layer); eviction alone starts (tests/test_pipeline_parallel.py)
  --async-scheduling          step t+1's plans would be made while step t runs
Async scheduling is off by default with eviction (vLLM turns it on by default
on CUDA; on CPU its platform turns it off), so a plain
`vllm serve M --kv-eviction h2o` starts. Cascade attention: removed from vLLM
0.32 (disable_cascade_attn is a deprecated no-op), pinned below.

Everything goes through the code `vllm serve` runs up to the engine start (its
parser with the plugin's flags, validate_parsed_serve_args, AsyncEngineArgs
.from_cli_args, create_engine_config with the plugin's hook), in this process,
and `LLM(...)` for the offline door. No engine is built. Stock vLLM (no
--kv-eviction) accepts every one of these settings at the same step, so the
refusal is the plugin's.
"""

import json

import pytest
from conftest import serve_config

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
# n-gram speculative decoding: starts with eviction alone, refused with offload
SPECULATION = [
    pytest.param(["--speculative-config", NGRAM], "--speculative-config", id="spec"),
    pytest.param(["--spec-method", "ngram", "--spec-tokens", "2"], "--spec-method",
                 id="spec-method"),
]
UNSUPPORTED = [
    pytest.param(["--async-scheduling"], "--async-scheduling", id="async"),
]
PP2 = ["--pipeline-parallel-size", "2"]
EVICTION = [
    pytest.param(["--kv-eviction", "h2o"], "--kv-eviction h2o", id="h2o"),
    pytest.param(["--kv-eviction", "snapkv", "--kv-budget", "0.2"], "--kv-eviction snapkv",
                 id="snapkv"),
    pytest.param(["--kv-eviction", "infinigen"], "--kv-eviction infinigen", id="infinigen"),
    pytest.param(["--kv-eviction", "streaming", "--kv-swap-space", "16MiB"],
                 "--kv-eviction streaming --kv-swap-space", id="swap-space"),
    pytest.param(["--additional-config", json.dumps({"kv_eviction": "h2o"})],
                 "--kv-eviction h2o", id="additional-config"),
]


@pytest.mark.parametrize("eviction, ours", EVICTION)
@pytest.mark.parametrize("setting, theirs", UNSUPPORTED)
def test_unsupported_setting_stops_startup_naming_both_flags(model_path, eviction, ours,
                                                             setting, theirs):
    said = serve_config(model_path, *eviction, *setting)
    assert isinstance(said, str), "started"
    assert said.startswith("EvictionConfigError: ") and theirs in said and ours in said, said
    assert "not supported with" in said, said


@pytest.mark.parametrize("setting, theirs", UNSUPPORTED + SPECULATION)
def test_stock_vllm_accepts_each_setting(model_path, setting, theirs):
    """The same settings without eviction pass the same steps: the refusal is ours."""
    cfg = serve_config(model_path, *setting)
    assert not isinstance(cfg, str), cfg
    if "--speculative-config" in setting or "--spec-method" in setting:
        assert cfg.speculative_config.method == "ngram"


@pytest.mark.parametrize("eviction, ours", [p for p in EVICTION if p.id not in
                                            ("infinigen", "swap-space")])
@pytest.mark.parametrize("setting, theirs", SPECULATION)
def test_ngram_speculation_with_eviction_starts(model_path, eviction, ours, setting, theirs):
    """n-gram drafts beside eviction alone, on this CPU machine: the engine
    config is built with the drafts and the eviction settings both."""
    cfg = serve_config(model_path, *eviction, *setting)
    assert not isinstance(cfg, str), cfg
    assert cfg.speculative_config.method == "ngram"
    assert cfg.speculative_config.num_speculative_tokens == 2
    assert cfg.additional_config["kv_eviction"] == ours.split()[1]
    assert cfg.scheduler_config.async_scheduling is False


@pytest.mark.parametrize("eviction, ours", [p for p in EVICTION if p.id in
                                            ("infinigen", "swap-space")])
@pytest.mark.parametrize("setting, theirs", SPECULATION)
def test_ngram_speculation_with_offload_stops_startup_saying_why(model_path, eviction, ours,
                                                                 setting, theirs):
    said = serve_config(model_path, *eviction, *setting)
    assert isinstance(said, str), "started"
    assert said.startswith(f"EvictionConfigError: {theirs} is not supported with "), said
    assert ours in said and "offload's host decode handles one new token" in said, said


EAGLE = {"method": "eagle", "model": "x", "num_speculative_tokens": 2}


@pytest.mark.parametrize("setting, theirs, method", [
    pytest.param(["--speculative-config", json.dumps(EAGLE)], "--speculative-config", "eagle",
                 id="eagle"),
    pytest.param(["--speculative-config", json.dumps({"model": "x", "num_speculative_tokens": 2})],
                 "--speculative-config", "draft_model", id="draft-model"),
    pytest.param(["--spec-method", "eagle", "--spec-model", "x", "--spec-tokens", "2"],
                 "--spec-method", "eagle", id="spec-method-eagle"),
    # A draft model without a method: vLLM infers draft_model, and so must the
    # early check (it let this through to vLLM's own ValidationError before).
    pytest.param(["--spec-model", "x", "--spec-tokens", "2"],
                 "--spec-model", "draft_model", id="spec-model"),
])
def test_model_drafting_methods_stop_startup_naming_the_method(model_path, setting, theirs,
                                                               method):
    """A method that drafts with a model is refused before vLLM builds its
    config (the draft model "x" does not exist, and is never looked up)."""
    said = serve_config(model_path, "--kv-eviction", "h2o", *setting)
    assert isinstance(said, str), "started"
    assert said.startswith(f"EvictionConfigError: {theirs} is not supported with "
                           f"--kv-eviction h2o: method {method!r} drafts with a model"), said
    assert "use method 'ngram'" in said, said


def test_eagle_is_refused_where_stock_vllm_builds_it(model_path):
    """The same EAGLE setting with a draft model that exists: stock vLLM builds
    its config, so the refusal is ours."""
    eagle = json.dumps({**EAGLE, "model": model_path})
    cfg = serve_config(model_path, "--speculative-config", eagle)
    assert not isinstance(cfg, str), cfg
    assert cfg.speculative_config.method == "eagle"
    said = serve_config(model_path, "--kv-eviction", "h2o", "--speculative-config", eagle)
    assert isinstance(said, str) and "method 'eagle' drafts with a model" in said, said


def test_more_draft_tokens_than_a_block_leaves_room_for_stop_startup(model_path):
    """At most block_size - 2 draft tokens (30 at --block-size 32): a
    compaction must leave room for the step and keep a token. Stock vLLM
    takes 31."""
    def ngram(n: int) -> list[str]:
        return ["--speculative-config",
                json.dumps({"method": "ngram", "num_speculative_tokens": n, "prompt_lookup_max": 3})]

    said = serve_config(model_path, "--kv-eviction", "h2o", *ngram(31))
    assert isinstance(said, str), "started"
    assert said.startswith("EvictionConfigError: --speculative-config is not supported with "
                           "--kv-eviction h2o: num_speculative_tokens 31"), said
    assert "at most 30 at --block-size 32" in said, said
    cfg = serve_config(model_path, "--kv-eviction", "h2o", *ngram(30))
    assert not isinstance(cfg, str), cfg
    assert cfg.speculative_config.num_speculative_tokens == 30
    stock = serve_config(model_path, *ngram(31))
    assert not isinstance(stock, str), stock


def test_speculation_at_pipeline_parallel_stops_startup_saying_why(model_path):
    """Eviction alone starts at PP 2 and so does n-gram speculation
    (test_pipeline_parallel_with_eviction_starts, stock below); both together
    are refused."""
    said = serve_config(model_path, "--kv-eviction", "h2o", "--speculative-config", NGRAM, *PP2)
    assert isinstance(said, str), "started"
    assert said.startswith("EvictionConfigError: --speculative-config is not supported with "
                           "--kv-eviction h2o: --pipeline-parallel-size 2:"), said
    assert "accepted a step late" in said, said
    stock = serve_config(model_path, "--speculative-config", NGRAM, *PP2)
    assert not isinstance(stock, str), stock
    assert stock.parallel_config.pipeline_parallel_size == 2


def test_refuse_speculation_rules():
    """The check itself (patches/engine_args.refuse_speculation), for what this
    CPU machine cannot reach through `vllm serve`: the CUDA backend refuses
    n-gram drafts beside eviction; the CPU takes them."""
    from vllm_kvevict.patches.engine_args import Speculation, refuse_speculation

    from vllm_kvevict.core.config.settings import EvictionConfig, EvictionConfigError

    h2o = EvictionConfig.from_dict({"kv_eviction": "h2o"})
    ngram = Speculation("--speculative-config", "ngram", 2)
    refuse_speculation(h2o, ngram, on_cpu=True, pipeline=1, block_size=32)
    with pytest.raises(EvictionConfigError,
                       match=r"^--speculative-config is not supported with --kv-eviction h2o: "
                             r"speculative decoding beside eviction runs on the CPU backend only"):
        refuse_speculation(h2o, ngram, on_cpu=False, pipeline=1, block_size=32)
    # Eviction off, or no speculation: nothing to refuse, on either backend.
    refuse_speculation(EvictionConfig(), ngram, on_cpu=False)
    refuse_speculation(h2o, None, on_cpu=False)
    # The method is unknown before vLLM builds its config: only what is known is checked.
    refuse_speculation(h2o, Speculation("--spec-tokens", None, 30), on_cpu=True, block_size=32)
    with pytest.raises(EvictionConfigError, match="at most 14 at --block-size 16"):
        refuse_speculation(h2o, Speculation("--spec-tokens", None, 15), on_cpu=True,
                           block_size=16)
    with pytest.raises(EvictionConfigError, match=r"^--spec-method is not supported with "
                                                  r"--kv-eviction h2o: method 'medusa'"):
        refuse_speculation(h2o, Speculation("--spec-method", "medusa", 2), on_cpu=True)


@pytest.mark.parametrize("eviction, ours", [p for p in EVICTION if p.id in
                                            ("infinigen", "swap-space")])
def test_pipeline_parallel_with_offload_stops_startup_saying_why(model_path, eviction, ours):
    said = serve_config(model_path, *eviction, *PP2)
    assert isinstance(said, str), "started"
    assert said.startswith("EvictionConfigError: ") and ours in said, said
    assert "--pipeline-parallel-size 2 is not supported with" in said, said
    assert "layer before it" in said and "another process" in said, said


@pytest.mark.parametrize("eviction, ours", [p for p in EVICTION if p.id not in
                                            ("infinigen", "swap-space")])
def test_pipeline_parallel_with_eviction_starts(model_path, eviction, ours):
    """Eviction without offload runs at PP 2 (what it does there:
    tests/test_pipeline_parallel.py); so does stock vLLM."""
    for args in ((*eviction, *PP2), PP2):
        cfg = serve_config(model_path, *args)
        assert not isinstance(cfg, str), cfg
        assert cfg.parallel_config.pipeline_parallel_size == 2


def test_prompt_modules_at_pipeline_parallel_are_refused_saying_why(model_path):
    """Schema registration and PML prompts check the engine first
    (prompt_modules._check_engine): at PP 2 they are refused alone, naming the flag."""
    from vllm_kvevict.core.modules.pml import PMLError
    from vllm_kvevict.integration.prompt_modules import _check_engine

    _check_engine(serve_config(model_path, "--kv-eviction", "h2o"))  # PP 1: fine
    with pytest.raises(PMLError, match="prompt modules are not supported with "
                                       "--pipeline-parallel-size 2: .* one pipeline stage"):
        _check_engine(serve_config(model_path, "--kv-eviction", "h2o", *PP2))


@pytest.mark.parametrize("extra", [(), ("--no-async-scheduling",), ("--kv-budget", "0.2")])
def test_eviction_with_defaults_starts_with_async_scheduling_off(model_path, extra):
    """`vllm serve M --kv-eviction h2o`: vLLM's own default (async_scheduling None:
    on where the platform allows it) is turned off by the plugin, not refused."""
    cfg = serve_config(model_path, "--kv-eviction", "h2o", *extra)
    assert not isinstance(cfg, str), cfg
    assert cfg.scheduler_config.async_scheduling is False
    assert cfg.speculative_config is None and cfg.parallel_config.pipeline_parallel_size == 1
    assert cfg.additional_config["kv_eviction"] == "h2o"


def test_async_scheduling_default_is_turned_off_before_vllm_decides(model_path):
    """On CUDA vLLM 0.32 turns async scheduling on when it is left unset
    (VllmConfig.__post_init__: async_scheduling None -> True); the CPU platform
    turns it off afterwards, so this checks the engine arguments the hook hands
    to vLLM: with eviction on, an unset value becomes False before the stock
    config is built; without eviction it stays vLLM's to decide."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    seen = []
    original = EngineArgs.create_engine_config.__kvevict_original__

    def spy(self, *args, **kwargs):
        seen.append(self.async_scheduling)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineArgs.create_engine_config, "__kvevict_original__", spy)
        for additional in ({"kv_eviction": "h2o"}, {}):
            EngineArgs(model_path, block_size=32, enforce_eager=True,
                       additional_config=additional).create_engine_config()
    assert seen == [False, None]


class Started(Exception):
    """Raised by the stubbed LLMEngine constructor: the engine would be built."""


@pytest.fixture
def no_engine(monkeypatch):
    from vllm.v1.engine.llm_engine import LLMEngine

    def stub(self, *args, **kwargs):
        raise Started

    monkeypatch.setattr(LLMEngine, "__init__", stub)


@pytest.mark.parametrize("make_kwargs, theirs", [
    # a model-drafting method (n-gram drafts are accepted offline too: below)
    pytest.param(lambda m: {"speculative_config": {**EAGLE, "model": m}}, "--speculative-config",
                 id="spec-eagle"),
    pytest.param(lambda m: {"async_scheduling": True}, "--async-scheduling", id="async"),
])
def test_offline_llm_is_refused_too(model_path, no_engine, make_kwargs, theirs):
    """LLM(...) goes through the same EngineArgs.create_engine_config hook, and
    stops before the engine is built (were it not refused, the engine's
    constructor, stubbed here, would be reached: no worker ever starts)."""
    from vllm import LLM

    from vllm_kvevict.core.config.settings import EvictionConfigError

    kwargs = make_kwargs(model_path)
    with pytest.raises(EvictionConfigError, match=f"{theirs} is not supported with "
                                                  f"--kv-eviction h2o"):
        LLM(model_path, enforce_eager=True, block_size=32, max_model_len=512,
            kv_cache_memory_bytes=64 << 20, additional_config={"kv_eviction": "h2o"},
            **kwargs)
    with pytest.raises(Started):  # stock vLLM gets as far as building the engine
        LLM(model_path, enforce_eager=True, block_size=32, max_model_len=512,
            kv_cache_memory_bytes=64 << 20, **kwargs)


def test_offline_llm_with_ngram_speculation_reaches_the_engine(model_path, no_engine):
    """n-gram drafts beside eviction pass both checks (before and after vLLM
    builds its config) offline too: the engine's constructor is reached."""
    from vllm import LLM

    with pytest.raises(Started):
        LLM(model_path, enforce_eager=True, block_size=32, max_model_len=512,
            kv_cache_memory_bytes=64 << 20, additional_config={"kv_eviction": "h2o"},
            speculative_config=json.loads(NGRAM))


def test_cascade_attention_is_gone_from_vllm():
    """Cascade attention read the logical `seq_lens_cpu` of a shared prefix,
    which compaction makes wrong. vLLM 0.32 removed it: disable_cascade_attn is a
    deprecated no-op (default True), the scheduler never reports a common prefix,
    and FlashAttention's metadata builder, which the plugin's CUDA backend wraps
    (integration/cuda_backend.py), has no cascade path. If a vLLM upgrade brings
    it back, this fails: then the engine-args hook must turn it off."""
    import inspect

    import vllm.v1.attention.backends.flash_attn as flash_attn
    from vllm.config import ModelConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput

    assert "cascade" not in inspect.getsource(flash_attn).lower()
    assert ModelConfig.__dataclass_fields__["disable_cascade_attn"].default is True
    assert "cascade attention has been removed" in KVCacheManager.get_num_common_prefix_blocks \
        .__doc__
    assert SchedulerOutput.__dataclass_fields__["num_common_prefix_blocks"].default_factory() == []


def test_prompt_modules_behind_several_api_servers_stop_startup_saying_why(model_path):
    """`VLLM_PLUGINS=kvevict,kvevict_modules vllm serve M --data-parallel-size 2`:
    vLLM then starts two API servers by default, each with its own schema
    registry, so a PML prompt would 400 whenever it reached the one that did
    not register its schema (seen before this refusal). The real command stops
    before any engine starts, naming the fix, which serves modules on both
    engines (tests/test_data_parallel_serve.py)."""
    from vllm_kvevict.eval.server import Server

    srv = Server(model_path, "--data-parallel-size", "2", start_timeout=300,
                 env={"VLLM_PLUGINS": "kvevict,kvevict_modules"})
    try:
        with pytest.raises(RuntimeError, match="vllm serve exited") as refused:
            srv.start()
    finally:
        srv.stop()  # were it to start
    said = str(refused.value)
    assert "EvictionConfigError: prompt modules need one API server" in said, said[-2000:]
    assert "--api-server-count 2 (vLLM's default with --data-parallel-size 2)" in said
    assert "pass --api-server-count 1" in said


def test_prompt_modules_check_the_api_server_count_per_request(model_path):
    """The same rule where a schema is registered or a PML prompt expanded
    (prompt_modules._check_engine), for a server whose plugins were named
    another way: every such request is refused alike, never by chance."""
    from vllm_kvevict.core.modules.pml import PMLError
    from vllm_kvevict.integration.prompt_modules import _check_engine

    cfg = serve_config(model_path, "--kv-eviction", "h2o")
    _check_engine(cfg)  # one API server: fine
    cfg.parallel_config._api_process_count = 2  # as vLLM's entry sets it in each API server
    with pytest.raises(PMLError, match="prompt modules need one API server"):
        _check_engine(cfg)
