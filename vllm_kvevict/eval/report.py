"""Tables and plots from result rows (ours and, when given, kvpress's).

    python -m vllm_kvevict.eval.report results.json [kvpress.json ...] --out DIR

Each JSON is either ``{"rows": [...], ...}`` or a bare list of rows; a row is
``{"framework", "model", "task", "policy", "budget", "query_mode", "score",
"n", "wall_s", "detail"}`` (see :mod:`vllm_kvevict.eval.run_vllm`). Rows of
framework ``kvpress`` (query_mode ``aware`` or ``agnostic``) add a side-by-side
table and dashed lines in the budget sweep.

Writes into DIR: ``results.md`` and ``sweep_<model>.png`` (score vs budget, one
panel per task, like H2O's Figure 4), ``ppl_windows_<model>.png`` (perplexity
per 256-token window, like InfiniGen's Figure 12) and ``niah_<model>.png``
(depth x length heatmaps per policy and budget).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from vllm_kvevict.eval import plots
from vllm_kvevict.eval.tasks import LOWER_IS_BETTER, tasks_in

OURS = "vllm_kvevict"


def load_rows(paths) -> list[dict]:
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows += data["rows"] if isinstance(data, dict) else data
    return rows


def _key(budget) -> float:
    return round(float(budget), 6)


def _fmt(score, task) -> str:
    if score is None or (isinstance(score, float) and math.isnan(score)):
        return "error"
    return f"{score:.2f}" if task in LOWER_IS_BETTER else f"{score:.3f}"


def _rel(score, full, task) -> str:
    """Perplexity: ratio to full (x1.25 = 25% worse); others: % of full."""
    if score is None or full in (None, 0):
        return ""
    return f" (x{score / full:.2f})" if task in LOWER_IS_BETTER else f" ({100 * score / full:.0f}%)"


def _select(rows, **want):
    return [r for r in rows if all(r.get(k) == v for k, v in want.items())]


def _full(rows, model, task, framework=OURS, query_mode="aware"):
    ref = _select(rows, framework=framework, model=model, task=task, policy="none")
    ref = [r for r in ref if r.get("query_mode", "aware") in (query_mode, None)] or ref
    return ref[0]["score"] if ref else None


def _policies(rows) -> list[str]:
    seen = []
    for r in rows:
        if r["policy"] not in seen and r["policy"] != "none":
            seen.append(r["policy"])
    return seen


def _models(rows) -> list[str]:
    return list(dict.fromkeys(r["model"] for r in rows))


def task_tables(rows, model) -> list[str]:
    """One markdown table per task: policy x budget, our framework only."""
    ours = _select(rows, framework=OURS, model=model)
    budgets = sorted({_key(r["budget"]) for r in ours if r["policy"] != "none"})
    out = []
    for task in tasks_in(ours):
        full = _full(ours, model, task)
        better = "lower is better" if task in LOWER_IS_BETTER else "higher is better"
        rel = "ratio to full cache" if task in LOWER_IS_BETTER else "% of full cache"
        n = next((r["n"] for r in _select(ours, task=task)), 0)
        out += [f"### {model}: {task} ({better}; n={n}; in brackets: {rel})", "",
                f"Full cache (policy none): **{_fmt(full, task)}**", "",
                "| policy | " + " | ".join(f"{100 * b:g}%" for b in budgets) + " |",
                "|---|" + "---|" * len(budgets)]
        for policy in _policies(ours):
            cells = []
            for b in budgets:
                hit = [r for r in _select(ours, task=task, policy=policy) if _key(r["budget"]) == b]
                cells.append(_fmt(hit[0]["score"], task) + _rel(hit[0]["score"], full, task)
                             if hit else "-")
            out.append(f"| {policy} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def wall_table(rows, model) -> list[str]:
    """Seconds per (engine, task) for our framework, plus engine start-up."""
    ours = _select(rows, framework=OURS, model=model)
    tasks = tasks_in(ours)
    engines = list(dict.fromkeys((r["policy"], _key(r["budget"])) for r in ours))
    out = [f"### {model}: wall time (s) per engine and task", "",
           "| policy | budget | start | " + " | ".join(tasks) + " | tokens evicted |",
           "|---|---|---|" + "---|" * (len(tasks) + 1)]
    for policy, b in engines:
        hits = {r["task"]: r for r in ours if r["policy"] == policy and _key(r["budget"]) == b}
        any_row = next(iter(hits.values()))
        start = any_row["detail"].get("engine_start_s", "")
        cells = [f"{hits[t]['wall_s']:.1f}" if t in hits and hits[t]["wall_s"] is not None
                 else "-" for t in tasks]
        evicted = sum(h["detail"].get("tokens_evicted", 0) for h in hits.values())
        out.append(f"| {policy} | {'full' if policy == 'none' else f'{100 * b:g}%'} | {start} | "
                   + " | ".join(cells) + f" | {evicted:,} |")
    return out + [""]


def _pick(rows, framework, mode, model, task, policy, budget) -> dict | None:
    hit = [r for r in _select(rows, framework=framework, model=model, task=task, policy=policy)
           if _key(r["budget"]) == budget and r.get("query_mode", "aware") == mode]
    return hit[0] if hit else None


def side_by_side(rows, model) -> list[str]:
    """task x policy x budget: ours vs kvpress (aware / agnostic), with wall times."""
    theirs = _select(rows, framework="kvpress", model=model)
    if not theirs:
        return []
    modes = [m for m in ("aware", "agnostic") if _select(theirs, query_mode=m)]
    head = ["task", "policy", "budget", "ours (aware)"] + [f"kvpress ({m})" for m in modes] + \
        ["ours s"] + [f"kvpress s ({m})" for m in modes]
    out = [f"### {model}: ours vs kvpress", "",
           ("Query-aware: the question is inside the compressed prompt; query-agnostic: "
            "the context is compressed without it (kvpress's pipeline with `question=`)."), "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = dict.fromkeys((r["task"], r["policy"], _key(r["budget"]))
                         for r in rows if r["model"] == model)
    for task, policy, b in sorted(keys, key=lambda k: (tasks_in(rows).index(k[0]), k[1] != "none",
                                                        k[1], k[2])):
        got = [_pick(rows, OURS, "aware", model, task, policy, b)] + \
            [_pick(rows, "kvpress", m, model, task, policy, b) for m in modes]
        if not any(got[1:]):
            continue
        scores = [_fmt(g["score"], task) if g else "-" for g in got]
        walls = [f"{g['wall_s']:.1f}" if g and g.get("wall_s") is not None else "-" for g in got]
        label = "full" if policy == "none" else f"{100 * b:g}%"
        out.append(f"| {task} | {policy} | {label} | " + " | ".join(scores + walls) + " |")
    return out + [""]


def write_report(rows: list[dict], out: str | Path, meta: dict | None = None) -> Path:
    """results.md and every plot into ``out``; returns the markdown path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# KV eviction fidelity (vllm_kvevict)", ""]
    engines = (meta or {}).get("engines", {})
    if meta:
        # the dtype the engines ran in (--dtype), not an assumed one
        dtypes = sorted({e.get("dtype", "bfloat16") for e in engines.values()}) or ["bfloat16"]
        lines += [(f"Config `{meta.get('config')}`, {meta.get('date', '')}, "
                   f"{meta.get('cpus', '?')} CPUs, total {meta.get('wall_s', '?')} s. "
                   "Budgets are fractions of each request's current length (never below two "
                   f"32-token blocks), a cap on the KV blocks a request holds. Greedy, {'/'.join(dtypes)}, "
                   "chunked prefill. Wall times come from "
                   "a shared machine: compare them within one run only."), ""]
    for model in _models(rows):
        lines += [f"## {model}", ""]
        if model in engines:
            e = engines[model]
            kv_dtype = e.get("kv_cache_dtype", "auto")
            lines += [(f"Engine: chunked prefill of {e['chunk_tokens']} tokens, KV pool "
                       f"{e['kv_pool_mib']} MiB"
                       + (f" (KV cache {kv_dtype}, every engine)" if kv_dtype != "auto" else "")
                       + f", block {e['block_size']}, max_model_len "
                       f"{e['max_model_len']}. "
                       + ("Eviction runs between prompt chunks, so a chunk's tokens always "
                          "see each other in full: prompt perplexity depends on the chunk "
                          "size." if e.get("prefill_cap") == 0 else
                          "A prompt is compressed once it is complete (between chunks only "
                          "if the pool cannot hold it; --kv-prefill-cap "
                          f"{e.get('prefill_cap') or 'auto'}).")), ""]
        for name in plots.plot_model(rows, model, out):
            lines += [f"![{name}]({name})", ""]
        lines += task_tables(rows, model) + side_by_side(rows, model) + wall_table(rows, model)
        failed = {(r["policy"], _key(r["budget"])): r["detail"]["error"] for r in rows
                  if r["model"] == model and r["framework"] == OURS and "error" in r["detail"]}
        if failed:
            lines += ["Failed engines:", ""] + [f"- {p} @ {100 * b:g}%: `{err}`"
                                                for (p, b), err in failed.items()] + [""]
    path = out / "results.md"
    path.write_text("\n".join(lines))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_kvevict.eval.report",
                                description="Regenerate results.md and plots from saved JSONs.")
    p.add_argument("results", nargs="+", help="results.json (ours) and any kvpress JSONs")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    first = json.loads(Path(args.results[0]).read_text())
    meta = first.get("meta") if isinstance(first, dict) else None
    print(write_report(load_rows(args.results), args.out, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
