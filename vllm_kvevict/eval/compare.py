"""Two fidelity runs of the same config side by side, instance by instance
(e.g. one score precision against another):

    python -m vllm_kvevict.eval.compare A/results.json B/results.json [--labels a b]

Prints a markdown table: per (model, task, policy, budget) both scores, how
many instances gave identical outputs (generated tokens or text; perplexity
to 1e-9) and, for `agreement`, how many moved their first divergence from
the full cache. Policy `none` is left out (it does not depend on scoring).
"""
from __future__ import annotations

import argparse
import json


def _rows(path: str) -> dict:
    with open(path) as f:
        return {(r["model"], r["task"], r["policy"], r["budget"]): r for r in json.load(f)["rows"]}


def _same(p: dict, q: dict) -> bool:
    if "ppl" in p:
        return abs(p["ppl"] - q["ppl"]) <= 1e-9 * abs(p["ppl"])
    skip = {"wall_s"}
    return {k: v for k, v in p.items() if k not in skip} == {k: v for k, v in q.items() if k not in skip}


def compare(a_path: str, b_path: str, labels=("A", "B")) -> str:
    a, b = _rows(a_path), _rows(b_path)
    lines = [f"| model | task | policy | budget | score {labels[0]} | score {labels[1]} | instances "
             f"| identical | first divergence moved |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for key in sorted(a.keys() & b.keys(), key=str):
        if key[2] == "none":
            continue
        x, y = a[key], b[key]
        ia, ib = x["detail"].get("instances", []), y["detail"].get("instances", [])
        if [i["id"] for i in ia] != [i["id"] for i in ib]:
            raise SystemExit(f"{key}: the runs hold different instances")
        same = sum(_same(p, q) for p, q in zip(ia, ib))
        moved = sum(p.get("first_divergence") != q.get("first_divergence") for p, q in zip(ia, ib))
        div = str(moved) if any("first_divergence" in p for p in ia) else ""
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]:g} | {x['score']:.4g} | "
                     f"{y['score']:.4g} | {len(ia)} | {same} | {div} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--labels", nargs=2, default=["A", "B"])
    args = p.parse_args(argv)
    print(compare(args.a, args.b, tuple(args.labels)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
