"""Every Triton kernel against its plain-torch reference, on CPU under
TRITON_INTERPRET=1 (fp32, and fp16 for the native-dtype dot path): GQA ratios 1/3/7, block sizes 16/32/128, ragged
lengths, single-token and empty requests, and the strided NHD cache views the
CUDA backend hands over (`NHDLayout.split` of vLLM's [NB, H, BS, 2D] cache)."""
import importlib
import math
from types import SimpleNamespace

import pytest
import torch

from vllm_kvevict.core.layouts.nhd_layout import NHDLayout
from vllm_kvevict.core.policies import POLICIES, Record, make_policy
from vllm_kvevict.core.scoring.window_scores import raw_scores_torch

D = 32


@pytest.fixture
def tk():
    """The kernel modules (on CPU, conftest turned the Triton interpreter on)."""
    names = ["paged_attention", "window", "compaction", "partial_attention", "reference"]
    return SimpleNamespace(**{n: importlib.import_module(f"vllm_kvevict.triton_kernels.{n}")
                              for n in names})


def nhd_cache(num_blocks, bs, h, d=D, seed=0, dtype=torch.float32):
    """vLLM's FlashAttention layer cache and its (key, value) views, each (NB, BS, H, D)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, h, bs, 2 * d, generator=g).to(dtype)
    layout = NHDLayout.for_cache(kv)
    return layout, *layout.split(kv)


# ----------------------------------------------------------------- paged attention + scores

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # fp16: P is rounded before P @ V


@pytest.mark.parametrize("gqa,bs", [(1, 16), (3, 32), (7, 128), (3, 16)])
@pytest.mark.parametrize("write_out", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_scores_matches_reference(tk, gqa, bs, write_out, dtype):
    h = 2
    lengths = [0, 1, bs - 1, bs, 2 * bs + 5, 77]  # empty, single token, ragged
    max_blocks = max(math.ceil(n / bs) for n in lengths) + 1
    num_blocks = len(lengths) * max_blocks + 3
    layout, kc, vc = nhd_cache(num_blocks, bs, h, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    # Rows own scattered, non-contiguous blocks.
    block_table = torch.randperm(num_blocks, generator=g)[: len(lengths) * max_blocks]
    block_table = block_table.view(len(lengths), max_blocks).int()
    # Decode queries of every row, plus a second query on row 4 (two queries, one request).
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 4])
    visible = torch.tensor(lengths + [lengths[4] - 3])
    query = torch.randn(len(rows), h * gqa, D, generator=g).to(dtype)
    weight = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])  # row 3 unscored
    scores = torch.rand(h, num_blocks * bs, generator=g)
    expected_out, delta = tk.reference.paged_attention_scores_ref(
        query, kc, vc, block_table, rows, visible, 0.3, weight)
    got_scores = scores.clone()
    out = tk.paged_attention.paged_attention_scores(
        query, kc, vc, block_table, rows, visible, 0.3, scores=got_scores,
        score_weight=weight, write_out=write_out)
    tol = TOL[dtype]
    torch.testing.assert_close(got_scores, scores + delta, rtol=tol, atol=tol)
    if write_out:
        torch.testing.assert_close(out.float(), expected_out, rtol=tol, atol=tol)
    else:
        assert out is None
    # Exactly the slots the queries see changed.
    seen = torch.zeros_like(scores, dtype=torch.bool)
    for r, n in zip(rows.tolist(), visible.tolist()):
        if weight[rows.tolist().index(r)]:
            seen[:, tk.reference.slots_of(block_table[r], n, bs)] = True
    assert torch.equal(got_scores != scores, seen & (delta != 0))


def test_paged_attention_without_scores_and_bad_input(tk):
    layout, kc, vc = nhd_cache(8, 16, 1)
    bt = torch.arange(8).view(2, 4).int()
    q = torch.randn(2, 3, D)
    out = tk.paged_attention.paged_attention_scores(q, kc, vc, bt, torch.tensor([0, 1]),
                                                    torch.tensor([40, 9]), 0.2)
    ref, _ = tk.reference.paged_attention_scores_ref(q, kc, vc, bt, torch.tensor([0, 1]),
                                                     torch.tensor([40, 9]), 0.2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    f = tk.paged_attention.paged_attention_scores
    with pytest.raises(ValueError, match="multiple of"):
        f(torch.randn(2, 3, D), *nhd_cache(8, 16, 2)[1:], bt, torch.tensor([0, 1]),
          torch.tensor([4, 4]), 0.2)
    with pytest.raises(ValueError, match="power of two"):
        f(q, *nhd_cache(8, 24, 1)[1:], bt, torch.tensor([0, 1]), torch.tensor([4, 4]), 0.2)
    with pytest.raises(ValueError, match="visible"):
        f(q, kc, vc, bt, torch.tensor([0, 1]), torch.tensor([4]), 0.2)
    with pytest.raises(ValueError, match="block-table rows hold 64"):
        f(q, kc, vc, bt, torch.tensor([0, 1]), torch.tensor([4, 65]), 0.2)
    with pytest.raises(ValueError, match="scores"):
        f(q, kc, vc, bt, torch.tensor([0, 1]), torch.tensor([4, 4]), 0.2,
          scores=torch.zeros(1, 8 * 16, dtype=torch.float64))


# ----------------------------------------------------------------- window scores

@pytest.mark.parametrize("projection", [False, True], ids=["attention", "projection"])
@pytest.mark.parametrize("gqa,w,n,dtype", [(1, 1, 1, torch.float32), (3, 8, 50, torch.float32),
                                           (7, 32, 130, torch.float32),
                                           (3, 32, 32, torch.float32), (3, 8, 70, torch.float16)])
def test_window_scores_match_torch_path(tk, projection, gqa, w, n, dtype):
    g = torch.Generator().manual_seed(2)
    h = 2
    q = torch.randn(2, w, h * gqa, D, generator=g).to(dtype)
    # Strided k/v: the first n tokens of a longer gathered buffer, as the worker passes them.
    k = torch.randn(2, h, n + 7, D, generator=g).to(dtype)[:, :, :n]
    v = torch.randn(2, h, n + 7, D, generator=g).to(dtype)[:, :, :n]
    got = tk.window.window_raw_scores(q, k, v, 0.25, projection=projection)
    want = raw_scores_torch(q.float(), k.float(), v.float(), 0.25, projection)
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_window_scores_reject_bad_input(tk):
    q, k = torch.randn(1, 8, 2, D), torch.randn(1, 2, 4, D)
    with pytest.raises(ValueError, match="window 8"):
        tk.window.window_raw_scores(q, k, k, 0.1)
    with pytest.raises(ValueError, match="projection must be a bool"):
        tk.window.window_raw_scores(q, k, k, 0.1, projection="andpro")


# ----------------------------------------------------------------- compaction

def plan_slots(src_blocks, dst_blocks, old_len, bs):
    pos = torch.arange(old_len)
    src = src_blocks[:, pos // bs] * bs + pos % bs
    full = torch.arange(dst_blocks.shape[1] * bs)
    return src, dst_blocks[:, full // bs] * bs + full % bs


@pytest.mark.parametrize("bs,old_len,new_len", [(16, 100, 37), (32, 64, 64), (128, 300, 129),
                                                (16, 1, 1), (16, 40, 0)])
@pytest.mark.parametrize("copy_on_write", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compaction_in_place_matches_reference(tk, bs, old_len, new_len, copy_on_write, dtype):
    h, rows = 3, 2  # rows: e.g. two layers of one request
    n_src, n_dst = math.ceil(old_len / bs), math.ceil(new_len / bs)
    num_blocks = rows * n_src + rows * n_dst + 2
    layout, kc, vc = nhd_cache(num_blocks, bs, h, seed=3, dtype=dtype)
    g = torch.Generator().manual_seed(4)
    perm = torch.randperm(num_blocks, generator=g)
    src_blocks = perm[: rows * n_src].view(rows, n_src)
    dst_blocks = src_blocks[:, :n_dst].clone()  # in place: the row keeps its first blocks
    if copy_on_write and n_dst:  # a shared kept block gets a private copy
        dst_blocks[:, 0] = perm[rows * n_src: rows * n_src + rows]
    keep = torch.stack([torch.stack([torch.randperm(old_len, generator=g)[:new_len].sort().values
                                     for _ in range(h)]) for _ in range(rows)])  # (R, H, new)
    scores = torch.rand(h, num_blocks * bs, generator=g)
    src, dst = plan_slots(src_blocks, dst_blocks, old_len, bs)

    want_k, want_v, want_s = kc.clone(), vc.clone(), scores.clone()
    tk.reference.compact_ref(layout, want_k, want_v, want_s, src, dst, keep)
    tk.compaction.compact_in_place(kc, vc, scores, src, dst, keep)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v) and torch.equal(scores, want_s)



def test_compaction_moves_nothing_else_and_rejects_bad_input(tk):
    layout, kc, vc = nhd_cache(6, 16, 2, seed=5)
    before = kc.clone()
    src, dst = plan_slots(torch.tensor([[4, 1]]), torch.tensor([[4]]), 20, 16)
    keep = torch.arange(10).expand(1, 2, 10) * 2  # every other token
    tk.compaction.compact_in_place(kc, vc, None, src, dst, keep)
    untouched = [b for b in range(6) if b != 4]
    assert torch.equal(kc[untouched], before[untouched])
    assert torch.equal(kc[4, :10], torch.cat([before[4, 0:16:2], before[1, 0:4:2]]))
    assert not kc[4, 10:].any()  # the rest of the last destination block is zeroed
    with pytest.raises(ValueError, match="whole blocks"):
        tk.compaction.compact_in_place(kc, vc, None, src, dst[:, :10], keep)
    with pytest.raises(ValueError, match="heads"):
        tk.compaction.compact_in_place(kc, vc, None, src, dst, keep[:, :1])


# ----------------------------------------------------------------- partial attention

@pytest.mark.parametrize("gqa", [1, 3, 7])
def test_partial_attention_matches_reference(tk, gqa):
    g = torch.Generator().manual_seed(6)
    h, n = 2, 150
    q = torch.randn(4, h * gqa, 64, generator=g)
    k = torch.randn(4, h, n, 64, generator=g)
    cols = torch.randperm(64, generator=g)[:19]  # 30% of the channels
    lengths = torch.tensor([150, 0, 1, 77])
    logits, counts = tk.partial_attention.partial_attention(q, k, cols, lengths, 4.0, 0.125)
    ref_logits, ref_counts = tk.reference.partial_attention_ref(q, k, cols, lengths, 4.0, 0.125)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(counts, ref_counts)


def test_speculated_tokens_take_the_mean_count_per_head_capped(tk):
    logits = torch.tensor([[[5.0, 1.0, 4.0, 0.0], [0.0, 9.0, 8.0, 7.0]],
                           [[1.0, 2.0, -1.0, float("-inf")], [3.0, 0.0, 1.0, float("-inf")]]])
    counts = torch.tensor([[2, 3], [1, 1]])
    picked = tk.partial_attention.speculated_tokens(logits, counts, torch.tensor([4, 3]))
    assert picked[0].tolist() == [[0, 2, 1], [1, 2, 3]]  # ceil(2.5) = 3 per head
    assert picked[1].tolist() == [[1], [0]]
    capped = tk.partial_attention.speculated_tokens(logits, counts, torch.tensor([4, 3]), 0.25)
    assert [p.shape[1] for p in capped] == [1, 1]
    empty = tk.partial_attention.speculated_tokens(logits[:, :, :0], counts * 0, torch.tensor([0, 0]))
    assert [p.shape for p in empty] == [torch.Size([2, 0])] * 2


# ----------------------------------------------------------------- where they run

def test_dispatch_is_one_switch(monkeypatch):
    from vllm_kvevict.core.eviction import kernel_dispatch as kernels
    from vllm_kvevict.core.layouts.cpu_layout import KVLayout

    nhd = NHDLayout(16, 2, 64, torch.float16)
    x = torch.zeros(1)
    monkeypatch.delenv("VLLM_KVEVICT_KERNELS", raising=False)
    assert not kernels.use_triton(x) and not kernels.use_triton(x, nhd)  # auto, CPU tensor
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "triton")
    assert kernels.use_triton(x) and kernels.use_triton(x, nhd)
    assert not kernels.use_triton(x, NHDLayout(8, 2, 64, torch.float16))  # block < one tile
    cpu_layout = object.__new__(KVLayout)  # the ISA-packed CPU cache: never the kernels
    assert not kernels.use_triton(x, cpu_layout)
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "torch")
    assert not kernels.use_triton(x, nhd)
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "cuda")
    with pytest.raises(ValueError, match="VLLM_KVEVICT_KERNELS"):
        kernels.use_triton(x)


@pytest.mark.parametrize("name", [n for n, p in POLICIES.items() if p.records is Record.QUERIES])
def test_window_policy_scores_through_the_kernel_when_chosen(tk, monkeypatch, name):
    policy = make_policy(name, window=8)
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(1, 8, 6, D, generator=g), *torch.randn(2, 1, 2, 40, D, generator=g)
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "torch")
    want = policy.scores(q, k, v, 0.2, recent=8)
    calls = []
    kernel = tk.window.window_raw_scores
    monkeypatch.setattr(tk.window, "window_raw_scores",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "triton")
    torch.testing.assert_close(policy.scores(q, k, v, 0.2, recent=8), want,
                               rtol=1e-4, atol=1e-5)
    assert calls == [1]


def test_kernel_benchmark_runs_on_cpu(tk, capsys):
    """benchmarks/kernels.py (the GPU benchmark) on tiny shapes: it checks
    every kernel against its reference before timing it."""
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels.py"
    rows = runpy.run_path(str(path))["main"](["--smoke", "--device", "cpu"])
    assert len(rows) == 7 and all(r[5] < 1e-4 for r in rows)  # max error per kernel
    assert "| compaction in place |" in capsys.readouterr().out
