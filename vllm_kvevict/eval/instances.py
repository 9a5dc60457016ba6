"""Generators of task instances (the dict format of :mod:`vllm_kvevict.eval.tasks`).

Every generator takes the model's tokenizer (lengths are measured in its
tokens) and a seed, and is deterministic: each task draws from its own
``random.Random(f"{seed}/{task}")`` (string seeds hash the same in every
process), and texts come from :mod:`vllm_kvevict.passages` (prepared by
:mod:`vllm_kvevict.eval.texts`).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from functools import lru_cache

from vllm_kvevict.passages import load, paragraph_start, passages, take_tokens


def _rng(seed: int, task: str) -> random.Random:
    return random.Random(f"{seed}/{task}")


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


_SENTENCE_END = re.compile(r"[.!?][\"'\u2019\u201d)]*\s")


def _sentence_end(text: str, pos: int) -> int:
    """The first sentence end at or after ``pos`` (within 400 chars), else ``pos``."""
    m = _SENTENCE_END.search(text, pos, pos + 400)
    return m.end() if m else pos


def _last_sentence_end(text: str) -> int:
    """End of the last sentence in ``text``'s final 400 chars, else ``len(text)``."""
    ends = list(_SENTENCE_END.finditer(text + " ", max(len(text) - 400, 0)))
    return min(ends[-1].end(), len(text)) if ends else len(text)


def perplexity(tokenizer, seed: int, docs, n_tokens: int, window: int) -> list[dict]:
    """One raw ``n_tokens`` passage per document, from a random paragraph start
    (:func:`vllm_kvevict.passages.passages`)."""
    return [dict(task="perplexity", id=f"perplexity/{doc}", context=context,
                 question="", answer=None, max_tokens=1,
                 meta=dict(raw=True, window=window, source=doc,
                           n_tokens=len(tokenizer(context)["input_ids"])))
            for doc, context in zip(docs, passages(tokenizer, seed, docs, n_tokens))]


NIAH_QUESTION = "What is the secret passcode for the vault? Answer with the number only."


def niah(tokenizer, seed: int, haystacks, lengths, depths, max_tokens: int) -> list[dict]:
    """A passcode sentence at each depth of each haystack length.

    Haystack = ``length`` tokens of real text (needle included); the needle
    goes to the first sentence end after ``depth`` of the haystack.
    """
    rng = _rng(seed, "niah")
    out = []
    for hay in haystacks:
        text = load(hay)
        for length in lengths:
            for depth in depths:
                code = str(rng.randrange(10000, 100000))
                needle = f"The secret passcode for the vault is {code}."
                body = take_tokens(tokenizer, text, paragraph_start(rng, text, 12 * length),
                                   length - n_tokens(tokenizer, needle) - 1)
                body = body[:_last_sentence_end(body)].rstrip()  # depth 1: own sentence
                if code in body:  # the answer must appear only in the needle
                    continue
                cut = 0 if depth <= 0 else len(body) if depth >= 1 else \
                    _sentence_end(body, int(depth * len(body)))
                before, after = body[:cut].rstrip(), body[cut:].lstrip()
                context = " ".join(p for p in (before, needle, after) if p)
                out.append(dict(
                    task="niah", id=f"niah/{hay}/{length}/{depth:g}", context=context,
                    question=NIAH_QUESTION, answer=code, max_tokens=max_tokens,
                    meta=dict(depth=depth, length=length, haystack=hay,
                              context_tokens=n_tokens(tokenizer, context),
                              needle_token=n_tokens(tokenizer, before) if before else 0)))
    return out


@lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    """500 everyday words (4-8 letters) from Austen, skipping the 100 commonest."""
    counts = Counter(re.findall(r"\b[a-z]{4,8}\b", load("austen_emma")))
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    return tuple(ranked[100:600])


def _new_key(rng: random.Random, words, keys: list[str], a=None, b=None) -> str:
    """A fresh "a-b" key (two different words; ``a``/``b`` fixed when given), added to ``keys``."""
    while True:
        key = f"{a or rng.choice(words)}-{b or rng.choice(words)}"
        first, second = key.split("-")
        if key not in keys and first != second:
            keys.append(key)
            return key


