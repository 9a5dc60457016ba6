"""InfiniGen's skewing is computed offline (`python -m vllm_kvevict.calibrate
MODEL`), never inside a serving worker: an engine without the file stops at
startup naming the command, a worker only loads the file, and the file the
command writes is the one the engine then finds (the session's `calibrated`
fixture, conftest.py, which test_infinigen_engine.py / _server.py run on)."""
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_kvevict import calibrate
from vllm_kvevict.core.offload import skewing as sk
from vllm_kvevict.core.offload import skewing_store
from vllm_kvevict.core.config.settings import EvictionConfig, EvictionConfigError

COMMAND = "python -m vllm_kvevict.calibrate"
LAYOUT = SimpleNamespace(num_kv_heads=3, block_size=32, head_size=64)  # SmolLM2, one rank


@pytest.fixture
def no_model_load(monkeypatch):
    """Record (and refuse) any attempt to load the HF model or calibrate."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a serving process must not load a model to calibrate")

    monkeypatch.setattr(calibrate, "load_model", refuse)
    monkeypatch.setattr(calibrate, "compute_skewing", refuse)
    return calls


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A skewing cache with nothing in it."""
    monkeypatch.setenv("VLLM_KVEVICT_SKEWING", str(tmp_path / "empty"))
    return tmp_path / "empty"


def _worker_state(model_path, **extra):
    """What host_tier reads of the worker's state (integration/worker.py)."""
    cfg = EvictionConfig.from_dict({"kv_eviction": "infinigen", "kv_swap_space": "16MiB",
                                    **extra})
    from vllm_kvevict.integration.offload_attention import OffloadState

    return SimpleNamespace(cfg=cfg, offload=OffloadState(model_path))


def _engine_config(model_path, **extra):
    """EngineArgs.create_engine_config, where startup checks the skewing (no
    engine is built: this is the step before any worker starts)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return EngineArgs(model_path, dtype="float32", block_size=32, max_model_len=512,
                      kv_cache_memory_bytes=64 << 20,
                      additional_config={"kv_eviction": "infinigen", "kv_budget": 64,
                                         **extra}).create_engine_config()


def test_engine_without_skewing_stops_at_startup_naming_the_command(
        fresh_engines, model_path, empty_cache, no_model_load):
    """Before any worker starts: LLM(...) raises with the exact command (the
    engine's --kv-partial and skewing directory included), and nothing loaded
    the HF model."""
    from vllm import LLM

    with pytest.raises(ValueError, match=COMMAND) as err:
        LLM(model_path, enforce_eager=True, dtype="float32", block_size=32,
            max_model_len=512, kv_cache_memory_bytes=64 << 20,
            additional_config={"kv_eviction": "infinigen", "kv_budget": 64,
                               "kv_partial": 0.5})
    msg = str(err.value)
    assert f"VLLM_KVEVICT_SKEWING={empty_cache} {COMMAND} {Path(model_path).resolve()} " \
           f"--partial 0.5" in msg, msg
    assert no_model_load == []


def test_worker_never_computes_a_missing_skewing(model_path, empty_cache, no_model_load):
    """The worker's first use of the host tier, mid-step, with no file: an
    error naming the command, not a model load."""
    from vllm_kvevict.integration.offload_attention import host_tier

    with pytest.raises(ValueError, match=COMMAND):
        host_tier(_worker_state(model_path), LAYOUT, torch.float32)
    assert no_model_load == []


def test_the_command_writes_the_file_engine_and_worker_load(calibrated, model_path,
                                                            no_model_load):
    """`calibrated` ran the command once (a subprocess, as a user would): its
    file is the one startup finds and the worker's host tier loads. Running it
    again finds the file and loads no model."""
    from vllm_kvevict.integration.offload_attention import host_tier

    path = Path(calibrated)
    assert path.parent == Path(os.environ["VLLM_KVEVICT_SKEWING"])
    assert skewing_store.locate(model_path) == path
    skew = sk.Skewing.load(path)
    assert skew.a.shape == (30, 3, 64, 64) and skew.num_partial == round(0.3 * 64)
    assert skew.meta["model_dir"] == str(Path(model_path).resolve())
    _engine_config(model_path)  # startup accepts it
    tier = host_tier(_worker_state(model_path), LAYOUT, torch.float32)
    assert torch.equal(tier.a, skew.packed().a)
    assert calibrate.calibrate(model_path) == path
    assert no_model_load == []


def test_kv_skewing_points_at_a_file(calibrated, model_path, tmp_path, monkeypatch, capsys,
                                     no_model_load):
    """--output writes a file (here from the cache, no model load) that
    --kv-skewing takes, relative paths made absolute for the workers; a
    missing, wrong-model or wrong-fraction file stops startup."""
    from vllm_kvevict.integration.offload_attention import host_tier

    monkeypatch.chdir(tmp_path)
    assert calibrate.main([model_path, "--output", "mine.safetensors"]) == 0
    mine = tmp_path / "mine.safetensors"
    assert capsys.readouterr().out.splitlines()[-1] == str(mine)
    monkeypatch.setenv("VLLM_KVEVICT_SKEWING", str(tmp_path / "empty"))  # not the cache
    config = _engine_config(model_path, kv_skewing="mine.safetensors")
    assert config.additional_config["kv_skewing"] == str(mine)
    state = _worker_state(model_path, kv_skewing=config.additional_config["kv_skewing"])
    assert torch.equal(host_tier(state, LAYOUT, torch.float32).a,
                       sk.Skewing.load(calibrated).packed().a)

    with pytest.raises(ValueError, match=f"--kv-skewing.*no file.*\n.*{COMMAND}.*--output"):
        _engine_config(model_path, kv_skewing="nope.safetensors")
    sk.Skewing.identity(2, 3, 64).save("small.safetensors")
    with pytest.raises(ValueError, match="2 layers x 3 KV heads.*has 30 x 3 x 64"):
        _engine_config(model_path, kv_skewing="small.safetensors")
    with pytest.raises(ValueError, match="19 partial channels.*--kv-partial 0.5"):
        _engine_config(model_path, kv_skewing="mine.safetensors", kv_partial=0.5)
    with pytest.raises(EvictionConfigError, match="--kv-skewing.*is for KV offload"):
        EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_skewing": "mine.safetensors"})
    assert no_model_load == []


def test_a_hub_model_id_resolves_to_its_local_snapshot(model_path, tmp_path, monkeypatch,
                                                       empty_cache):
    """`vllm serve org/name`: vLLM has put config.json into the hub cache before
    startup checks; the skewing is keyed by that snapshot directory and the
    command names the repo id (which the command downloads)."""
    from huggingface_hub import constants

    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_bytes((Path(model_path) / "config.json").read_bytes())
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    assert skewing_store.model_directory("org/tiny") == snap.resolve()
    assert skewing_store.default_path("org/tiny").parent == empty_cache
    with pytest.raises(ValueError, match=f"none at {empty_cache}.*\n.*{COMMAND} org/tiny\n"):
        skewing_store.locate("org/tiny")
    with pytest.raises(ValueError, match=f"org/absent: not a model directory.*\n.*{COMMAND} "
                                         f"org/absent\n"):
        skewing_store.locate("org/absent")
