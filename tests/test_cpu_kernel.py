"""The compiled CPU scoring kernel (vllm_kvevict/cpu_kernel) against float64
references written from H2O's definition, on both instruction paths.

Every machine runs both paths where its CPU has them: the avx2 path (forced in
production by VLLM_KVEVICT_CPU_ISA=avx2) runs on any x86 CI machine, and the
avx512bf16 one wherever the CPU has AVX-512 BF16 (it is skipped, saying so,
only on a CPU without it). Layouts are built by hand from KVLayout's tile map,
so vLLM's amx, vec and an odd tiling are all read whatever this CPU's writer is.
"""
import os
import subprocess
import sys

import pytest
import torch
from conftest import kernel_isas

from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.scoring import scores
from vllm_kvevict.core.layouts.cpu_layout import KVLayout, split_kv_cache, token_slots
from vllm_kvevict.core.eviction.kernel_dispatch import cpu_kernel_isa, cpu_path

# (T0, D0, base, st1, st0, sd1, sd0) per layout, as KVLayout._fit_tiles finds them.
TILES = {
    "amx": lambda bs, d: (16, 2, 0, 16 * d, 2, 32, 1),  # [BS/16][D/2][16][2]
    "vec": lambda bs, d: (bs, d, 0, 0, 1, 0, bs),       # [D][BS]
    "odd": lambda bs, d: (8, 4, 0, 8 * d, 4, 32, 1),    # [BS/8][D/4][8][4]
    "plain": lambda bs, d: (bs, d, 0, 0, d, 0, 1),      # [BS][D]
}
NB = 40


