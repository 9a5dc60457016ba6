"""Quality of prompt modules: the harness's retrieval tasks with documents as modules.

    python -m vllm_kvevict.eval.prompt_modules_quality             # default run (~15 min, 2 cores)
    python -m vllm_kvevict.eval.prompt_modules_quality --quick     # a few minutes
    python -m vllm_kvevict.eval.prompt_modules_quality --json out.json --dense-check 0

Question (Prompt Cache, sections 3.3 and 5): when each document is encoded as
its own module (attention masked to the module, at its schema positions) and a
prompt imports them all, is the answer as good as with the plain prompt? One file because it is one
experiment, end to end (instances, both encodings, the dense check, the report).

Method
------
* Instances: the fidelity harness's generators (vllm_kvevict.eval.instances:
  ``niah``, ``kv_retrieval``); scoring is the harness's ``tasks.score_text``;
  the plain prompt is the harness's ``tasks.prompt_ids`` (SmolLM2's chat
  template around context + "\\n\\n" + question).
* Documents: every instance is cut into each n of --docs documents of about
  equal length, and every split is scored (paired with the same plain run).
  niah: cuts at sentence ends only (before the single space that follows, or
  between the two newlines of a paragraph break); kv_retrieval: the header
  line stays in front (with the chat template's prefix: the schema's
  anonymous text), the records are cut into groups at line ends. Cuts sit
  where tokenization does not change, so the modules' tokens, read in position
  order, are EXACTLY the plain prompt's tokens at its positions (checked per
  split with the plugin's own vllm_kvevict.core.modules.prompt_layout; the header line of
  each table says how many pass). The only difference between (a) and (b) is
  then how the KV is computed.
* (a) plain: the harness prompt as token ids, ordinary causal attention.
  (b) modules: one schema per (instance, n),
  ``<schema>{chat prefix}<module name="d0">document 0</module>...</schema>``,
  prompt ``<prompt schema=..><d0/><d1/>...{"\\n" question chat-suffix}</prompt>``
  (the first "\\n" of the "\\n\\n" before the question closes the last module:
  PML keeps one newline of an edge run of whitespace). A module's full 32-token
  blocks are encoded alone at registration and reused; "shared" is the
  fraction of prompt tokens that vLLM reports as cached (num_cached_tokens),
  i.e. that really were computed module-masked. The rest (chat prefix, each
  module's last partial block, the question) is computed by the request and
  attends to everything before it in the request's physical order (see
  vllm_kvevict/core/modules/prompt_layout.py).
  (r) noise reference: the plain prompt with the same n documents in another
  order (a random derangement seeded by instance and n: every document
  moves), joined by a blank line (niah) or a newline (kv_retrieval). The
  answer does not depend on the order, so score(r) - score(a) is what an
  irrelevant change to the prompt does to this model's score, instance by
  instance. Module encoding is
  "within noise" when score(b) - score(a) is of that size; both come with a
  paired bootstrap 95% interval over instances.
* Decoding: greedy, the instance's max_tokens, the same for (a), (b) and (r).
  One engine: float32 by default (this AVX2-only CPU has no native bfloat16:
  ~4x slower; --dtype bfloat16 runs everything in bfloat16), prefix
  caching on (prompt modules need it), block size 32, enforce_eager, seed 0.
* Agreement: "same output" counts instances whose generated token ids equal
  the plain prompt's; "tok agree" is the harness's tasks.agreement (fraction
  of positions equal to the plain output), averaged.
* --dense-check K: for up to K splits whose module score differs from the
  plain score (contexts up to 1.1K tokens), recompute plain and module outputs
  with a dense transformers float32 model (the Prompt Cache computation
  written as an attention mask, as in tests/test_prompt_modules.py) and report
  whether vLLM's outputs equal them: tells a property of the method from a
  bug in the plugin.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from xml.sax.saxutils import escape

from vllm_kvevict.eval import instances as gen
from vllm_kvevict.eval import tasks as T
from vllm_kvevict.inprocess import close

BLOCK = 32
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64  # SmolLM2-135M: layers x (K, V) x KV heads x head dim
PLACEHOLDER = "\x00CONTENT\x00"

# Per task: the harness generator's keyword arguments, the instance seeds, and
# the document counts each instance is split into. Sizes where SmolLM2-135M's
# plain prompt scores above zero: the harness's full config gets niah 0.93 at
# 1-4K tokens but kv_retrieval only 0.06 at 16-32 pairs, hence 8 pairs (plain
# 0.33 on 24 instances; 10 pairs: 0.125). kv documents must still span a whole
# 32-token block to be shared at all: 8 pairs ~ 112 tokens, 2 documents of ~55
# tokens share one block each, 3 documents (3 + 2 + 3 records, ~41 + 27 + 41
# tokens) one block each of the outer two. niah: 1K-token haystacks, at most 8
# documents of ~126 tokens.
CONFIGS = {
    "default": dict(
        niah=dict(gen=dict(haystacks=("austen_prideprejudice", "austen_emma",
                                      "austen_persuasion", "austen_mansfieldpark"),
                           lengths=(1024,), depths=(0.1, 0.3, 0.5, 0.7, 0.9), max_tokens=32),
                  seeds=(0,), docs=(2, 4, 8)),
        kv_retrieval=dict(gen=dict(n_pairs=(8,), n_keys=(1,), repeats=30, max_tokens=24),
                          seeds=(0,), docs=(2, 3)),
    ),
    "quick": dict(
        niah=dict(gen=dict(haystacks=("austen_prideprejudice",), lengths=(1024,),
                           depths=(0.3, 0.7), max_tokens=32),
                  seeds=(0,), docs=(2, 8)),
        kv_retrieval=dict(gen=dict(n_pairs=(8,), n_keys=(1,), repeats=2, max_tokens=24),
                          seeds=(0,), docs=(2,)),
    ),
}


# --- instances and documents ---------------------------------------------------

def build(task: str, tok, kwargs: dict, seeds) -> list[dict]:
    """The harness's instances of `task` for each seed (ids prefixed by the seed)."""
    return [{**inst, "id": f"s{seed}/{inst['id']}"}
            for seed in seeds for inst in getattr(gen, task)(tok, seed=seed, **kwargs)]


