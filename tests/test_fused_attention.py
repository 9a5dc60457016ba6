"""The fused CPU attention pass (cpu_kernel/fused_attention.h: attention and
H2O's column sums in one pass) against a float64 reference written from the
definitions, and against vLLM's own CPU attention on the same paged cache.

The batch is what a step of vLLM's runner hands the backend: a prefill chunk
over earlier keys, a whole prompt, decode rows and a short chunk, in blocks
scattered over the cache (vLLM's vec layout, discovered from its writer).
Skipped, saying so, where the kernel is not built or the CPU lacks AVX-512
BF16 (the pass is not offered there: `cpu_kernel.fuses_attention`).
"""
import pytest
import torch
from vllm import _custom_ops as ops

from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.layouts.cpu_layout import KVLayout


def _needs_pass():
    mod = cpu_kernel.module()
    if mod is None:
        pytest.skip("the kernel is not built (scripts/setup.sh builds it)")
    if not mod.supports("avx512bf16"):
        pytest.skip("this CPU lacks AVX-512 BF16: the fused pass is not offered")


# (query tokens, physical length) per row: a chunk over 700 keys, a whole
# prompt, two decode rows, a 16-token chunk.
ROWS = [(300, 700), (257, 257), (1, 500), (1, 33), (16, 16)]
SCORED = [True, False, False, True, True]


def _batch(bs, d, h, g, gen, isa="vec", unwritten=float("nan"), rows=ROWS):
    """A step's batch (`rows`) over a paged cache whose slots past each row's
    length hold `unwritten` (NaN: the pass must not read them)."""
    layout = KVLayout.discover(ops.cpu_attn_reshape_and_cache, isa, torch.bfloat16, bs, d, h)
    need = [-(-s // bs) for _, s in rows]
    nb = sum(need) + 7
    kv = torch.full((nb, h, bs, 2 * d), unwritten, dtype=torch.bfloat16)
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
                            torch.randn(h, s, d, generator=gen).bfloat16(),
                            torch.randn(h, s, d, generator=gen).bfloat16())
    starts = torch.tensor([0] + [n for n, _ in rows]).cumsum(0)
    seq = torch.tensor([s for _, s in rows])
    q = (torch.randn(int(starts[-1]), h * g, d, generator=gen) * 2).bfloat16()
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
def test_fused_pass_matches_float64_reference(bs, d, h, g):
    """Output within one bf16 rounding of the float64 attention (the
    float32-accurate contract); column sums of the scored rows to float32
    accuracy, added onto what the slots held; the other rows' slots untouched."""
    _needs_pass()
    gen = torch.Generator().manual_seed(bs + d + h)
    layout, kc, vc, blocks, starts, seq, q = _batch(bs, d, h, g, gen, "vec" if bs % 32 == 0 else "vec16")
    assert cpu_kernel.fuses_attention(layout, torch.bfloat16)
    scale = d ** -0.5
    scores = torch.rand(h, kc.shape[0] * bs, generator=gen)  # earlier steps' sums
    before = scores.clone()
    out = torch.full_like(q, float("nan"))
    qs = q[:, None].expand(-1, 2, -1, -1)[:, 0]  # a strided view, as vLLM's q is
    cpu_kernel.attend_add_column_sums(out, layout, kc, vc, qs, starts, seq, blocks,
                                      torch.tensor(SCORED), scale, scores)
    ref, cols = _reference(layout, kc, vc, blocks, starts, seq, q, scale)
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-6)
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


# A decode step: one query per row, lengths inside a block, at a block's end,
# one past it, and long.
DECODE_ROWS = [(1, 1), (1, 31), (1, 32), (1, 33), (1, 200), (1, 1500)]
DECODE_SCORED = [True, True, False, True, True, True]


@pytest.mark.parametrize("bs,d,h,g", [(32, 64, 3, 3), (32, 64, 2, 7), (16, 128, 1, 12)],
                         ids=["smollm2", "qwen2.5-0.5b", "g12-d128"])
def test_fused_pass_decode_step_matches_float64_reference(bs, d, h, g):
    """A decode-only step (one query a row: the kernel reads keys and values in place, its
    group's heads at most 8 at a time: g 12 is 8 + 4) against float64: output
    within one bf16 rounding, the scored rows' column sums, the others untouched."""
    _needs_pass()
    gen = torch.Generator().manual_seed(g)
    layout, kc, vc, blocks, starts, seq, q = _batch(bs, d, h, g, gen, "vec" if bs % 32 == 0 else "vec16",
                                                    rows=DECODE_ROWS)
    scale = d ** -0.5
    scores = torch.rand(h, kc.shape[0] * bs, generator=gen)
    before = scores.clone()
    out = torch.full_like(q, float("nan"))
    cpu_kernel.attend_add_column_sums(out, layout, kc, vc, q, starts, seq, blocks,
                                      torch.tensor(DECODE_SCORED), scale, scores)
    ref, cols = _reference(layout, kc, vc, blocks, starts, seq, q, scale, rows=DECODE_ROWS)
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-6)
    for i, (_, s) in enumerate(DECODE_ROWS):
        slots = _slots(blocks, i, s, bs)
        added = (scores[:, slots] - before[:, slots]).double()
        if DECODE_SCORED[i]:
            torch.testing.assert_close(added, cols[i], rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(added, torch.zeros_like(added))


def test_fused_pass_agrees_with_vllm_attention():
    """Same paged cache, same batch through vLLM's `cpu_attention_with_kv_cache`
    (its vec path): both are float32 computations rounded to bf16 once, so
    they differ only where a rounding tips, in a small share of the elements,
    and the fused pass is no further from the float64 result than vLLM is."""
    _needs_pass()
    bs, d, h, g = 32, 64, 3, 3
    gen = torch.Generator().manual_seed(7)
    # vLLM's kernel reads a block's unwritten slots (0 x NaN is NaN there): zeros
    layout, kc, vc, blocks, starts, seq, q = _batch(bs, d, h, g, gen, unwritten=0.0)
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
    differ = ours != theirs
    assert differ.float().mean() < 2e-3, float(differ.float().mean())
    ref, _ = _reference(layout, kc, vc, blocks, starts, seq, q, scale)
    err_ours, err_theirs = ((x.double() - ref).abs().max() for x in (ours, theirs))
    assert err_ours <= 1.25 * err_theirs, (float(err_ours), float(err_theirs))


def test_fused_pass_refuses_a_layout_it_cannot_read():
    """vLLM's amx layout keeps values in pairs of tokens: not offered, and the
    kernel itself refuses it rather than read it wrongly."""
    _needs_pass()
    bs, d, h = 32, 64, 2
    tiles_amx = (2, 16, 0, 32, 1, 512, 2)  # vLLM amx's value tiling at D 64
    layout = KVLayout("amx", torch.bfloat16, bs, d, h, None, None, (16, 2, 0, 1024, 2, 32, 1), tiles_amx)
    assert not cpu_kernel.fuses_attention(layout, torch.bfloat16)
    kv = torch.zeros(4, h, bs, 2 * d, dtype=torch.bfloat16)
    kc, vc = layout.split(kv)
    q = torch.zeros(1, h, d, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="vLLM's vec layouts"):
        cpu_kernel.attend_add_column_sums(torch.empty_like(q), layout, kc, vc, q, torch.tensor([0, 1]),
                                          torch.tensor([1]), torch.tensor([[0]]),
                                          torch.tensor([True]), 0.125, torch.zeros(h, 4 * bs))
