"""Run the team's quality tasks through NVIDIA's kvpress, for a side-by-side.

Standalone on purpose: it runs in its own venv (``scripts/setup_kvpress.sh``
makes ``.venv-kvpress``: CPU torch + transformers + kvpress, no vLLM). At module
level it imports the standard library and :mod:`vllm_kvevict.eval.tasks` only
(pure Python, no vLLM, no torch: the harness's JSON interface, prompt and
scoring rules, shared so that both frameworks score alike); torch,
transformers, kvpress and tqdm are imported inside the functions that need
them. The pure parts (budget mapping, parsing, prompt, scoring) are therefore
testable in any venv, kvpress or not. One file because it runs standalone in
that other venv: a second module would have to travel with it.

From the repository root (the kvpress venv does not install the project):

    PYTHONPATH=$PWD .venv-kvpress/bin/python -m vllm_kvevict.eval.kvpress_runner \\
        --tasks TASKS.json --out kvpress.json \\
        [--presses none,h2o,snapkv,streaming,andpro] [--budgets 0.05,0.2] \\
        [--query-mode aware,agnostic]

Input: the file written by ``python -m vllm_kvevict.eval --dump-tasks FILE``::

    {"model": "smollm2", "model_dir": "<HF checkpoint dir>",
     "instances": [{"task": "niah"|"kv_retrieval"|"agreement"|"perplexity",
                    "id": str, "context": str, "question": str,
                    "answer": str|null, "max_tokens": int, "meta": {...}}]}

Policies and the kvpress press each one runs (``press`` field of a row):

    none       no press: the full cache (also the agreement reference)
    h2o        ObservedAttentionPress   "observed_attention" (needs eager attention)
    snapkv     SnapKVPress              "snapkv"
    streaming  StreamingLLMPress        "streaming_llm"
    andpro     CriticalKVPress(SnapKVPress)  "criticalkv"  (see ANDPRO_NEAREST)

``budget`` is the fraction of tokens KEPT; kvpress's ``compression_ratio`` is
the fraction removed, ``1 - budget`` (:func:`budget_to_compression_ratio`);
"none" rows carry budget 1.0, as the harness's.
kvpress keeps ``int(n * (1 - compression_ratio))`` tokens, so the count can be
one below ``budget * n`` through float rounding: every instance records the
tokens actually kept (``kept_tokens``).

Query modes (the ``query_mode`` field of a row):

    aware     the prompt is the chat template of ONE user message
              ``context + "\\n\\n" + question`` (just ``context`` when the
              question is ""; ``tasks.prompt_ids``), generation prompt added, and
              the press compresses all of it, question included, as SnapKV
              sees its question inside vLLM. The first token comes from the
              prefill's own (uncompressed) attention, the rest from the
              compressed cache.
    agnostic  kvpress's own pipeline convention:
              ``pipeline("kv-press-text-generation")(context, question=question,
              press=press)``: the chat-templated context is compressed without
              the question, then the question (+ the template's tail) is fed
              uncompressed and the answer decoded greedily. Retrieval tasks
              call that pipeline as is; agreement needs token ids and no EOS
              stop, so it takes the pipeline's own ``preprocess`` ids and runs
              :meth:`Runner.greedy`, the same prefill-then-decode (checked: the
              same text as the pipeline for all four presses).

Scoring: the harness's own functions (``tasks.score_text``, ``tasks.agreement``):

    niah, kv_retrieval  the fraction of the expected answers (``meta.answers``,
                        else ``answer``) found in the generated text, as is or
                        with the gaps between digits removed ("4 8 2 1 3" ->
                        "48213"); greedy, ``max_tokens`` new tokens, stopping
                        at EOS.
    agreement           the fraction of the ``max_tokens`` positions whose
                        greedy token equals kvpress's own full-cache ("none")
                        output for the same instance and query mode, decoded
                        without stopping at EOS (``meta.ignore_eos``); plus
                        the first divergence index (null when there is none).
    perplexity          skipped: kvpress compresses the prefill only, so a
                        teacher-forced perplexity over the prompt would see the
                        full cache. Listed under ``skipped`` in the output.

Output: ``{"rows": [...], "skipped": [...], "meta": {...}}``, one row per
(query_mode, task, policy, budget)::

    {"framework": "kvpress", "model", "task", "policy", "press", "budget",
     "query_mode", "score" (mean over instances), "n", "wall_s", "detail"}

``wall_s`` is the sum of the instances' wall times (prefill + decode);
``detail.instances`` has each instance's own. The file is rewritten after every
row, so an interrupted run keeps what it finished.

All presses run on one model load (one dtype, one attention implementation:
eager by default, which ObservedAttentionPress needs), so the agreement
reference and every press share the same kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Iterable, Sequence

from vllm_kvevict.eval import tasks as T  # pure: neither vLLM nor torch

FRAMEWORK = "kvpress"
RETRIEVAL_TASKS = ("niah", "kv_retrieval")
AGREEMENT_TASKS = ("agreement",)
SCORED_TASKS = RETRIEVAL_TASKS + AGREEMENT_TASKS
SKIPPED_TASKS = {
    "perplexity": "kvpress compresses the prefill only (compression runs in a hook "
                  "after the prompt's forward pass), so a teacher-forced perplexity "
                  "over the prompt would be computed on the full cache",
}
QUERY_MODES = ("aware", "agnostic")
POLICIES = ("none", "h2o", "snapkv", "streaming", "andpro")

# policy name (ours) -> the `press` field of a row
PRESS_NAMES = {
    "none": None,
    "h2o": "observed_attention",
    "snapkv": "snapkv",
    "streaming": "streaming_llm",
    "andpro": "criticalkv",
}

ANDPRO_NEAREST = """\
AnDPro's nearest kvpress equivalent: CriticalKVPress wrapping SnapKVPress.

