"""The fidelity harness end to end: the smoke configuration through real engines.

SmolLM2-135M, 1K-token contexts, policies none + h2o + streaming at budgets
10% and 100% (5 engines, built and shut down one after another in this
process; about a minute on 2 idle cores). Needs the texts from the setup step
(`python -m vllm_kvevict.eval.texts`, run by scripts/setup.sh).
"""

import json

import pytest
from conftest import DTYPE

from vllm_kvevict.passages import ALL_TEXTS, texts_dir

POLICIES = ("h2o", "streaming")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, model_path, engines):
    missing = [n for n in ALL_TEXTS if not (texts_dir() / f"{n}.txt").is_file()]
    if missing:
        pytest.fail(f"texts {missing} missing in {texts_dir()}: run "
                    "`python -m vllm_kvevict.eval.texts` (scripts/setup.sh does)")
    from vllm_kvevict.eval.__main__ import main

    engines.close()  # the harness builds its engines in this process, one at a time

    out = tmp_path_factory.mktemp("eval-smoke")
    assert main(["--config", "smoke", "--policies", "none", *POLICIES, "--out", str(out),
                 "--dtype", DTYPE]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    return out, rows


def _row(rows, task, policy, budget):
    hit = [r for r in rows if r["task"] == task and r["policy"] == policy
           and r["budget"] == budget]
    assert len(hit) == 1, (task, policy, budget)
    return hit[0]


def test_writes_results_report_and_plots(smoke):
    out, rows = smoke
    for name in ("results.json", "results.md", "sweep_smollm2.png",
                 "ppl_windows_smollm2.png", "niah_smollm2.png"):
        assert (out / name).stat().st_size > 0, name
    # 1 full-cache engine + 2 policies x 2 budgets, 4 tasks each, none failed.
    assert len(rows) == 5 * 4
    assert all(r["score"] is not None and r["wall_s"] > 0 for r in rows)
    md = (out / "results.md").read_text()
    assert "### smollm2: perplexity (lower is better" in md and "| h2o |" in md


def test_full_budget_changes_nothing(smoke):
    """Budget 100%: nothing is evicted, greedy tokens equal the full cache's and
    prompt perplexity matches it (the plugin's own KV write and scoring path
    must not change a logit)."""
    _, rows = smoke
    full_ppl = _row(rows, "perplexity", "none", 1.0)["score"]
    for policy in POLICIES:
        assert _row(rows, "agreement", policy, 1.0)["score"] == 1.0, policy
        assert _row(rows, "perplexity", policy, 1.0)["score"] == pytest.approx(full_ppl, rel=1e-3)
        assert all(_row(rows, t, policy, 1.0)["detail"]["tokens_evicted"] == 0
                   for t in ("perplexity", "niah", "agreement")), policy


def test_small_budget_evicts_and_costs_quality(smoke):
    """Budget 10%: every policy evicts during chunked prefill and decode, and
    StreamingLLM (sinks + recent only) reads the prompt with higher perplexity."""
    _, rows = smoke
    full_ppl = _row(rows, "perplexity", "none", 1.0)["score"]
    for policy in POLICIES:
        for task in ("perplexity", "niah", "agreement"):
            assert _row(rows, task, policy, 0.1)["detail"]["tokens_evicted"] > 0, (policy, task)
    assert _row(rows, "perplexity", "streaming", 0.1)["score"] > full_ppl * 1.01
    windows = _row(rows, "perplexity", "streaming", 0.1)["detail"]["windows"]
    assert len(windows) == 4  # 1,024 tokens in 256-token windows


def test_report_regenerates_from_saved_json_with_kvpress_rows(smoke, tmp_path):
    """`python -m vllm_kvevict.eval.report ours.json kvpress.json --out DIR`
    adds the side-by-side table when kvpress rows are present."""
    from vllm_kvevict.eval.report import main

    out, rows = smoke
    theirs = [dict(r, framework="kvpress", query_mode=mode, detail={})
              for r in rows for mode in ("aware", "agnostic")]
    (tmp_path / "kvpress.json").write_text(json.dumps(theirs))
    assert main([str(out / "results.json"), str(tmp_path / "kvpress.json"),
                 "--out", str(tmp_path / "report")]) == 0
    md = (tmp_path / "report" / "results.md").read_text()
    assert "ours vs kvpress" in md and "kvpress (agnostic)" in md
