"""The fused pass on vLLM's `amx` layout in the real engine: SmolLM2-135M in
bf16 on an AMX CPU, where vLLM attends with AMX tiles (blocks of 32n).

There the pass takes only H2O's decode steps (integration/fused_attention.wanted:
its tiles beat vLLM's attention plus the scoring kernel there, not on prompt
chunks, and not as attention alone). Each request's ~600-token prompt
exceeds its 128-token budget, so it compacts right after the prompt and its
decode steps take the pass, whose column sums feed the compactions of its 64
tokens of decode (one every 32 tokens). The same requests run with the pass
switched off (VLLM_KVEVICT_CPU_FUSED=off: vLLM's attention, the decode log
and the scoring kernel), prefix cache reset between the runs.
"""
import pytest
from conftest import close, cpu_has_amx, engine_settings, make_llm
from kept_positions import KeptRecorder

from vllm_kvevict import cpu_kernel, passages


@pytest.fixture(scope="module")
def runs(model_path):
    if not cpu_has_amx():
        pytest.skip("this CPU lacks AMX: vLLM keeps no bf16 cache in its amx layout")
    if cpu_kernel.module() is None or cpu_kernel.isa() != "amx":
        pytest.skip("the kernel's amx path is not built or not chosen (scripts/setup.sh builds it)")
    from vllm import SamplingParams
    from vllm import _custom_ops as ops

    from vllm_kvevict.core.scoring.query_buffers import QueryBuffers
    from vllm_kvevict.integration.worker import worker_state

    llm = make_llm(model_path, dtype="bfloat16", **engine_settings("h2o"))
    calls = {}
    real_pass, real_attention = cpu_kernel.attend_add_column_sums, ops.cpu_attention_with_kv_cache
    real_hold = QueryBuffers.hold

    def counting_pass(*args):
        q_lens = args[5][1:] - args[5][:-1]
        calls["fused"] += 1
        calls["fused_prompt_rows"] += int((q_lens > 1).sum())
        calls["scored_rows"] += int(args[8].sum())
        calls["rows"] += len(q_lens)
        return real_pass(*args)

    def counting_attention(**kw):
        q_lens = kw["query_start_loc"][1:] - kw["query_start_loc"][:-1]
        calls["vllm_prompt_rows"] += int((q_lens > 1).sum())
        calls["vllm_decode_only"] += int(bool((q_lens == 1).all()))
        return real_attention(**kw)

    def hold(*args, **kw):
        calls["logged"] += 1
        return real_hold(*args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernel, "attend_add_column_sums", counting_pass)
        mp.setattr(ops, "cpu_attention_with_kv_cache", counting_attention)
        mp.setattr(QueryBuffers, "hold", hold)
        try:
            tok = llm.get_tokenizer()
            prompts = passages.passages(tok, 3, [f"austen_{n}" for n in passages.AUSTEN[:2]], 600)
            params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                                    extra_args={"kv_budget": 128})
            state, out = worker_state(), {}
            for mode in ("off", "on"):
                mp.setenv("VLLM_KVEVICT_CPU_FUSED", mode)
                llm.reset_prefix_cache()
                calls.update(dict.fromkeys(("fused", "fused_prompt_rows", "scored_rows", "rows",
                                            "vllm_prompt_rows", "vllm_decode_only", "logged"), 0))
                rec = KeptRecorder(state)
                steps = state.cpu_pass_steps
                res = llm.generate(prompts, params, use_tqdm=False)
                rec.remove()
                out[mode] = dict(calls, tokens=[list(o.outputs[0].token_ids) for o in res],
                                 compactions=[p for _, p in rec.compactions],
                                 layers=len(state.layers), pass_steps=state.cpu_pass_steps - steps)
            yield out
        finally:
            close(llm)


def test_h2o_decode_steps_take_the_amx_pass_and_prompt_chunks_keep_vllm(runs):
    """On: every decode-only step went through the pass (vLLM's attention saw
    none), scoring every row, and no prompt chunk did; off: the pass never ran."""
    on, off = runs["on"], runs["off"]
    assert on["fused"] > 0 and on["fused"] % on["layers"] == 0
    assert on["pass_steps"] * on["layers"] == on["fused"] and off["pass_steps"] == 0
    assert on["fused"] >= on["layers"] * 60  # 64 tokens: ~62 decode-only steps
    assert on["vllm_decode_only"] == 0 and on["fused_prompt_rows"] == 0
    assert on["vllm_prompt_rows"] > 0 and on["scored_rows"] == on["rows"]
    assert off["fused"] == 0 and off["vllm_decode_only"] > 0


def test_amx_pass_scores_drive_the_same_compactions(runs):
    """The prompts' attention is vLLM's on both runs: first tokens and first
    compactions equal. The decode compactions, scored by the pass (on) or by
    the decode log's kernel (off), keep nearly the same tokens: the same
    float32 logits and probabilities, over queries that differ only where
    the outputs (bf16 probabilities in both kernels' P V) tip a rounding."""
    on, off = runs["on"], runs["off"]
    assert [t[0] for t in on["tokens"]] == [t[0] for t in off["tokens"]]
    assert len(on["compactions"]) == len(off["compactions"]) > len(on["tokens"])
    overlaps = []
    for a, b in zip(on["compactions"], off["compactions"]):
        assert a.shape == b.shape
        same = sum(len(set(x.tolist()) & set(y.tolist()))
                   for x, y in zip(a.flatten(0, 1), b.flatten(0, 1)))
        overlaps.append(same / a.numel())
    n = len(on["tokens"])
    assert min(overlaps[:n]) == 1.0, overlaps  # after the prompt: vLLM's attention both times
    assert min(overlaps[n:]) >= 0.9, overlaps
