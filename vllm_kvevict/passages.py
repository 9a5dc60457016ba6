"""Passages of real English text, cut to a length in a model's tokens.

The texts (the Jargon File, six Austen novels) are prepared once by
``python -m vllm_kvevict.eval.texts`` (scripts/setup.sh runs it) into
:func:`texts_dir`; this module only reads them. It serves both
``python -m vllm_kvevict.calibrate`` (its calibration text is one passage) and
the fidelity harness (``eval.instances``), so the product's command does not
depend on the harness. Imports neither vLLM nor torch.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

SETUP_HINT = ("run `python -m vllm_kvevict.eval.texts` (or `bash scripts/setup.sh`) once "
              "to download them")

JARGON = "jargon"
AUSTEN = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice",
          "sensesensibility")
ALL_TEXTS = (JARGON,) + tuple(f"austen_{n}" for n in AUSTEN)


class TextsMissing(FileNotFoundError):
    """The prepared texts are not there; the message says how to make them."""


def texts_dir() -> Path:
    """``$VLLM_KVEVICT_TEXTS`` if set, else ``~/.cache/vllm_kvevict/texts``."""
    env = os.environ.get("VLLM_KVEVICT_TEXTS")
    return (Path(env) if env else Path.home() / ".cache" / "vllm_kvevict" / "texts").expanduser()


def load(name: str) -> str:
    """The prepared text ``name`` (one of :data:`ALL_TEXTS`); never downloads."""
    path = texts_dir() / f"{name}.txt"
    if not path.is_file():
        raise TextsMissing(f"text {name!r} not found at {path}; {SETUP_HINT}")
    return path.read_text(encoding="utf-8")


def take_tokens(tokenizer, text: str, start: int, n: int) -> str:
    """The span of ``text`` from char ``start`` covering its next ``n`` tokens.

    Cut at a token's end offset, so the span re-encodes to ``n`` tokens (give
    or take one at the edge; callers record the real count).
    """
    span = 8 * n
    while True:
        chunk = text[start:start + span]
        offsets = tokenizer(chunk, add_special_tokens=False,
                            return_offsets_mapping=True)["offset_mapping"]
        if len(offsets) > n or start + span >= len(text):
            break
        span *= 2
    if len(offsets) < n:
        raise ValueError(f"text too short for {n} tokens from char {start}")
    return chunk[:offsets[n - 1][1]]


def paragraph_start(rng: random.Random, text: str, reserve: int) -> int:
    """A random paragraph start that leaves at least ``reserve`` chars after it."""
    starts = [m.end() for m in re.finditer(r"\n\n", text[:max(len(text) - reserve, 1)])]
    return rng.choice(starts) if starts else 0


def passages(tokenizer, seed: int, docs, n_tokens: int) -> list[str]:
    """One raw ``n_tokens`` passage of each text in ``docs``, from a random
    paragraph start, drawn in order from one stream seeded by ``seed``: the
    harness's perplexity task, and (one text) the calibration text."""
    rng = random.Random(f"{seed}/perplexity")  # string seeds hash the same in every process
    out = []
    for doc in docs:
        text = load(doc)
        out.append(take_tokens(tokenizer, text, paragraph_start(rng, text, 12 * n_tokens),
                               n_tokens))
    return out
