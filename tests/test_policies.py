"""Selection rules of the policies and the planner, on plain tensors."""

import pytest
import torch

from vllm_kvevict.core.config.settings import EvictionConfig
from vllm_kvevict.core.eviction.planner import compaction_target
from vllm_kvevict.core.policies import H2OPolicy, StreamingPolicy


def test_h2o_keeps_recent_window_plus_heaviest_per_head():
    scores = torch.tensor([[5., 0., 9., 1., 3., 0., 0., 0.],
                           [0., 7., 0., 6., 2., 0., 0., 0.]])
    kept = H2OPolicy().select(scores, keep=5, recent=2)
    assert kept.tolist() == [[0, 2, 4, 6, 7], [1, 3, 4, 6, 7]]


def test_h2o_recent_tokens_kept_even_with_zero_score():
    scores = torch.rand(3, 40)
    scores[:, -8:] = 0
    kept = H2OPolicy().select(scores, keep=16, recent=8)
    assert (kept[:, -8:] == torch.arange(32, 40)).all()
    assert (kept[:, :8].sort(dim=1).values == scores[:, :32].topk(8).indices.sort(dim=1).values).all()


@pytest.mark.parametrize("n,keep,recent", [(64, 40, 8), (64, 16, 4), (33, 33, 0), (40, 8, 8)])
def test_ties_at_the_cut_keep_the_newest_whichever_branch(n, keep, recent):
    """SnapKV/AnDPro's pooled chunk scores tie by design: the kept set is then
    the top (score, position) pairs, newest winning ties, in both the drop
    branch (few dropped) and the keep branch, the same on any device."""
    from vllm_kvevict.core.policies import recent_plus_top_scored

    g = torch.Generator().manual_seed(n + keep)
    scores = torch.randint(0, 4, (3, n), generator=g).float()  # many ties
    kept = recent_plus_top_scored(scores, keep, recent)
    old = n - recent
    want = []
    for row in scores[:, :old].tolist():  # lexicographic (score, position), highest first
        top = sorted(range(old), key=lambda i: (row[i], i), reverse=True)[:keep - recent]
        want.append(sorted(top) + list(range(old, n)))
    assert kept.tolist() == want


def test_streaming_keeps_exactly_sinks_and_recent():
    kept = StreamingPolicy(sink=4).select(torch.rand(3, 100), keep=20, recent=0)
    assert kept.tolist() == [list(range(4)) + list(range(84, 100))] * 3


def test_planner_decode_and_chunk_boundaries():
    cfg = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 64})
    assert compaction_target(cfg, 95, 95, in_prefill=False, block_size=32) is None
    assert compaction_target(cfg, 96, 500, in_prefill=False, block_size=32) == 64
    # Prefill (issue 18): the prompt stays whole while the pool has room for
    # its next chunk and --kv-prefill-cap allows; otherwise down to the budget.
    assert compaction_target(cfg, 5000, 5000, in_prefill=True, block_size=32) is None
    assert compaction_target(cfg, 65, 65, True, 32, room=False) == 64
    assert compaction_target(cfg, 64, 64, True, 32, room=False) is None
    capped = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 64,
                                       "kv_prefill_cap": 512})
    assert compaction_target(capped, 512, 512, True, 32) is None
    assert compaction_target(capped, 513, 513, True, 32) == 64
    between = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 64,
                                        "kv_prefill_cap": "0"})
    assert compaction_target(between, 65, 65, True, 32) == 64
    assert compaction_target(between, 64, 64, True, 32) is None
    off = EvictionConfig.from_dict({"kv_eviction": "none"})
    assert compaction_target(off, 10_000, 10_000, False, 32) is None


def test_never_compacts_only_when_the_whole_request_fits_a_token_budget():
    from vllm_kvevict.core.config.settings import EvictionConfig
    from vllm_kvevict.core.eviction.planner import never_compacts

    h2o = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 256})
    assert never_compacts(h2o, 200, 56) and not never_compacts(h2o, 200, 57)
    frac = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 0.5})
    assert not never_compacts(frac, 10, 10)  # a fraction of the length always bites
    assert not never_compacts(EvictionConfig(), 10, 10)  # eviction off


def test_each_policy_declares_what_it_needs():
    """The plugin reads these declarations, not policy names (core/policies/)."""
    from vllm_kvevict.core.config.settings import POLICIES as CHOICES
    from vllm_kvevict.core.policies import POLICIES, make_policy

    assert CHOICES == ("none", *POLICIES)  # --kv-eviction offers every registered policy
    declared = {name: (p.needs_scores, p.window)
                for name in POLICIES for p in [make_policy(name, sink=2, window=16)]}
    assert declared == {"h2o": (True, 0), "streaming": (False, 0), "snapkv": (False, 16),
                        "andpro": (False, 16), "infinigen": (False, 0)}
    assert make_policy("infinigen", sink=2).sink == 2  # sinks + recent stay resident
    assert [POLICIES[n].default_recent(256, 32) for n in ("h2o", "snapkv")] == [128, 32]
    with pytest.raises(ValueError, match="no eviction policy named 'lru'"):
        make_policy("lru")