def _layout(kind, dtype, bs, d, h):
    """A KVLayout with `kind`'s tiling, its map written out from the tiles;
    "scrambled": a random permutation of each block's elements, which no
    tiling fits (the kernel's element-by-element copies)."""
    if kind == "scrambled":
        m = torch.randperm(h * bs * d, generator=torch.Generator().manual_seed(0)).view(h, bs, d)
        return KVLayout(kind, dtype, bs, d, h, m, m, None, None)
    tiles = TILES[kind](bs, d)
    t0, d0, base, st1, st0, sd1, sd0 = tiles
    t, e = torch.arange(bs).view(1, bs, 1), torch.arange(d).view(1, 1, d)
    m = (torch.arange(h).view(h, 1, 1) * bs * d + base + t // t0 * st1 + t % t0 * st0
         + e // d0 * sd1 + e % d0 * sd0)
    return KVLayout(kind, dtype, bs, d, h, m, m, tiles, tiles)


def _cache(kind, dtype, bs, d, h, gen):
    """A paged cache in `kind`'s layout with random keys, and its dense keys
    (NB * BS, H, D) float64."""
    layout = _layout(kind, dtype, bs, d, h)
    kv = torch.full((NB, h, bs, 2 * d), float("nan"), dtype=dtype)  # unwritten = NaN
    kc, vc = split_kv_cache(kv)
    keys = torch.randn(h, NB * bs, d, generator=gen).to(dtype)
    slots = torch.arange(NB * bs).expand(h, -1)
    layout.write_tokens(kc, vc, slots // bs, slots % bs, keys, keys)
    return layout, kc, keys.transpose(0, 1).double()


def _reference(keys, queries, visible, rows, scale, bs):
    """(R, H, M) float64: each query's softmax over its visible keys, summed."""
    r, nq, hq, d = queries.shape
    h = keys.shape[1]
    out = torch.zeros(r, h, rows.shape[1] * bs, dtype=torch.float64)
    for i in range(r):
        slots = (rows[i][:, None] * bs + torch.arange(bs)).flatten()
        for t in range(nq):
            v = int(visible[i, t])
            if v:
                q = queries[i, t].double().view(h, hq // h, d)
                p = (torch.einsum("hgd,vhd->hgv", q, keys[slots[:v]]) * scale).softmax(-1)
                out[i, :, :v] += p.sum(1)
    return out


# The avx512bf16 path takes bf16 caches only (the dispatcher sends others to avx2).
LAYOUTS = {"amx": [("amx", torch.bfloat16), ("vec", torch.bfloat16)],
           "avx512bf16": [("amx", torch.bfloat16), ("vec", torch.bfloat16), ("odd", torch.bfloat16)],
           "avx2": [("amx", torch.bfloat16), ("vec", torch.float32), ("plain", torch.float16)]}


@pytest.mark.parametrize("isa,kind,dtype", [pytest.param(p.values[0], *c, marks=p.marks)
                                            for p in kernel_isas() for c in LAYOUTS[p.values[0]]])
@pytest.mark.parametrize("h,g,d,bs", [(3, 3, 64, 32), (2, 7, 128, 16), (1, 1, 32, 128),
                                      (2, 2, 96, 32)])
def test_column_sums_match_float64(isa, kind, dtype, h, g, d, bs):
    """Ragged rows, padding queries (visible 0), causal and decode-like
    horizons, GQA 1-7, head sizes 32-128, blocks 16-128; unwritten cache
    slots hold NaN and must not leak in. bf16 on the avx512bf16 path and
    every dtype on avx2 are float32-accurate: 2e-6 relative to float64."""
    gen = torch.Generator().manual_seed(h * 100 + g * 10 + d)
    layout, kc, keys = _cache(kind, dtype, bs, d, h, gen)
    nblk = -(-300 // bs)
    rows = torch.stack([torch.randperm(NB, generator=gen)[:nblk] for _ in range(3)])
    visible = torch.tensor([[290, 291, 292, 293, 294, 295, 296, 297, 298, 299, 300],  # causal tail
                            [1, 17, 0, 0, 0, 0, 0, 0, 0, 0, 0],                        # padding
                            [255, 255, 255, 255, 256, 256, 256, 256, 257, 0, 300]])
    queries = (torch.randn(3, 11, h * g, d, generator=gen) * 2).to(dtype)
    got = cpu_kernel.column_sums(layout, kc, queries, visible, rows, d ** -0.5, isa)
    want = _reference(keys, queries, visible, rows, d ** -0.5, bs)
    assert got.dtype == torch.float32 and not got.isnan().any()
    err = (got.double() - want).norm() / want.norm()
    assert err < 2e-6, err
    assert got[:, :, 300:].abs().max() == 0  # nothing past the widest horizon
    # each real query's softmax sums to one per query head
    assert got.sum().item() == pytest.approx((visible > 0).sum().item() * h * g, rel=1e-5)


@pytest.mark.parametrize("isa", kernel_isas())
def test_kept_sets_equal_float64s_at_a_flush_shape(isa):
    """What eviction uses: the top-64 of 192 keys per (row, head) after a
    32-query decode flush is the same set as float64's."""
    gen = torch.Generator().manual_seed(7)
    layout, kc, keys = _cache("amx", torch.bfloat16, 32, 64, 3, gen)
    rows = torch.stack([torch.randperm(NB, generator=gen)[:6] for _ in range(9)])
    visible = torch.arange(161, 193).expand(9, -1).contiguous()
    queries = (torch.randn(9, 32, 9, 64, generator=gen) * 3).bfloat16()
    got = cpu_kernel.column_sums(layout, kc, queries, visible, rows, 0.125, isa)
    want = _reference(keys, queries, visible, rows, 0.125, 32)
    same = [set(got[i, j].topk(64).indices.tolist()) == set(want[i, j].topk(64).indices.tolist())
            for i in range(9) for j in range(3)]
    assert all(same), f"{sum(same)}/27 sets equal"


def test_score_queries_runs_the_kernel_and_agrees_with_the_torch_path(monkeypatch):
    """The production entry (core/scores.score_queries) goes through the kernel
    by default, which adds into the score slots itself (into a strided view, as
    a layer's rows of a stack's scores are), and its per-slot scores equal the
    torch path's; nothing outside the view is touched."""
    if cpu_kernel.module() is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    gen = torch.Generator().manual_seed(3)
    layout, kc, _ = _cache("vec", torch.bfloat16, 32, 64, 3, gen)
    rows = torch.stack([torch.randperm(NB, generator=gen)[:4] for _ in range(2)])
    visible = torch.tensor([[100, 101, 102], [60, 0, 0]])
    queries = torch.randn(2, 3, 9, 64, generator=gen).bfloat16()
    calls = []
    real = cpu_kernel.add_column_sums
    monkeypatch.setattr(cpu_kernel, "add_column_sums", lambda *a: calls.append(a[-1]) or real(*a))
    stack = torch.zeros(3, 2 * NB * 32)
    got = stack[:, NB * 32:]
    scores.score_queries(got, layout, kc, queries, visible, rows, 0.125)
    assert stack[:, :NB * 32].abs().max() == 0
    assert calls == [cpu_kernel.isa()]  # no shared blocks: the kernel adds into the slots
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "torch")
    want = torch.zeros(3, NB * 32)
    scores.score_queries(want, layout, kc, queries, visible, rows, 0.125)
    assert len(calls) == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_dispatcher_honours_the_forced_path_and_dtypes(monkeypatch):
    if cpu_kernel.module() is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    layout = _layout("vec", torch.bfloat16, 32, 64, 3)
    kc = torch.zeros(2, 3, 32, 64, dtype=torch.bfloat16)
    q16, q32 = torch.zeros(1, 1, 9, 64, dtype=torch.bfloat16), torch.zeros(1, 1, 9, 64)
    monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", "avx2")
    assert cpu_kernel_isa(q16, kc, layout) == "avx2"
    assert cpu_path() == "cpu-kernel avx2"
    monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", "auto")
    best = cpu_kernel.isa()
    assert cpu_kernel_isa(q16, kc, layout) == best
    assert cpu_kernel_isa(q32, kc, layout) == "avx2"  # float32 queries: the float32 path
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "torch")
    assert cpu_kernel_isa(q16, kc, layout) is None
    assert cpu_path().startswith("torch (VLLM_KVEVICT_KERNELS=torch)")
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "auto")
    monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", "sse")
    with pytest.raises(ValueError, match="VLLM_KVEVICT_CPU_ISA"):
        cpu_kernel.isa()


def test_without_a_build_the_torch_path_runs_and_says_why(tmp_path):
    """A kernel cache with nothing built for this source: serving does not
    compile, it scores in torch and path() tells how to build."""
    code = ("import torch; from vllm_kvevict import cpu_kernel as c; "
            "from vllm_kvevict.core.eviction import kernel_dispatch as kd; from vllm_kvevict.core.eviction.kernel_dispatch import cpu_kernel_isa; "
            "from vllm_kvevict.core.layouts.cpu_layout import KVLayout; "
            "l = KVLayout('vec', torch.bfloat16, 32, 64, 1, None, None, (32, 64, 0, 0, 1, 0, 32), None); "
            "print(c.module() is None, cpu_kernel_isa(torch.zeros(1), torch.zeros(1), l)); print(kd.cpu_path())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "VLLM_KVEVICT_KERNEL_CACHE": str(tmp_path)})
    first, second = out.stdout.splitlines()
    assert first == "True None"
    assert second.startswith("torch (the CPU kernel is not built") and "setup.sh" in second


def test_bad_block_ids_are_refused_not_read():
    if cpu_kernel.module() is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    layout = _layout("vec", torch.float32, 32, 64, 1)
    kc, _ = split_kv_cache(torch.zeros(4, 1, 32, 128))
    q = torch.zeros(1, 1, 1, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernel.column_sums(layout, kc, q, torch.tensor([[10]]), torch.tensor([[4]]), 1.0, "avx2")
    with pytest.raises(RuntimeError, match="sees past"):
        cpu_kernel.column_sums(layout, kc, q, torch.tensor([[33]]), torch.tensor([[0]]), 1.0, "avx2")


def test_a_second_build_reuses_the_first():
    if cpu_kernel.module() is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    out = subprocess.run([sys.executable, "-m", "vllm_kvevict.cpu_kernel", "build"],
                         capture_output=True, text=True, check=True, timeout=120)
    assert "already built" in out.stdout


@pytest.mark.parametrize("env", [{}, {"VLLM_KVEVICT_KERNELS": "torch"}, {"VLLM_KVEVICT_CPU_FUSED": "off"}],
                         ids=["auto", "torch", "fused-off"])
def test_info_names_the_scoring_and_fused_paths(env):
    out = subprocess.run([sys.executable, "-m", "vllm_kvevict.cpu_kernel", "info"],
                         capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, **env}).stdout.splitlines()
    off = bool(env) or cpu_path().startswith("torch")
    torch_only = "VLLM_KVEVICT_KERNELS" in env
    assert out[0] == ("torch (VLLM_KVEVICT_KERNELS=torch)" if torch_only else cpu_path())
    want = {d: None if off else cpu_kernel.fused_isa(t)
            for d, t in (("bf16", torch.bfloat16), ("float32", torch.float32))}
    assert out[1] == "fused attention + H2O: " + ", ".join(f"{d} {p or 'none'}" for d, p in want.items())


@pytest.mark.parametrize("isa", kernel_isas())
def test_snapkv_window_sums_match_float64(isa):
    """SnapKV's window through the kernel (dense keys cut into 16-token blocks,
    n not a multiple of 16) against the torch window attention in float64."""
    from vllm_kvevict.core.scoring.window_scores import raw_scores_torch

    gen = torch.Generator().manual_seed(11)
    dtype = torch.float32 if isa == "avx2" else torch.bfloat16
    q = torch.randn(3, 32, 9, 64, generator=gen).to(dtype)
    k, v = (torch.randn(3, 3, 203, 64, generator=gen).to(dtype) for _ in range(2))
    got = cpu_kernel.window_column_sums(q, k, 0.125, isa)
    want = raw_scores_torch(q.double(), k.double(), v.double(), 0.125)
    assert got.shape == (3, 3, 203)
    assert (got.double() - want).norm() / want.norm() < 2e-6


# Two rows (layers of a layer stack) of five blocks each, for the token copies.
SRC_ROWS = torch.tensor([[2, 5, 9, 11, 30], [14, 3, 17, 20, 31]])


def _token_cache(kind, dtype, seed):
    """(the compiled module, a `kind` layout with BS 32, D 64, H 3, a random
    paged cache of NB blocks in it, the generator that made it) for the tests
    of the kernel's token copies; fails if the kernel is not built."""
    mod = cpu_kernel.module()
    if mod is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    bs, d, h = 32, 64, 3
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(NB, h, bs, 2 * d, generator=gen).to(dtype)
    return mod, _layout(kind, dtype, bs, d, h), kv, gen


@pytest.mark.parametrize("kind", ["amx", "vec", "odd", "scrambled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("copy_on_write", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_token_moves_equal_the_torch_path(kind, dtype, copy_on_write, threads,
                                                   monkeypatch, torch_threads):
    """fill_holes through the kernel's move_tokens/copy_blocks leaves the cache,
    the scores and the returned slot order bit-identical to the torch path
    (test_fill_holes holds both to the ordered reference on vLLM's layouts),
    on one thread and split across two (~300 moves: two tasks)."""
    from vllm_kvevict.core.eviction.compaction import fill_holes

    torch_threads(threads)
    mod, layout, kv, gen = _token_cache(kind, dtype, seed=11)
    bs, h = layout.block_size, layout.num_kv_heads
    scores = torch.rand(h, NB * bs, generator=gen)
    src = SRC_ROWS.clone()
    dst = src[:, :3].clone()
    if copy_on_write:  # both rows' first blocks shared: private copies
        dst[:, 0] = torch.tensor([35, 36])
    old_len, new_len = 4 * bs + 7, 2 * bs + 9
    keep = torch.stack([torch.randperm(old_len, generator=gen)[:new_len] for _ in range(2 * h)])
    keep = keep.view(2, h, new_len)
    calls = []
    for name in ("move_tokens", "copy_blocks"):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    results = []
    for mode in ("auto", "torch"):
        monkeypatch.setenv("VLLM_KVEVICT_KERNELS", mode)
        c, sc = kv.clone(), scores.clone()
        after = fill_holes(layout, *split_kv_cache(c), src, dst, keep, old_len, sc)
        results.append((c, sc, after))
    assert calls == ["copy_blocks", "move_tokens"] if copy_on_write else ["move_tokens"]
    (c1, s1, a1), (c2, s2, a2) = results
    assert not torch.equal(c1, kv)  # something moved
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))
    assert torch.equal(s1, s2) and torch.equal(a1, a2)


@pytest.mark.parametrize("kind", ["amx", "vec", "odd", "scrambled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reordered", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_token_reads_equal_the_torch_gather(kind, dtype, reordered, threads,
                                                     torch_threads):
    """read_tokens (a compaction's K and V for the window policies, oldest
    first: recorders.StackContext) returns exactly what the layout's block
    gather followed by the age order (compaction.by_age) returns, for two
    layers of a layer stack, with and without an earlier compaction's order,
    on one thread and split across two (one task per (layer, head))."""
    from vllm_kvevict.core.eviction.compaction import by_age

    torch_threads(threads)

    mod, layout, kv, gen = _token_cache(kind, dtype, seed=5)
    bs, d, h = layout.block_size, layout.head_size, layout.num_kv_heads
    kc, vc = split_kv_cache(kv)
    src_rows = SRC_ROWS
    n = 4 * bs + 7
    src_slots = token_slots(src_rows, n, bs)  # (L, n)
    rows = (torch.stack([torch.randperm(n, generator=gen) for _ in range(2 * h)]).view(2, h, n)
            if reordered else None)
    slots = (src_slots[:, None].expand(-1, h, -1) if rows is None
             else src_slots.gather(1, rows.flatten(1)).view_as(rows))
    for cache, offsets, gather in ((kc, layout.element_offsets(kc, vc)[0], layout.gather_keys),
                                   (vc, layout.element_offsets(kc, vc)[1], layout.gather_values)):
        got = mod.read_tokens(cache, offsets, slots.contiguous())
        want = by_age(gather(cache, src_rows, src_rows.shape[1])[:, :, :n], rows)
        assert got.shape == (2, h, n, d) and got.dtype == dtype
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outside the cache"):
        mod.read_tokens(kc, layout.element_offsets(kc, vc)[0],
                        torch.full((1, h, 1), NB * bs, dtype=torch.long))


PAGED_PROJECTION_CASES = [  # (path, cache dtype): the bf16 paths take bf16; avx2 any dtype
    (isa, dtype) for isa in ("amx", "avx512bf16", "avx2")
    for dtype in ((torch.bfloat16,) if isa != "avx2" else (torch.bfloat16, torch.float32))]


@pytest.mark.parametrize("isa,dtype", [pytest.param(i, d, marks=p.marks)
                                       for p in kernel_isas() for i, d in PAGED_PROJECTION_CASES
                                       if i == p.values[0]],
                         ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("kind", ["amx", "vec", "scrambled"])
@pytest.mark.parametrize("reordered", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_projection_reads_keys_and_values_in_place_as_from_read_tokens(
        isa, dtype, kind, reordered, threads, torch_threads):
    """window_projection_paged (AnDPro's window scores, K and V read in place
    from the paged cache: recorders.StackContext.window_value_projection)
    returns the bits window_projection_sums returns on read_tokens' K and V,
    for two layer rows of a stack, with and without an earlier compaction's
    order (slots out of age order), on every layout and path, one thread
    and two."""
    torch_threads(threads)
    mod, layout, kv, gen = _token_cache(kind, dtype, seed=13)
    bs, d, h = layout.block_size, layout.head_size, layout.num_kv_heads
    kc, vc = split_kv_cache(kv)
    n, w, g = 4 * bs + 7, 16, 3
    src_slots = token_slots(SRC_ROWS, n, bs)  # (L, n)
    rows = (torch.stack([torch.randperm(n, generator=gen) for _ in range(2 * h)]).view(2, h, n)
            if reordered else None)
    slots = (src_slots[:, None].expand(-1, h, -1) if rows is None
             else src_slots.gather(1, rows.flatten(1)).view_as(rows)).contiguous()
    q = torch.randn(2, w, h * g, d, generator=gen).to(dtype)
    k_off, v_off = layout.element_offsets(kc, vc)
    k, v = mod.read_tokens(kc, k_off, slots), mod.read_tokens(vc, v_off, slots)
    for split in (True, False):
        want = cpu_kernel.window_projection_sums(q, k, v, 0.125, isa, split=split)
        got = cpu_kernel.window_projection_paged(layout, kc, vc, q, slots, 0.125, isa, split=split)
        assert got.shape == (2, h, n) and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernel.window_projection_paged(layout, kc, vc, q, torch.full_like(slots, NB * bs),
                                           0.125, isa)


def test_bad_moves_are_refused_before_anything_is_written():
    mod = cpu_kernel.module()
    if mod is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    layout = _layout("amx", torch.bfloat16, 32, 64, 2)
    kv = torch.randn(4, 2, 32, 128).to(torch.bfloat16)
    before = kv.clone()
    kc, vc = split_kv_cache(kv)
    offsets = layout.element_offsets(kc, vc)
    ok, bad = torch.tensor([0, 1]), torch.tensor([1, 4])  # block 4 of 4
    with pytest.raises(RuntimeError, match="outside the cache"):
        mod.move_tokens(kc, vc, *offsets, ok, ok, bad, ok, ok, None)
    with pytest.raises(RuntimeError, match="outside the cache"):
        mod.copy_blocks(kc, vc, ok, bad)
    assert torch.equal(kv, before)


def test_logged_queries_land_where_the_torch_path_puts_them(monkeypatch):
    """The query logs' store (QueryBuffers) through the kernel's copy_rows, held
    by reference and stored for every layer in one call at the first read,
    equals index_copy_ at once, for strided query views like vLLM's (slices of
    the fused qkv output); a cell outside the buffer is refused."""
    from vllm_kvevict.core.scoring.decode_log import StepPlacement
    from vllm_kvevict.core.scoring.query_buffers import QueryBuffers

    mod = cpu_kernel.module()
    if mod is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    gen = torch.Generator().manual_seed(3)
    qkv = [torch.randn(6, 15 * 64, generator=gen).to(torch.bfloat16) for _ in range(3)]
    queries = [x[:, : 9 * 64].view(6, 9, 64) for x in qkv]  # row stride 960, not 576
    calls = []
    real = mod.copy_rows
    monkeypatch.setattr(mod, "copy_rows", lambda *a: calls.append(len(a[0])) or real(*a))
    got = {}
    for mode in ("auto", "torch"):
        monkeypatch.setenv("VLLM_KVEVICT_KERNELS", mode)
        # the path is looked up once per step, when the placement is made
        placement = StepPlacement(torch.arange(6), torch.tensor([3, 40, 7, 12, 63, 0]))
        bufs = QueryBuffers(cols=32)
        for i, q in enumerate(queries):
            bufs.hold(f"layer.{i}", q, placement, rows=2, scale=0.125)
        got[mode] = torch.stack([bufs[f"layer.{i}"] for i in range(3)])
    assert calls == [3]  # one call, every layer
    assert got["auto"].abs().sum() > 0 and torch.equal(got["auto"], got["torch"])
    with pytest.raises(RuntimeError, match="outside dst"):
        real([got["auto"][0].view(-1, 9 * 64)], torch.tensor([64 * 8]), [queries[0][:1].flatten(1)])


@pytest.fixture
def torch_threads():
    """Set torch's intra-op thread count for one test, then put it back.
    torch._C's function, not torch.set_num_threads: vLLM's CPU worker replaces
    that with a no-op once it has bound its threads, and an in-process engine
    may have run earlier in this test process."""
    before = torch.get_num_threads()
    yield torch._C.set_num_threads
    torch._C.set_num_threads(before)


def test_the_kernel_runs_its_tasks_on_torchs_threads(torch_threads):
    """at::parallel_for is a header template: compiled without OpenMP it runs
    every task on the calling thread, whatever torch's thread count (the
    kernel did, until cpu_kernel.CFLAGS got -fopenmp). vLLM's CPU worker sets
    torch's count to the cores it binds, so the kernel must follow it."""
    if cpu_kernel.module() is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    for n in (1, 2, 3):
        torch_threads(n)
        assert cpu_kernel.module().parallel_threads() == n


@pytest.mark.parametrize("isa", kernel_isas())
def test_threads_change_no_bit_of_the_scores(isa, torch_threads):
    """Each task writes its own output and the split sums are added in a fixed
    order, so at the engine's shapes (at least 8 (row, head) tasks: one split
    on 1 or 2 threads) 1 and 2 threads give the same bits, for H2O's column
    sums and AnDPro's window projection."""
    gen = torch.Generator().manual_seed(11)
    layout, kc, _ = _cache("amx" if isa != "avx2" else "vec", torch.bfloat16, 32, 64, 3, gen)
    rows = torch.stack([torch.randperm(NB, generator=gen)[:6] for _ in range(9)])
    visible = torch.arange(161, 193).expand(9, -1).contiguous()
    queries = (torch.randn(9, 32, 9, 64, generator=gen) * 3).bfloat16()
    q = torch.randn(4, 8, 9, 64, generator=gen).bfloat16()
    k, v = (torch.randn(4, 3, 200, 64, generator=gen).bfloat16() for _ in range(2))
    got = {}
    for n in (1, 2):
        torch_threads(n)
        assert cpu_kernel.module().parallel_threads() == n
        got[n] = (cpu_kernel.column_sums(layout, kc, queries, visible, rows, 0.125, isa),
                  cpu_kernel.window_projection_sums(q, k, v, 0.125, isa))
    assert torch.equal(got[1][0], got[2][0])
    assert torch.equal(got[1][1], got[2][1])
    assert got[1][0].abs().sum() > 0 and got[1][1].abs().sum() > 0
