"""fp8 KV caches (`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`) under eviction, on CPU.

vLLM's CPU backend stores an fp8 cache as uint8 bytes in the float8 bit
formats, over a per-layer k_scale / v_scale. The plugin reads it as its float8
view (`cpu_backend.EvictingCPUAttentionImpl.readable`: gathers decode it, the
token mover copies its bytes, k_scale joins the logits' scale). Ground truth,
as for bf16 in test_kv_layout.py: vLLM's own fp8 writer and attention kernel,
and stock vLLM's tokens with the same fp8 cache.

vLLM runs fp8 KV caches on x86 CPUs with AVX-512 only (`cpu_attn._get_attn_isa`);
on other CPUs these cases skip, saying so.
"""

from types import SimpleNamespace

import pytest
import torch
import vllm._custom_ops as ops  # a missing vLLM fails, never skips
from conftest import (DTYPE, PROMPTS, STOCK_TOKENS, engine_settings, kernel_isas,
                      needs_stock_writer, serve_config, stock_ids)
from test_kv_layout import _stock_attention

from vllm_kvevict.core.eviction.planner import max_blocks_per_request
from vllm_kvevict.core.layouts.cpu_layout import FP8_CACHE_DTYPES, split_kv_cache
from vllm_kvevict.core.policies import POLICIES, Record
from vllm_kvevict.integration.cpu_backend import discover_layout

NAMES = ["fp8", "fp8_e5m2"]  # fp8_e4m3 is fp8's other name (same float8 format)
NB, BS, D, H = 10, 32, 64, 3


def needs_fp8(isa: str = "vec") -> None:
    if not torch.cpu._is_avx512_supported():
        pytest.skip("vLLM's CPU backend runs fp8 KV caches on x86 with AVX-512 only; "
                    "this CPU has no AVX-512")
    needs_stock_writer(isa)


def _fp8_tokens(n, fp8, gen, scale=1.0):
    """(n, H, D) bf16 tokens the fp8 format holds exactly (after / scale), so
    vLLM's writer stores them without rounding and reads can be exact."""
    return (torch.randn(n, H, D, generator=gen).to(fp8).float() * scale).to(torch.bfloat16)


def _cache(fp8):
    """(uint8 [NB, H, BS, 2D] as vLLM allocates it, its float8 view's (K, V))."""
    raw = torch.zeros(NB, H, BS, 2 * D, dtype=torch.uint8)
    return raw, split_kv_cache(raw.view(fp8))


