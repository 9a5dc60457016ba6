"""`python -m vllm_kvevict.eval.compare`: two fidelity runs instance by instance."""
import json

import pytest

from vllm_kvevict.eval.compare import compare


def _write(path, rows):
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    return str(path)


def _row(task, policy, score, instances):
    return {"model": "m", "task": task, "policy": policy, "budget": 0.1, "score": score,
            "detail": {"instances": instances}}


def test_counts_identical_instances_and_moved_divergences(tmp_path):
    a = _write(tmp_path / "a.json", [
        _row("agreement", "andpro", 0.5, [{"id": "x", "token_ids": [1, 2], "first_divergence": 1},
                                          {"id": "y", "token_ids": [3], "first_divergence": 0}]),
        _row("perplexity", "andpro", 20.0, [{"id": "p", "ppl": 20.0, "wall_s": 1.0}]),
        _row("niah", "none", 1.0, [{"id": "n", "score": 1.0}])])
    b = _write(tmp_path / "b.json", [
        _row("agreement", "andpro", 0.4, [{"id": "x", "token_ids": [1, 5], "first_divergence": 1},
                                          {"id": "y", "token_ids": [3], "first_divergence": 0}]),
        _row("perplexity", "andpro", 20.0, [{"id": "p", "ppl": 20.0, "wall_s": 2.0}]),
        _row("niah", "none", 0.0, [{"id": "n", "score": 0.0}])])
    lines = compare(a, b, ("f32", "bf16")).splitlines()
    assert "score f32" in lines[0] and "score bf16" in lines[0]
    assert lines[2] == "| m | agreement | andpro | 0.1 | 0.5 | 0.4 | 2 | 1 | 0 |"
    assert lines[3] == "| m | perplexity | andpro | 0.1 | 20 | 20 | 1 | 1 |  |"  # wall time ignored
    assert len(lines) == 4  # policy none left out


def test_runs_of_different_instances_are_refused(tmp_path):
    a = _write(tmp_path / "a.json", [_row("niah", "h2o", 1.0, [{"id": "x", "score": 1.0}])])
    b = _write(tmp_path / "b.json", [_row("niah", "h2o", 1.0, [{"id": "z", "score": 1.0}])])
    with pytest.raises(SystemExit, match="different instances"):
        compare(a, b)
