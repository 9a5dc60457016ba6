"""Where InfiniGen skewing files live, and how a serving engine finds one.

The cache (written by `python -m vllm_kvevict.calibrate MODEL`) is
``$VLLM_KVEVICT_SKEWING``, else ``~/.cache/vllm_kvevict/skewing``, keyed by the
model directory, a hash of its ``config.json`` and the calibration parameters
(:func:`cache_path`). A serving engine never computes a skewing: it finds the
default calibration at the partial fraction it runs with (:func:`locate`), or
stops naming the command that makes one, and checks the file against the
model (:func:`check_file`). The math and the file format are in `skewing`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from vllm_kvevict.core.config.settings import EvictionConfigError
from vllm_kvevict.core.offload.skewing import (
    DEFAULT_CALIBRATION,
    DEFAULT_FRACTION,
    FORMAT_VERSION,
    num_partial,
)


def skewing_dir() -> Path:
    """``$VLLM_KVEVICT_SKEWING`` if set, else ``~/.cache/vllm_kvevict/skewing``."""
    env = os.environ.get("VLLM_KVEVICT_SKEWING")
    base = Path(env) if env else Path.home() / ".cache" / "vllm_kvevict" / "skewing"
    return base.expanduser()


def cache_key(model_dir: str | os.PathLike, **params) -> str:
    """Hex digest of the model directory, its config.json and ``params``."""
    model_dir = Path(model_dir).expanduser().resolve()
    config = (model_dir / "config.json").read_bytes()
    h = hashlib.sha256()
    h.update(f"skewing-v{FORMAT_VERSION}\0{model_dir}\0".encode())
    h.update(hashlib.sha256(config).digest())
    h.update(json.dumps(params, sort_keys=True).encode())
    return h.hexdigest()


def cache_path(model_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
               **params) -> Path:
    """Where :func:`vllm_kvevict.calibrate.load_or_compute` keeps the skewing of ``model_dir`` for ``params``."""
    name = Path(model_dir).expanduser().resolve().name
    key = cache_key(model_dir, **params)[:20]
    return Path(cache_dir or skewing_dir()) / f"{name}-{key}.safetensors"


# ---------------------------------------------------------------------------
# Serving: find the file, check it fits, never compute
# ---------------------------------------------------------------------------

class SkewingFileError(EvictionConfigError):
    """No usable skewing file for a serving engine (missing, or not this model's);
    the message says how to make one."""


def model_directory(model: str | os.PathLike) -> Path:
    """The local directory of ``model``: a path, or a Hugging Face repo id already
    in the local hub cache (vLLM fetches its config.json before this is asked)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), local_files_only=True)).resolve()
    except Exception as e:  # not cached, offline, bad id: all say "not here"
        raise FileNotFoundError(f"{model}: not a model directory nor a cached Hugging "
                                f"Face model ({type(e).__name__})") from e


def default_path(model: str | os.PathLike, fraction: float = DEFAULT_FRACTION) -> Path:
    """Where ``python -m vllm_kvevict.calibrate MODEL`` writes, and where a serving
    engine looks: :func:`cache_path` of the default calibration."""
    return cache_path(model_directory(model), fraction=fraction, skew=True,
                      **DEFAULT_CALIBRATION)


def calibrate_command(model: str | os.PathLike, fraction: float = DEFAULT_FRACTION,
                      output: str | os.PathLike | None = None) -> str:
    """The shell command that writes the skewing a serving engine looks for.
    It carries $VLLM_KVEVICT_SKEWING when set, so it writes where the engine looks."""
    import shlex

    path = Path(model).expanduser()
    words = ["python", "-m", "vllm_kvevict.calibrate",
             str(path.resolve()) if path.is_dir() else str(model)]
    if fraction != DEFAULT_FRACTION:
        words += ["--partial", f"{fraction:g}"]
    if output is not None:
        words += ["--output", str(output)]
    env = os.environ.get("VLLM_KVEVICT_SKEWING") if output is None else None
    return (f"VLLM_KVEVICT_SKEWING={shlex.quote(env)} " if env else "") + shlex.join(words)


def locate(model: str | os.PathLike, fraction: float = DEFAULT_FRACTION,
           explicit: str | os.PathLike | None = None) -> Path:
    """The skewing file a serving engine uses: ``explicit`` (--kv-skewing), else
    :func:`default_path`. Raises :class:`SkewingFileError` naming the command that
    writes it: calibration loads the whole model in float32, which a serving
    worker (one per tensor-parallel rank, mid-step) must never do."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise SkewingFileError(
                f"--kv-skewing (additional_config['kv_skewing']): no file {path}; write it "
                f"once, offline, with:\n    {calibrate_command(model, fraction, path)}")
        return path
    try:
        path = default_path(model, fraction)
    except FileNotFoundError as e:
        where = str(e)
    else:
        if path.is_file():
            return path
        where = f"none at {path}"
    raise SkewingFileError(
        f"KV offload (--kv-eviction infinigen / --kv-swap-space) needs InfiniGen's skewing "
        f"of {model}, computed once, offline ({where}). Run:\n"
        f"    {calibrate_command(model, fraction)}\n"
        f"then start again (or point --kv-skewing at a file it wrote).")


def check_file(path: str | os.PathLike, num_layers: int, num_kv_heads: int, head_dim: int,
               fraction: float = DEFAULT_FRACTION) -> None:
    """Refuse a skewing file that does not fit the model being served (reads the
    safetensors header only), so a wrong file stops startup, not a decode step."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            a_shape = tuple(f.get_slice("a").get_shape())
            c = f.get_slice("cols").get_shape()[-1]
    except Exception as e:
        raise SkewingFileError(f"{path}: not a skewing file ({e})") from e
    want = (num_layers, num_kv_heads, head_dim, head_dim)
    if a_shape != want:
        raise SkewingFileError(
            f"{path}: a skewing of {a_shape[0]} layers x {a_shape[1]} KV heads x head "
            f"dim {a_shape[2]}, but the model has {num_layers} x {num_kv_heads} x "
            f"{head_dim}: calibrate this model")
    if c != num_partial(head_dim, fraction):
        raise SkewingFileError(
            f"{path}: {c} partial channels, but --kv-partial {fraction:g} means "
            f"{num_partial(head_dim, fraction)}; calibrate with --partial {fraction:g} or "
            f"serve with the --kv-partial the file was made for")
