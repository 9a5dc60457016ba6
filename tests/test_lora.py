"""LoRA under eviction (`enable_lora`, a `LoRARequest` per prompt), offline:
a batch mixing prompts served with an adapter and without one.

The adapter is random (rank 8 on q_proj and v_proj of every layer, written
here in PEFT's format): enough to change every prompt's tokens, which the
first test checks, so that the comparison with stock covers the adapter's
path. vLLM keys its prefix cache by adapter too, so the same prompt with and
without it never shares blocks.
"""

import json

import pytest
from conftest import DTYPE, PROMPTS, kv_bytes, make_llm, run_child

from vllm_kvevict.probe import attach

MAX_TOKENS = 100
# Each prompt twice: even positions with the adapter, odd ones without.
BATCH = [p for p in PROMPTS[:4] for _ in range(2)]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("lora")
    gen = torch.Generator().manual_seed(0)
    hidden, kv, rank = 576, 192, 8  # SmolLM2-135M: 9 query heads, 3 KV heads of 64
    tensors = {}
    for layer in range(30):
        for name, out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.05
            tensors[prefix + ".lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.05
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "task_type": "CAUSAL_LM"}))
    return str(path)


@pytest.fixture(scope="module")
def stock(model_path, adapter):
    return run_child("stock_lora.py", [model_path, DTYPE, kv_bytes(DTYPE), adapter, MAX_TOKENS],
                     BATCH, "IDS=")


@pytest.fixture(scope="module")
def llm(engines, model_path):
    from vllm_kvevict.inprocess import close

    engines.close()  # the shared engine first: one engine in memory at a time
    llm = make_llm(model_path, max_num_batched_tokens=256, enable_lora=True, max_lora_rank=8,
                   max_loras=2, additional_config={"kv_eviction": "h2o", "kv_budget": 256})
    yield llm
    close(llm)


def _generate(llm, adapter, extra_args=None):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    lora = LoRARequest("random", 1, adapter)
    outs = llm.generate(BATCH, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                              ignore_eos=True, extra_args=extra_args),
                        lora_request=[lora if i % 2 == 0 else None for i in range(len(BATCH))],
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_mixed_adapter_batch_within_budget_is_stocks_tokens(llm, adapter, stock):
    (manager,) = attach(llm).managers()
    compactions0 = manager.num_compactions
    ids = _generate(llm, adapter)
    assert ids == stock
    # The adapter changed every prompt's tokens: its path was compared too.
    assert all(ids[i] != ids[i + 1] for i in range(0, len(BATCH), 2))
    assert manager.num_compactions == compactions0  # within the budget: nothing compacted


def test_mixed_adapter_batch_compacts_and_frees_every_block(llm, adapter):
    (manager,) = attach(llm).managers()
    compactions0 = manager.num_compactions
    probe = attach(llm)
    ids = _generate(llm, adapter, {"kv_budget": 64})
    assert all(len(t) == MAX_TOKENS for t in ids)
    # Prompts of 9-28 tokens + 100 pass 64 resident tokens: each request compacts.
    assert manager.num_compactions - compactions0 >= len(BATCH)
    assert probe.used_blocks() == 0  # nothing left behind in vLLM's pool