_SENT = re.compile(r"[.!?][\"'\u2019\u201d)]*(?= \S)")  # cut before the space
_PARA = re.compile(r"(?<=\S)\n(?=\n\S)")  # cut between the two newlines


def _cut_candidates(task: str, body: str) -> list[int]:
    if task == "niah":
        cands = {m.end() for m in _SENT.finditer(body)} | {m.end() for m in _PARA.finditer(body)}
    else:  # kv_retrieval: after each record's newline
        cands = {m.end() for m in re.finditer(r"\n(?=\")", body)}
    return sorted(c for c in cands if 0 < c < len(body))


def split_documents(task: str, context: str, n_docs: int) -> tuple[str, list[str]]:
    """(lead, documents) with lead + "".join(documents) == context; documents of
    about equal length, cut where the pieces tokenize like the whole (prepare
    checks it)."""
    lead, body = "", context
    if task == "kv_retrieval":  # the header line stays in front, out of the documents
        cut = context.index("\n\n") + 1
        lead, body = context[:cut], context[cut:]
    cands = _cut_candidates(task, body)
    cuts: list[int] = []
    for i in range(1, n_docs):  # the candidate nearest to an equal share of the chars
        free = [c for c in cands if not cuts or c > cuts[-1]]
        if not free:
            break
        cuts.append(min(free, key=lambda c: abs(c - len(body) * i / n_docs)))
    docs = [body[a:b] for a, b in zip([0] + cuts, cuts + [len(body)])]
    return lead, [d for d in docs if d]


def derangement(n: int, seed: str) -> list[int]:
    """A seeded random order of range(n) in which no document keeps its place."""
    rng = random.Random(seed)
    while True:
        order = rng.sample(range(n), n)
        if all(i != j for i, j in enumerate(order)):
            return order


def reordered_context(task: str, lead: str, docs: list[str], seed: str) -> str:
    sep = "\n\n" if task == "niah" else "\n"
    body = sep.join(docs[j].strip() for j in derangement(len(docs), seed))
    return lead.rstrip() + "\n\n" + body if lead else body


def chat_frame(tok) -> tuple[str, str]:
    """(prefix, suffix) of the harness's chat prompt around the user content."""
    text = tok.apply_chat_template([{"role": "user", "content": PLACEHOLDER}],
                                   add_generation_prompt=True, tokenize=False)
    before, after = text.split(PLACEHOLDER)
    return before, after


