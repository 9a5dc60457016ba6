"""gpu_check.json (every figure) and gpu_check.md (the tables) for one run."""
from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import torch

from vllm_kvevict.gpu_check.cases import Target


def environment(t: Target) -> dict:
    import triton

    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "dry_run": t.dry}
    if t.gpu:
        p = torch.cuda.get_device_properties(t.device)
        env.update(device=p.name, capability=f"sm_{p.major}{p.minor}",
                   memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                   cuda=torch.version.cuda)
    else:
        env.update(device=f"CPU ({platform.processor() or platform.machine()}), Triton interpreter")
    return env


def failures(results: dict) -> list[dict]:
    return [r for rows in results.values() for r in rows if r.get("ok") is False]


def _fmt(x) -> str:
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return f"{x:.2e}" if x and (abs(x) < 1e-2 or abs(x) >= 1e5) else f"{x:.3g}"
    return str(x)


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> list[str]:
    out = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for _, key in cols:
            v = r.get(key, "")
            cells.append(_fmt(v) if v != "" else "")
        if "error" in r:
            cells[-1] = f"**FAILED**: {r['error'][:160]}"
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return out


def markdown(env: dict, results: dict, seconds: dict, total: float, argv) -> str:
    lines = [f"# gpu_check: {env['device']}", "",
             f"{env['date']}; torch {env['torch']}, Triton {env['triton']}"
             + (f", CUDA {env['cuda']}, {env['capability']}, {env['sms']} SMs, "
                f"{env['memory_gib']} GiB" if "cuda" in env else "")
             + f"; `python -m vllm_kvevict.gpu_check {' '.join(argv)}`; {total:.0f} s "
             f"({', '.join(f'{k} {v:.0f} s' for k, v in seconds.items())}).", ""]
    if env["dry_run"]:
        lines += ["Dry run: Triton's interpreter on CPU, tiny shapes; its times prove "
                  "only that the code runs.", ""]
    if "correctness" in results:
        lines += ["## Kernels against their references", "",
                  "Error: ||got - ref|| / ||ref||; bounds in `gpu_check/correctness.py`.", ""]
        lines += _table(results["correctness"], [
            ("kernel", "kernel"), ("config", "config"), ("dtype", "dtype"),
            ("out err", "out_err"), ("scores/logits err", "scores_err"),
            ("logits err", "logits_err"), ("exact", "exact"), ("ok", "ok")]) + [""]
    if "core" in results:
        lines += ["## The core on the device against the CPU", ""]
        lines += _table(results["core"], [
            ("check", "check"), ("dtype", "dtype"), ("compactions", "compactions"),
            ("kept-set overlap (min)", "overlap_min"), ("bound", "overlap_bound"),
            ("same cache", "same_cache"), ("selection scores err", "selection_err"),
            ("H2O scores err", "scores_err"), ("out err", "out_err"),
            ("same selection", "same_selection"), ("ok", "ok")]) + [""]
    if "syncs" in results:
        lines += ["## Host-device syncs per launch", "",
                  "counter: `gpu_check/sync_counter.py` (the CPU tests' counter); torch: "
                  "`torch.cuda.set_sync_debug_mode` (GPU only).", ""]
        rows = [dict(r, kinds=", ".join([f"{k} x{n}" for k, n in r.get("kinds", {}).items()]
                                        + [f"torch: {w}" for w in r.get("torch_where", [])]))
                for r in results["syncs"]]
        lines += _table(rows, [("launch path", "launch path"), ("inputs", "inputs"),
                               ("expected", "expected"), ("counter", "counter"),
                               ("torch", "torch"), ("what", "kinds"), ("ok", "ok")]) + [""]
    if "timing" in results:
        lines += ["## Time against a device copy of the same bytes", "",
                  "Median of `triton.testing.do_bench` (CUDA events). `of copy`: the copy's "
                  "time over the kernel's (1.0 = as fast as the memory system copies).", ""]
        rows = [dict(r, ms=f"{r['ms']:.4f}", copy_ms=f"{r['copy_ms']:.4f}",
                     gbps=f"{r['gbps']:.0f}", copy_gbps=f"{r['copy_gbps']:.0f}",
                     of_copy=f"{r['of_copy']:.2f}") for r in results["timing"]]
        lines += _table(rows, [("kernel", "kernel"), ("shape", "shape"), ("ms", "ms"),
                               ("GB/s", "gbps"), ("copy ms", "copy_ms"),
                               ("copy GB/s", "copy_gbps"), ("of copy", "of_copy"),
                               ("note", "note")]) + [""]
    failed = failures(results)
    lines += [f"**{len(failed)} failed check(s).**" if failed else "All checks passed.", ""]
    return "\n".join(lines)


def write(out: str, t: Target, results: dict, seconds: dict, total: float, argv) -> str:
    env = environment(t)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    doc = markdown(env, results, seconds, total, list(argv))
    (folder / "gpu_check.md").write_text(doc)
    (folder / "gpu_check.json").write_text(json.dumps(
        {"environment": env, "seconds": seconds, "total_seconds": total, "results": results},
        indent=1, default=str))
    return doc
