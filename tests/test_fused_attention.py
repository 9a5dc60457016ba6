"""The fused CPU attention pass (cpu_kernel/fused_attention.h: attention and
H2O's column sums in one pass) against a float64 reference written from the
definitions, and against vLLM's own CPU attention on the same paged cache.

The batch is what a step of vLLM's runner hands the backend: a prefill chunk
over earlier keys, a whole prompt, decode rows and a short chunk, in blocks
scattered over the cache (vLLM's vec layout, discovered from its writer).
Every path the CPU has runs (avx512bf16 on bf16; avx2 on bf16 and float32,
forced where the CPU has a better one); a path the CPU lacks is skipped,
saying so, as is everything where the kernel is not built.
"""
import pytest
import torch
from vllm import _custom_ops as ops

from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.layouts.cpu_layout import KVLayout


# The pass's paths (`cpu_kernel.fused_isa`), each forced in turn: AVX-512 BF16
# (bf16) where the CPU has it, AVX2 + FMA (bf16 widened, or float32) on every x86 CPU.
PATHS = [("avx512bf16", torch.bfloat16), ("avx2", torch.bfloat16), ("avx2", torch.float32)]
PATH_IDS = ["avx512bf16", "avx2-bf16", "avx2-f32"]
# Output against float64: within one bf16 rounding (bf16), float32 accuracy (float32).
OUT_TOL = {torch.bfloat16: dict(rtol=2 ** -8, atol=1e-6), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.fixture(params=PATHS, ids=PATH_IDS)
def path(request, monkeypatch):
    """(isa, dtype) of a path this CPU runs, forced through VLLM_KVEVICT_CPU_ISA."""
    isa, dtype = request.param
    mod = cpu_kernel.module()
    if mod is None:
        pytest.skip("the kernel is not built (scripts/setup.sh builds it)")
    if not mod.supports(isa):
        pytest.skip(f"this CPU lacks {isa}")
    monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", isa)
    assert cpu_kernel.fused_isa(dtype) == isa
    return isa, dtype


# (query tokens, physical length) per row: a chunk over 700 keys, a whole
# prompt, two decode rows, a 16-token chunk.
ROWS = [(300, 700), (257, 257), (1, 500), (1, 33), (16, 16)]
SCORED = [True, False, False, True, True]


def _layout(isa, dtype, bs, d, h):
    """vLLM's layout, discovered from its writer; `amx` built from its tiling
    (`cpu_kernel.amx_tiles`), so CPUs without AMX test the pass on it too
    (the pass reads it with AVX-512 BF16 alone); on AMX CPUs the discovered
    tiling must be that one."""
    if isa != "amx":
        return KVLayout.discover(ops.cpu_attn_reshape_and_cache, isa, dtype, bs, d, h)
    kt, vt = cpu_kernel.amx_tiles(bs, d)
    if torch.cpu._is_amx_tile_supported():
        found = KVLayout.discover(ops.cpu_attn_reshape_and_cache, "amx", dtype, bs, d, h)
        assert (found.k_tiles, found.v_tiles) == (kt, vt)
    return KVLayout("amx", dtype, bs, d, h, None, None, kt, vt)


def _batch(bs, d, h, g, gen, isa="vec", unwritten=float("nan"), rows=ROWS, dtype=torch.bfloat16):
    """A step's batch (`rows`) over a paged cache of `dtype` whose slots past
    each row's length hold `unwritten` (NaN: the pass must not read them)."""
    layout = _layout(isa, dtype, bs, d, h)
    need = [-(-s // bs) for _, s in rows]
    nb = sum(need) + 7
    kv = torch.full((nb, h, bs, 2 * d), unwritten, dtype=dtype)
    kc, vc = layout.split(kv)
    perm = torch.randperm(nb, generator=gen)
    nblk = max(need)
    blocks = torch.zeros(len(rows), nblk, dtype=torch.int64)
    at = 0
    for i, k in enumerate(need):
        blocks[i, :k] = perm[at:at + k]
        at += k
        s = rows[i][1]  # only a row's first s slots are written: the pass must not read past them
        slots = (blocks[i, torch.arange(s) // bs] * bs + torch.arange(s) % bs).expand(h, -1)
        layout.write_tokens(kc, vc, slots // bs, slots % bs,
                            torch.randn(h, s, d, generator=gen).to(dtype),
                            torch.randn(h, s, d, generator=gen).to(dtype))
    starts = torch.tensor([0] + [n for n, _ in rows]).cumsum(0)
    seq = torch.tensor([s for _, s in rows])
    q = (torch.randn(int(starts[-1]), h * g, d, generator=gen) * 2).to(dtype)
    return layout, kc, vc, blocks, starts, seq, q


def _reference(layout, kc, vc, blocks, starts, seq, q, scale, rows=ROWS):
    """float64 attention output (N, H_q, D) and per-row column sums (H, seq)."""
    h = layout.num_kv_heads
    g = q.shape[1] // h
    out = torch.zeros(q.shape, dtype=torch.float64)
    cols = []
    for i, (n, s) in enumerate(rows):
        k = layout.gather_keys(kc, blocks[i:i + 1])[0, :, :s].double()  # (H, s, D)
        v = layout.gather_values(vc, blocks[i:i + 1])[0, :, :s].double()
        qi = q[starts[i]:starts[i + 1]].double()  # (n, H_q, D)
        logits = torch.einsum("thd,hsd->hts", qi, k.repeat_interleave(g, 0)) * scale
        horizon = torch.arange(s - n + 1, s + 1)
        logits = logits.masked_fill(torch.arange(s)[None, None, :] >= horizon[None, :, None],
                                    float("-inf"))
        p = logits.softmax(-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hts,hsd->thd", p, v.repeat_interleave(g, 0))
        cols.append(p.view(h, g, n, s).sum((1, 2)))
    return out, cols


def _slots(blocks, i, s, bs):
    j = torch.arange(s)
    return blocks[i, j // bs] * bs + j % bs


@pytest.mark.parametrize("bs,d,h,g", [(32, 64, 3, 3), (128, 64, 2, 7), (32, 128, 2, 2), (16, 80, 1, 4)],
                         ids=["smollm2", "qwen2.5-0.5b", "d128", "vec16-d80"])
def test_fused_pass_matches_float64_reference(bs, d, h, g, path):
    """Output within one bf16 rounding of the float64 attention (the
    float32-accurate contract; float32: to float32 accuracy); column sums of
    the scored rows to float32 accuracy, added onto what the slots held; the
    other rows' slots untouched."""
    _, dtype = path
    gen = torch.Generator().manual_seed(bs + d + h)
    layout, kc, vc, blocks, starts, seq, q = _batch(bs, d, h, g, gen, "vec" if bs % 32 == 0 else "vec16",
                                                    dtype=dtype)
    assert cpu_kernel.fuses_attention(layout, dtype)
    scale = d ** -0.5
    scores = torch.rand(h, kc.shape[0] * bs, generator=gen)  # earlier steps' sums
    before = scores.clone()
    out = torch.full_like(q, float("nan"))
    qs = q[:, None].expand(-1, 2, -1, -1)[:, 0]  # a strided view, as vLLM's q is
    cpu_kernel.attend_add_column_sums(out, layout, kc, vc, qs, starts, seq, blocks,
                                      torch.tensor(SCORED), scale, scores)
    ref, cols = _reference(layout, kc, vc, blocks, starts, seq, q, scale)
    torch.testing.assert_close(out.double(), ref, **OUT_TOL[dtype])
    touched = torch.zeros(scores.shape[1], dtype=torch.bool)
    for i, (n, s) in enumerate(ROWS):
        slots = _slots(blocks, i, s, bs)
        touched[slots] = True
        added = (scores[:, slots] - before[:, slots]).double()
        if SCORED[i]:
            torch.testing.assert_close(added, cols[i], rtol=1e-4, atol=1e-5)
            assert abs(float(added.sum()) - h * g * n) < 1e-2 * n  # each query's softmax sums to 1
        else:
            assert torch.equal(scores[:, slots], before[:, slots])
    assert torch.equal(scores[:, ~touched], before[:, ~touched])


def test_fused_pass_scoring_no_row_is_the_same_attention_and_takes_no_score_buffer(path):
    """The pass with no row scored (what SnapKV, AnDPro and StreamingLLM steps
    run: attention alone) writes the same output, bit for bit, as with rows
    scored, and takes an (H, 0) score buffer (theirs); a scored row still
    needs the (H, NB * BS) buffer."""
    _, dtype = path
    bs, d, h, g = 32, 64, 3, 3
    gen = torch.Generator().manual_seed(5)
    layout, kc, vc, blocks, starts, seq, q = _batch(bs, d, h, g, gen, dtype=dtype)
    scored_out, alone_out = torch.empty_like(q), torch.full_like(q, float("nan"))
    scores = torch.zeros(h, kc.shape[0] * bs)
    cpu_kernel.attend_add_column_sums(scored_out, layout, kc, vc, q, starts, seq, blocks,
                                      torch.tensor(SCORED), d ** -0.5, scores)
    none = torch.zeros(len(ROWS), dtype=torch.bool)
    cpu_kernel.attend_add_column_sums(alone_out, layout, kc, vc, q, starts, seq, blocks, none,
                                      d ** -0.5, torch.zeros(h, 0))
    assert torch.equal(alone_out, scored_out)
    assert scores.sum() > 0  # the scored call did score
    with pytest.raises(RuntimeError, match="scores: float32"):
        cpu_kernel.attend_add_column_sums(alone_out, layout, kc, vc, q, starts, seq, blocks,
                                          torch.tensor(SCORED), d ** -0.5, torch.zeros(h, 0))


# A decode step: one query per row, lengths inside a block, at a block's end,
# one past it, and long.
DECODE_ROWS = [(1, 1), (1, 31), (1, 32), (1, 33), (1, 200), (1, 1500)]
DECODE_SCORED = [True, True, False, True, True, True]


@pytest.mark.parametrize("bs,d,h,g", [(32, 64, 3, 3), (32, 64, 2, 7), (16, 128, 1, 12)],
                         ids=["smollm2", "qwen2.5-0.5b", "g12-d128"])
def test_fused_pass_decode_step_matches_float64_reference(bs, d, h, g, path):
    """A decode-only step (one query a row, keys and values read in place; on
    avx512bf16 a group's heads at most 8 at a time: g 12 is 8 + 4, on avx2
    rows of 8) against float64: the output as above, the scored rows' column
    sums, the others untouched."""
    _, dtype = path
    gen = torch.Generator().manual_seed(g)
    layout, kc, vc, blocks, starts, seq, q = _batch(bs, d, h, g, gen, "vec" if bs % 32 == 0 else "vec16",
                                                    rows=DECODE_ROWS, dtype=dtype)
    scale = d ** -0.5
    scores = torch.rand(h, kc.shape[0] * bs, generator=gen)
    before = scores.clone()
    out = torch.full_like(q, float("nan"))
    cpu_kernel.attend_add_column_sums(out, layout, kc, vc, q, starts, seq, blocks,
                                      torch.tensor(DECODE_SCORED), scale, scores)
    ref, cols = _reference(layout, kc, vc, blocks, starts, seq, q, scale, rows=DECODE_ROWS)
    torch.testing.assert_close(out.double(), ref, **OUT_TOL[dtype])
    for i, (_, s) in enumerate(DECODE_ROWS):
        slots = _slots(blocks, i, s, bs)
        added = (scores[:, slots] - before[:, slots]).double()
        if DECODE_SCORED[i]:
            torch.testing.assert_close(added, cols[i], rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(added, torch.zeros_like(added))


def test_fused_pass_agrees_with_vllm_attention(path):
    """Same paged cache, same batch through vLLM's `cpu_attention_with_kv_cache`
    (its vec path), and the fused pass is no further from the float64 result
    than vLLM is. In float32 the two agree to float32 roundoff. In bf16,
    vLLM's AVX-512 build computes in float32 and rounds once, as the pass
    does, so the two differ only where a rounding tips, in a small share of
    the elements; its AVX2 build rounds more (about twice the pass's distance
    from float64, measured), so there only the distance is compared."""
    _, dtype = path
    bs, d, h, g = 32, 64, 3, 3
    gen = torch.Generator().manual_seed(7)
    # vLLM's kernel reads a block's unwritten slots (0 x NaN is NaN there): zeros
    layout, kc, vc, blocks, starts, seq, q = _batch(bs, d, h, g, gen, unwritten=0.0, dtype=dtype)
    scale = d ** -0.5
    ours = torch.empty_like(q)
    cpu_kernel.attend_add_column_sums(ours, layout, kc, vc, q, starts, seq, blocks,
                                      torch.zeros(len(ROWS), dtype=torch.bool), scale,
                                      torch.zeros(h, kc.shape[0] * bs))
    qsl, sl = starts.int(), seq.int()
    md = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(ROWS), num_heads=h * g, num_kv_heads=h, head_dim=d, seq_lens=sl,
        dtype=q.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
        isa="vec", enable_kv_split=False)
    theirs = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=kc, value_cache=vc, output=theirs, query_start_loc=qsl,
        seq_lens=sl, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=blocks.int(), softcap=0.0, scheduler_metadata=md, s_aux=None,
        k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    elif torch.cpu._is_avx512_supported():
        differ = ours != theirs
        assert differ.float().mean() < 2e-3, float(differ.float().mean())
    ref, _ = _reference(layout, kc, vc, blocks, starts, seq, q, scale)
    # float32's errors are roundoff: their mean is stable where a maximum is one draw
    reduce = torch.amax if dtype == torch.bfloat16 else torch.mean
    err_ours, err_theirs = (reduce((x.double() - ref).abs()) for x in (ours, theirs))
    assert err_ours <= 1.25 * err_theirs, (float(err_ours), float(err_theirs))


@pytest.fixture(params=["avx512bf16", "amx"])
def amx_layout_path(request, monkeypatch):
    """The paths that read vLLM's amx layout, each forced where the CPU has
    it: AVX-512 BF16 (every row), and AMX (decode rows on tiles, the rest as
    AVX-512 BF16)."""
    mod = cpu_kernel.module()
    if mod is None:
        pytest.skip("the kernel is not built (scripts/setup.sh builds it)")
    if not mod.supports(request.param):
        pytest.skip(f"this CPU lacks {request.param}")
    monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", request.param)
    return request.param


@pytest.mark.parametrize("rows,scored", [(ROWS, SCORED), (DECODE_ROWS, DECODE_SCORED)],
                         ids=["chunks", "decode"])
@pytest.mark.parametrize("bs,d,h,g", [(32, 64, 3, 3), (64, 64, 2, 7), (32, 128, 1, 12)],
                         ids=["smollm2", "qwen2.5-0.5b-bs64", "g12-d128"])
def test_fused_pass_reads_vllm_amx_layout_as_float64_reference(bs, d, h, g, rows, scored,
                                                               amx_layout_path, monkeypatch):
    """vLLM's bf16 amx layout (keys [BS/16][D/2][16][2], values in token pairs,
    slots past a row's length NaN, odd lengths leaving a pair half written):
    prompt chunks (keys packed, values widened) and decode rows (both read in
    place) within one bf16 rounding of float64 (the amx path's decode rows:
    within their bf16 probabilities' rounding, as vLLM's amx kernel), the
    scored rows' column sums to float32 accuracy, the other rows' slots
    untouched."""
    gen = torch.Generator().manual_seed(bs + d + g)
    layout, kc, vc, blocks, starts, seq, q = _batch(bs, d, h, g, gen, "amx", rows=rows)
    assert cpu_kernel.fuses_attention(layout, torch.bfloat16)
    scale = d ** -0.5
    scores = torch.rand(h, kc.shape[0] * bs, generator=gen)
    before = scores.clone()
    out = torch.full_like(q, float("nan"))
    cpu_kernel.attend_add_column_sums(out, layout, kc, vc, q, starts, seq, blocks,
                                      torch.tensor(scored), scale, scores)
    ref, cols = _reference(layout, kc, vc, blocks, starts, seq, q, scale, rows=rows)
    if amx_layout_path == "avx512bf16":
        torch.testing.assert_close(out.double(), ref, **OUT_TOL[torch.bfloat16])
    else:  # decode rows' P in bf16 for the tiles, as vLLM's amx kernel: 2^-9 a weight
        torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=2 ** -7)
        # on average within 1.5x the error of the float32-P path (avx512bf16)
        monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", "avx512bf16")
        exact = torch.empty_like(q)
        cpu_kernel.attend_add_column_sums(exact, layout, kc, vc, q, starts, seq, blocks,
                                          torch.tensor(scored), scale, scores.clone())
        err, err_exact = ((x.double() - ref).abs().mean() for x in (out, exact))
        assert err <= 1.5 * err_exact, (float(err), float(err_exact))
    for i, (n, s) in enumerate(rows):
        slots = _slots(blocks, i, s, bs)
        added = (scores[:, slots] - before[:, slots]).double()
        if scored[i]:
            torch.testing.assert_close(added, cols[i], rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(added, torch.zeros_like(added))


def test_fused_pass_agrees_with_vllm_amx_attention(amx_layout_path):
    """On an AMX CPU, the batch through vLLM's own amx attention (what stock
    runs for bf16 there) on the same cache: the pass no further from float64
    than vLLM is (vLLM's tiles multiply bf16 probabilities; the pass keeps
    them float32)."""
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU lacks AMX: vLLM's amx attention cannot run")
    torch._C._cpu._init_amx()  # the tile state's permission, as vLLM's worker asks for it
    bs, d, h, g = 32, 64, 3, 3
    gen = torch.Generator().manual_seed(11)
    for rows in (ROWS, DECODE_ROWS):
        layout, kc, vc, blocks, starts, seq, q = _batch(bs, d, h, g, gen, "amx", unwritten=0.0,
                                                        rows=rows)
        scale = d ** -0.5
        ours = torch.empty_like(q)
        cpu_kernel.attend_add_column_sums(ours, layout, kc, vc, q, starts, seq, blocks,
                                          torch.zeros(len(rows), dtype=torch.bool), scale,
                                          torch.zeros(h, 0))
        qsl, sl = starts.int(), seq.int()
        md = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(rows), num_heads=h * g, num_kv_heads=h, head_dim=d, seq_lens=sl,
            dtype=q.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
            isa="amx", enable_kv_split=False)
        theirs = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=theirs, query_start_loc=qsl,
            seq_lens=sl, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=blocks.int(), softcap=0.0, scheduler_metadata=md, s_aux=None,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        ref, _ = _reference(layout, kc, vc, blocks, starts, seq, q, scale, rows=rows)
        err_ours, err_theirs = (torch.amax((x.double() - ref).abs()) for x in (ours, theirs))
        assert err_theirs < 0.1  # vLLM's kernel did attend this layout
        assert err_ours <= 1.25 * err_theirs, (float(err_ours), float(err_theirs))


def test_fused_pass_refuses_a_layout_it_cannot_read(path):
    """vLLM's amx layout keeps values in pairs of tokens: the AVX-512 BF16
    path reads it, the AVX2 path does not (not offered there, and the kernel
    itself refuses it rather than read it wrongly)."""
    isa, dtype = path
    bs, d, h = 32, 64, 2
    layout = KVLayout("amx", dtype, bs, d, h, None, None, *cpu_kernel.amx_tiles(bs, d))
    assert cpu_kernel.fuses_attention(layout, dtype) == (isa == "avx512bf16")
    if isa == "avx512bf16":
        return
    kv = torch.zeros(4, h, bs, 2 * d, dtype=dtype)
    kc, vc = layout.split(kv)
    q = torch.zeros(1, h, d, dtype=dtype)
    with pytest.raises(RuntimeError, match="vLLM's vec layouts"):
        cpu_kernel.attend_add_column_sums(torch.empty_like(q), layout, kc, vc, q, torch.tensor([0, 1]),
                                          torch.tensor([1]), torch.tensor([[0]]),
                                          torch.tensor([True]), 0.125, torch.zeros(h, 4 * bs))


def test_fused_path_follows_the_cpu_and_the_switches(monkeypatch):
    """`cpu_kernel.fused_isa`: bf16 takes AVX-512 BF16 where the CPU has it,
    else AVX2; float32 takes AVX2; other dtypes have no path. The engine
    plans it for vLLM's vec layouts, and its amx one on the amx path.
    VLLM_KVEVICT_CPU_ISA=avx2 forces AVX2; the engine's switch
    (`fused_attention.enabled`) is off under VLLM_KVEVICT_CPU_FUSED=off and
    under VLLM_KVEVICT_KERNELS=torch, which turns the whole kernel off."""
    from vllm_kvevict.integration import fused_attention

    mod = cpu_kernel.module()
    if mod is None:
        pytest.skip("the kernel is not built (scripts/setup.sh builds it)")
    for var in ("VLLM_KVEVICT_CPU_ISA", "VLLM_KVEVICT_KERNELS", "VLLM_KVEVICT_CPU_FUSED"):
        monkeypatch.delenv(var, raising=False)
    assert cpu_kernel.fused_isa(torch.bfloat16) == ("avx512bf16" if mod.supports("avx512bf16") else "avx2")
    assert cpu_kernel.fused_isa(torch.float32) == "avx2"
    assert cpu_kernel.fused_isa(torch.float16) is None
    assert cpu_kernel.fused_pass_runs(torch.float32, 64, 32)
    assert not cpu_kernel.fused_pass_runs(torch.float32, 72, 32)  # head size not a multiple of 16
    assert fused_attention.enabled()
    # the engine plans the pass on vLLM's vec layouts, and on its amx one
    # where the kernel's own path is amx (AMX tiles; not AVX-512 BF16 alone)
    from types import SimpleNamespace
    builder = dict(kv_cache_dtype="auto", dtype=torch.bfloat16, head_dim=64, block_size=32)
    assert fused_attention.reads(SimpleNamespace(isa="vec", **builder))
    assert fused_attention.reads(SimpleNamespace(isa="amx", **builder)) == (cpu_kernel.isa() == "amx")
    if cpu_kernel.isa() == "amx":
        monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", "avx512bf16")
        assert not fused_attention.reads(SimpleNamespace(isa="amx", **builder))
        monkeypatch.delenv("VLLM_KVEVICT_CPU_ISA")
    monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", "avx2")
    assert cpu_kernel.fused_isa(torch.bfloat16) == "avx2"
    monkeypatch.setenv("VLLM_KVEVICT_CPU_FUSED", "off")
    assert not fused_attention.enabled()
    monkeypatch.setenv("VLLM_KVEVICT_CPU_FUSED", "on")
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "torch")
    assert not fused_attention.enabled()