def pml_pair(name: str, prefix: str, suffix: str, lead: str, docs: list[str],
             question: str) -> tuple[str, str]:
    """(schema, prompt) PML: documents as modules d0.., the question as free text.
    The first newline of the "\\n\\n" before the question closes the last module
    (PML turns an edge run of whitespace holding a newline into one newline)."""
    docs = docs[:-1] + [docs[-1] + "\n"]
    schema = (f'<schema name="{name}">{escape(prefix + lead)}'
              + "".join(f'<module name="d{i}">{escape(d)}</module>' for i, d in enumerate(docs))
              + "</schema>")
    imports = "".join(f"<d{i}/>" for i in range(len(docs)))
    prompt = f'<prompt schema="{name}">{imports}{escape(chr(10) + question + suffix)}</prompt>'
    return schema, prompt


def request_layout(schema: str, prompt: str, enc):
    """(schema layout, request layout) exactly as the plugin computes them."""
    from vllm_kvevict.core.modules.pml import parse_prompt, parse_schema
    from vllm_kvevict.core.modules.prompt_layout import layout_prompt, layout_schema

    s = layout_schema(parse_schema(schema), enc)
    return s, layout_prompt(s, parse_prompt(prompt), enc, BLOCK)


def same_tokens_and_positions(schema: str, prompt: str, plain: list[int], enc) -> bool:
    """Are the PML prompt's tokens, in position order, the plain prompt's at
    positions 0..n-1?"""
    _, lay = request_layout(schema, prompt, enc)
    pairs = sorted(zip(lay.positions, lay.token_ids))
    return [p for p, _ in pairs] == list(range(len(plain))) and [t for _, t in pairs] == plain


def encoder(tok):
    return lambda s: list(tok.encode(s, add_special_tokens=False))


def prepare(task: str, insts: list[dict], tok, docs) -> list[dict]:
    """Per instance: the plain prompt and, per document count, the split."""
    enc = encoder(tok)
    prefix, suffix = chat_frame(tok)
    cases = []
    for i, inst in enumerate(insts):
        case = dict(inst=inst, plain=T.prompt_ids(inst, tok), splits={})
        for n in docs:
            lead, parts = split_documents(task, inst["context"], n)
            assert lead + "".join(parts) == inst["context"]
            name = f"pmq_{task}_{i}_{n}"
            schema, prompt = pml_pair(name, prefix, suffix, lead, parts, inst["question"])
            reordered = T.prompt_ids({**inst, "context": reordered_context(
                task, lead, parts, f"{inst['id']}/{len(parts)}")}, tok)
            case["splits"][n] = dict(
                name=name, schema=schema, prompt=prompt, reordered=reordered,
                doc_tokens=[len(enc(p)) for p in parts],
                exact=same_tokens_and_positions(schema, prompt, case["plain"], enc))
        cases.append(case)
    return cases


# --- engine --------------------------------------------------------------------

def build_llm(model_dir: str, dtype: str, max_model_len: int, pool_mib: int, chunk: int):
    from vllm import LLM

    return LLM(model_dir, enforce_eager=True, dtype=dtype, seed=0, block_size=BLOCK,
               max_model_len=max_model_len, kv_cache_memory_bytes=pool_mib << 20,
               enable_prefix_caching=True, enable_chunked_prefill=True,
               max_num_batched_tokens=chunk)


def kv_pool_tokens(pool_mib: int, dtype: str) -> int:
    return (pool_mib << 20) // (KV_BYTES_PER_TOKEN * (2 if dtype == "bfloat16" else 4))


def _params(inst):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=inst["max_tokens"])


def _record(o) -> dict:
    return dict(text=o.outputs[0].text, ids=list(o.outputs[0].token_ids),
                cached=o.num_cached_tokens or 0, prompt_len=len(o.prompt_token_ids))


def run_plain(llm, cases: list[dict]) -> float:
    """(a): case["plain_out"]; returns the generate call's wall time."""
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": c["plain"]} for c in cases],
                        [_params(c["inst"]) for c in cases], use_tqdm=False)
    for c, o in zip(cases, outs):
        c["plain_out"] = _record(o)
    return time.perf_counter() - t0


def run_reordered(llm, cases: list[dict], n: int) -> float:
    """(r) for the n-document split: split["reordered_out"]."""
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": c["splits"][n]["reordered"]} for c in cases],
                        [_params(c["inst"]) for c in cases], use_tqdm=False)
    for c, o in zip(cases, outs):
        c["splits"][n]["reordered_out"] = _record(o)
    return time.perf_counter() - t0


