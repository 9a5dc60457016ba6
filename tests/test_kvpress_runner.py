"""The pure parts of vllm_kvevict.eval.kvpress_runner, without kvpress.

The runner lives in its own venv (.venv-kvpress); the main test venv has no
kvpress, so these tests also check that importing the module pulls in none of
kvpress, torch or vLLM. Scoring and the aware prompt are the harness's own
(vllm_kvevict.eval.tasks); these tests pin that the runner uses them.
"""

import json
import subprocess
import sys

import pytest

from vllm_kvevict.eval import kvpress_runner as kr


def test_import_is_light():
    code = ("import sys; import vllm_kvevict.eval.kvpress_runner; "
            "bad = [m for m in ('vllm', 'kvpress', 'torch', 'transformers', 'tqdm') if m in sys.modules]; "
            "print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# --- budget -> compression_ratio ---------------------------------------------

@pytest.mark.parametrize("budget, ratio", [(0.05, 0.95), (0.2, 0.8), (0.5, 0.5), (1.0, 0.0),
                                           (0.1, 0.9), (0.25, 0.75)])
def test_budget_is_fraction_kept(budget, ratio):
    assert kr.budget_to_compression_ratio(budget) == ratio


@pytest.mark.parametrize("budget", [0, 0.0, -0.1, 1.5, 2])
def test_budget_out_of_range(budget):
    with pytest.raises(ValueError):
        kr.budget_to_compression_ratio(budget)


def test_parse_budgets():
    assert kr.parse_budgets("0.05, 0.2,0.2,,1") == [0.05, 0.2, 1.0]
    for bad in ("", "0", "x", "0.2,1.2"):
        with pytest.raises(ValueError):
            kr.parse_budgets(bad)


def test_parse_choices():
    assert kr.parse_choices("SnapKV,h2o,snapkv", kr.POLICIES, "policy") == ["snapkv", "h2o"]
    assert kr.parse_choices("agnostic", kr.QUERY_MODES, "mode") == ["agnostic"]
    with pytest.raises(ValueError, match="unknown policy"):
        kr.parse_choices("h2o,pyramidkv", kr.POLICIES, "policy")


def test_configs_run_none_first_once():
    plan = kr.configs(["snapkv", "none", "h2o"], [0.2, 0.5])
    assert plan == [("none", 1.0), ("snapkv", 0.2), ("snapkv", 0.5), ("h2o", 0.2), ("h2o", 0.5)]
    assert kr.configs(["none"], [0.2]) == [("none", 1.0)]


def test_press_names_cover_policies():
    assert set(kr.PRESS_NAMES) == set(kr.POLICIES)
    assert kr.PRESS_NAMES["none"] is None
    assert kr.PRESS_NAMES["andpro"] == "criticalkv"


# --- scoring: the harness's rule (vllm_kvevict.eval.tasks) ------------------

def _retrieval(answer, task="niah", **meta):
    return {"task": task, "id": "x", "context": "c", "question": "q", "answer": answer,
            "max_tokens": 8, "meta": meta}


@pytest.mark.parametrize("answer, text, score", [
    ("48213", "The special magic number is 48213.", 1.0),
    ("48213", "the number is 4 8 2 1 3", 1.0),      # small models spell digits apart
    ("48213", "the number is 48,213", 1.0),         # and group them
    ("48213", "It is 4821.", 0.0),
    ("48213", "", 0.0),
])
def test_score_output_niah(answer, text, score):
    assert kr.score_output(_retrieval(answer), text) == score


def test_score_output_kv_retrieval_is_fraction_of_answers():
    inst = _retrieval("11, 22", task="kv_retrieval", answers=["11", "22"])
    assert kr.score_output(inst, "11 and 33") == 0.5
    assert kr.score_output(inst, "22; 11") == 1.0


def test_agreement_rule():
    agree = kr.T.agreement  # (tokens, reference), as the runner calls it
    assert agree([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, None)
    assert agree([1, 2, 9, 4], [1, 2, 3, 4]) == (0.75, 2)
    assert agree([1, 2], [1, 2, 3, 4]) == (0.5, 2)  # missing positions differ


def test_ignores_eos():
    assert kr.ignores_eos({"task": "agreement", "meta": {"ignore_eos": True}})
    assert kr.ignores_eos({"task": "agreement", "meta": {}})  # hand-made files too
    assert not kr.ignores_eos({"task": "niah", "meta": {"depth": 0.5}})


# --- prompt building ----------------------------------------------------------

class FakeTokenizer:
    """Renders ChatML; one id per character."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert tokenize is False
        self.messages = messages
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        self.text = text
        return {"input_ids": [ord(c) for c in text]}


def test_aware_prompt_is_one_user_message():
    tok = FakeTokenizer()
    inst = {"task": "niah", "context": "The sky is blue.", "question": "What color?", "meta": {}}
    ids = kr.aware_prompt_ids(inst, tok)
    assert tok.messages == [{"role": "user", "content": "The sky is blue.\n\nWhat color?"}]
    assert tok.text == ("<|im_start|>user\nThe sky is blue.\n\nWhat color?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert ids == [ord(c) for c in tok.text]


def test_aware_prompt_without_question_is_the_context():
    tok = FakeTokenizer()
    kr.aware_prompt_ids({"task": "agreement", "context": "Write a poem.", "question": "",
                         "meta": {"ignore_eos": True}}, tok)
    assert tok.messages == [{"role": "user", "content": "Write a poem."}]


# --- TASKS.json ---------------------------------------------------------------

def _inst(task, i, **kw):
    d = {"task": task, "id": f"{task}-{i}", "context": "c", "question": "q",
         "answer": "42" if task in kr.RETRIEVAL_TASKS else None, "max_tokens": 8, "meta": {}}
    d.update(kw)
    return d


def test_load_tasks_skips_perplexity(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps({"model": "smollm2", "model_dir": "/m", "instances": [
        _inst("niah", 0), _inst("perplexity", 0), _inst("agreement", 0),
        _inst("kv_retrieval", 0), _inst("perplexity", 1)]}))
    header, scored, skipped = kr.load_tasks(str(path))
    assert header == {"model": "smollm2", "model_dir": "/m"}
    assert all("meta" in i for i in scored)
    assert [i["id"] for i in scored] == ["niah-0", "agreement-0", "kv_retrieval-0"]
    assert [(s["task"], s["n"]) for s in skipped] == [("perplexity", 2)]
    assert "prefill" in skipped[0]["reason"]
    assert kr.tasks_in_order(scored) == ["niah", "agreement", "kv_retrieval"]


@pytest.mark.parametrize("inst", [
    _inst("summarize", 0),
    _inst("niah", 0, answer=None),
    _inst("kv_retrieval", 0, answer="", meta={"answers": []}),
    _inst("agreement", 0, max_tokens=0),
    {"task": "niah", "id": "x", "context": "c", "answer": "1", "max_tokens": 4},  # no question
])
def test_load_tasks_rejects(tmp_path, inst):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps({"model_dir": "/m", "instances": [inst]}))
    with pytest.raises(ValueError):
        kr.load_tasks(str(path))


def test_cli_errors_before_loading_anything(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps({"model_dir": "/m", "instances": [_inst("niah", 0)]}))
    out = str(tmp_path / "out.json")
    assert kr.main(["--tasks", str(path), "--out", out, "--budgets", "1.5"]) == 2
    assert kr.main(["--tasks", str(path), "--out", out, "--presses", "pyramidkv"]) == 2
    assert kr.main(["--tasks", str(path), "--out", out, "--attn-impl", "sdpa"]) == 2  # h2o needs eager


def test_format_table():
    rows = [{"query_mode": "aware", "task": "niah", "policy": "snapkv", "press": "snapkv",
             "budget": 0.2, "score": 0.5, "n": 2, "wall_s": 3.0},
            {"query_mode": "agnostic", "task": "agreement", "policy": "none", "press": None,
             "budget": None, "score": None, "n": 0, "wall_s": 0.0}]
    lines = kr.format_table(rows).splitlines()
    assert lines[2] == "| aware | niah | snapkv | snapkv | 0.2 | 0.500 | 2 | 1.50 |"
    assert lines[3] == "| agnostic | agreement | none | - | - | - | 0 | - |"
