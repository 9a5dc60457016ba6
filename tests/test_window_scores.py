"""SnapKV / AnDPro scores: the batched path against the loop reference, and the
query ring that feeds them."""

import pytest
import torch
from window_reference import keep, selection_scores, token_scores

from vllm_kvevict.core.policies import POLICIES, WindowPolicy, make_policy
from vllm_kvevict.core.scoring.query_window import QueryWindow
from vllm_kvevict.core.scoring.window_scores import attention_sums, value_projection

# Every registered policy scored by an observation window (its raw scores and
# the loop reference's `kind` share the policy's name).
WINDOW_POLICIES = [n for n, p in POLICIES.items() if issubclass(p, WindowPolicy)]


@pytest.mark.parametrize("kind", WINDOW_POLICIES)
@pytest.mark.parametrize("h,g,w,n", [(1, 1, 4, 9), (3, 3, 8, 45), (2, 7, 32, 70),
                                     (2, 3, 32, 32), (1, 2, 5, 6)])
def test_batched_scores_equal_the_loop_reference(kind, h, g, w, n):
    torch.manual_seed(h * 100 + n)
    b, d, scale = 2, 16, 0.25
    q = torch.randn(b, w, h * g, d)
    k, v = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    got = make_policy(kind, window=w).scores(q, k, v, scale)
    assert got.shape == (b, h, n)
    for r in range(b):
        for head in range(h):
            raw = token_scores(kind, q[r, :, head * g:(head + 1) * g], k[r, head], v[r, head],
                               scale)
            want = selection_scores(raw, w)
            torch.testing.assert_close(got[r, head].double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", WINDOW_POLICIES)
def test_policy_keeps_window_first_token_and_the_reference_choice(kind):
    torch.manual_seed(1)
    h, g, w, n, budget, recent = 3, 3, 8, 60, 24, 12
    q = torch.randn(1, w, h * g, 16)
    k, v = torch.randn(1, h, n, 16), torch.randn(1, h, n, 16)
    policy = make_policy(kind, window=w)
    kept = policy.select(policy.scores(q, k, v, 0.25)[0], budget, recent)
    for head in range(h):
        raw = token_scores(kind, q[0, :, head * g:(head + 1) * g], k[0, head], v[0, head], 0.25)
        sel = selection_scores(raw, w)
        want = keep(sel, budget, recent)
        # Tokens of one chunk tie: where the cut splits a chunk, either may stay.
        assert sorted(sel[kept[head]].tolist()) == sorted(sel[want].tolist())
        got = kept[head].tolist()
        assert 0 in got and all(i in got for i in range(n - recent, n))


def test_andpro_differs_from_snapkv_on_values_that_cancel():
    """Two tokens with equal attention: AnDPro prefers the one whose value points
    along the output y, SnapKV cannot tell them apart."""
    d = 4
    k = torch.zeros(1, 1, 6, d)  # equal logits: uniform attention
    v = torch.zeros(1, 1, 6, d)
    v[0, 0, :, 0] = 1.0  # everything points along e0 ...
    v[0, 0, 2, 0] = -1.0  # ... except token 2
    q = torch.zeros(1, 1, 1, d)
    snap = attention_sums(q, k, 1.0)[0, 0]
    andp = value_projection(q, k, v, 1.0)[0, 0]
    assert torch.allclose(snap, torch.full((6,), 1 / 6))
    assert andp[2] < 0 < andp[1] and torch.allclose(andp[1], andp[3])


def test_ring_returns_the_newest_queries_in_order():
    ring = QueryWindow(size=4)
    hq, d = 2, 3
    # Step 1: a 6-token prefill chunk (logical 0..5): only the last 4 are kept.
    q1 = torch.arange(6 * hq * d, dtype=torch.float32).view(6, hq, d)
    ring.record("l0", q1, ring.place(["a"], [6], [6]), 0.5)
    got, scale = ring.window("a", ["l0"], 6)
    assert scale == 0.5 and torch.equal(got[0], q1[2:])
    # Step 2: decode token 6 for "a", with "b" prefilling 3 tokens beside it.
    q2 = -torch.arange(4 * hq * d, dtype=torch.float32).view(4, hq, d)
    ring.record("l0", q2, ring.place(["b", "a"], [3, 1], [3, 7]), 0.5)
    got, _ = ring.window("a", ["l0"], 7)
    assert torch.equal(got[0], torch.cat([q1[3:], q2[3:]]))
    got, _ = ring.window("b", ["l0"], 3)
    assert torch.equal(got[0], q2[:3])
    # The window must end at the compaction's logical length.
    assert ring.window("a", ["l0"], 8) is None
    # A gap (tokens never seen, e.g. a prefix-cache hit) restarts the row.
    ring.record("l0", q2[:2], ring.place(["b"], [2], [10]), 0.5)
    got, _ = ring.window("b", ["l0"], 10)
    assert torch.equal(got[0], q2[:2])
    # Unscored rows log nothing; dropped rows are forgotten.
    ring.place(["c"], [5], [5], scored=[False])
    assert "c" not in ring.row_of
    ring.drop(["a"])
    assert ring.window("a", ["l0"], 7) is None


def test_ring_window_shrinks_to_the_resident_tail_after_a_small_compaction():
    """A compaction that keeps only 8 recent tokens leaves older window tokens
    out of order: the next window starts at what is known to be contiguous."""
    ring = QueryWindow(size=32)
    q = torch.randn(40, 1, 2)
    ring.record("l0", q, ring.place(["a"], [40], [40]), 1.0)
    assert ring.window("a", ["l0"], 40)[0].shape[1] == 32
    ring.compacted("a", recent=8)
    ring.record("l0", q[:4], ring.place(["a"], [4], [44]), 1.0)
    got, _ = ring.window("a", ["l0"], 44)
    assert torch.equal(got[0], torch.cat([q[32:40], q[:4]]))  # 8 kept + 4 new


def test_small_budget_keeps_first_token_and_half_recent():
    torch.manual_seed(3)
    policy = make_policy("andpro", window=32)
    q, k, v = torch.randn(1, 32, 3, 8), torch.randn(1, 3, 96, 8), torch.randn(1, 3, 96, 8)
    kept = policy.select(policy.scores(q, k, v, 0.3, recent=16)[0], 32, 16)
    assert (kept[:, 0] == 0).all() and (kept[:, -16:] == torch.arange(80, 96)).all()
