"""The torch scoring kernel (core/scoring/scores.py) against a dense loop written
from H2O's definition: each query's softmax over the keys it can see, summed over
the query heads of each KV head, added to each key's slot."""

import pytest
import torch
import vllm._custom_ops as ops  # noqa: E402  (a missing vLLM fails, never skips)

from vllm_kvevict.core.layouts.cpu_layout import split_kv_cache
from vllm_kvevict.core.scoring.scores import accumulate_scores, score_queries
from vllm_kvevict.integration.cpu_backend import discover_layout

BS, D, NB = 16, 64, 24


def _paged(h, gen, dtype):
    """A vec-layout CPU cache filled through the stock writer, and its dense keys
    per slot: (kv cache, layout, key_cache, dense keys (NB*BS, H, D))."""
    kv = torch.zeros(NB, h, BS, 2 * D, dtype=dtype)
    kc, vc = split_kv_cache(kv)
    keys = torch.randn(NB * BS, h, D, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, keys, kc, vc, torch.arange(NB * BS), "vec")
    return discover_layout("vec", dtype, BS, D, h), kc, keys.float()


def _dense(scores, keys, queries, visible, rows, scale):
    h = keys.shape[1]
    for r in range(queries.shape[0]):
        slots = (rows[r][:, None] * BS + torch.arange(BS)).flatten()
        for t in range(queries.shape[1]):
            v = int(visible[r, t])
            if v == 0:
                continue
            k = keys[slots[:v]]  # (v, H, D)
            q = queries[r, t].float().view(h, -1, D)  # (H, G, D)
            p = (torch.einsum("hgd,vhd->hgv", q, k) * scale).softmax(-1).sum(1)
            scores[:, slots[:v]] += p


