"""The fidelity harness without an engine: the R reader, the task instances and
their JSON interface, scoring. Fast (seconds); needs the setup step's texts."""

import json
import math
import struct

import pytest

from vllm_kvevict.eval import tasks as T
from vllm_kvevict.eval.rdata import unserialize


def _xdr(*ints: int) -> bytes:
    return struct.pack(f">{len(ints)}i", *ints)


def _charsxp(s: str | None) -> bytes:
    if s is None:
        return _xdr(9, -1)
    raw = s.encode()
    return _xdr(9 | (1 << 3 << 12), len(raw)) + raw  # CHARSXP, UTF-8 flag


def test_rdata_reads_a_named_character_vector():
    """c(a="x", b=NA, c="é") as R's serialize(version=3, xdr=TRUE) writes it."""
    names = _xdr(16, 3) + b"".join(_charsxp(s) for s in "abc")
    blob = (b"X\n" + _xdr(3, 0x040300, 0x030500, 5) + b"UTF-8"
            + _xdr(16 | (1 << 9), 3) + _charsxp("x") + _charsxp(None) + _charsxp("é")
            + _xdr(2 | (1 << 10), 1) + _charsxp("names") + names  # attribute pairlist
            + _xdr(254))
    vec = unserialize(blob)
    assert list(vec) == ["x", None, "é"] and vec.names == ["a", "b", "c"]


@pytest.fixture(scope="module")
def tokenizer(hf):
    return hf[1]


@pytest.fixture(scope="module")
def smoke_instances(tokenizer):
    return T.build_instances("smoke", tokenizer)


def test_instances_follow_the_interface_and_are_deterministic(tokenizer, smoke_instances):
    keys = {"task", "id", "context", "question", "answer", "max_tokens", "meta"}
    assert all(set(i) == keys for i in smoke_instances)
    assert {i["task"] for i in smoke_instances} == set(T.TASKS)
    assert len({i["id"] for i in smoke_instances}) == len(smoke_instances)
    assert T.build_instances("smoke", tokenizer) == smoke_instances
    json.dumps(smoke_instances)  # plain JSON


def test_needle_is_where_the_depth_says_and_only_there(smoke_instances):
    niah = [i for i in smoke_instances if i["task"] == "niah"]
    assert [i["meta"]["depth"] for i in niah] == [0.0, 0.5, 1.0]
    for inst in niah:
        assert inst["context"].count(inst["answer"]) == 1
        assert 1000 <= inst["meta"]["context_tokens"] <= 1024
    needle = f"The secret passcode for the vault is {niah[0]['answer']}."
    assert niah[0]["context"].startswith(needle)
    assert niah[2]["context"].endswith(f"vault is {niah[2]['answer']}.")


def test_kv_retrieval_answers_are_the_queried_values(smoke_instances):
    for inst in (i for i in smoke_instances if i["task"] == "kv_retrieval"):
        lines = inst["context"].split("\n")[2:]
        records = dict(line.split(": ") for line in lines)
        assert len(records) == inst["meta"]["n_pairs"] == len(lines)
        key = inst["question"].split('"')[1]
        assert records[f'"{key}"'] == inst["answer"]
        first, second = key.split("-")  # distractors share one word each
        assert sum(k.strip('"').startswith(first + "-") for k in records) >= 2
        assert sum(k.strip('"').endswith("-" + second) for k in records) >= 2


def test_prompts_raw_and_chat(tokenizer, smoke_instances):
    ppl = next(i for i in smoke_instances if i["task"] == "perplexity")
    ids = T.prompt_ids(ppl, tokenizer)
    assert len(ids) == ppl["meta"]["n_tokens"] == 1024
    assert tokenizer.decode(ids) == ppl["context"]
    niah = next(i for i in smoke_instances if i["task"] == "niah")
    text = tokenizer.decode(T.prompt_ids(niah, tokenizer))
    assert text.endswith(niah["context"] + "\n\n" + niah["question"]
                         + "<|im_end|>\n<|im_start|>assistant\n")


def test_scoring():
    inst = {"answer": "48213", "meta": {}}
    assert T.score_text(inst, "The passcode is 4 8 2 1 3.") == 1.0
    assert T.score_text(inst, "The passcode is 48212.") == 0.0
    two = {"answer": "1, 2", "meta": {"answers": ["111111", "222222"]}}
    assert T.score_text(two, "111111 and 333333") == 0.5
    assert T.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (0.75, 2)
    assert T.agreement([1, 2], [1, 2]) == (1.0, None)
    nll = [None] + [math.log(4.0)] * 7
    assert T.window_perplexity(nll, 4) == pytest.approx([4.0, 4.0])
    assert T.pooled_perplexity([nll, nll]) == pytest.approx(4.0)


def test_dump_tasks_cli(tmp_path):
    from vllm_kvevict.eval.__main__ import main

    path = tmp_path / "tasks.json"
    assert main(["--dump-tasks", str(path), "--model", "smollm2", "--config", "smoke",
                 "--tasks", "niah"]) == 0
    dump = json.loads(path.read_text())
    assert set(dump) == {"model", "model_dir", "instances"} and dump["model"] == "smollm2"
    assert [i["task"] for i in dump["instances"]] == ["niah"] * 3
