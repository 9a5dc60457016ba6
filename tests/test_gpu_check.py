"""`python -m vllm_kvevict.gpu_check --dry-run`: the GPU machine's check, on CPU.

It runs in a subprocess the way the GPU machine runs it (a plain checkout on
PYTHONPATH, nothing of ours installed is needed), with vLLM made unimportable,
so the command cannot grow a vLLM dependency or rot between GPU loans."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Any `import vllm` in the run fails, as on the GPU machine (which has no vLLM).
NO_VLLM = """
import sys, runpy
class NoVLLM:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"{name}: no vLLM on the GPU machine")
sys.meta_path.insert(0, NoVLLM())
sys.argv = ["gpu_check"] + sys.argv[1:]
runpy.run_module("vllm_kvevict.gpu_check", run_name="__main__")
"""


def test_dry_run_checks_every_kernel_the_core_and_syncs_without_vllm(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", NO_VLLM, "--dry-run", "--out", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    res = data["results"]
    assert data["environment"]["dry_run"] and "torch" in data["environment"]
    kernels = {r["kernel"] for r in res["correctness"]}
    assert {"paged attention + scores", "paged scores only", "window scores (snapkv)",
            "window scores (andpro)", "compaction in place",
            "partial attention + count"} <= kernels
    checked = res["correctness"] + res["core"] + res["syncs"]
    assert all(r["ok"] for r in checked), [r for r in checked if not r["ok"]]
    # The checks measured something: errors are real numbers, compactions happened.
    assert all(0 < r["out_err"] < 1e-2 for r in res["correctness"] if "out_err" in r)
    assert all(r["compactions"] > 0 and r["overlap_min"] == 1.0 and r["same_cache"]
               for r in res["core"] if "compactions" in r)
    assert {r["counter"] for r in res["syncs"]} == {0, 1, 2}
    assert len(res["timing"]) >= 8
    md = (tmp_path / "gpu_check.md").read_text()
    for heading in ("Kernels against their references", "The core on the device",
                    "Host-device syncs", "Time against a device copy"):
        assert heading in md


def test_a_wrong_kernel_fails_the_check(tmp_path, monkeypatch):
    """The correctness bounds can fail: a paged kernel that drops the last key of
    every request is caught (in-process, interpreter on, as conftest sets it)."""
    from vllm_kvevict.gpu_check import cases, correctness, kernel

    pa = kernel("paged_attention")
    real = pa.paged_attention_scores

    def drop_last_key(query, kc, vc, table, rows, visible, *a, **kw):
        kw.pop("max_visible", None)
        return real(query, kc, vc, table, rows, (visible - 1).clamp(min=0), *a, **kw)

    monkeypatch.setattr(pa, "paged_attention_scores", drop_last_key)
    t = cases.target(dry_run=True)
    rec = correctness.record("paged", "GQA 3", "float32", lambda: correctness.paged_case(
        t, t.dtypes[0], 3, 16, 32, [1, 15, 16, 37]))
    assert rec["ok"] is False and rec["out_err"] > 1e-3
