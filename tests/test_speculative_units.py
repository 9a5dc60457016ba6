"""Speculative decoding (n-gram drafts) beside eviction, piece by piece, with
no engine: the planner leaves room for a step's drafts, the decode log and the
query window log a step's token with its drafts and forget the rejected ones
(`roll_back`), and the chunk log leaves drafted decode rows to the decode log.

A decode row with d drafts has n = 1 + d queries; query t of it sees
s - n + 1 + t keys (s: the physical length after the step), as a prefill
chunk's would. The engine-level behaviour (tokens, kept sets against a dense
reference) is in tests/test_speculative_decoding.py.
"""

import pytest
import torch
from test_scores import BS, D, NB, _dense, layer_caches

from vllm_kvevict.core.config.settings import EvictionConfig
from vllm_kvevict.core.eviction.blocks import PoolView, RequestState, compaction_point
from vllm_kvevict.core.eviction.planner import compaction_target, never_compacts
from vllm_kvevict.core.scoring.chunk_log import ChunkLog
from vllm_kvevict.core.scoring.decode_log import DecodeQueryLog, StepPlacement
from vllm_kvevict.core.scoring.query_window import QueryWindow


def h2o(budget) -> EvictionConfig:
    return EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": budget})


# --- planner -------------------------------------------------------------------


def one_token_rule(cfg: EvictionConfig, physical: int, logical: int, in_prefill: bool,
                   block_size: int, room: bool = True) -> int | None:
    """The planner's rule before speculative decoding (one new token per decode
    step), written out: compact when the step takes the request past its
    budget's block cap, down to compaction_keep."""
    if not cfg.enabled or (cfg.offload and in_prefill):
        return None
    if in_prefill:
        if room and (cfg.prefill_cap is None or physical <= cfg.prefill_cap):
            return None
        budget = cfg.budget_tokens(logical, block_size)
    else:
        budget = cfg.budget_tokens(logical + 1, block_size)
        physical += 1
    if physical > EvictionConfig.block_cap(budget, block_size):
        return cfg.compaction_keep(budget, block_size)
    return None


GRID_CONFIGS = [
    pytest.param(h2o(32), id="32"), pytest.param(h2o(48), id="48"),
    pytest.param(h2o(128), id="128"), pytest.param(h2o(101), id="101"),
    pytest.param(h2o(0.05), id="0.05"), pytest.param(h2o(0.5), id="0.5"),
    pytest.param(h2o(1.0), id="1.0"),
    pytest.param(EvictionConfig.from_dict({"kv_eviction": "snapkv", "kv_budget": 64,
                                           "kv_prefill_cap": 96}), id="snapkv-prefill-cap"),
    pytest.param(EvictionConfig.from_dict({"kv_eviction": "infinigen", "kv_budget": 64}),
                 id="infinigen"),
    pytest.param(EvictionConfig(), id="off"),
]