def run_modules(llm, cases: list[dict], n: int, pool_tokens: int) -> tuple[float, float]:
    """(b) for the n-document split: split["modules_out"]. Schemas are registered
    in groups whose pinned KV leaves room for the group's requests, then removed.
    Returns (registration, generation) wall time."""
    from vllm_kvevict.integration import prompt_modules as pm

    reg = run = 0.0
    i = 0
    while i < len(cases):
        group, used = [], 0
        # pinned module tokens + the request's own (question, tails, output): < 1.25x
        while i < len(cases) and (not group or used + 1.25 * len(cases[i]["plain"])
                                  < pool_tokens):
            group.append(cases[i])
            used += 1.25 * len(cases[i]["plain"])
            i += 1
        splits = [c["splits"][n] for c in group]
        t0 = time.perf_counter()
        registered = []
        try:
            for s in splits:
                pm.register_schema(llm, s["schema"])
                registered.append(s["name"])
            t1 = time.perf_counter()
            outs = llm.generate([s["prompt"] for s in splits], [_params(c["inst"]) for c in group],
                                use_tqdm=False)
            reg, run = reg + t1 - t0, run + time.perf_counter() - t1
        finally:
            for name in registered:
                pm.remove_schema(llm, name)
        for s, o in zip(splits, outs):
            s["modules_out"] = _record(o)
    return reg, run


# --- dense reference -----------------------------------------------------------

def dense_check(model_dir: str, tok, cases: list[dict], limit: int, max_tokens: int = 1100):
    """vLLM's plain and module outputs vs a dense transformers float32 greedy
    run of the same computation, for up to `limit` splits whose module score
    differs from the plain one (the biggest drops first). Returns rows
    {id, n_docs, plain_same, modules_same, dense_modules_text}."""
    import torch
    from transformers import AutoModelForCausalLM

    changed = [(s["modules_score"] - c["plain_score"], k, c, n) for k, c in enumerate(cases)
               for n, s in c["splits"].items()
               if s["modules_score"] != c["plain_score"] and len(c["plain"]) <= max_tokens]
    picked = [(c, n) for *_, c, n in sorted(changed, key=lambda x: x[:2])[:limit]]  # worse first
    if not picked:
        return []
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    enc = encoder(tok)

    def greedy(ids, positions, allowed, n_new, stop):
        n = len(ids)
        mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
        out = []
        with torch.no_grad():
            r = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
                      attention_mask=mask, use_cache=True)
            pos = max(positions) + 1
            while True:  # every generated token attends to everything
                nxt = int(r.logits[0, -1].argmax())
                out.append(nxt)
                if nxt in stop or len(out) == n_new:
                    return out
                r = model(input_ids=torch.tensor([[nxt]]), position_ids=torch.tensor([[pos]]),
                          attention_mask=torch.zeros(1, 1, 1, n + len(out)),
                          past_key_values=r.past_key_values, use_cache=True)
                pos += 1

    rows = []
    stop = {tok.eos_token_id}
    for c, n in picked:
        s, k = c["splits"][n], c["inst"]["max_tokens"]
        _, lay = request_layout(s["schema"], s["prompt"], enc)
        seg = []
        for i, (_, count) in enumerate(lay.imports):  # shared module tokens: their module only
            seg += [i] * count
        seg = torch.tensor(seg + [-1] * (len(lay.token_ids) - len(seg)))
        causal = torch.ones(len(seg), len(seg), dtype=torch.bool).tril()
        allowed = causal & ((seg[:, None] < 0) | (seg[:, None] == seg[None, :]))
        mod = greedy(lay.token_ids, lay.positions, allowed, k, stop)
        m = len(c["plain"])
        plain = greedy(c["plain"], list(range(m)),
                       torch.ones(m, m, dtype=torch.bool).tril(), k, stop)
        strip = lambda ids: [t for t in ids if t not in stop]  # noqa: E731 (vLLM drops EOS)
        rows.append(dict(id=c["inst"]["id"], n_docs=n,
                         plain_same=strip(plain) == strip(c["plain_out"]["ids"]),
                         modules_same=strip(mod) == strip(s["modules_out"]["ids"]),
                         dense_modules_text=tok.decode(strip(mod))))
    return rows


# --- statistics ----------------------------------------------------------------