@pytest.mark.parametrize("h,g", [(1, 1), (3, 3), (2, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_queries_matches_dense_loop(h, g, dtype):
    """Ragged requests, several queries each, padding (visible 0), GQA."""
    gen = torch.Generator().manual_seed(h * 10 + g)
    layout, kc, keys = _paged(h, gen, dtype)
    perm = torch.randperm(NB, generator=gen)
    rows = torch.stack([perm[0:5], perm[5:10], perm[10:15]])  # (R=3, 5 blocks)
    visible = torch.tensor([[70, 71, 72, 0], [3, 4, 0, 0], [60, 61, 62, 63]])
    queries = torch.randn(3, 4, h * g, D, generator=gen).to(dtype)
    got, want = torch.zeros(h, NB * BS), torch.zeros(h, NB * BS)
    score_queries(got, layout, kc, queries, visible, rows, 0.125)
    _dense(want, keys, queries, visible, rows, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got.sum().item() == pytest.approx(h * g * 9, rel=1e-5)  # 9 real queries


def test_long_causal_chunks_are_scored_in_tiles_like_the_dense_loop():
    """Chunks longer than one query tile (scores._MAX_TILE_QUERIES): each tile
    reaches only the keys its queries see, the masks of consecutive tiles
    meet, and a shorter chunk's padding adds nothing. Two requests, bf16."""
    import vllm_kvevict.core.scoring.scores as scoring

    assert 150 > 2 * scoring._MAX_TILE_QUERIES  # three tiles, the last one ragged
    gen = torch.Generator().manual_seed(7)
    h, g = 3, 3
    layout, kc, keys = _paged(h, gen, torch.bfloat16)
    perm = torch.randperm(NB, generator=gen)
    rows = torch.stack([perm[:12], perm[12:]])  # (R=2, 12 blocks): 192 tokens each
    visible = torch.zeros(2, 150, dtype=torch.int64)
    visible[0] = torch.arange(31, 181)  # 150 queries after 30 resident tokens
    visible[1, :130] = torch.arange(1, 131)  # a 130-token first chunk, padded
    queries = torch.randn(2, 150, h * g, D, generator=gen).bfloat16()
    got, want = torch.zeros(h, NB * BS), torch.zeros(h, NB * BS)
    score_queries(got, layout, kc, queries, visible, rows, 0.125)
    _dense(want, keys, queries, visible, rows, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.sum().item() == pytest.approx(h * g * 280, rel=1e-5)


def test_accumulate_scores_prefill_is_causal_and_resets_new_slots():
    """A 2-request step: a 5-token prefill chunk after 40 resident tokens, and a
    decode token. New slots start from zero; the chunk is causal."""
    gen = torch.Generator().manual_seed(5)
    h, g = 3, 3
    layout, kc, keys = _paged(h, gen, torch.float32)
    table = torch.stack([torch.arange(0, 4), torch.arange(4, 8)])
    seq = torch.tensor([45, 20])
    qsl = torch.tensor([0, 5, 6])
    slot_mapping = torch.cat([torch.arange(40, 45), torch.tensor([4 * BS + 19])])
    query = torch.randn(6, h * g, D, generator=gen)
    got = torch.rand(h, NB * BS, generator=gen)
    want = got.clone()
    want[:, slot_mapping] = 0
    _dense(want, keys, query[:5][None], torch.arange(41, 46)[None], table[:1], 0.2)
    _dense(want, keys, query[5:][None], torch.tensor([[20]]), table[1:], 0.2)
    accumulate_scores(got, layout, kc, query, qsl, seq, table, slot_mapping, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_accumulate_scores_skips_unscored_rows():
    """rows=False requests (never compacted) get no scores; the others do."""
    gen = torch.Generator().manual_seed(6)
    layout, kc, keys = _paged(3, gen, torch.float32)
    table = torch.stack([torch.arange(0, 4), torch.arange(4, 8)])
    seq, qsl = torch.tensor([30, 20]), torch.tensor([0, 1, 2])
    slot_mapping = torch.tensor([29, 4 * BS + 19])
    query = torch.randn(2, 9, D, generator=gen)
    got, want = torch.zeros(3, NB * BS), torch.zeros(3, NB * BS)
    _dense(want, keys, query[1:][None, :], torch.tensor([[20]]), table[1:], 0.2)
    accumulate_scores(got, layout, kc, query, qsl, seq, table, slot_mapping, 0.2,
                      rows=torch.tensor([False, True]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[:, : 4 * BS].sum() == 0


def test_private_rows_take_a_shared_prefix_scores_and_leave_its_slots_alone():
    """Two requests share their first 2 blocks (a prefix hit): the second one's
    scores of those 32 tokens go to its private row (core/scoring/private_scores.py),
    exactly what its own slots would have received; the shared slots keep the
    first request's scores only, and every later slot is scored as usual.
    Both a prefill chunk and a decode step of the sharer."""
    gen = torch.Generator().manual_seed(7)
    h, g = 3, 3
    layout, kc, keys = _paged(h, gen, torch.float32)
    shared = torch.tensor([0, 1])
    table = torch.stack([torch.cat([shared, torch.tensor([2, 3])]),
                         torch.cat([shared, torch.tensor([4, 5])])])
    # Owner: decode at 50 resident; sharer: a 6-token chunk after its 32-token hit.
    seq, qsl = torch.tensor([50, 38]), torch.tensor([0, 1, 7])
    slot_mapping = torch.cat([torch.tensor([3 * BS + 1]), 4 * BS + torch.arange(6)])
    query = torch.randn(7, h * g, D, generator=gen)
    n = 2 * BS
    private = torch.zeros(h, n)
    got = torch.zeros(h, NB * BS)
    accumulate_scores(got, layout, kc, query, qsl, seq, table, slot_mapping, 0.2,
                      private=[None, private])
    owner, sharer = torch.zeros(h, NB * BS), torch.zeros(h, NB * BS)
    _dense(owner, keys, query[:1][None], torch.tensor([[50]]), table[:1], 0.2)
    _dense(sharer, keys, query[1:][None], torch.arange(33, 39)[None], table[1:], 0.2)
    sharer_slots = (table[1][:, None] * BS + torch.arange(BS)).flatten()
    torch.testing.assert_close(private, sharer[:, sharer_slots[:n]], rtol=1e-5, atol=1e-6)
    want = owner.clone()
    want[:, sharer_slots[n:]] += sharer[:, sharer_slots[n:]]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # A decode step of the sharer (39 resident), through the same path.
    before = private.clone()
    got2 = torch.zeros(h, NB * BS)
    q1 = torch.randn(1, h * g, D, generator=gen)
    accumulate_scores(got2, layout, kc, q1, torch.tensor([0, 1]), torch.tensor([39]),
                      table[1:], torch.tensor([4 * BS + 6]), 0.2, private=[private])
    step = torch.zeros(h, NB * BS)
    _dense(step, keys, q1[None], torch.tensor([[39]]), table[1:], 0.2)
    torch.testing.assert_close(private - before, step[:, sharer_slots[:n]],
                               rtol=1e-5, atol=1e-6)
    assert got2[:, : 2 * BS].sum() == 0  # the shared slots got nothing
    torch.testing.assert_close(got2[:, sharer_slots[n:]], step[:, sharer_slots[n:]])


def test_chunk_log_scores_a_deferred_chunk_as_its_forward_would():
    """A step with a 5-token prefill chunk (after 40 resident tokens) and a
    decode row: the chunk log takes the chunk, the step scores only the decode
    row, and the flush at the next step's start adds exactly what scoring the
    chunk in its forward would have. A chunk over max_tokens is not taken, and
    a dropped request's chunk adds nothing."""
    from vllm_kvevict.core.scoring.chunk_log import ChunkLog
    from vllm_kvevict.core.layouts.layer_stack import LayerCache, LayerStack

    gen = torch.Generator().manual_seed(8)
    h, g = 3, 3
    kv = torch.zeros(NB, h, BS, 2 * D)
    kc, vc = split_kv_cache(kv)
    keys = torch.randn(NB * BS, h, D, generator=gen)
    ops.cpu_attn_reshape_and_cache(keys, keys, kc, vc, torch.arange(NB * BS), "vec")
    layout = discover_layout("vec", torch.float32, BS, D, h)
    table = torch.stack([torch.arange(0, 4), torch.arange(4, 8)])
    seq, qsl = torch.tensor([45, 20]), torch.tensor([0, 5, 6])
    slot_mapping = torch.cat([torch.arange(40, 45), torch.tensor([4 * BS + 19])])
    query = torch.randn(6, h * g, D, generator=gen)
    want = torch.zeros(h, NB * BS)
    accumulate_scores(want, layout, kc, query, qsl, seq, table, slot_mapping, 0.2)

    log = ChunkLog(max_tokens=8)
    deferred = log.place(["a", "b"], [5, 1], [45, 20])
    assert deferred.tolist() == [True, False]
    lc = LayerCache(kv, layout, torch.zeros(h, NB * BS))
    stacks = LayerStack.build({"l0": lc})  # lc.scores is now a view of the stack's
    accumulate_scores(lc.scores, layout, kc, query, qsl, seq, table, slot_mapping, 0.2,
                      rows=~deferred)
    log.record("l0", query, 0.2)
    assert lc.scores[:, :4 * BS].sum() == 0  # nothing for the chunk yet
    log.flush(stacks, {"a": table[0].tolist(), "b": table[1].tolist()}.get)
    torch.testing.assert_close(lc.scores, want, rtol=1e-5, atol=1e-6)
    assert not log.chunks and not log.queries

    assert ChunkLog(max_tokens=4).place(["a", "b"], [5, 1], [45, 20]) is None
    dropped = ChunkLog(max_tokens=8)
    dropped.place(["a", "b"], [5, 1], [45, 20])
    dropped.record("l0", query, 0.2)
    dropped.drop(["a"])
    before = lc.scores.clone()
    dropped.flush(stacks, {"a": table[0].tolist()}.get)
    assert torch.equal(lc.scores, before)


def test_decode_log_reads_consecutive_rows_as_a_view():
    from vllm_kvevict.core.scoring.decode_log import rows_of

    assert rows_of([0, 1, 2]) == slice(0, 3) and rows_of([4]) == slice(4, 5)
    assert torch.equal(rows_of([0, 2, 3]), torch.tensor([0, 2, 3]))


@pytest.mark.parametrize("flush_order", [["a", "b"], ["b", "a"]])
def test_decode_log_flush_scores_every_layer_of_a_stack_in_one_call(flush_order):
    """Three layers in one buffer (as vLLM allocates them), one LayerStack: the
    decode log's flush scores each layer's logged queries against that layer's
    keys only, equal to the dense loop per layer; a request's private row (layer
    1 only) takes its first positions there instead of the shared slots. The
    order the requests are named in does not matter (the flush reads rows in
    buffer order)."""
    from vllm_kvevict.core.scoring.decode_log import DecodeQueryLog
    from vllm_kvevict.core.layouts.layer_stack import LayerCache, LayerStack

    gen = torch.Generator().manual_seed(11)
    h, g, n_layers = 3, 3, 3
    buf, layout, keys = layer_caches(gen, n_layers, h)
    layers = {f"l{i}": LayerCache(buf[i], layout, torch.zeros(h, NB * BS))
              for i in range(n_layers)}
    stacks = LayerStack.build(layers)
    assert len(stacks) == 1 and stacks[0].num_layers == n_layers

    table = {"a": [3, 7, 1], "b": [10, 2]}
    log = DecodeQueryLog(depth=4)
    queries = {name: [] for name in layers}
    for step, seq in enumerate([(40, 20), (41, 21), (42, 22)]):
        placement = log.place(["a", "b"], [1, 1], list(seq))
        for name in layers:
            q = torch.randn(2, h * g, D, generator=gen)
            log.record(name, q, placement, 0.2)
            queries[name].append(q)
    private = torch.zeros(h, 16)  # "b" scores its first 16 positions in layer 1 here
    log.flush(flush_order, stacks, table.get,
              lambda r, name, st: private if (r, name) == ("b", "l1") else None)

    for i, name in enumerate(layers):
        want = torch.zeros(h, NB * BS)
        q = torch.stack(queries[name], dim=1)  # (R=2, 3 steps, H_q, D)
        _dense(want, keys[i].float(), q, torch.tensor([[40, 41, 42], [20, 21, 22]]),
               [torch.tensor(table["a"]), torch.tensor(table["b"])], 0.2)
        got = layers[name].scores
        if name == "l1":
            b_slots = (torch.tensor(table["b"])[:, None] * BS + torch.arange(BS)).flatten()
            torch.testing.assert_close(private, want[:, b_slots[:16]], rtol=1e-5, atol=1e-6)
            assert got[:, b_slots[:16]].sum() == 0
            want[:, b_slots[:16]] = 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not any(log.count.values())


def layer_caches(gen: torch.Generator, n_layers: int, h: int):
    """(n_layers, NB, h, BS, 2 * D) float32 vec caches with random keys (and
    the same values) in every slot, their layout, and each layer's keys
    (NB * BS, h, D) in slot order."""
    buf = torch.zeros(n_layers, NB, h, BS, 2 * D)
    layout = discover_layout("vec", torch.float32, BS, D, h)
    keys = []
    for layer in range(n_layers):
        kc, vc = split_kv_cache(buf[layer])
        k = torch.randn(NB * BS, h, D, generator=gen)
        ops.cpu_attn_reshape_and_cache(k, k, kc, vc, torch.arange(NB * BS), "vec")
        keys.append(k)
    return buf, layout, keys
