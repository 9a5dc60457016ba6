"""The report's figures (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

from vllm_kvevict.eval.tasks import LOWER_IS_BETTER, tasks_in

OURS = "vllm_kvevict"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_axis(ax, axis: str, ticks=None) -> None:
    """Log scale with plain numbers ("30", not "3x10^1") and no minor labels."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    getattr(ax, f"set_{axis}scale")("log")
    target = getattr(ax, f"{axis}axis")
    if ticks:
        getattr(ax, f"set_{axis}ticks")(ticks)
    target.set_major_formatter(ScalarFormatter())
    target.set_minor_formatter(NullFormatter())


def _perplexity_axis(ax) -> None:
    """Log y only when the data spans a wide range: a log axis within one decade
    has no labelled major tick."""
    lo, hi = ax.get_ylim()
    if lo > 0 and hi / lo > 4:
        _log_axis(ax, "y")


def _ok(score) -> bool:
    return score is not None and not (isinstance(score, float) and math.isnan(score))


def _label(r) -> str:
    return r["policy"] if r["framework"] == OURS else \
        f"kvpress {r['policy']} ({r.get('query_mode', 'aware')})"


# One colour per policy, one line style per (framework, query mode): a policy's
# lines from both frameworks read as a pair.
_STYLE = {(OURS, "aware"): ("-", "o"), ("kvpress", "aware"): ("--", "x"),
          ("kvpress", "agnostic"): (":", "+")}


def _style(r, policies: list[str]) -> dict:
    ls, marker = _STYLE.get((r["framework"], r.get("query_mode", "aware")), ("-.", "s"))
    color = f"C{policies.index(r['policy']) % 10}" if r["policy"] in policies else "gray"
    return dict(ls=ls, marker=marker, color=color, ms=4)


def sweep(rows, model, path: Path) -> bool:
    """Score vs budget %, one panel per task, one line per (framework, policy)."""
    rows = [r for r in rows if r["model"] == model]
    tasks = tasks_in(rows)
    if not tasks:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.8), squeeze=False,
                             layout="constrained")
    budgets = sorted({100 * float(r["budget"]) for r in rows
                      if r["policy"] != "none" and _ok(r["score"]) and float(r["budget"]) > 0})
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "none"))
    for ax, task in zip(axes[0], tasks):
        lines: dict[str, tuple[dict, list]] = {}
        for r in rows:
            if r["task"] != task or not _ok(r["score"]):
                continue
            if r["policy"] == "none":  # full cache: a horizontal reference per framework
                ax.axhline(r["score"], color="black", lw=1, ls=_style(r, policies)["ls"],
                           label="full cache" if r["framework"] == OURS else
                           f"kvpress full ({r.get('query_mode', 'aware')})")
                continue
            lines.setdefault(_label(r), (_style(r, policies), []))[1].append(
                (100 * float(r["budget"]), r["score"]))
        for label, (style, pts) in lines.items():
            ax.plot(*zip(*sorted(pts)), label=label, **style)
        _log_axis(ax, "x", [b for b in budgets] or None)
        ax.set_xlabel("KV budget (% of length)")
        ax.set_ylabel(task + (" (lower is better)" if task in LOWER_IS_BETTER else ""))
        if task in LOWER_IS_BETTER:
            _perplexity_axis(ax)
        ax.set_title(task)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:  # union of labels across panels
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h), labels.append(lab)
    fig.legend(handles, labels, loc="outside upper center", ncol=min(len(labels), 6), fontsize=8)
    fig.suptitle(f"{model}: score vs KV budget", x=0.01, ha="left")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def ppl_windows(rows, model, path: Path) -> bool:
    """Perplexity per window vs token position: one panel per budget < 100%."""
    rows = [r for r in rows if r["model"] == model and r["framework"] == OURS
            and r["task"] == "perplexity" and _ok(r["score"]) and "windows" in r["detail"]]
    full = next((r for r in rows if r["policy"] == "none"), None)
    budgets = sorted({float(r["budget"]) for r in rows if r["policy"] != "none"
                      and float(r["budget"]) < 1})
    if not full or not budgets:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(budgets), figsize=(3.6 * len(budgets) + 0.6, 3.4),
                             squeeze=False, sharey=True, layout="constrained")
    window = full["detail"]["window"]

    def draw(ax, r, **kw):
        ws = r["detail"]["windows"]
        ax.plot([window * (i + 1) for i in range(len(ws))], ws, **kw)

    for ax, b in zip(axes[0], budgets):
        draw(ax, full, color="black", lw=1, label="full cache")
        for r in rows:
            if r["policy"] != "none" and float(r["budget"]) == b:
                draw(ax, r, marker="o", ms=3, label=r["policy"])
        ax.set_title(f"budget {100 * b:g}%")
        ax.set_xlabel("token position")
        _perplexity_axis(ax)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"perplexity per {window}-token window")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{model}: perplexity per window", x=0.01, ha="left")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _niah_grid(row):
    """(depths, lengths, mean score matrix [depth][length]) of one niah row."""
    cells: dict[tuple, list] = {}
    for p in row["detail"]["instances"]:
        cells.setdefault((p["depth"], p["length"]), []).append(p["score"])
    depths = sorted({d for d, _ in cells})
    lengths = sorted({n for _, n in cells})
    grid = [[(sum(cells[d, n]) / len(cells[d, n])) if (d, n) in cells else float("nan")
             for n in lengths] for d in depths]
    return depths, lengths, grid


def niah(rows, model, path: Path) -> bool:
    """Depth x length heatmaps: rows = policies (full cache first), columns = budgets."""
    rows = [r for r in rows if r["model"] == model and r["framework"] == OURS
            and r["task"] == "niah" and _ok(r["score"])]
    if not rows:
        return False
    policies = ["none"] + [p for p in dict.fromkeys(r["policy"] for r in rows) if p != "none"]
    budgets = sorted({float(r["budget"]) for r in rows if r["policy"] != "none"}) or [1.0]
    plt = _plt()
    fig, axes = plt.subplots(len(policies), len(budgets), squeeze=False, layout="constrained",
                             figsize=(2.6 * len(budgets) + 1, 2.4 * len(policies)))
    image = None
    for i, policy in enumerate(policies):
        for j, b in enumerate(budgets):
            ax = axes[i][j]
            hit = [r for r in rows if r["policy"] == policy
                   and (policy == "none" or float(r["budget"]) == b)]
            if not hit or (policy == "none" and j > 0):
                ax.axis("off")
                continue
            depths, lengths, grid = _niah_grid(hit[0])
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for y, line in enumerate(grid):
                for x, v in enumerate(line):
                    ax.text(x, y, f"{v:.1f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [f"{n / 1024:.1f}K" for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths], fontsize=7)
            ax.set_title("full cache" if policy == "none" else f"{policy} @ {100 * b:g}%",
                         fontsize=9)
            if j == 0:
                ax.set_ylabel("needle depth")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="retrieved")
    fig.suptitle(f"{model}: needle in a haystack (x: haystack tokens)", x=0.01, ha="left")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_model(rows, model, out: Path) -> list[str]:
    """Every figure for ``model`` into ``out``; returns the file names written."""
    safe = model.replace("/", "_")
    written = []
    for name, fn in ((f"sweep_{safe}.png", sweep), (f"ppl_windows_{safe}.png", ppl_windows),
                     (f"niah_{safe}.png", niah)):
        if fn(rows, model, Path(out) / name):
            written.append(name)
    return written