@pytest.mark.parametrize("cfg", GRID_CONFIGS)
def test_one_new_token_plans_as_before_speculation(cfg):
    """new_tokens=1 (the default, every request without drafts) gives the
    one-token rule's target at every length, in decode and in prefill, with
    and without prefill room, at two block sizes."""
    compactions = 0
    for bs in (16, 32):
        if isinstance(cfg.budget, int) and cfg.budget < bs:
            continue
        for logical in range(1, 400, 3):
            for physical in sorted({1, logical // 3 + 1, logical // 2 + 1, logical}):
                for in_prefill in (False, True):
                    for room in (True, False):
                        want = one_token_rule(cfg, physical, logical, in_prefill, bs, room)
                        args = (cfg, physical, logical, in_prefill, bs, room)
                        assert compaction_target(*args, new_tokens=1) == want, (args, want)
                        assert compaction_target(*args) == want, (args, want)
                        compactions += want is not None
    # The grid reaches compactions wherever they happen (a fraction of 1.0 never compacts).
    assert (compactions > 0) == (cfg.enabled and cfg.budget != 1.0), compactions


def test_drafts_that_would_overfill_the_block_cap_compact_leaving_room_for_the_step():
    """Budget 128 at 32-token blocks: cap 128, a compaction keeps 96. At 125
    resident the token fits (126 <= 128) and so do 2 drafts (128), but 3
    drafts (129) would not: the request compacts now, to 96, which leaves
    room for the whole step."""
    cfg, bs = h2o(128), 32
    logical = 300  # compacted before: physical < logical
    assert compaction_target(cfg, 125, logical, False, bs) is None
    assert compaction_target(cfg, 125, logical, False, bs, new_tokens=3) is None
    target = compaction_target(cfg, 125, logical, False, bs, new_tokens=4)
    assert target == 96 and target + 4 <= 128
    # compaction_point passes the request's new_tokens on (spec.py sets it
    # from the drafts vLLM is about to schedule).
    pool = PoolView(num_free=100)
    state = dict(num_blocks=4, logical=logical, evicted=logical - 125)
    assert compaction_point(cfg, RequestState(**state), pool, bs) is None
    assert compaction_point(cfg, RequestState(**state, new_tokens=4), pool, bs) == 96


@pytest.mark.parametrize("budget, bs", [(128, 32), (101, 32), (64, 16), (0.3, 32), (32, 32),
                                        (20, 16)])
def test_every_decode_step_fits_the_block_cap_after_its_compaction(budget, bs):
    """For every resident length up to the cap and every step size up to a
    block less one (the most startup allows: num_speculative_tokens <=
    block_size - 2): the request compacts exactly when the step would take it
    past the cap, and then to a length at which the step fits. Multi-block
    caps still compact to compaction_keep (a block of room holds any step)."""
    cfg = h2o(budget)
    logical = 500
    for new_tokens in range(1, bs):
        cap = EvictionConfig.block_cap(cfg.budget_tokens(logical + new_tokens, bs), bs)
        keep = cfg.compaction_keep(cfg.budget_tokens(logical + new_tokens, bs), bs)
        for physical in range(1, cap + 1):
            target = compaction_target(cfg, physical, logical, False, bs, new_tokens=new_tokens)
            if physical + new_tokens <= cap:
                assert target is None, (physical, new_tokens, target)
                continue
            assert target is not None and 1 <= target < physical, (physical, new_tokens, target)
            assert target + new_tokens <= cap, (physical, new_tokens, target, cap)
            if cap >= 2 * bs:
                assert target == keep, (physical, new_tokens, target)


def test_one_block_budget_compacts_to_the_cap_less_the_step():
    """A one-block budget's room is one token (compaction_keep = cap - 1): a
    step with drafts needs more, so it compacts to cap - new_tokens; at most
    block_size - 1 new tokens, it still keeps a token."""
    cfg, bs = h2o(32), 32
    assert cfg.compaction_keep(32, bs) == 31
    assert compaction_target(cfg, 31, 200, False, bs) is None  # 32: fits
    assert compaction_target(cfg, 32, 200, False, bs) == 31  # one token: as before
    assert compaction_target(cfg, 28, 200, False, bs, new_tokens=4) is None  # 32: fits
    assert compaction_target(cfg, 29, 200, False, bs, new_tokens=4) == 28
    assert compaction_target(cfg, 30, 200, False, bs, new_tokens=4) == 28
    assert compaction_target(cfg, 2, 200, False, bs, new_tokens=31) == 1
    # Prefill writes no drafts: its target is not lowered by new_tokens.
    prefill = compaction_target(cfg, 100, 100, True, bs, room=False)
    assert prefill == 31
    assert compaction_target(cfg, 100, 100, True, bs, room=False, new_tokens=4) == prefill


def test_never_compacts_counts_the_drafts_vllm_may_write_past_max_tokens():
    cfg = h2o(256)
    assert never_compacts(cfg, 200, 56) and never_compacts(cfg, 200, 56, 0)
    assert not never_compacts(cfg, 200, 56, 1)
    assert never_compacts(cfg, 200, 53, 3) and not never_compacts(cfg, 200, 54, 3)
    assert not never_compacts(h2o(0.5), 10, 10, 0)  # a fraction always may compact
    assert not never_compacts(EvictionConfig(), 10, 10, 3)  # eviction off


# --- decode log ------------------------------------------------------------------


def test_decode_log_places_a_drafted_row_and_rolls_back_its_rejected_drafts():
    """A decode row with 3 drafts (n = 4, physical 20 after the step) takes 4
    columns, seeing 17..20 keys (causal, as a prefill chunk's queries); a row
    beside it without drafts takes one. Rolling back 2 rejected drafts empties
    their columns, and the next step's queries take those columns again."""
    log = DecodeQueryLog(depth=8)
    p = log.place(["b", "a"], [1, 4], [9, 20], drafts=[0, 3])
    rb, ra = log.row_of["b"], log.row_of["a"]
    assert log.count == {"b": 1, "a": 4}
    assert log.visible[ra].tolist() == [17, 18, 19, 20, 0, 0, 0, 0]
    assert log.visible[rb].tolist() == [9, 0, 0, 0, 0, 0, 0, 0]
    assert p.tokens.tolist() == [0, 1, 2, 3, 4]
    assert p.cells.tolist() == [rb * 8] + [ra * 8 + c for c in range(4)]

    log.roll_back("a", 2)  # the token and its first draft were accepted
    assert log.count["a"] == 2 and log.count["b"] == 1
    assert log.visible[ra].tolist() == [17, 18, 0, 0, 0, 0, 0, 0]
    log.roll_back("nobody", 2)  # a request without a log: nothing happens
    log.roll_back("b", 0)
    assert log.count == {"b": 1, "a": 2}

    # Next step: 18 resident (the accepted token and draft); the new token and
    # 2 drafts, at positions 18..20, see 19..21 keys.
    p = log.place(["a", "b"], [3, 1], [21, 10], drafts=[2, 0])
    assert log.count == {"a": 5, "b": 2}
    assert log.visible[ra].tolist() == [17, 18, 19, 20, 21, 0, 0, 0]
    assert p.tokens.tolist() == [0, 1, 2, 3]
    assert p.cells.tolist() == [ra * 8 + c for c in (2, 3, 4)] + [rb * 8 + 1]

    # A rollback past what is logged (the log was flushed since) stops at empty.
    log.roll_back("a", 9)
    assert log.count["a"] == 0 and not log.visible[ra].any()


def test_decode_log_full_asks_for_room_for_a_whole_row():
    log = DecodeQueryLog(depth=8)
    assert not log.full() and not log.full(8) and log.full(9) is False  # empty: no request
    log.place(["a"], [4], [20], drafts=[3])
    log.place(["a"], [1], [21])
    assert log.count["a"] == 5
    assert not log.full() and not log.full(3) and log.full(4)  # 5 + 4 > 8
    log.place(["a"], [3], [24], drafts=[2])
    assert log.count["a"] == 8 and log.full() and log.full(1)  # as before: count >= depth
    log.roll_back("a", 1)
    assert not log.full() and log.full(2)


def test_decode_log_still_drops_a_prefilled_request_and_skips_unscored_rows():
    """A prefill row (n > 1, no drafts) still drops the request's log (it is
    prefilled again); a drafted row that is not scored logs nothing."""
    log = DecodeQueryLog(depth=8)
    log.place(["a", "b"], [4, 1], [20, 9], drafts=[3, 0])
    ra = log.row_of["a"]
    p = log.place(["a", "b"], [5, 1], [40, 10], drafts=[0, 0])
    assert "a" not in log.row_of and "a" not in log.count and not log.visible[ra].any()
    assert log.count == {"b": 2} and p.tokens.tolist() == [5]
    p = log.place(["c", "b"], [3, 1], [30, 11], scored=[False, True], drafts=[2, 0])
    assert "c" not in log.row_of and p.tokens.tolist() == [3]


def test_step_placement_defers_drafted_rows():
    """Drafted rows are the decode log's: not scored in the forward. A step
    whose only multi-token rows are drafted scores nothing now; a prefill
    chunk beside them still is, unless the chunk log took it too."""
    cells = torch.zeros(0, dtype=torch.int64)
    p = StepPlacement(cells, cells)
    p.defer(None, [4, 1], None)  # without drafts the 4-token row is a prefill chunk
    assert p.deferred is None and p.score_now
    p.defer(None, [4, 1], None, drafts=[3, 0])
    assert p.deferred.tolist() == [True, False] and not p.score_now
    p.defer(None, [4, 5], None, drafts=[3, 0])
    assert p.deferred.tolist() == [True, False] and p.score_now
    p.defer(torch.tensor([False, True]), [4, 5], None, drafts=[3, 0])  # chunk log took row 1
    assert p.deferred.tolist() == [True, True] and not p.score_now
    p.defer(None, [4, 5], [True, False], drafts=[3, 0])  # row 1 unscored
    assert p.deferred.tolist() == [True, False] and not p.score_now
    p.defer(None, [1, 5], None, drafts=[0, 0])  # no drafts this step: as before
    assert p.deferred is None and p.score_now


def test_chunk_log_leaves_drafted_rows_to_the_decode_log():
    log = ChunkLog(max_tokens=16)
    assert log.place(["a"], [4], [24], drafts=[3]) is None and not log.chunks
    taken = log.place(["a", "b"], [4, 5], [24, 45], drafts=[3, 0])
    assert taken.tolist() == [False, True]
    assert [(c.req_id, c.start, c.n, c.seq_len) for c in log.chunks] == [("b", 0, 5, 45)]
    assert log.tokens.tolist() == [4, 5, 6, 7, 8]
    # Without drafts the same 4-token row is a chunk, taken as before.
    assert ChunkLog(max_tokens=16).place(["a", "b"], [4, 5], [24, 45]).tolist() == [True, True]


# --- decode log: the scores -------------------------------------------------------


def _stack(buf, layout, h):
    from vllm_kvevict.core.layouts.layer_stack import LayerCache, LayerStack

    layers = {f"l{i}": LayerCache(buf[i], layout, torch.zeros(h, NB * BS))
              for i in range(buf.shape[0])}
    return layers, LayerStack.build(layers)


def test_rolled_back_drafts_score_as_the_accepted_tokens_one_step_at_a_time():
    """Three steps of two requests, two layers: "a" drafts 3 tokens (2
    rejected), then 2 (1 rejected), then none; "b" decodes plainly, then
    drafts 1 (accepted). Logging each step's rows with their drafts, rolling
    back the rejected ones, and flushing gives the scores of logging only the
    accepted queries, one token per step, and of the dense loop. Without the
    rollback the rejected drafts' attention would be in the scores."""
    gen = torch.Generator().manual_seed(5)
    h, g, n_layers, scale = 3, 3, 2, 0.2
    buf, layout, keys = layer_caches(gen, n_layers, h)
    table = {"a": [3, 7, 1, 12], "b": [10, 2]}

    # (req_ids, q_lens, physical lengths after the step, drafts, rejected per request)
    steps = [(["b", "a"], [1, 4], [18, 24], [0, 3], {"a": 2}),
             (["a", "b"], [3, 1], [25, 19], [2, 0], {"a": 1}),
             (["a", "b"], [1, 2], [25, 21], [0, 1], {})]
    queries = [{f"l{i}": torch.randn(sum(q_lens), h * g, D, generator=gen)
                for i in range(n_layers)} for _, q_lens, *_ in steps]

    def speculative(roll_back: bool):
        layers, stacks = _stack(buf, layout, h)
        log = DecodeQueryLog(depth=8)
        for (req_ids, q_lens, seq_lens, drafts, rejected), q in zip(steps, queries):
            if log.full(1 + max(drafts)):
                log.flush_all(stacks, table.get)
            placement = log.place(req_ids, q_lens, seq_lens, drafts=drafts)
            for name, query in q.items():
                log.record(name, query, placement, scale)
            if roll_back:  # the next step's begin_step (worker._roll_back_drafts)
                for req_id, num in rejected.items():
                    log.roll_back(req_id, num)
        log.flush(["a", "b"], stacks, table.get)
        assert not any(log.count.values())
        return {name: lc.scores for name, lc in layers.items()}

    # The accepted queries: per request, (step, token index in the step, keys seen).
    accepted = {"a": [(0, 1, 21), (0, 2, 22), (1, 0, 23), (1, 1, 24), (2, 0, 25)],
                "b": [(0, 0, 18), (1, 3, 19), (2, 1, 20), (2, 2, 21)]}
    layers, stacks = _stack(buf, layout, h)
    log = DecodeQueryLog(depth=8)
    for req_id, taken in accepted.items():
        for step, token, seen in taken:
            placement = log.place([req_id], [1], [seen])
            for name in layers:
                log.record(name, queries[step][name][token][None], placement, scale)
    log.flush(["a", "b"], stacks, table.get)
    one_by_one = {name: lc.scores for name, lc in layers.items()}

    got = speculative(roll_back=True)
    for i, name in enumerate(one_by_one):
        assert one_by_one[name].sum() > 0
        torch.testing.assert_close(got[name], one_by_one[name], rtol=1e-5, atol=1e-6)
        want = torch.zeros(h, NB * BS)
        nq = max(len(t) for t in accepted.values())
        q = torch.zeros(2, nq, h * g, D)
        visible = torch.zeros(2, nq, dtype=torch.int64)
        for r, (req_id, taken) in enumerate(accepted.items()):
            for t, (step, token, seen) in enumerate(taken):
                q[r, t], visible[r, t] = queries[step][name][token], seen
        _dense(want, keys[i], q, visible, [torch.tensor(table["a"]), torch.tensor(table["b"])],
               scale)
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6)
    # Each query adds h * g (its softmax rows) to the scores: 9 accepted queries.
    assert got["l0"].sum().item() == pytest.approx(9 * h * g, rel=1e-5)

    kept_rejected = speculative(roll_back=False)
    assert kept_rejected["l0"].sum().item() == pytest.approx(12 * h * g, rel=1e-5)
    assert not torch.allclose(kept_rejected["l0"], one_by_one["l0"])


# --- query window -----------------------------------------------------------------


def _window_after_drafts(spare: int):
    """Six single tokens (logical 1..6), then a token with 2 drafts (logical
    7..9), of which the 2 drafts are rejected."""
    ring = QueryWindow(size=4, spare=spare)
    q = torch.randn(9, 2, 3, generator=torch.Generator().manual_seed(spare))
    for s in range(1, 7):
        ring.record("l0", q[s - 1:s], ring.place(["a"], [1], [s]), 0.5)
    assert ring.window_len("a", 6) == 4
    ring.record("l0", q[6:9], ring.place(["a"], [3], [9]), 0.5)
    assert ring.window_len("a", 9) == 4  # the size, whatever the ring holds
    ring.roll_back("a", 2)
    return ring, q


def test_query_window_spare_cells_keep_a_full_window_after_a_rollback():
    """The drafts were written over the ring's oldest cells: with spare cells
    (the most drafts a step has) beyond the window, the 4 newest accepted
    queries survive the rollback, in order; the next step continues the row."""
    ring, q = _window_after_drafts(spare=2)
    assert ring.window_len("a", 9) == 0  # rolled back: the row ends at 7
    assert ring.window_len("a", 7) == 4
    got, scale = ring.windows(["a"], ["l0"], [7])
    assert scale == 0.5 and torch.equal(got[0], q[3:7])
    # The next token is logical 8 (the rejected drafts' position): contiguous.
    q8 = torch.randn(1, 2, 3)
    ring.record("l0", q8, ring.place(["a"], [1], [8]), 0.5)
    assert ring.window_len("a", 8) == 4
    got, _ = ring.window("a", ["l0"], 8)
    assert torch.equal(got[0], torch.cat([q[4:7], q8]))


def test_query_window_without_spare_cells_loses_part_of_the_window():
    """Why the spare cells exist: in a ring of the window's size (4 cells),
    the rejected drafts (positions 7, 8) overwrote the queries of positions
    3 and 4 (cells 3 and 0), so after the rollback only 2 contiguous queries
    remain (positions 5, 6), fewer than the window's 4; they are still the
    right ones."""
    ring, q = _window_after_drafts(spare=0)
    assert ring.window_len("a", 7) == 2
    got, _ = ring.windows(["a"], ["l0"], [7])
    assert got.shape[1] == 2 and torch.equal(got[0], q[5:7])


def test_the_worker_decode_log_holds_a_row_of_many_drafts():
    """Startup allows up to block_size - 2 drafts (62 at 64-token blocks), more
    than the decode log's default depth of 32: the worker's log must hold a
    whole drafted row (a 41-query row into a 32-deep log raised before)."""
    from vllm_kvevict.integration.worker import WorkerEviction

    cfg = EvictionConfig(policy="h2o", budget=256)
    log = WorkerEviction(cfg, 64, max_drafts=40).decode_log
    assert log.depth >= 41
    placement = log.place(["r"], [41], [300], drafts=[40])
    assert placement.tokens.tolist() == list(range(41))
    assert log.visible[log.row_of["r"], :41].tolist() == list(range(260, 301))
    assert WorkerEviction(cfg, 32).decode_log.depth == 32  # no drafts: as before