def kv_retrieval(tokenizer, seed: int, n_pairs, n_keys, repeats: int,
                 max_tokens: int) -> list[dict]:
    """RULER-style key-value retrieval over word-pair keys ("silver-orchard": 482913).

    For each queried key "a-b" two distractors share one word ("a-x", "y-b");
    the other records are random pairs. Values are distinct 6-digit numbers.
    """
    rng = _rng(seed, "kv_retrieval")
    words = _vocabulary()
    out = []
    for pairs in n_pairs:
        for k in n_keys:
            for rep in range(repeats):
                keys: list[str] = []
                queried = [_new_key(rng, words, keys) for _ in range(k)]
                for key in queried:  # distractors: one shared word each
                    a, b = key.split("-")
                    _new_key(rng, words, keys, a=a)
                    _new_key(rng, words, keys, b=b)
                while len(keys) < pairs:
                    _new_key(rng, words, keys)
                values = rng.sample(range(100000, 1000000), len(keys))
                records = list(zip(keys, map(str, values)))
                rng.shuffle(records)
                lines = [f'"{key}": {value}' for key, value in records]
                answers = [dict(records)[key] for key in queried]
                quoted = " and ".join(f'"{key}"' for key in queried)
                question = (f"What is the value of key {quoted}? Answer with the number only."
                            if k == 1 else
                            f"What are the values of keys {quoted}? Answer with the numbers only.")
                context = ("Below is a list of key-value records. Each key appears exactly "
                           "once.\n\n" + "\n".join(lines))
                out.append(dict(
                    task="kv_retrieval", id=f"kv_retrieval/{len(keys)}x{k}/{rep}",
                    context=context, question=question, answer=", ".join(answers),
                    max_tokens=max_tokens,
                    meta=dict(n_pairs=len(keys), n_keys=k, answers=answers,
                              positions=[[r[0] for r in records].index(q) for q in queried],
                              context_tokens=n_tokens(tokenizer, context))))
    return out


INSTRUCTIONS = (
    "Write a detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step, how a CPU executes an instruction.",
    "Describe the water cycle to a ten-year-old, with examples.",
    "List ten ideas for a science fair project and explain each one.",
    "Write a letter to a friend describing your favourite city and why you love it.",
    "Explain how a hash table works and when you would use one.",
    "Give a short history of the printing press and its effects on society.",
    "Write a recipe for a vegetable soup, with ingredients and steps.",
)
PASSAGE_QUESTIONS = (
    "Summarize the passage above in a few sentences.",
    "Describe in detail what happens in the text above.",
    "Explain the main ideas of the text above.",
)
PASSAGE_SOURCES = ("austen_persuasion", "jargon", "austen_sensesensibility")


def agreement(tokenizer, seed: int, n_instructions: int, passage_tokens,
              passages_per_length: int, max_tokens: int) -> list[dict]:
    """Open-ended prompts for agreement with the full-cache output.

    Short hand-written instructions (the cache grows mostly by generation)
    and real passages with a question (the cache starts long).
    """
    rng = _rng(seed, "agreement")
    out = []
    for i, instruction in enumerate(INSTRUCTIONS[:n_instructions]):
        out.append(dict(task="agreement", id=f"agreement/instruction/{i}", context=instruction,
                        question="", answer=None, max_tokens=max_tokens,
                        meta=dict(ignore_eos=True, context_tokens=n_tokens(tokenizer,
                                                                             instruction))))
    for length in passage_tokens:
        for j in range(passages_per_length):
            src = PASSAGE_SOURCES[(len(out) + j) % len(PASSAGE_SOURCES)]
            text = load(src)
            context = take_tokens(tokenizer, text, paragraph_start(rng, text, 12 * length),
                                  length)
            out.append(dict(task="agreement", id=f"agreement/passage/{length}/{j}",
                            context=context, question=rng.choice(PASSAGE_QUESTIONS),
                            answer=None, max_tokens=max_tokens,
                            meta=dict(ignore_eos=True, source=src,
                                      context_tokens=n_tokens(tokenizer, context))))
    return out