AnDPro (vllm_kvevict.core.scoring.window_scores) scores token i by the window attention
weighted by the projection of its value on the pre-eviction output,
sum_t a[t, i] * <y_t, v_i> with y_t = sum_j a[t, j] v_j: attention alone is
not enough, the value's contribution to the output counts too. Of kvpress's
presses, only CriticalKV and CriticalAdaKV fold the value into the score:
CriticalKV rescales a base press's attention score by the L1 norm of the
value after the output projection, ||W_o v_i||_1 (the magnitude of what the
token adds to the layer output, where AnDPro takes the signed projection on the
output direction), after reserving half of the budget for the base press's
pure attention top-k. Its base press here is SnapKVPress, so the attention part
is the same observation window of the last `window` queries that AnDPro uses.
CriticalKVPress rather than CriticalAdaKVPress: ours, like CriticalKVPress,
keeps the same number of tokens in every KV head (the stock paged kernels need
it), while CriticalAdaKVPress moves budget between heads (and refuses eager
attention). Other value-aware presses were ruled out: CURPress/LeverageScore
are query-free geometry scores, KVzip/KVgrad reconstruct the context with
extra passes, and ChunkKVPress (chunking, as AnDPro's chunks of 4) would pick
chunks shared by all heads and refuses eager attention.
"""

# --------------------------------------------------------------------------
# Pure parts (no torch / transformers / kvpress): unit-tested in the main venv
# --------------------------------------------------------------------------

def budget_to_compression_ratio(budget: float) -> float:
    """Fraction KEPT (ours) -> fraction REMOVED (kvpress's compression_ratio).

    kvpress asserts ``0 <= compression_ratio < 1``, so a budget must be in
    (0, 1]; 1 means no compression. Rounded to 12 digits so that 0.2 maps to
    0.8, not 0.7999999999999999.
    """
    budget = float(budget)
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget is the fraction of tokens kept, in (0, 1]; got {budget!r}")
    return round(1.0 - budget, 12)


def parse_budgets(text: str) -> list[float]:
    """``"0.05,0.2"`` -> ``[0.05, 0.2]``, each checked, duplicates dropped."""
    out: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"budget {part!r} is not a number") from None
        budget_to_compression_ratio(value)  # validates
        if value not in out:
            out.append(value)
    if not out:
        raise ValueError("no budget given")
    return out


def parse_choices(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """Comma list -> names in the order given, each one of ``allowed``."""
    out: list[str] = []
    for part in text.split(","):
        name = part.strip().lower()
        if not name:
            continue
        if name not in allowed:
            raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(allowed)}")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"no {what} given")
    return out


def ignores_eos(inst: dict[str, Any]) -> bool:
    """Generate exactly max_tokens (agreement: ``meta.ignore_eos``, as the harness's)."""
    return bool(inst.get("meta", {}).get("ignore_eos")) or inst["task"] in AGREEMENT_TASKS


def score_output(inst: dict[str, Any], text: str) -> float:
    """niah / kv_retrieval score of one output: the harness's rule."""
    return T.score_text(inst, text)


def aware_prompt_ids(inst: dict[str, Any], tokenizer: Any) -> list[int]:
    """Query-aware prompt: the harness's own token ids (``tasks.prompt_ids``)."""
    return T.prompt_ids(inst, tokenizer)


def load_tasks(path: str) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """Read a TASKS.json -> (header, scored instances, skipped summary).

    The header is the file minus its instances. Unknown tasks are an error;
    perplexity instances are counted into the skipped summary.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for key in ("model_dir", "instances"):
        if key not in data:
            raise ValueError(f"{path}: missing {key!r}")
    header = {k: v for k, v in data.items() if k != "instances"}
    scored: list[dict[str, Any]] = []
    skipped: dict[str, int] = {}
    for i, inst in enumerate(data["instances"]):
        task = inst.get("task")
        inst.setdefault("meta", {})
        if task in SKIPPED_TASKS:
            skipped[task] = skipped.get(task, 0) + 1
            continue
        if task not in SCORED_TASKS:
            raise ValueError(f"{path}: instance {i} has unknown task {task!r}")
        for key in ("id", "context", "question", "max_tokens"):
            if key not in inst:
                raise ValueError(f"{path}: instance {i} ({task}) lacks {key!r}")
        if int(inst["max_tokens"]) < 1:
            raise ValueError(f"{path}: instance {inst['id']!r}: max_tokens must be >= 1")
        if task in RETRIEVAL_TASKS and not (inst.get("answer") or inst["meta"].get("answers")):
            raise ValueError(f"{path}: instance {inst['id']!r} ({task}) has no answer")
        scored.append(inst)
    summary = [{"task": t, "n": n, "reason": SKIPPED_TASKS[t]} for t, n in sorted(skipped.items())]
    return header, scored, summary


def tasks_in_order(instances: Iterable[dict[str, Any]]) -> list[str]:
    """Task names in first-seen order."""
    out: list[str] = []
    for inst in instances:
        if inst["task"] not in out:
            out.append(inst["task"])
    return out


def configs(policies: Sequence[str], budgets: Sequence[float]) -> list[tuple[str, float]]:
    """(policy, budget) pairs to run, "none" first (it is the agreement
    reference, so it always runs, once, with budget 1.0 as in the harness)."""
    out: list[tuple[str, float]] = [("none", 1.0)]
    for policy in policies:
        if policy != "none":
            out.extend((policy, b) for b in budgets)
    return out


# --------------------------------------------------------------------------
# kvpress side (imports inside functions)
# --------------------------------------------------------------------------

def make_press(policy: str, budget: float, *, window: int, kernel_size: int,
               n_sink: int):
    """The kvpress press for one of our policies at one budget (None for "none")."""
    if policy == "none":
        return None
    from kvpress import CriticalKVPress, ObservedAttentionPress, SnapKVPress, StreamingLLMPress

    ratio = budget_to_compression_ratio(budget)
    snapkv = lambda: SnapKVPress(compression_ratio=ratio, window_size=window,  # noqa: E731
                                 kernel_size=kernel_size)
    presses = {  # our policy -> the press that implements the same paper (PRESS_NAMES)
        "h2o": lambda: ObservedAttentionPress(compression_ratio=ratio),
        "snapkv": snapkv,
        "streaming": lambda: StreamingLLMPress(compression_ratio=ratio, n_sink=n_sink),
        "andpro": lambda: CriticalKVPress(snapkv()),
    }
    if policy not in presses:
        raise ValueError(f"no press for policy {policy!r}")
    return presses[policy]()


def describe_press(press) -> str | None:
    if press is None:
        return None
    inner = getattr(press, "press", None)
    if inner is not None and not isinstance(inner, (int, float, str)):
        return f"{type(press).__name__}({inner!r}, epsilon={press.epsilon}, " \
               f"first_stage_ratio={press.first_stage_ratio})"
    return repr(press)


class Runner:
    """One model load; runs one (query_mode, policy, budget) over the instances."""

    def __init__(self, model_dir: str, dtype: str, attn_impl: str) -> None:
        import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), attn_implementation=attn_impl).eval()
        cfg = self.model.config
        if getattr(cfg, "head_dim", None) is None:
            # kvpress 0.5.5's CriticalKVPress reads config.head_dim, which
            # transformers 5.2's Qwen2Config does not define (every instance
            # failed with AttributeError); it is hidden / heads there.
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.pipe = pipeline("kv-press-text-generation", model=self.model,
                             tokenizer=self.tokenizer)
        eos = self.model.generation_config.eos_token_id
        self.stop_ids = set(eos if isinstance(eos, list) else [eos])

    # -- token ids --------------------------------------------------------

    def aware_ids(self, inst):
        return self.torch.tensor([aware_prompt_ids(inst, self.tokenizer)]), None

    def agnostic_ids(self, inst):
        """(context ids, question ids) exactly as kvpress's pipeline builds them."""
        params = self.pipe._sanitize_parameters(question=inst["question"])[0]
        pre = self.pipe.preprocess(inst["context"], **params)
        return pre["context_ids"], pre["questions_ids"][0]

    # -- generation -------------------------------------------------------

    def greedy(self, prefill_ids, suffix_ids, press, n: int, stop: bool):
        """Prefill ``prefill_ids`` under ``press`` (compressed), feed
        ``suffix_ids`` (uncompressed; None: none), then greedy-decode up to
        ``n`` tokens. Positions continue from the uncompressed length, as in
        kvpress's pipeline. -> (token ids, tokens kept after the prefill)."""
        import contextlib

        from transformers import DynamicCache

        torch = self.torch
        model = self.model
        cache = DynamicCache()
        with torch.inference_mode():
            with press(model) if press is not None else contextlib.nullcontext():
                out = model.model(input_ids=prefill_ids, past_key_values=cache)
            kept = cache.get_seq_length()
            pos = prefill_ids.shape[1]
            if suffix_ids is not None and suffix_ids.shape[1] > 0:
                m = suffix_ids.shape[1]
                logits = model(input_ids=suffix_ids, past_key_values=cache,
                               position_ids=torch.arange(pos, pos + m).unsqueeze(0),
                               logits_to_keep=1).logits[0, -1]
                pos += m
            else:
                logits = model.lm_head(out.last_hidden_state[:, -1:])[0, -1]
            tokens = [int(logits.argmax())]
            while len(tokens) < n and not (stop and tokens[-1] in self.stop_ids):
                logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                               position_ids=torch.tensor([[pos]])).logits[0, -1]
                pos += 1
                tokens.append(int(logits.argmax()))
        return tokens, kept

    def pipeline_answer(self, inst, press, n: int):
        """kvpress's own pipeline call (agnostic retrieval). -> (text, kept)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        with self.torch.inference_mode():
            out = self.pipe(inst["context"], question=inst["question"], press=press,
                            max_new_tokens=n, cache=cache)
        return out["answer"], cache.get_seq_length()

    def run_instance(self, inst, mode: str, press, reference: list[int] | None):
        """-> per-instance detail dict (score, timing, sizes, output).

        reference: the full-cache token ids of this agreement instance, or
        None when this run *is* the full cache."""
        n = int(inst["max_tokens"])
        retrieval = inst["task"] in RETRIEVAL_TASKS
        if mode == "aware":
            prefill, suffix = self.aware_ids(inst)
        else:
            prefill, suffix = self.agnostic_ids(inst)
        t0 = time.perf_counter()
        if retrieval and mode == "agnostic":
            text, kept = self.pipeline_answer(inst, press, n)
            tokens = None
        else:
            tokens, kept = self.greedy(prefill, suffix, press, n, stop=not ignores_eos(inst))
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        wall = time.perf_counter() - t0
        rec: dict[str, Any] = {"id": inst["id"]}
        if retrieval:
            rec.update(score=score_output(inst, text), output=text)
            if inst["task"] == "niah":
                rec.update(depth=inst["meta"].get("depth"), length=inst["meta"].get("length"))
        else:
            if reference is None:
                score, first = 1.0, None
            else:
                score, first = T.agreement(tokens, reference)
            rec.update(score=score, first_divergence=first, token_ids=tokens, text=text)
        rec.update(wall_s=round(wall, 3), prompt_tokens=int(prefill.shape[1]),
                   kept_tokens=int(kept))
        if suffix is not None:  # agnostic: fed after compression, never compressed
            rec["question_tokens"] = int(suffix.shape[1])
        return rec


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in ("torch", "transformers", "kvpress", "accelerate"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def _write(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_kvevict.eval.kvpress_runner",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", required=True, help="TASKS.json (python -m vllm_kvevict.eval --dump-tasks)")
    p.add_argument("--out", required=True, help="output JSON file ({'rows': [...]})")
    p.add_argument("--presses", default=",".join(POLICIES),
                   help="our policy names, comma-separated (default: all; 'none' always runs)")
    p.add_argument("--budgets", default="0.05,0.1,0.2,0.5",
                   help="fractions of tokens KEPT (compression_ratio = 1 - budget)")
    p.add_argument("--query-mode", default=",".join(QUERY_MODES), help="aware,agnostic")
    p.add_argument("--model-dir", default=None, help="override the TASKS.json model_dir")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="bfloat16 (default: measured faster here, on AVX512-BF16 CPUs)")
    p.add_argument("--attn-impl", default="eager", choices=("eager", "sdpa"),
                   help="one for every press (h2o's ObservedAttentionPress needs eager)")
    p.add_argument("--window", type=int, default=32,
                   help="SnapKV/CriticalKV observation window (vllm_kvevict's kv_window; kvpress's default is 64)")
    p.add_argument("--kernel-size", type=int, default=7,
                   help="SnapKV pooling kernel (vllm_kvevict's 7; kvpress's default is 5, avg-pool)")
    p.add_argument("--n-sink", type=int, default=4, help="StreamingLLM sink tokens (vllm_kvevict's kv_sink)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: on a shared 2-core box, 2 threads "
                        "measured 3 s/token decode under load against 80 ms with 1; 0: torch's default)")
    p.add_argument("--limit", type=int, default=None, help="first N scored instances only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        policies = parse_choices(args.presses, POLICIES, "policy")
        budgets = parse_budgets(args.budgets)
        modes = parse_choices(args.query_mode, QUERY_MODES, "query mode")
        header, instances, skipped = load_tasks(args.tasks)
    except (ValueError, OSError) as e:
        print(f"kvpress_runner: {e}", file=sys.stderr)
        return 2
    if "h2o" in policies and args.attn_impl != "eager":
        print("kvpress_runner: h2o (ObservedAttentionPress) needs --attn-impl eager", file=sys.stderr)
        return 2
    if args.limit is not None:
        instances = instances[: args.limit]
    for s in skipped:
        print(f"kvpress_runner: skipping {s['n']} {s['task']} instance(s): {s['reason']}",
              file=sys.stderr)

    import torch
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir or header["model_dir"]
    model_name = header.get("model") or os.path.basename(os.path.normpath(model_dir))
    t_load = time.perf_counter()
    runner = Runner(model_dir, args.dtype, args.attn_impl)
    load_s = time.perf_counter() - t_load

    plan = configs(policies, budgets)
    meta = {
        "framework": FRAMEWORK, "model": model_name, "model_dir": model_dir,
        "tasks_file": os.path.abspath(args.tasks), "versions": _versions(),
        "dtype": args.dtype, "attn_impl": args.attn_impl, "threads": torch.get_num_threads(),
        "window": args.window, "kernel_size": args.kernel_size, "n_sink": args.n_sink,
        "press_names": PRESS_NAMES, "andpro_nearest": ANDPRO_NEAREST, "load_s": round(load_s, 2),
        "budget_semantics": "fraction of tokens kept; kvpress compression_ratio = 1 - budget",
    }
    payload: dict[str, Any] = {"rows": [], "skipped": skipped, "meta": meta}
    tasks = tasks_in_order(instances)
    by_task = {t: [i for i in instances if i["task"] == t] for t in tasks}
    bar = tqdm(total=len(modes) * len(plan) * len(instances), unit="inst", dynamic_ncols=True)
    for mode in modes:
        references: dict[str, list[int]] = {}  # instance id -> full-cache tokens
        for policy, budget in plan:
            press = make_press(policy, budget, window=args.window,
                               kernel_size=args.kernel_size, n_sink=args.n_sink)
            for task in tasks:
                recs, errors = [], []
                for inst in by_task[task]:
                    bar.set_description(f"{mode} {policy} {budget:g} {task}")
                    ref = None if policy == "none" else references.get(inst["id"])
                    try:
                        if task in AGREEMENT_TASKS and policy != "none" and ref is None:
                            raise RuntimeError("no full-cache reference (its 'none' run failed)")
                        rec = runner.run_instance(inst, mode, press, ref)
                    except Exception as e:  # one bad instance must not end the run
                        errors.append({"id": inst["id"], "error": f"{type(e).__name__}: {e}"})
                        print(f"kvpress_runner: {mode} {policy} {budget} {inst['id']}: "
                              f"{type(e).__name__}: {e}", file=sys.stderr)
                    else:
                        if policy == "none" and task in AGREEMENT_TASKS:
                            references[inst["id"]] = rec["token_ids"]
                        recs.append(rec)
                    bar.update(1)
                scores = [r["score"] for r in recs]
                detail: dict[str, Any] = {
                    "compression_ratio": budget_to_compression_ratio(budget),
                    "press_repr": describe_press(press),
                    "dtype": args.dtype, "attn_impl": args.attn_impl,
                    "instances": recs, "errors": errors,
                }
                detail["prompt_tokens"] = sum(r["prompt_tokens"] for r in recs)
                detail["kept_tokens"] = sum(r["kept_tokens"] for r in recs)
                if task in AGREEMENT_TASKS:  # as the harness's run_vllm
                    firsts = [r["first_divergence"] for r in recs
                              if r["first_divergence"] is not None]
                    detail["mean_first_divergence"] = sum(firsts) / len(firsts) if firsts else None
                    detail["diverged"] = len(firsts)
                payload["rows"].append({
                    "framework": FRAMEWORK, "model": model_name, "task": task,
                    "policy": policy, "press": PRESS_NAMES[policy], "budget": budget,
                    "query_mode": mode,
                    "score": sum(scores) / len(scores) if scores else None,
                    "n": len(recs), "wall_s": round(sum(r["wall_s"] for r in recs), 3),
                    "detail": detail,
                })
                _write(args.out, payload)
    bar.close()
    _write(args.out, payload)
    print(format_table(payload["rows"]))
    return 0


def format_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the rows (score, n, wall time per instance)."""
    lines = ["| mode | task | policy | press | budget | score | n | s/inst |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        score = "-" if r["score"] is None else f"{r['score']:.3f}"
        per = f"{r['wall_s'] / r['n']:.2f}" if r["n"] else "-"
        budget = "-" if r["budget"] is None else f"{r['budget']:g}"
        lines.append(f"| {r['query_mode']} | {r['task']} | {r['policy']} | {r['press'] or '-'} "
                     f"| {budget} | {score} | {r['n']} | {per} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
