"""The fused CPU attention pass in the real engine (integration/fused_attention.py):
SmolLM2-135M through vLLM with each policy, prompts over their budget, in the
CPU's native dtype (bf16 on AVX-512 BF16: that path; float32 elsewhere: avx2;
float32 on AMX CPUs too, where vLLM's bf16 cache is in its `amx` layout:
test_fused_engine_amx.py).

Each request's prompt (~600 tokens, 256-token chunks) exceeds its 128-token
budget, so it compacts right after the prompt and no identity promise covers
it: its prompt chunks and then its decode steps take the pass. Under H2O the
pass scores every row and no layer logs a query for later scoring; under
SnapKV and AnDPro it attends alone and the layers still log the window's
queries, which score every compaction; StreamingLLM's layers record nothing. The same requests run with the pass
switched off (VLLM_KVEVICT_CPU_FUSED=off: vLLM's attention, then the scoring
kernel) on the same engine, prefix cache reset between the runs; and once
more with 200-token prompts at budget 208, which must not take the pass.
"""
import pytest
from conftest import DTYPE, close, cpu_has_amx, engine_settings, make_llm
from kept_positions import KeptRecorder

from vllm_kvevict import cpu_kernel, passages

# On an AMX CPU vLLM attends a bf16 cache through its `amx` layout (it takes
# blocks of 32n only), where the pass takes H2O's decode steps alone
# (fused_attention.wanted; test_fused_engine_amx.py): there this file's
# engine runs float32, whose `vec` layout the pass reads for every step (avx2).
PASS_DTYPE = "float32" if cpu_has_amx() else DTYPE


@pytest.fixture(scope="module", params=["h2o", "snapkv", "andpro", "streaming"])
def runs(request, model_path, monkeypatch_module):
    import torch

    if cpu_kernel.module() is None:
        pytest.skip("the fused pass needs the built kernel (scripts/setup.sh builds it)")
    assert cpu_kernel.fused_isa(getattr(torch, PASS_DTYPE)) is not None  # avx512bf16 (bf16) or avx2
    from vllm import SamplingParams
    from vllm import _custom_ops as ops

    from vllm_kvevict.core.scoring.query_buffers import QueryBuffers
    from vllm_kvevict.integration.worker import worker_state

    policy = request.param
    llm = make_llm(model_path, dtype=PASS_DTYPE, **engine_settings(policy))
    try:
        tok = llm.get_tokenizer()
        prompts = passages.passages(tok, 3, [f"austen_{n}" for n in passages.AUSTEN[:2]], 600)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                extra_args={"kv_budget": 128})
        calls = {"fused": 0, "fused_rows": 0, "fused_decode_only": 0, "fused_prompt_rows": 0, "scored_rows": 0,
                 "vllm_rows": 0, "vllm_prompt_rows": 0, "logged": 0}
        real_pass, real_attention = cpu_kernel.attend_add_column_sums, ops.cpu_attention_with_kv_cache
        real_hold, real_hold_ref = QueryBuffers.hold, QueryBuffers.hold_ref

        def counting_pass(*args):
            q_lens = args[5][1:] - args[5][:-1]
            calls["fused"] += 1
            calls["fused_rows"] += len(q_lens)
            calls["fused_decode_only"] += int(bool((q_lens == 1).all()))
            calls["fused_prompt_rows"] += int((q_lens > 1).sum())
            calls["scored_rows"] += int(args[8].sum())
            return real_pass(*args)

        def counting_attention(**kw):
            q_lens = kw["query_start_loc"][1:] - kw["query_start_loc"][:-1]
            calls["vllm_rows"] += len(q_lens)
            calls["vllm_prompt_rows"] += int((q_lens > 1).sum())
            return real_attention(**kw)

        def counting(real):
            def hold(*args, **kw):
                calls["logged"] += 1
                return real(*args, **kw)
            return hold

        monkeypatch_module.setattr(cpu_kernel, "attend_add_column_sums", counting_pass)
        monkeypatch_module.setattr(ops, "cpu_attention_with_kv_cache", counting_attention)
        monkeypatch_module.setattr(QueryBuffers, "hold", counting(real_hold))
        monkeypatch_module.setattr(QueryBuffers, "hold_ref", counting(real_hold_ref))
        state = worker_state()
        out = {}
        # within: 200-token prompts (the engine caps budgets at 256), budget 208
        short = [{"prompt_token_ids": tok(p)["input_ids"][:200]} for p in prompts]
        within = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                extra_args={"kv_budget": 208})
        for mode in ("off", "on", "within"):
            monkeypatch_module.setenv("VLLM_KVEVICT_CPU_FUSED", "off" if mode == "off" else "on")
            llm.reset_prefix_cache()
            for k in calls:
                calls[k] = 0
            rec = KeptRecorder(state)
            windowless, pass_steps = state.num_windowless, state.cpu_pass_steps
            res = (llm.generate(short, within, use_tqdm=False) if mode == "within"
                   else llm.generate(prompts, params, use_tqdm=False))
            rec.remove()
            first = {}  # each request's first compaction, by the id the user sees
            for plan, positions in rec.compactions:  # (the engine's ids add a suffix)
                first.setdefault(plan.req_id.rsplit("-", 1)[0], positions)
            out[mode] = dict(calls, tokens=[list(o.outputs[0].token_ids) for o in res],
                             prompt_lens=[len(o.prompt_token_ids) for o in res],
                             first=[first[o.request_id] for o in res if o.request_id in first],
                             compactions=len(rec.compactions), layers=len(state.layers),
                             windowless=state.num_windowless - windowless, policy=policy,
                             pass_steps=state.cpu_pass_steps - pass_steps)
        yield out
    finally:
        close(llm)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _logs_queries(policy: str) -> bool:
    """Whether the policy's layers log queries: H2O's decode log, the window's ring."""
    return policy != "streaming"


