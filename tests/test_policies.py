"""Selection rules of the policies and the planner, on plain tensors."""

import pytest
import torch

from vllm_kvevict.core.config.settings import EvictionConfig, EvictionConfigError
from vllm_kvevict.core.eviction.planner import compaction_target
from vllm_kvevict.core.policies import POLICIES, DenseContext, H2OPolicy, StreamingPolicy, make_policy


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
    cfg = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 96})
    # Decode: the budget is a cap. At 96 resident the next token would pass it,
    # so the request compacts a block below it (to 64, the block 64-95 free).
    assert compaction_target(cfg, 95, 95, in_prefill=False, block_size=32) is None
    assert compaction_target(cfg, 96, 500, in_prefill=False, block_size=32) == 64
    # Prefill (issue 18): the prompt stays whole while the pool has room for
    # its next chunk and --kv-prefill-cap allows; otherwise a block below the budget.
    assert compaction_target(cfg, 5000, 5000, in_prefill=True, block_size=32) is None
    assert compaction_target(cfg, 97, 97, True, 32, room=False) == 64
    assert compaction_target(cfg, 96, 96, True, 32, room=False) is None
    capped = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 96,
                                       "kv_prefill_cap": 512})
    assert compaction_target(capped, 512, 512, True, 32) is None
    assert compaction_target(capped, 513, 513, True, 32) == 64
    between = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 96,
                                        "kv_prefill_cap": "0"})
    assert compaction_target(between, 97, 97, True, 32) == 64
    assert compaction_target(between, 96, 96, True, 32) is None
    off = EvictionConfig.from_dict({"kv_eviction": "none"})
    assert compaction_target(off, 10_000, 10_000, False, 32) is None
    # A fraction caps the length after this step's token: 100% never compacts,
    # 50% compacts once the next token would pass half the new length.
    whole = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 1.0})
    assert compaction_target(whole, 500, 500, False, 32) is None
    half = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 0.5})
    # ceil(501 / 2) = 251 tokens need 8 blocks: the request may fill them (256).
    assert compaction_target(half, 255, 500, False, 32) is None
    assert compaction_target(half, 256, 500, False, 32) == 256 - 32


@pytest.mark.parametrize("budget,target", [
    (32, 31),   # one block: one token of room, a compaction every step
    (40, 32),   # under two blocks: down to one whole block
    (64, 32), (160, 128),  # a block of room
    (161, 160), (101, 96),  # the budget's last block filled, then a block of room
])
def test_a_decoding_request_never_holds_more_than_its_budgets_blocks(budget, target):
    """Replays decode under the planner: the resident count after every step's
    write stays within the ceil(budget / 32) blocks the budget needs, and
    every compaction lands on `target`, whole blocks below the last one."""
    cfg = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": budget})
    physical, landed = budget // 2, set()
    for logical in range(budget // 2, 4 * budget):
        new = compaction_target(cfg, physical, logical, in_prefill=False, block_size=32)
        if new is not None:
            landed.add(new)
            physical = new
        physical += 1  # this step's token
        assert physical <= -(-budget // 32) * 32, (logical, physical)
    assert landed == {target}


def test_a_small_fraction_floors_at_two_blocks_and_compacts_once_per_block():
    """5% of a short request is under a block: the fraction's floor (two blocks)
    leaves a block of room, so decode compacts once per 32 new tokens, back to
    one block, never every step (as a one-block floor under the cap did)."""
    cfg = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 0.05})
    physical, compactions = 12, 0
    for logical in range(12, 12 + 640):
        new = compaction_target(cfg, physical, logical, in_prefill=False, block_size=32)
        if new is not None:
            assert new == 32, (logical, new)
            compactions, physical = compactions + 1, new
        physical += 1
        assert physical <= 64, (logical, physical)
    assert compactions == (640 - (64 - 12)) // 32 + 1  # first at 64 resident, then every 32


def test_never_compacts_only_when_the_whole_request_fits_a_token_budget():
    from vllm_kvevict.core.config.settings import EvictionConfig
    from vllm_kvevict.core.eviction.planner import never_compacts

    h2o = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 256})
    assert never_compacts(h2o, 200, 56) and not never_compacts(h2o, 200, 57)
    frac = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 0.5})
    assert not never_compacts(frac, 10, 10)  # a fraction of the length always bites
    assert not never_compacts(EvictionConfig(), 10, 10)  # eviction off


def test_evicts_after_prompt_exactly_when_the_first_decode_step_compacts():
    """The requests the fused CPU pass may serve (their tokens leave stock's at
    the second): the prompt alone overfills the budget's blocks. A prompt
    within them, one that fits exactly, offload and eviction off: no."""
    from vllm_kvevict.core.config.settings import EvictionConfig
    from vllm_kvevict.core.eviction.planner import compaction_target, evicts_after_prompt

    h2o = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 128})
    assert evicts_after_prompt(h2o, 600, 32) and evicts_after_prompt(h2o, 128, 32)
    assert not evicts_after_prompt(h2o, 127, 32)  # the first decode token still fits
    assert compaction_target(h2o, 128, 128, False, 32) is not None  # the same test, by hand
    frac = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 0.9})
    assert evicts_after_prompt(frac, 512, 32) and evicts_after_prompt(frac, 3000, 128)
    assert not evicts_after_prompt(frac, 40, 32)  # two blocks at least: 64 tokens
    off = EvictionConfig.from_dict({"kv_eviction": "infinigen", "kv_budget": 128})
    assert off.offload and not evicts_after_prompt(off, 600, 32)
    assert not evicts_after_prompt(EvictionConfig(), 600, 32)


