"""Adding a policy is one class and one registry entry: a key-norm policy
(keep the tokens whose keys have the *smallest* L2 norm, after Devoto et al.
2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression") written here, in the test module only, registered for the
test's engine, and run through the real CPU vLLM engine. It is the worked
example of docs/design.md, "Adding a policy"; the product does not ship it.

What is checked, against vLLM's own accounting and a plain-torch reference:
  * the engine runs it: compactions happen, the policy's compaction_scores
    ran, requests never hold more blocks than the budget (a cap) allows, and
    vLLM's BlockPool is whole once the engine is idle (blocks really freed);
  * its kept sets equal the reference's. Key norms are RoPE-invariant (RoPE
    rotates pairs of channels), so the reference takes the keys straight from
    Hugging Face's `k_proj` of the same model in float32. The prompt is
    compacted once, after its last chunk, with every prompt key as a dense
    run computes it: every layer is compared there. Layer 0's keys depend
    on the token alone (no attention before them), so layer 0 is compared at
    every later compaction too. The reference replays the engine's resident
    set (its previous choice plus the new tokens) and picks the recent window
    plus the lowest-norm older tokens; kept sets are compared by their
    reference norms (a repeated token has the same layer-0 norm at every
    position, so positions of equal norms may swap), and the recent window
    by position.
"""

from __future__ import annotations

import pytest
import torch
from conftest import close, make_llm
from kept_positions import KeptRecorder

from vllm_kvevict.core.policies import POLICIES, CompactionContext, EvictionPolicy

BUDGET, BLOCK, MAX_TOKENS = 64, 32, 80
NORM_RTOL = 1e-3  # engine (vLLM's kernels) vs reference (HF) key norms, float32


class KeyNormPolicy(EvictionPolicy):
    """Keep the recent window plus the older tokens with the lowest key norm:
    score = -||k_i||, averaged over nothing (one score per layer and KV head).
    Nothing is recorded per step (Record.NOTHING, the default): the keys are
    read from the cache at the compaction."""

    name = "keynorm"
    calls = 0  # compaction_scores calls, for the test

    def compaction_scores(self, ctx: CompactionContext) -> torch.Tensor:
        KeyNormPolicy.calls += 1
        return -ctx.keys().float().norm(dim=-1)  # (L, H, old_len)


@pytest.fixture
def keynorm_registered(monkeypatch):
    monkeypatch.setitem(POLICIES, KeyNormPolicy.name, KeyNormPolicy)
    KeyNormPolicy.calls = 0
    yield
    assert KeyNormPolicy.name in POLICIES  # removed by monkeypatch after this


def reference_key_norms(hf_model, token_ids: list[int]) -> torch.Tensor:
    """(layers, KV heads, T) float64 L2 norm of each token's key in a dense
    float32 forward of the same model (pre-RoPE `k_proj` outputs: RoPE keeps
    norms)."""
    cfg = hf_model.config
    h, d = cfg.num_key_value_heads, cfg.head_dim
    keys = []
    hooks = [layer.self_attn.k_proj.register_forward_hook(
        lambda mod, inp, out: keys.append(out[0].view(-1, h, d)))
        for layer in hf_model.model.layers]
    try:
        with torch.no_grad():
            hf_model(torch.tensor([token_ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([k.double().norm(dim=-1).T for k in keys])  # (L, H, T)


def test_a_key_norm_policy_added_in_a_test_runs_in_the_engine(
        keynorm_registered, fresh_engines, model_path, hf):
    from vllm import SamplingParams

    from vllm_kvevict.core.eviction.planner import max_blocks_per_request
    from vllm_kvevict.integration.worker import worker_state
    from vllm_kvevict.probe import attach

    hf_model, tok = hf
    prompt = tok(open("/usr/share/common-licenses/GPL-3").read())["input_ids"][:300]
    llm = make_llm(model_path, dtype="float32", max_num_batched_tokens=128,
                   additional_config={"kv_eviction": "keynorm", "kv_budget": BUDGET})
    try:
        state = worker_state()
        assert isinstance(state.policy, KeyNormPolicy)
        probe = attach(llm)
        recorder = KeptRecorder(state)
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)[0]
        generated = list(out.outputs[0].token_ids)
        managers = probe.managers()
        freed = sum(m.num_blocks_freed for m in managers)
        evicted = sum(m.num_tokens_evicted for m in managers)
        idle_used = probe.used_blocks()
        recorder.remove()
    finally:
        close(llm)

    # The engine ran it, and vLLM's accounting saw the blocks come back.
    assert len(generated) == MAX_TOKENS
    compactions = recorder.compactions
    assert len(compactions) >= 2 and KeyNormPolicy.calls >= len(compactions)
    assert evicted >= len(prompt) + MAX_TOKENS - 1 - BUDGET  # the budget is a cap
    assert freed >= (len(prompt) - BUDGET) // BLOCK
    assert probe.max_blocks_per_request <= max(max_blocks_per_request(BUDGET, BLOCK),
                                               -(-(len(prompt)) // BLOCK) + 1)
    assert idle_used == 0  # the BlockPool is whole again

    # Its kept sets equal the plain-torch reference's.
    norms = reference_key_norms(hf_model, prompt + generated)  # (L, H, T)
    num_layers, h, _ = norms.shape
    first_plan = compactions[0][0]
    assert first_plan.old_len == first_plan.logical_len == len(prompt)  # the whole prompt
    previous = None
    checked = 0
    for i, (plan, positions) in enumerate(compactions):
        layers = range(num_layers) if i == 0 else range(1)
        for layer in layers:
            for head in range(h):
                if previous is None:
                    resident = torch.arange(plan.old_len)
                else:
                    resident = torch.cat([previous[layer, head],
                                          torch.arange(previous_logical, plan.logical_len)])
                    resident = resident[: plan.old_len]
                n, keep, recent = plan.old_len, plan.new_len, plan.recent
                assert resident.numel() == n
                score = -norms[layer, head, resident]
                order = sorted(range(n - recent), key=lambda j: (score[j].item(), j),
                               reverse=True)[: keep - recent]
                want = resident[sorted(order) + list(range(n - recent, n))]
                got = positions[layer, head]
                assert torch.equal(got[-recent:], want[-recent:]), (i, layer, head)
                torch.testing.assert_close(
                    norms[layer, head, got].sort().values, norms[layer, head, want].sort().values,
                    rtol=NORM_RTOL, atol=0, msg=f"compaction {i}, layer {layer}, head {head}")
                checked += 1
        previous, previous_logical = positions, plan.logical_len
    assert checked >= num_layers * h + (len(compactions) - 1) * h