def bootstrap_ci(diffs: list[float], n_boot: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean of paired differences."""
    if not diffs:
        return (math.nan, math.nan)
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choice(diffs) for _ in range(n)) / n for _ in range(n_boot))
    return means[int(0.025 * n_boot)], means[int(0.975 * n_boot) - 1]


def _mean(xs):
    return sum(xs) / len(xs) if xs else math.nan


def score(cases: list[dict]) -> None:
    """Scores (harness scorer) and agreement with the plain output, in place."""
    for c in cases:
        inst, ref = c["inst"], c["plain_out"]["ids"]
        c["plain_score"] = T.score_text(inst, c["plain_out"]["text"])
        for s in c["splits"].values():
            for v in ("modules", "reordered"):
                out = s.get(f"{v}_out")
                if out is not None:
                    s[f"{v}_score"] = T.score_text(inst, out["text"])
                    s[f"{v}_same"] = out["ids"] == ref
                    s[f"{v}_agreement"] = T.agreement(out["ids"], ref)[0]


def summarize(task: str, cases: list[dict]) -> dict:
    score(cases)
    rows = []
    for n in cases[0]["splits"]:
        splits = [(c, c["splits"][n]) for c in cases]
        row = dict(n_docs=n, n=len(cases), plain=_mean([c["plain_score"] for c in cases]),
                   exact_layout=sum(s["exact"] for _, s in splits),
                   doc_tokens=_mean([t for _, s in splits for t in s["doc_tokens"]]))
        for v in ("modules", "reordered"):
            if f"{v}_out" not in splits[0][1]:
                continue
            diffs = [s[f"{v}_score"] - c["plain_score"] for c, s in splits]
            row[v] = dict(score=_mean([s[f"{v}_score"] for _, s in splits]), delta=_mean(diffs),
                          ci=bootstrap_ci(diffs), better=sum(d > 0 for d in diffs),
                          worse=sum(d < 0 for d in diffs),
                          same=sum(s[f"{v}_same"] for _, s in splits),
                          agreement=_mean([s[f"{v}_agreement"] for _, s in splits]),
                          shared=_mean([s[f"{v}_out"]["cached"] / s[f"{v}_out"]["prompt_len"]
                                        for _, s in splits]))
        rows.append(row)
    instances = [dict(id=c["inst"]["id"], prompt_tokens=len(c["plain"]),
                      plain=dict(score=c["plain_score"], output=c["plain_out"]["text"]),
                      splits={n: dict(doc_tokens=s["doc_tokens"], exact_layout=s["exact"],
                                      **{v: dict(score=s[f"{v}_score"], same=s[f"{v}_same"],
                                                 output=s[f"{v}_out"]["text"],
                                                 cached=s[f"{v}_out"]["cached"])
                                         for v in ("modules", "reordered") if f"{v}_out" in s})
                              for n, s in c["splits"].items()})
                 for c in cases]
    return dict(task=task, rows=rows, instances=instances)


def markdown(res: dict, settings: str) -> str:
    rows = res["rows"]
    exact = sum(r["exact_layout"] for r in rows)
    total = sum(r["n"] for r in rows)
    out = [f"### {res['task']} (n={rows[0]['n']} instances; {settings})", "",
           f"Plain prompt (a): **{rows[0]['plain']:.3f}**. Module prompts with exactly the plain "
           f"prompt's tokens and positions: {exact}/{total} splits.", "",
           "| documents | prompt | score | Δ vs plain [95% CI] | better / worse | same output "
           "| tok agree | shared |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for v, label in (("modules", "(b) modules"),
                         ("reordered", "(r) plain, reordered (noise)")):
            d = r.get(v)
            if d is None:
                continue
            # reordered prompts can hit the prefix cache (plain KV, exact): not "shared"
            shared = f"{100 * d['shared']:.0f}%" if v == "modules" else ""
            out.append(f"| {r['n_docs']} (~{r['doc_tokens']:.0f} tok) | {label} | "
                       f"{d['score']:.3f} | {d['delta']:+.3f} [{d['ci'][0]:+.3f}, "
                       f"{d['ci'][1]:+.3f}] | {d['better']} / {d['worse']} | "
                       f"{d['same']}/{r['n']} | {d['agreement']:.2f} | {shared} |")
    changed = {v: [sum(r[v][k] for r in rows if v in r) for k in ("better", "worse")]
               for v in ("modules", "reordered")}
    out += ["", f"Instances x splits whose score changed vs plain: modules "
            f"{sum(changed['modules'])}/{total} ({changed['modules'][0]} better, "
            f"{changed['modules'][1]} worse); reordered plain (noise) "
            f"{sum(changed['reordered'])}/{total} ({changed['reordered'][0]} better, "
            f"{changed['reordered'][1]} worse)."]
    return "\n".join(out)


# --- main ----------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_kvevict.eval.prompt_modules_quality",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few instances (smoke)")
    p.add_argument("--json", metavar="FILE", help="write settings, tables and per-instance rows")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--tasks", nargs="+", default=["niah", "kv_retrieval"],
                   choices=["niah", "kv_retrieval"])
    p.add_argument("--seeds", type=int, nargs="+", help="instance seeds (default per task)")
    p.add_argument("--docs", type=int, nargs="+", help="document counts (default per task)")
    p.add_argument("--niah-lengths", type=int, nargs="+", help="haystack tokens (default 1024)")
    p.add_argument("--kv-pairs", type=int, nargs="+", help="records (default 8)")
    p.add_argument("--pool-mib", type=int, default=768, help="KV cache (MiB)")
    p.add_argument("--chunk-tokens", type=int, default=2048,
                   help="max_num_batched_tokens (chunked-prefill chunk)")
    p.add_argument("--dense-check", type=int, default=3, metavar="K",
                   help="check up to K changed splits per task against a dense transformers "
                   "run (default 3; 0: off)")
    args = p.parse_args(argv)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from transformers import AutoTokenizer

    from vllm_kvevict.models import ensure_smollm2

    cfg = {t: {**c, "gen": dict(c["gen"])}
           for t, c in CONFIGS["quick" if args.quick else "default"].items() if t in args.tasks}
    for c in cfg.values():
        c["seeds"] = tuple(args.seeds or c["seeds"])
        c["docs"] = tuple(args.docs or c["docs"])
    if args.niah_lengths and "niah" in cfg:
        cfg["niah"]["gen"]["lengths"] = tuple(args.niah_lengths)
    if args.kv_pairs and "kv_retrieval" in cfg:
        cfg["kv_retrieval"]["gen"]["n_pairs"] = tuple(args.kv_pairs)
    model_dir = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(model_dir)
    t_start = time.perf_counter()
    cases = {t: prepare(t, build(t, tok, c["gen"], c["seeds"]), tok, c["docs"])
             for t, c in cfg.items()}
    longest = max(max(len(c["plain"]), *(len(s["reordered"]) for s in c["splits"].values()))
                  + c["inst"]["max_tokens"] for cs in cases.values() for c in cs)
    max_len = -(-(longest + 8) // BLOCK) * BLOCK
    pool_tokens = kv_pool_tokens(args.pool_mib, args.dtype)
    llm = build_llm(model_dir, args.dtype, max_len, args.pool_mib, args.chunk_tokens)
    results = {}
    try:
        for task, cs in cases.items():
            wall = dict(plain=run_plain(llm, cs), reordered=0.0, register=0.0, modules=0.0)
            for n in cfg[task]["docs"]:
                wall["reordered"] += run_reordered(llm, cs, n)
                reg, run = run_modules(llm, cs, n, pool_tokens)
                wall["register"] += reg
                wall["modules"] += run
            results[task] = summarize(task, cs)
            results[task]["wall_s"] = {k: round(v, 1) for k, v in wall.items()}
            c = cfg[task]
            settings = (f"{args.dtype}, seeds {list(c['seeds'])}, {json.dumps(c['gen'])}")
            print(markdown(results[task], settings), "\n", flush=True)
            print(f"wall (s): {results[task]['wall_s']}\n", flush=True)
    finally:
        close(llm)
    if args.dense_check:
        for task, cs in cases.items():
            rows = dense_check(model_dir, tok, cs, args.dense_check)
            results[task]["dense_check"] = rows
            print(f"dense check, {task}: vLLM plain output = dense "
                  f"{sum(r['plain_same'] for r in rows)}/{len(rows)}, vLLM module output = dense "
                  f"masked {sum(r['modules_same'] for r in rows)}/{len(rows)} "
                  f"({', '.join(r['id'] + ' n=' + str(r['n_docs']) for r in rows)})", flush=True)
    total = time.perf_counter() - t_start
    print(f"total {total:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=dict(dtype=args.dtype, tasks=cfg, block_size=BLOCK,
                                         max_model_len=max_len, pool_mib=args.pool_mib,
                                         chunk_tokens=args.chunk_tokens, argv=sys.argv[1:],
                                         wall_s=round(total, 1)),
                           results=results), f, indent=1, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
