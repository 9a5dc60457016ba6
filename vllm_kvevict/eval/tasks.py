"""The fidelity tasks and the JSON interface every runner consumes.

Two runners read the same instances: ours (:mod:`vllm_kvevict.eval.run_vllm`,
vLLM + this plugin) and a kvpress runner (Hugging Face transformers, separate
venv, no vLLM). This module imports neither vLLM nor torch, so both can use it.

Dump (``python -m vllm_kvevict.eval --dump-tasks FILE --model smollm2 --config smoke|full``)::

    {"model": "smollm2",
     "model_dir": "<converted HF checkpoint dir>",
     "instances": [{"task": str, "id": str, "context": str, "question": str,
                    "answer": str | null, "max_tokens": int, "meta": {...}}, ...]}

Prompt (:func:`prompt_ids`), query-aware mode:

* ``meta.raw`` true (perplexity only): ``tokenizer(context)["input_ids"]``, no
  chat template (the tokenizer's default special tokens; none for SmolLM2 and
  Qwen2.5).
* otherwise: ``tokenizer.apply_chat_template([{"role": "user", "content":
  context + "\\n\\n" + question}], add_generation_prompt=True, tokenize=False)``
  encoded with ``add_special_tokens=False``; when ``question`` is "" the
  content is just ``context``.

Generation: greedy, ``max_tokens`` new tokens; ``meta.ignore_eos`` true means
generate exactly ``max_tokens`` (agreement). Query-agnostic runners compress
``context`` alone and append the question afterwards.

Tasks and scores (all in [0, 1], higher is better, except perplexity):

* ``perplexity``: ``meta = {raw: true, window: 256, source, n_tokens}``,
  ``max_tokens`` 1, ``answer`` null. Score = exp(mean NLL) over every prompt
  token after the first (prompt logprobs), pooled over instances; also per
  ``window``-token window of prompt positions (:func:`window_perplexity`).
* ``niah``: a 5-digit passcode sentence at ``meta.depth`` (0-1) of a
  ``meta.length``-token haystack. Score 1 if ``answer`` is in the output
  (:func:`score_text`).
* ``kv_retrieval``: RULER-style list of ``meta.n_pairs`` "key": value records
  with distractor keys sharing a word with each queried key; ``meta.answers``
  lists the queried values; score = fraction of them found in the output.
* ``agreement``: ``answer`` null, ``meta.ignore_eos`` true. Score = fraction of
  the ``max_tokens`` positions whose token equals the same framework's
  full-cache output; also the first differing position (:func:`agreement`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

TASKS = ("perplexity", "niah", "kv_retrieval", "agreement")
LOWER_IS_BETTER = {"perplexity"}


def tasks_in(rows) -> list[str]:
    """The tasks of result ``rows``, in TASKS order, unknown ones last (sorted)."""
    present = {r["task"] for r in rows}
    return [t for t in TASKS if t in present] + sorted(present - set(TASKS))

# Per task: its generator's keyword arguments (see vllm_kvevict.eval.instances).
# Lengths are in tokens of the model's tokenizer.
CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "smoke": {
        "perplexity": dict(docs=("austen_emma",), n_tokens=1024, window=256),
        "niah": dict(haystacks=("austen_prideprejudice",), lengths=(1024,),
                     depths=(0.0, 0.5, 1.0), max_tokens=32),
        "kv_retrieval": dict(n_pairs=(12,), n_keys=(1,), repeats=2, max_tokens=32),
        "agreement": dict(n_instructions=1, passage_tokens=(256,), passages_per_length=1,
                          max_tokens=64),
    },
    # Sized for this 2-core CPU (about 1 minute per SmolLM2 engine, 21 engines);
    # the sweep, not the instance count, is what the results compare.
    "full": {
        "perplexity": dict(docs=("austen_emma", "jargon"), n_tokens=4096, window=256),
        "niah": dict(haystacks=("austen_prideprejudice",), lengths=(1024, 2048, 4096),
                     depths=(0.0, 0.25, 0.5, 0.75, 1.0), max_tokens=40),
        "kv_retrieval": dict(n_pairs=(16, 32), n_keys=(1, 2), repeats=2, max_tokens=48),
        "agreement": dict(n_instructions=4, passage_tokens=(512, 1024),
                          passages_per_length=1, max_tokens=128),
    },
}

# The budgets (fractions of the request's current length) each config sweeps.
# Full omits 1.0 for the evicting policies: budget >= length is token-identical
# to the full cache (tests/test_engine.py), so the `none` row is the 100% point.
BUDGETS = {"smoke": (0.1, 1.0), "full": (0.02, 0.05, 0.1, 0.2, 0.5)}


def user_content(instance: dict) -> str:
    """The one user message of the query-aware prompt."""
    q = instance["question"]
    return instance["context"] + "\n\n" + q if q else instance["context"]


def prompt_ids(instance: dict, tokenizer) -> list[int]:
    """Token ids of the query-aware prompt (see the module docstring)."""
    if instance["meta"].get("raw"):
        return list(tokenizer(instance["context"])["input_ids"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_content(instance)}],
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_instances(config: str, tokenizer, tasks: Sequence[str] = TASKS,
                    seed: int = 0) -> list[dict]:
    """Every instance of ``tasks`` for ``config``; deterministic for (config, tokenizer, seed)."""
    from vllm_kvevict.eval import instances as gen

    if config not in CONFIGS:
        raise ValueError(f"unknown config {config!r}; choose from {sorted(CONFIGS)}")
    out = []
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {TASKS}")
        out += getattr(gen, task)(tokenizer, seed=seed, **CONFIGS[config][task])
    return out


# --- scoring (pure Python, shared by every runner) ---

_DIGIT_GAPS = re.compile(r"(?<=\d)[\s,]+(?=\d)")


def _found(answer: str, text: str) -> bool:
    # Small models spell numbers one digit per token ("4 8 2 1 3"): also try
    # the text with the gaps between digits removed.
    return answer in text or answer in _DIGIT_GAPS.sub("", text)


def score_text(instance: dict, text: str) -> float:
    """niah / kv_retrieval: fraction of the expected answers found in ``text``."""
    answers = instance["meta"].get("answers") or [instance["answer"]]
    return sum(_found(a, text) for a in answers) / len(answers)


def agreement(tokens: Sequence[int], reference: Sequence[int]) -> tuple[float, int | None]:
    """(fraction of positions equal to ``reference``, first differing index or None).

    Positions past the end of the shorter sequence count as different.
    """
    n = max(len(reference), 1)
    same = sum(a == b for a, b in zip(tokens, reference))
    first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    if first is None and len(tokens) != len(reference):
        first = min(len(tokens), len(reference))
    return same / n, first


def window_perplexity(nll: Sequence[float | None], window: int) -> list[float]:
    """Perplexity per ``window``-token window of prompt positions.

    ``nll[i]``: negative log-likelihood (nats) of prompt token ``i`` given the
    tokens before it; ``nll[0]`` is None (no context). Returns one value per
    window: exp(mean NLL over the window's scored positions).
    """
    out = []
    for start in range(0, len(nll), window):
        vals = [v for v in nll[start:start + window] if v is not None]
        if vals:
            out.append(math.exp(sum(vals) / len(vals)))
    return out


def pooled_perplexity(nlls: Sequence[Sequence[float | None]]) -> float:
    """exp(mean NLL) over every scored position of every sequence."""
    vals = [v for seq in nlls for v in seq if v is not None]
    return math.exp(sum(vals) / len(vals)) if vals else float("nan")