def _write(k, v, raw, slots, isa, name, k_scale=1.0, v_scale=1.0):
    ops.cpu_attn_reshape_and_cache(k, v, *split_kv_cache(raw), slots, isa, k_scale=k_scale,
                                   v_scale=v_scale, kv_cache_dtype=name)


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize("name", NAMES)
def test_fp8_reads_match_stock_writer(isa, name):
    """vLLM's fp8 writer stores tokens at random slots; the discovered layout
    reads them back exactly through the float8 view: per-head token reads,
    whole-block gathers, the float32 transposed key gather scoring uses."""
    needs_fp8(isa)
    fp8 = FP8_CACHE_DTYPES[name]
    gen = torch.Generator().manual_seed(3)
    L = discover_layout(isa, fp8, BS, D, H)
    raw, (kc, vc) = _cache(fp8)
    slots = torch.randperm(NB * BS, generator=gen)[: NB * BS // 2]
    k, v = _fp8_tokens(len(slots), fp8, gen), _fp8_tokens(len(slots), fp8, gen)
    _write(k, v, raw, slots, isa, name)

    pick = torch.stack([torch.randperm(len(slots), generator=gen)[:40] for _ in range(H)])
    rk, rv = L.read_tokens(kc, vc, slots[pick] // BS, slots[pick] % BS)
    hh = torch.arange(H).view(-1, 1)
    assert rk.dtype == fp8
    assert torch.equal(rk.float(), k[pick, hh].float()) and torch.equal(rv.float(), v[pick, hh].float())

    dense = [torch.zeros(NB * BS, H, D) for _ in range(2)]
    dense[0][slots], dense[1][slots] = k.float(), v.float()
    dk, dv = (x.view(NB, BS, H, D).transpose(1, 2) for x in dense)
    table = torch.randint(0, NB, (4, 3), generator=gen, dtype=torch.int32)
    want = lambda x, m: x[table[:, :m].long()].transpose(1, 2).flatten(2, 3)  # noqa: E731
    assert torch.equal(L.gather_keys(kc, table).float(), want(dk, 3))
    assert torch.equal(L.gather_values(vc, table, 2).float(), want(dv, 2))
    assert torch.equal(L.gather_keys_t(kc, table, 3), want(dk, 3).transpose(2, 3))


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize("name", NAMES)
def test_fp8_compaction_moves_bytes_the_stock_kernel_reads(name, isa, kernels, monkeypatch):
    """The plugin's compaction (`fill_holes`, with a copy-on-write first block)
    on the float8 view, through the compiled token mover (auto) and torch, in
    vLLM's vec and amx fp8 layouts: the cache's bytes then equal vLLM's writer
    storing each kept token where fill_holes says it went, another request's
    block is untouched, and vLLM's fp8 attention kernel over the compacted
    request equals float32 attention over each head's kept tokens (the amx
    kernel only on a CPU with AMX)."""
    from conftest import cpu_has_amx

    from vllm_kvevict.core.eviction.compaction import fill_holes
    from vllm_kvevict.core.eviction.kernel_dispatch import cpu_token_mover

    needs_fp8(isa)
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", kernels)
    fp8 = FP8_CACHE_DTYPES[name]
    gen = torch.Generator().manual_seed(5)
    L = discover_layout(isa, fp8, BS, D, H)
    raw, (kc, vc) = _cache(fp8)
    if kernels == "auto":
        assert cpu_token_mover(L, kc) is not None, "the compiled mover is not built"
    n_old, n_new = 2 * BS + 9, BS + 3
    src = torch.tensor([[0, 1, 2]])
    dst = torch.tensor([[7, 1]])  # block 0 shared: kept tokens go to a private copy, 7
    k, v = _fp8_tokens(n_old, fp8, gen), _fp8_tokens(n_old, fp8, gen)
    old_slots = (src[0, torch.arange(n_old) // BS] * BS + torch.arange(n_old) % BS)
    _write(k, v, raw, old_slots, isa, name)
    neighbour = _fp8_tokens(BS, fp8, gen)
    _write(neighbour, neighbour, raw, 4 * BS + torch.arange(BS), isa, name)
    keep = torch.stack([torch.randperm(n_old, generator=gen)[:n_new] for _ in range(H)])

    expected = raw.clone()
    after = fill_holes(L, kc, vc, src, dst, keep[None], n_old)[0]  # (H, n_new) slots
    assert torch.equal(after.sort(dim=1).values, torch.arange(n_new).expand(H, -1))
    hh = torch.arange(H).view(-1, 1)
    kk = torch.zeros(n_new, H, D, dtype=torch.bfloat16)
    vk = torch.zeros(n_new, H, D, dtype=torch.bfloat16)
    kk[after, hh], vk[after, hh] = k[keep, hh], v[keep, hh]
    new_slots = dst[0, torch.arange(n_new) // BS] * BS + torch.arange(n_new) % BS
    # Block 0 keeps the request's old bytes (another reader shares it); block 7
    # starts as its copy, then the holes are filled.
    expected[7] = expected[0]
    _write(kk, vk, expected, new_slots, isa, name)
    assert torch.equal(raw, expected)

    if isa == "amx" and not cpu_has_amx():
        return  # the bytes are checked; vLLM's amx attention kernel needs AMX hardware
    q = torch.randn(1, 2 * H, D, generator=gen).to(torch.bfloat16)
    out = _stock_attention(isa, q, *split_kv_cache(raw), dst.int(), [n_new], H, name)
    g = 2
    kf, vf = (x.transpose(0, 1).float().repeat_interleave(g, 0) for x in (kk, vk))
    ref = ((q[0].float()[:, None] @ kf.transpose(1, 2))[:, 0] * D**-0.5).softmax(-1)
    torch.testing.assert_close(out[0].float(), torch.einsum("hl,hld->hd", ref, vf),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("path", [*kernel_isas(), "torch"])
@pytest.mark.parametrize("layout", ["vec", "amx"])
@pytest.mark.parametrize("name", NAMES)
def test_fp8_h2o_scores_match_float32_reference_with_k_scale(name, layout, path, monkeypatch):
    """H2O's scores from an fp8 cache written with k_scale 0.5: the impl's
    `readable` hands scoring the float8 view (one view per cache tensor) and
    the softmax scale times k_scale; `score_queries` over them, on each path
    of the compiled kernel (the cache's bytes decoded into its operands; amx
    hands fp8 to avx512bf16) and in torch, equals float32 softmax attention
    over the decoded keys times k_scale, summed per slot; in vLLM's vec and
    amx fp8 layouts (the cache as vLLM's writer packs it for each)."""
    from vllm_kvevict import cpu_kernel
    from vllm_kvevict.core.scoring.scores import score_queries
    from vllm_kvevict.integration.cpu_backend import EvictingCPUAttentionImpl

    needs_fp8(layout)
    if path == "torch":
        monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "torch")
    else:
        monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", path)
    ran = []
    monkeypatch.setattr(cpu_kernel, "module", lambda m=cpu_kernel.module(): SimpleNamespace(
        supports=m.supports, column_sums=lambda *a: ran.append(a[-1]) or m.column_sums(*a),
        add_column_sums=lambda *a: ran.append(a[-1]) or m.add_column_sums(*a)))
    fp8 = FP8_CACHE_DTYPES[name]
    gen = torch.Generator().manual_seed(9)
    impl = object.__new__(EvictingCPUAttentionImpl)  # what __init__ sets for readable
    impl.scale, impl.kv_view_dtype, impl._kv_view = D**-0.5, fp8, None
    layer = SimpleNamespace(_k_scale_float=0.5)
    raw = torch.zeros(NB, H, BS, 2 * D, dtype=torch.uint8)
    view, scale = impl.readable(layer, raw)
    assert view.dtype == fp8 and impl.readable(layer, raw)[0] is view
    assert scale == pytest.approx(D**-0.5 * 0.5)

    n = 2 * BS + 5
    blocks = torch.tensor([[3, 8, 5]])
    slots = blocks[0, torch.arange(n) // BS] * BS + torch.arange(n) % BS
    k = _fp8_tokens(n, fp8, gen, scale=0.5)  # stored as k / 0.5: exact in fp8
    _write(k, k, raw, slots, layout, name, k_scale=0.5, v_scale=0.5)
    kc, _ = split_kv_cache(view)
    L = discover_layout(layout, fp8, BS, D, H)
    q = torch.randn(1, 4, 2 * H, D, generator=gen).to(torch.bfloat16)  # 4 queries, GQA 2
    visible = torch.tensor([[n - 3, n - 2, n - 1, n]])
    scores = torch.zeros(H, NB * BS)
    score_queries(scores, L, kc, q, visible, blocks, scale)

    ref = torch.zeros(H, NB * BS)
    kf = k.float().transpose(0, 1).repeat_interleave(2, 0)  # (H_q, n, D) true keys
    for t in range(4):
        m = int(visible[0, t])
        p = ((q[0, t].float()[:, None] @ kf[:, :m].transpose(1, 2))[:, 0] * D**-0.5).softmax(-1)
        ref[:, slots[:m]] += p.view(H, 2, m).sum(1)
    assert ran == ([] if path == "torch" else ["avx512bf16" if path == "amx" else path])
    assert float(scores.sum()) > 0
    torch.testing.assert_close(scores, ref, atol=1e-5, rtol=1e-5)


def test_offload_with_an_fp8_cache_stops_startup_saying_why(model_path):
    """Offload's host tier and decode hold K/V in the model dtype: refused at
    startup, naming both flags; eviction alone with fp8, and stock vLLM with
    fp8, start."""
    said = serve_config(model_path, "--kv-eviction", "infinigen", "--kv-cache-dtype", "fp8")
    assert isinstance(said, str), "started"
    assert said.startswith("EvictionConfigError: ") and "--kv-cache-dtype fp8" in said, said
    assert "--kv-eviction infinigen" in said and "not supported with" in said, said
    for args in (("--kv-eviction", "h2o", "--kv-cache-dtype", "fp8_e5m2"),
                 ("--kv-cache-dtype", "fp8_e5m2")):
        cfg = serve_config(model_path, *args)
        assert not isinstance(cfg, str), cfg
        assert cfg.cache_config.cache_dtype == "fp8_e5m2"


@pytest.mark.parametrize("policy", list(POLICIES))
def test_fp8_engine_identical_to_stock_while_scoring_then_compacts(fresh_engines, model_path,
                                                                  policy):
    """A real engine with `kv_cache_dtype="fp8"`. First each request's budget
    is one token under its final length (as in test_engine.py's
    test_scoring_every_step_without_eviction_is_token_identical_to_stock):
    every step is scored from the fp8 cache, nothing is evicted, and the tokens
    equal stock vLLM's with the same fp8 cache (a subprocess, VLLM_PLUGINS="").
    Then budget 64: the policy compacts the fp8 cache, each request stays
    within its block bound in vLLM's req_to_blocks, and every block returns to
    vLLM's pool."""
    from vllm import SamplingParams

    from vllm_kvevict.integration.worker import worker_state
    from vllm_kvevict.probe import attach

    needs_fp8()
    llm = fresh_engines.get(kv_cache_dtype="fp8", **engine_settings(policy))
    state, probe = worker_state(), attach(llm)
    tok = llm.get_tokenizer()
    params = [SamplingParams(temperature=0, max_tokens=STOCK_TOKENS, ignore_eos=True, extra_args={
        "kv_budget": len(tok(p)["input_ids"]) + STOCK_TOKENS - 1}) for p in PROMPTS]
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    managers = probe.managers()
    assert state.layers and all(lc.kv_cache.dtype == torch.float8_e4m3fn
                                for lc in state.layers.values())  # the plugin read fp8
    assert sum(m.num_tokens_evicted for m in managers) == 0
    if POLICIES[policy].records is Record.ATTENTION:
        assert sum(float(lc.scores.abs().sum()) for lc in state.layers.values()) > 0
    assert ours == stock_ids(model_path, DTYPE, "fp8"), policy

    probe = attach(llm)  # the block bound below is the compacting run's
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True,
                                                extra_args={"kv_budget": 64}), use_tqdm=False)
    llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)  # workers hear of the finish
    assert all(len(o.outputs[0].token_ids) == 200 for o in outs)
    assert sum(m.num_tokens_evicted for m in managers) >= len(PROMPTS) * (200 - 64)
    assert probe.max_blocks_per_request <= max_blocks_per_request(64, 32)
    assert probe.used_blocks() == 0