def test_each_policy_declares_what_it_needs():
    """The plugin reads these declarations, not policy names (core/policies/)."""
    from vllm_kvevict.core.config.flags import ALIASES
    from vllm_kvevict.core.config.settings import POLICIES as CHOICES
    from vllm_kvevict.core.policies import POLICIES, Record, make_policy

    # --kv-eviction offers every registered policy, and the aliases (offload modes)
    assert CHOICES == ("none", *POLICIES, *ALIASES)
    assert "infinigen" not in POLICIES and ALIASES["infinigen"] == ("streaming", True)
    declared = {name: POLICIES[name].records for name in POLICIES}
    assert declared == {"h2o": Record.ATTENTION, "streaming": Record.NOTHING,
                        "snapkv": Record.QUERIES, "andpro": Record.QUERIES}
    assert make_policy("streaming", sink=2).sink == 2  # sinks + recent stay resident
    assert make_policy("snapkv", window=16).window == 16
    assert [POLICIES[n].default_recent(256, 32) for n in ("h2o", "snapkv")] == [128, 32]
    with pytest.raises(ValueError, match="no eviction policy named 'lru'"):
        make_policy("lru")
    with pytest.raises(ValueError, match="no eviction policy named 'infinigen'"):
        make_policy("infinigen")  # a mode, parsed by the config (flags.ALIASES)


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_keeps_recent_and_keep_tokens_from_its_own_scores(name):
    """Each registered policy through the interface the worker calls: its
    compaction scores over a dense context (whatever it reads), then select.
    Every head keeps `keep` ascending indices ending with the recent window."""
    policy = make_policy(name, sink=2, window=8)
    g = torch.Generator().manual_seed(5)
    layers, h, hq, n, d, keep, recent = 2, 3, 6, 60, 16, 24, 8
    k, v = torch.randn(layers, h, n, d, generator=g), torch.randn(layers, h, n, d, generator=g)
    ctx = DenseContext(k, v, accumulated=torch.rand(layers, h, n, generator=g),
                       window=(torch.randn(layers, 8, hq, d, generator=g), d ** -0.5),
                       new_len=keep, recent=recent)
    scores = policy.compaction_scores(ctx)
    assert scores.shape == (layers, h, n)
    kept = policy.select(scores.reshape(layers * h, n), keep, recent)
    assert kept.shape == (layers * h, keep)
    assert (kept.diff(dim=1) > 0).all() and (kept[:, -recent:] == torch.arange(n - recent, n)).all()


class CountingContext(DenseContext):
    """DenseContext that notes which of the (costly, gathered) reads a policy made."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads: set[str] = set()

    def keys(self):
        self.reads.add("keys")
        return super().keys()

    def values(self):
        self.reads.add("values")
        return super().values()

    def accumulated(self):
        self.reads.add("accumulated")
        return super().accumulated()

    def window(self):
        self.reads.add("window")
        return super().window()


def test_each_policy_reads_only_what_its_scores_use():
    """A compaction gathers every layer's keys or values from the paged cache on
    first read (StackContext): SnapKV scores with the keys alone, so its
    compactions must not gather the values AnDPro projects onto."""
    g = torch.Generator().manual_seed(6)
    layers, h, hq, n, d = 2, 3, 6, 40, 16
    reads = {}
    for name in POLICIES:
        ctx = CountingContext(torch.randn(layers, h, n, d, generator=g),
                              torch.randn(layers, h, n, d, generator=g),
                              accumulated=torch.rand(layers, h, n, generator=g),
                              window=(torch.randn(layers, 8, hq, d, generator=g), d ** -0.5),
                              new_len=16, recent=8)
        make_policy(name, sink=2, window=8).compaction_scores(ctx)
        reads[name] = ctx.reads
    assert reads == {"h2o": {"accumulated"}, "streaming": set(),
                     "snapkv": {"window", "keys"}, "andpro": {"window", "keys", "values"}}


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_checks_its_settings_and_names_the_flag(name):
    """A policy's own setting rules run through the config, whose error names
    the flag; settings every policy accepts pass."""
    EvictionConfig.from_dict({"kv_eviction": name, "kv_budget": 64, "kv_sink": 4,
                              "kv_window": 16})
    if name == "streaming":
        with pytest.raises(EvictionConfigError, match=r"--kv-sink \(additional_config"):
            EvictionConfig.from_dict({"kv_eviction": name, "kv_budget": 4, "kv_sink": 4})
