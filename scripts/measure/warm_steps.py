"""Each engine's steps at capacity in an interleaved steady run, split by
what ran just before them: its own step (warm, as every step of a lone
engine) or another engine's (cold).

    python scripts/measure/warm_steps.py RUN.json

RUN.json: `benchmarks/throughput.py --workloads steady --interleave --json`.
Runs that record `step_warm` (benchmarks/interleave.py since the
fifty-fifth session) are split by it; older ones by their turn order
replayed: one step a turn, the order reversed every other round, so the
engines at either end of the order took every other step right after their
own. Prints, per engine, ms a step over the steps at which every engine was
at capacity, warm and cold, and the ratio of its output rate to stock's on
each set.
"""
from __future__ import annotations

import json
import sys


def reversed_order_warm(steps: list[int]) -> list[list[bool]]:
    """Per engine and step, whether the step came right after the engine's
    own, for the reversed-round interleave (`steps`: each engine's count)."""
    left, live, rnd, seq = list(steps), list(range(len(steps))), 0, []
    while live:
        for c in (list(live) if rnd % 2 == 0 else live[::-1]):
            seq.append(c)
            left[c] -= 1
            if left[c] == 0:
                live.remove(c)
        rnd += 1
    warm: list[list[bool]] = [[] for _ in steps]
    for i, c in enumerate(seq):
        warm[c].append(i > 0 and seq[i - 1] == c)
    return warm


def main(path: str) -> None:
    runs = [r for r in json.load(open(path))["constrained"]
            if r.get("ok") and r.get("pool_multiple", 1) == 1]
    if all("step_warm" in r for r in runs):
        warm = [r["step_warm"] for r in runs]
    else:
        warm = reversed_order_warm([len(r["step_s"]) for r in runs])
    n = min(len(r["step_s"]) for r in runs)
    shared = [k for k in range(n) if all(r["step_full"][k] for r in runs)]
    stock = next(i for i, r in enumerate(runs) if r["policy"] == "none"
                 and not r.get("stock_window"))

    def rate(i: int, ks: list[int]) -> float:
        return sum(runs[i]["step_tokens"][k] for k in ks) / sum(runs[i]["step_s"][k] for k in ks)

    print("| engine | warm steps | ms/step | vs stock (stock's warm steps) | cold steps | ms/step "
          "| vs stock (stock's cold steps) |\n|---|---|---|---|---|---|---|")
    for i, r in enumerate(runs):
        name = r["policy"] + (f", window {r['stock_window']}" if r.get("stock_window") else "")
        cells = []
        for want in (True, False):
            ks = [k for k in shared if warm[i][k] == want]
            ref = [k for k in shared if warm[stock][k] == want]
            if not ks or not ref:
                cells += [str(len(ks)), "-", "-"]
                continue
            ms = 1e3 * sum(r["step_s"][k] for k in ks) / len(ks)
            cells += [str(len(ks)), f"{ms:.1f}", f"{rate(i, ks) / rate(stock, ref):.2f}x"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
