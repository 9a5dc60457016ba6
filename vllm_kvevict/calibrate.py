"""InfiniGen's offline calibration: compute a model's skewing once, before serving.

    python -m vllm_kvevict.calibrate MODEL [--partial 0.3] [--output PATH]
                                           [--device cuda] [--dtype bfloat16] [--force]

MODEL is a model directory or a Hugging Face repo id. One forward pass over
``--tokens`` tokens of calibration text, then an SVD per layer and KV head
(:mod:`vllm_kvevict.skewing`). The file goes where a serving engine with
``--kv-eviction infinigen`` (or ``--kv-swap-space``) looks for it
(:func:`vllm_kvevict.skewing.default_path`: ``$VLLM_KVEVICT_SKEWING`` or
``~/.cache/vllm_kvevict/skewing``, keyed by the model's config and the
calibration), or to ``--output`` (serve with ``--kv-skewing PATH``). The last
line printed is the file's path.

Why offline: calibration loads the whole HF model (float32 by default: a 13B
model is ~52 GB). Done lazily inside serving, it ran mid-step in every
tensor-parallel rank; now an engine without the file stops at startup and
names this command.

``--partial`` must match the server's ``--kv-partial``. Non-default calibration
text (``--tokens``, ``--doc``, ``--seed``) gives a file the engine does not look
for by default: pass it with ``--kv-skewing``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from vllm_kvevict import skewing as sk

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_default(doc: str, seed: int, n_tokens: int) -> bool:
    """The calibration text a serving engine looks for without --kv-skewing."""
    return dict(doc=doc, seed=seed, n_tokens=n_tokens) == sk.DEFAULT_CALIBRATION


def calibrate(model: str, fraction: float = sk.DEFAULT_FRACTION,
              doc: str = sk.DEFAULT_CALIBRATION["doc"],
              seed: int = sk.DEFAULT_CALIBRATION["seed"],
              n_tokens: int = sk.DEFAULT_CALIBRATION["n_tokens"],
              output: str | os.PathLike | None = None, force: bool = False,
              device: str = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """Compute and write the skewing of ``model``; returns the file's path.

    Without ``output`` the file is the cache entry (``skewing.cache_path``); one
    already there is kept unless ``force`` (then nothing loads the model).
    ``output``: the same skewing written there too, for ``--kv-skewing``."""
    params = dict(fraction=fraction, skew=True, doc=doc, seed=seed, n_tokens=n_tokens)
    cached = _cache_entry(model, params)
    if cached is not None and cached.is_file() and not force:
        result = sk.Skewing.load(cached) if output is not None else None
    else:
        hf, tok = sk.load_model(model, dtype, device)  # downloads a repo id's weights
        model_dir = sk.model_directory(model)
        cached = sk.cache_path(model_dir, **params)
        result = sk.load_or_compute(model_dir, model=hf, tokenizer=tok, recompute=True,
                                    **params)
    if output is None:
        return cached
    output = Path(output).expanduser().resolve()  # printed: what --kv-skewing takes
    result.save(output)
    return output


def _cache_entry(model: str, params: dict) -> Path | None:
    """The cache file of ``model`` for ``params``; None for a repo id not downloaded yet."""
    try:
        return sk.cache_path(sk.model_directory(model), **params)
    except FileNotFoundError:
        return None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_kvevict.calibrate",
                                description=__doc__.split("\n")[0])
    p.add_argument("model", help="model directory or Hugging Face repo id, as served")
    p.add_argument("--partial", type=float, default=sk.DEFAULT_FRACTION,
                   help="fraction of the head dimension in the partial query/key; must "
                        "equal the server's --kv-partial (default %(default)s)")
    p.add_argument("--output", help="write the file here too; serve with --kv-skewing PATH")
    p.add_argument("--force", action="store_true", help="recompute a cached file")
    p.add_argument("--device", default="cpu", help="where the forward pass runs (cpu, cuda)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="model weights' dtype for the pass (queries are kept in float32)")
    p.add_argument("--tokens", type=int, default=sk.DEFAULT_CALIBRATION["n_tokens"],
                   help="calibration tokens (default %(default)s)")
    p.add_argument("--doc", default=sk.DEFAULT_CALIBRATION["doc"],
                   help="calibration text (vllm_kvevict.eval's documents)")
    p.add_argument("--seed", type=int, default=sk.DEFAULT_CALIBRATION["seed"])
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not 0 < args.partial <= 1:  # before the model loads
        p.error(f"--partial must be in (0, 1], got {args.partial:g}")
    start = time.perf_counter()
    path = calibrate(args.model, args.partial, args.doc, args.seed, args.tokens, args.output,
                     args.force, args.device, DTYPES[args.dtype])
    hint = (f"serve with: --kv-skewing {path}"
            if args.output or not is_default(args.doc, args.seed, args.tokens)
            else "a server with --kv-eviction infinigen finds it")
    if args.partial != sk.DEFAULT_FRACTION:
        hint += f" and --kv-partial {args.partial:g}"
    print(f"skewing of {args.model} in {time.perf_counter() - start:.1f} s; {hint}",
          file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