def test_requests_over_budget_take_the_pass_for_every_step(runs):
    """With the pass on, every step went through it, prompt chunks and
    decode-only steps alike (vLLM's attention saw no row), each layer once a
    step. H2O: scoring every row, no layer logging a query for later scoring.
    SnapKV/AnDPro: scoring no row in the pass, the layers logging the window's
    queries, and every compaction scored by a window. Off, the pass never ran
    and the layers logged their queries."""
    on, off, policy = runs["on"], runs["off"], runs["on"]["policy"]
    assert all(n > 256 + 128 for n in on["prompt_lens"])  # over budget, more than one chunk
    assert on["fused"] > 0 and on["fused"] % on["layers"] == 0
    # what /metrics says (vllm_kvevict_cpu_pass_steps_total): one per step, every layer in it
    assert on["pass_steps"] * on["layers"] == on["fused"] and off["pass_steps"] == 0
    assert on["fused_prompt_rows"] >= on["layers"] * 3  # >= 3 chunks of ~600 tokens at 256 a step
    assert on["fused_decode_only"] >= on["layers"] * 20  # 24 tokens: ~22 decode-only steps
    assert on["vllm_rows"] == 0
    if policy == "h2o":
        assert on["logged"] == 0 and on["scored_rows"] == on["fused_rows"]
    else:
        assert on["scored_rows"] == 0 and (on["logged"] > 0) == _logs_queries(policy)
    assert on["compactions"] > 0 and on["windowless"] == 0
    assert off["fused"] == 0 and off["vllm_prompt_rows"] > 0
    assert (off["logged"] > 0) == _logs_queries(policy)


def test_requests_within_their_budget_keep_vllm_attention(runs):
    """Budget above the prompt (scored, since it may compact in decode): held
    to stock's tokens until it evicts, which these 24 tokens do not reach, so
    every step keeps vLLM's attention and the layers log their queries (none
    under StreamingLLM)."""
    within = runs["within"]
    assert within["compactions"] == 0
    assert within["fused"] == 0 and within["pass_steps"] == 0 and within["vllm_prompt_rows"] > 0
    assert (within["logged"] > 0) == _logs_queries(within["policy"])


def test_first_tokens_equal_and_kept_sets_agree_with_the_unfused_path(runs):
    """The prompt's attention is the same computation in another order: first
    tokens (sampled from the fused prompt, before any eviction) equal the
    unfused run's, and the first compaction of each request keeps nearly the
    same tokens (scores equal to float32 rounding; a near-tie may swap)."""
    on, off = runs["on"], runs["off"]
    assert [t[0] for t in on["tokens"]] == [t[0] for t in off["tokens"]]
    assert on["compactions"] == off["compactions"] > 0
    assert len(on["first"]) == len(off["first"]) == len(on["tokens"])
    for a, b in zip(on["first"], off["first"]):
        assert a.shape == b.shape
        same = sum(len(set(x.tolist()) & set(y.tolist()))
                   for x, y in zip(a.flatten(0, 1), b.flatten(0, 1)))
        assert same >= 0.97 * a.numel(), same / a.numel()
