"""Smoke run of the dense InfiniGen / H2O evaluation (vllm_kvevict.eval.infinigen_dense)
on 200 tokens of real text with SmolLM2, the methods as rows of one batch
(~40-60 s on one core of a busy box), plus a 48-token `evaluate` run with host pools."""
import math

import pytest
import torch

from vllm_kvevict import calibrate
from vllm_kvevict.core.offload import skewing as sk
from vllm_kvevict.core.offload.host_pool import replay
from vllm_kvevict.eval import infinigen_dense as ev

TOKENS, BUDGET, BS = 200, 32, 16


@pytest.fixture(scope="module")
def smol(model_path, hf):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny per-token ops: one thread is far faster on a busy box
    model, tok = hf  # the session's SmolLM2 (conftest), what calibrate.load_model loads
    skew = calibrate.load_or_compute(model_path, model=model, tokenizer=tok, n_tokens=256,
                              doc="austen_emma")
    yield model, tok, skew
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run(smol):
    model, tok, skew = smol
    ids = ev.passage_ids(tok, "jargon", 0, TOKENS)
    offloaded = (model.config.num_hidden_layers - 1) * ((TOKENS - 1) // BS)
    rows = [
        ev.Full(),
        ev.InfiniGen(10 ** 6, skew, alpha=1e9, name="infinigen-all"),  # nothing left out
        ev.H2O(BUDGET),
        ev.InfiniGen(BUDGET, skew, alpha=4.0, block_size=BS, trace=True),
        ev.Offload(BUDGET, skew, alpha=math.inf, cap=1.0, block=BS),  # the plugin's rule
        ev.Offload(BUDGET, skew, block=BS),
    ]
    nll = ev.DenseRun(model, rows).run(ids)
    return model, ids, rows, nll, offloaded


def test_shapes_and_full_row_matches_one_hf_forward(run):
    model, ids, rows, nll, _ = run
    assert nll.shape == (len(rows), TOKENS - 1) and torch.isfinite(nll).all()
    with torch.no_grad():
        ref = -model(ids[None]).logits[0, :-1].log_softmax(-1).gather(1, ids[1:, None])[:, 0]
    torch.testing.assert_close(nll[0], ref, rtol=1e-4, atol=1e-4)
    assert model.config._attn_implementation == "eager"  # restored after the run
    assert not any(hasattr(layer.self_attn, "kvevict_run") for layer in model.model.layers)


def test_unbounded_infinigen_equals_the_full_cache(run):
    _, _, rows, nll, _ = run
    torch.testing.assert_close(nll[1], nll[0], rtol=1e-5, atol=1e-5)
    s = rows[1].summary()
    assert s["recall"][1:] == [1.0] * 29 and min(s["mass"][1:]) > 1 - 1e-5
    assert not s["binding"]
    # every past token selected: t at steps t = 1 .. T - 2, (T - 1) / 2 on average
    assert s["selected"][1:] == pytest.approx([(TOKENS - 1) / 2] * 29)


def test_the_plugins_rule_fetching_everything_equals_the_full_cache(run):
    """Offload (resident sinks + recent, the rest on the host): with alpha = inf
    and no cap every host token comes back, so the perplexity is the full
    cache's; with the defaults it is not (something was left on the host)."""
    _, _, rows, nll, _ = run
    torch.testing.assert_close(nll[4], nll[0], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(nll[5]).all() and not torch.allclose(nll[5], nll[0], atol=1e-3)


def test_budgeted_methods_respect_the_budget_and_lose_little(run):
    _, _, rows, nll, _ = run
    h2o, ig = rows[2], rows[3]
    assert all(pos.shape == (3, BUDGET) for pos in h2o.pos.values())
    s = ig.summary()
    assert s["binding"] and max(s["selected"]) <= BUDGET and min(s["selected"][1:]) >= 1
    assert all(0 < r < 1 for r in s["recall"][1:])  # a budget that binds: not everything
    assert all(0.3 < m <= 1 + 1e-6 for m in s["mass"][1:])
    full = math.exp(nll[0].mean())
    for r in (2, 3):
        ppl = math.exp(nll[r].mean())
        assert full * 0.95 < ppl < full * 3, (rows[r].name, ppl, full)
    assert not torch.equal(nll[3], nll[0]) and not torch.equal(nll[2], nll[0])
    # the first BUDGET + 1 tokens fit: H2O is exact there (same ops, bit-identical)
    assert torch.equal(nll[2, :BUDGET], nll[0, :BUDGET])
    assert not torch.equal(nll[2, BUDGET + 1:], nll[0, BUDGET + 1:])


def test_trace_and_its_replay_on_pools(run):
    _, _, rows, nll, offloaded = run
    ig = rows[3]
    capacity = int(0.8 * offloaded)
    inserts = [e for e in ig.trace if e[0] == "insert"]
    assert len(inserts) == offloaded  # every full block of layers 1..29, once
    assert {key[1] for _, key in inserts} == set(range(1, 30))
    prefetches = [e for e in ig.trace if e[0] == "prefetch"]
    assert len(prefetches) == 29 * (TOKENS - 2)  # layers >= 1, steps t >= 1
    stats = {p: replay(ig.trace, capacity, p, 12288) for p in ("counter", "lru", "fifo")}
    unlimited = replay(ig.trace, offloaded, "fifo", 12288)
    assert unlimited.hit_rate == 1.0 and unlimited.evictions == 0
    for p, s in stats.items():
        assert s.peak_blocks == capacity and s.evictions == offloaded - capacity, p
        assert s.hit_rate < 1.0, p
        assert s.bytes_out < unlimited.bytes_out


def test_evaluate_with_pools_in_the_loop_and_markdown(smol):
    model, tok, skew = smol
    ids = ev.passage_ids(tok, "jargon", 0, 48)
    res = ev.evaluate(model, ids, 8, skew, window=20, block_size=8,
                      methods=("full", "h2o", "infinigen", "infinigen@first=2@query=exact"),
                      pool_policies=("counter", "fifo"))
    assert res.names == ["full", "h2o", "infinigen", "infinigen@first=2@query=exact",
                         "infinigen+counter", "infinigen+fifo"]
    variant = res.summaries["infinigen@first=2@query=exact"]
    assert variant["first_layer"] == 2 and variant["selected"][1] == 0  # layer 1: full cache
    assert variant["selected"][2] > 0
    assert len(res.windows("full")) == 3  # 47 targets: 20 + 20 + 7
    text = ev.markdown(res)
    assert "| full |" in text and "| 1 | 0." in text and "| 0 | - |" in text
    assert "| counter |" in text
    assert [r["policy"] for r in res.pool_replay] == ["unlimited", "counter", "fifo",
                                                      "(fetch all offloaded)"]
    assert res.pool_replay[-1]["bytes_per_token"] >= res.pool_replay[0]["bytes_per_token"]
    offloaded = 29 * (47 // 8)
    capacity = int(0.8 * offloaded)
    assert res.config["offloaded_blocks"] == offloaded and res.config["pool_capacity"] == capacity
    for policy in ("counter", "fifo"):
        st = res.summaries[f"infinigen+{policy}"]["pool"]
        assert st["peak_blocks"] == capacity and st["evictions"] == offloaded - capacity
        assert st["prefetch_misses"] == 0  # evicted blocks are never selected in the loop
        assert st["prefetch_hits"] > 0
    # until the pool fills, the pooled rows are the plain InfiniGen row (to float
    # rounding: rows of one batch are not bit-identical on every CPU; CI's differed)
    first_eviction = 8 * (capacity // 29 + 1)  # blocks fill all layers together
    full_nll = res.nll[res.names.index("infinigen")]
    for policy in ("counter", "fifo"):
        pooled = res.nll[res.names.index(f"infinigen+{policy}")]
        torch.testing.assert_close(pooled[:first_eviction - 1], full_nll[:first_eviction - 1],
                                   rtol=1e-5, atol=1e-5)


def test_parse_method_specs():
    assert ev.parse_method("full") == ("full", {})
    assert ev.parse_method("infinigen-noskew") == ("infinigen", {"skew": 0})
    assert ev.parse_method("infinigen@alpha=8@first=2@query=exact") == (
        "infinigen", {"alpha": 8.0, "first": 2, "query": "exact"})
    assert ev.parse_method("h2o@recent=16") == ("h2o", {"recent": 16})
    for bad in ("snapkv", "h2o@alpha=3", "infinigen@first=x", "full@budget=3"):
        with pytest.raises(ValueError):
            ev.parse_method(bad)
    with pytest.raises(ValueError):
        ev.InfiniGen(8, sk.Skewing.identity(2, 1, 4), first_layer=0)
    with pytest.raises(ValueError):
        ev.InfiniGen(8, sk.Skewing.identity(2, 1, 4), query="oracle")
