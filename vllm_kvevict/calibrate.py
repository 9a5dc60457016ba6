"""InfiniGen's offline calibration: compute a model's skewing once, before serving.

    python -m vllm_kvevict.calibrate MODEL [--partial 0.3] [--output PATH]
                                           [--device cuda] [--dtype bfloat16] [--force]

MODEL is a model directory or a Hugging Face repo id. One forward pass over
``--tokens`` tokens of calibration text, then an SVD per layer and KV head
(:mod:`vllm_kvevict.core.offload.skewing`). The file goes where a serving engine with
``--kv-eviction infinigen`` (or ``--kv-swap-space``) looks for it
(:func:`vllm_kvevict.core.offload.skewing_store.default_path`: ``$VLLM_KVEVICT_SKEWING`` or
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

from vllm_kvevict.core.offload import skewing as sk
from vllm_kvevict.core.offload import skewing_store

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --- the Hugging Face side: queries and keys of one forward pass -----------

def _attention_modules(model) -> list:
    base = getattr(model, "model", model)
    return [layer.self_attn for layer in base.layers]


@torch.no_grad()
def collect_qk(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run ``model`` once over ``input_ids`` (1, T) and return per layer the
    post-RoPE queries (H_q, T, D) and keys (H, T, D), float32.

    Recomputed from each attention module's input (a forward pre-hook on
    ``self_attn``: ``hidden_states`` after the input norm, and the rotary
    ``position_embeddings``), so the model's attention itself is untouched.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    out: list = []
    handles = []

    def hook(module, args, kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        d = module.head_dim
        q = module.q_proj(x).view(*x.shape[:-1], -1, d).transpose(1, 2)
        k = module.k_proj(x).view(*x.shape[:-1], -1, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        # On the CPU: a big model calibrates on a GPU, its per-layer SVDs are small.
        out.append((q[0].float().cpu(), k[0].float().cpu()))

    for m in _attention_modules(model):
        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        model(input_ids.to(model.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return out


def compute_skewing(model, input_ids: torch.Tensor, fraction: float = sk.DEFAULT_FRACTION,
                    skew: bool = True, meta: dict | None = None) -> sk.Skewing:
    """One forward pass over ``input_ids`` (1, T) -> :class:`~vllm_kvevict.core.offload.skewing.Skewing`."""
    return sk.skewing_from_qk(collect_qk(model, input_ids), fraction, skew, meta)


def calibration_ids(tokenizer, doc: str, seed: int, n_tokens: int) -> torch.Tensor:
    """(1, T) token ids of the project's passage of ``doc``
    (:func:`vllm_kvevict.passages.passages`, the harness's perplexity text)."""
    from vllm_kvevict.passages import passages

    (context,) = passages(tokenizer, seed, [doc], n_tokens)
    return torch.tensor([tokenizer(context)["input_ids"]])


def load_model(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
               device: str = "cpu"):
    """(model, tokenizer): the HF checkpoint (default float32) with eager attention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                 attn_implementation="eager").to(device).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def load_or_compute(model_dir: str | os.PathLike, fraction: float = sk.DEFAULT_FRACTION,
                    skew: bool = True, doc: str = sk.DEFAULT_CALIBRATION["doc"],
                    seed: int = sk.DEFAULT_CALIBRATION["seed"],
                    n_tokens: int = sk.DEFAULT_CALIBRATION["n_tokens"],
                    cache_dir: str | os.PathLike | None = None, model=None,
                    tokenizer=None, recompute: bool = False) -> sk.Skewing:
    """The skewing of the checkpoint ``model_dir``, from the cache or computed
    once (calibration text: the perplexity passage of ``doc``, ``n_tokens``
    tokens) and stored. ``model`` / ``tokenizer``: already loaded ones to reuse;
    ``recompute``: replace a cached file. Offline only (calibrate.py, the dense
    evaluation): serving engines :func:`locate` the file instead."""
    params = dict(fraction=fraction, skew=skew, doc=doc, seed=seed, n_tokens=n_tokens)
    path = skewing_store.cache_path(model_dir, cache_dir, **params)
    if path.is_file() and not recompute:
        return sk.Skewing.load(path)
    if model is None or tokenizer is None:
        model, tokenizer = load_model(model_dir)
    ids = calibration_ids(tokenizer, doc, seed, n_tokens)
    meta = dict(params, model_dir=str(Path(model_dir).expanduser().resolve()),
                key=skewing_store.cache_key(model_dir, **params), calibration_tokens=ids.shape[1],
                format=sk.FORMAT_VERSION, rope="post-rope")
    result = compute_skewing(model, ids, fraction, skew, {k: str(v) for k, v in meta.items()})
    result.save(path)
    return result


# --- the command ------------------------------------------------------------

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

    Without ``output`` the file is the cache entry (``skewing_store.cache_path``); one
    already there is kept unless ``force`` (then nothing loads the model).
    ``output``: the same skewing written there too, for ``--kv-skewing``."""
    params = dict(fraction=fraction, skew=True, doc=doc, seed=seed, n_tokens=n_tokens)
    cached = _cache_entry(model, params)
    if cached is not None and cached.is_file() and not force:
        result = sk.Skewing.load(cached) if output is not None else None
    else:
        hf, tok = load_model(model, dtype, device)  # downloads a repo id's weights
        model_dir = skewing_store.model_directory(model)
        cached = skewing_store.cache_path(model_dir, **params)
        result = load_or_compute(model_dir, model=hf, tokenizer=tok, recompute=True,
                                    **params)
    if output is None:
        return cached
    output = Path(output).expanduser().resolve()  # printed: what --kv-skewing takes
    result.save(output)
    return output


def _cache_entry(model: str, params: dict) -> Path | None:
    """The cache file of ``model`` for ``params``; None for a repo id not downloaded yet."""
    try:
        return skewing_store.cache_path(skewing_store.model_directory(model), **params)
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
                   help="calibration text, one of vllm_kvevict.passages.ALL_TEXTS")
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
