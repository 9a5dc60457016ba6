"""InfiniGen's skewing (vllm_kvevict.core.offload.skewing): the weight fold for non-RoPE
models on random OPT-like weights, the post-RoPE path on the real SmolLM2, the
partial channels, the decode-time prediction helpers, and the cache."""
import json
import shutil

import pytest
import torch

from vllm_kvevict import calibrate
from vllm_kvevict.core.offload import skewing as sk
from vllm_kvevict.core.offload import skewing_store

# ---------------------------------------------------------------------------
# Pure tensor checks
# ---------------------------------------------------------------------------

def random_orthogonal(h, d, gen):
    return torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0]


def rope_tables(t, d, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()  # (T, D)


def attention(x, wq, wk, wv, bq, bk, hq, h, d, rope=False):
    """Causal multi-head attention of x (T, hidden), OPT-like (biases, no RoPE)
    or with RoPE; returns (T, H_q * D)."""
    t = x.shape[0]
    q = (x @ wq.T + bq).view(t, hq, d).transpose(0, 1)
    k = (x @ wk.T + bk).view(t, h, d).transpose(0, 1)
    v = (x @ wv.T).view(t, h, d).transpose(0, 1)
    if rope:
        cos, sin = rope_tables(t, d)
        q, k = sk.rope(q, cos, sin), sk.rope(k, cos, sin)
    g = hq // h
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    logits = q @ k.transpose(1, 2) / d ** 0.5
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return (logits.softmax(-1) @ v).transpose(0, 1).reshape(t, hq * d)


@pytest.mark.parametrize("hq,h", [(4, 4), (6, 2)])
def test_fold_into_weights_keeps_attention_without_rope(hq, h):
    gen = torch.Generator().manual_seed(0)
    d, hidden, t = 16, 48, 20
    x = torch.randn(t, hidden, generator=gen, dtype=torch.float64)
    wq, wk, wv = (torch.randn(n * d, hidden, generator=gen, dtype=torch.float64) * 0.2
                  for n in (hq, h, h))
    bq = torch.randn(hq * d, generator=gen, dtype=torch.float64)
    bk = torch.randn(h * d, generator=gen, dtype=torch.float64)
    a = random_orthogonal(h, d, gen)
    base = attention(x, wq, wk, wv, bq, bk, hq, h, d)
    wq2, wk2, bq2, bk2 = sk.fold_into_weights(wq, wk, a, bq, bk)
    assert wq2.shape == wq.shape and bk2.shape == bk.shape
    torch.testing.assert_close(attention(x, wq2, wk2, wv, bq2, bk2, hq, h, d), base,
                               rtol=1e-9, atol=1e-9)
    # folded queries are the skewed queries
    q = (x @ wq.T + bq).view(t, hq, d).transpose(0, 1)
    torch.testing.assert_close((x @ wq2.T + bq2).view(t, hq, d).transpose(0, 1),
                               sk.skew_queries(q, a))
    # control: A folded into W_Q only does change attention
    assert not torch.allclose(attention(x, wq2, wk, wv, bq2, bk, hq, h, d), base, atol=1e-3)
    # and so does folding into a RoPE model: why RoPE models skew post-RoPE
    rope_base = attention(x, wq, wk, wv, bq, bk, hq, h, d, rope=True)
    rope_folded = attention(x, wq2, wk2, wv, bq2, bk2, hq, h, d, rope=True)
    assert (rope_folded - rope_base).abs().max() > 1e-2


def test_post_rope_skew_keeps_logits_on_random_rope_attention():
    gen = torch.Generator().manual_seed(1)
    hq, h, d, t = 6, 2, 16, 24
    q = torch.randn(hq, t, d, generator=gen, dtype=torch.float64)
    k = torch.randn(h, t, d, generator=gen, dtype=torch.float64)
    cos, sin = rope_tables(t, d)
    q, k = sk.rope(q, cos, sin), sk.rope(k, cos, sin)
    a = random_orthogonal(h, d, gen)
    logits = q @ k.repeat_interleave(3, 0).transpose(1, 2)
    skewed = sk.skew_queries(q, a) @ sk.skew_keys(k, a).repeat_interleave(3, 0).transpose(1, 2)
    torch.testing.assert_close(skewed, logits, rtol=1e-9, atol=1e-9)


def test_skew_matrix_is_orthogonal_and_sorts_channels_by_singular_value():
    gen = torch.Generator().manual_seed(2)
    # a few large directions, not aligned with the axes
    q = torch.randn(200, 32, generator=gen) @ torch.diag(torch.linspace(5, 0.1, 32)) \
        @ random_orthogonal(1, 32, gen)[0].float()
    a = sk.skew_matrix(q)
    torch.testing.assert_close(a.T @ a, torch.eye(32), atol=1e-5, rtol=0)
    norms = (q @ a).norm(dim=0)
    torch.testing.assert_close(norms, torch.linalg.svdvals(q.double()).float(), rtol=1e-4,
                               atol=1e-4)
    c = 8  # Ky Fan: the first C skewed channels hold the most energy of any C channels
    assert (norms[:c] ** 2).sum() > (q.norm(dim=0) ** 2).topk(c).values.sum() * 1.2
    short = sk.skew_matrix(torch.randn(5, 32, generator=gen))  # N < D: still D x D
    torch.testing.assert_close(short.T @ short, torch.eye(32), atol=1e-5, rtol=0)


def test_select_columns_and_packed_layout():
    gen = torch.Generator().manual_seed(3)
    hq, h, d, t, layers = 6, 2, 20, 30, 2
    qk = []
    for _ in range(layers):
        scale = torch.ones(d)
        scale[[3, 11, 17]] = 30.0  # outlier channels
        qk.append((torch.randn(hq, t, d, generator=gen) * scale,
                   torch.randn(h, t, d, generator=gen) * scale))
    plain = sk.skewing_from_qk(qk, fraction=0.15, skew=False)
    assert plain.num_partial == 3
    assert sorted(plain.cols[0, 0].tolist()) == [3, 11, 17]
    skewed = sk.skewing_from_qk(qk, fraction=0.3)
    packed = skewed.packed()
    assert packed.is_packed and not skewed.is_packed
    c = packed.num_partial
    for li, (q, k) in enumerate(qk):
        a, ap = skewed.a[li], packed.a[li]
        torch.testing.assert_close(ap.transpose(1, 2) @ ap, torch.eye(d).expand(h, d, d),
                                   atol=1e-5, rtol=0)
        qs, ks = sk.skew_queries(q, a), sk.skew_keys(k, a)
        for head in range(h):
            cols = skewed.cols[li, head]
            want = qs[3 * head][:, cols] @ ks[head][:, cols].T
            got = sk.skew_queries(q, ap)[3 * head][:, :c] @ sk.skew_keys(k, ap)[head][:, :c].T
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("hq,h", [(4, 4), (9, 3)])
def test_partial_attention_torch_matches_the_reference(hq, h):
    from vllm_kvevict.triton_kernels.reference import partial_attention_ref

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, hq, 16, generator=gen)
    k = torch.randn(3, h, 40, 16, generator=gen)
    cols = torch.tensor([7, 0, 3, 12, 5])
    lengths = torch.tensor([40, 17, 0])
    for alpha in (0.5, 3.0, 1e9):
        logits, counts = sk.partial_attention_torch(q, k, cols, lengths, alpha, 0.25)
        ref_logits, ref_counts = partial_attention_ref(q, k, cols, lengths, alpha, 0.25)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(counts, ref_counts)
    assert counts[1].tolist() == [17] * hq and counts[2].tolist() == [0] * hq
    # cols=None: all channels of an already partial cache
    part_q, part_k = q[..., cols], k[..., cols]
    logits, counts = sk.partial_attention_torch(part_q, part_k, None, lengths, 3.0, 0.25)
    ref_logits, ref_counts = partial_attention_ref(q, k, cols, lengths, 3.0, 0.25)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(counts, ref_counts)


def test_speculate_threshold_budget_and_kernel_path(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    hq, h, n, c = 6, 2, 50, 5
    q = torch.randn(1, hq, c, generator=gen)
    k = torch.randn(1, h, n, c, generator=gen)
    length = torch.tensor([n])
    everything = sk.speculate(q, k, length, alpha=1e9, scale=1.0)[0]
    assert everything.shape == (hq, n)
    assert all(sorted(row.tolist()) == list(range(n)) for row in everything)
    assert sk.speculate(q, k, length, alpha=1e9, scale=1.0, budget=7)[0].shape == (hq, 7)
    logits = (k.repeat_interleave(3, 1) @ q[..., None])[0, :, :, 0]
    tight = sk.speculate(q, k, length, alpha=1e-6, scale=1.0)[0]
    assert tight.shape == (hq, 1) and torch.equal(tight[:, 0], logits.argmax(1))
    mid = sk.speculate(q, k, length, alpha=2.0, scale=1.0)[0]
    counts = (logits > logits.max(1, keepdim=True).values - 2.0).sum(1).float()
    assert mid.shape[1] == int(torch.ceil(counts.mean()))  # the mean count, every head
    # the Triton kernel (interpreted on CPU) selects the same tokens
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "triton")
    assert torch.equal(sk.speculate(q, k, length, alpha=2.0, scale=1.0)[0], mid)


# ---------------------------------------------------------------------------
# The real model (SmolLM2-135M: RoPE, 9 query / 3 KV heads, 30 layers)
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(hf):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is much faster on a busy box
    model, tok = hf  # the session's SmolLM2 (conftest), what calibrate.load_model loads
    ids = calibrate.calibration_ids(tok, "austen_persuasion", 0, 96)
    yield model, tok, ids
    torch.set_num_threads(threads)


def test_collect_qk_are_the_models_post_rope_queries_and_keys(smol):
    model, _, ids = smol
    qk = calibrate.collect_qk(model, ids)
    cfg = model.config
    assert len(qk) == cfg.num_hidden_layers
    with torch.no_grad():
        probs = model(ids, output_attentions=True).attentions
    t = ids.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    for li in (0, 7, 29):
        q, k = qk[li]
        assert q.shape == (9, t, 64) and k.shape == (3, t, 64)
        logits = q @ k.repeat_interleave(3, 0).transpose(1, 2) * 64 ** -0.5
        mine = logits.masked_fill(mask, float("-inf")).softmax(-1)
        torch.testing.assert_close(mine, probs[li][0], rtol=1e-4, atol=1e-5)


def test_post_rope_skewing_keeps_the_real_models_logits(smol):
    model, _, ids = smol
    qk = calibrate.collect_qk(model, ids)
    skew = sk.skewing_from_qk(qk)
    assert skew.a.shape == (30, 3, 64, 64) and skew.cols.shape == (30, 3, 19)
    for li, (q, k) in enumerate(qk):
        a = skew.a[li]
        logits = q @ k.repeat_interleave(3, 0).transpose(1, 2)
        skewed = sk.skew_queries(q, a) @ sk.skew_keys(k, a).repeat_interleave(3, 0).transpose(1, 2)
        tol = 1e-5 * logits.abs().max()
        assert (skewed - logits).abs().max() <= tol, li
        # the skewed queries' first C channels hold at least the energy of the
        # C strongest raw channels (SVD optimality), per KV head
        c = skew.num_partial
        qs = sk.skew_queries(q, a)
        for head in range(3):
            raw = q[3 * head:3 * head + 3].reshape(-1, 64)
            sk_ = qs[3 * head:3 * head + 3].reshape(-1, 64)
            assert (sk_[:, :c] ** 2).sum() >= (raw ** 2).sum(0).topk(c).values.sum() * 0.999
    # the rotation must be the right one: a random orthogonal A is also exact
    # but does not concentrate (control for the energy check above)
    q = qk[5][0][:3].reshape(-1, 64)
    rand = random_orthogonal(1, 64, torch.Generator().manual_seed(0))[0].float()
    assert ((q @ rand)[:, :19] ** 2).sum() < ((q @ skew.a[5, 0])[:, :19] ** 2).sum()


def test_partial_queries_and_keys_match_the_models_projection(smol):
    model, _, ids = smol
    seen = {}

    def hook(module, args, kwargs):
        seen[module.layer_idx] = (kwargs["hidden_states"][0], kwargs["position_embeddings"])

    layers = model.model.layers
    handles = [layers[i].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
               for i in (3, 4)]
    try:
        qk = calibrate.collect_qk(model, ids)
    finally:
        for hd in handles:
            hd.remove()
    packed = sk.skewing_from_qk(qk).packed()
    c = packed.num_partial
    x, (cos, sin) = seen[4]
    att = layers[4].self_attn
    a = packed.a[4]
    got = sk.partial_queries(x, att.q_proj.weight, a, c, cos[0], sin[0])  # (T, H_q, C)
    want = sk.skew_queries(qk[4][0], a)[..., :c].transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sk.partial_keys(qk[4][1], a, c),
                               sk.skew_keys(qk[4][1], a)[..., :c])
    # InfiniGen's speculation: layer 3's input through layer 4's W_Q
    x3 = seen[3][0]
    pred = sk.partial_queries(x3, att.q_proj.weight, a, c, cos[0], sin[0])
    cos_sim = torch.nn.functional.cosine_similarity(pred.flatten(1), got.flatten(1)).mean()
    assert 0.5 < cos_sim < 0.9999


def test_load_or_compute_caches_by_model_and_config(smol, model_path, tmp_path, monkeypatch):
    model, tok, _ = smol
    kwargs = dict(n_tokens=64, doc="austen_persuasion", cache_dir=tmp_path)
    first = calibrate.load_or_compute(model_path, model=model, tokenizer=tok, **kwargs)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and files[0].name.startswith("SmolLM2-135M-Instruct-")
    assert first.meta["rope"] == "post-rope" and first.meta["calibration_tokens"] == "64"

    def boom(*a, **k):
        raise AssertionError("recomputed although cached")

    monkeypatch.setattr(calibrate, "compute_skewing", boom)
    again = calibrate.load_or_compute(model_path, model=model, tokenizer=tok, **kwargs)
    assert torch.equal(again.a, first.a) and torch.equal(again.cols, first.cols)
    assert again.meta == first.meta
    with pytest.raises(AssertionError, match="recomputed"):  # other params: another entry
        calibrate.load_or_compute(model_path, model=model, tokenizer=tok, fraction=0.5, **kwargs)
    # the key follows the config's contents, not just the directory name
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(f"{model_path}/config.json", copy / "config.json")
    key = skewing_store.cache_key(copy, x=1)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (copy / "config.json").write_text(json.dumps(cfg))
    assert skewing_store.cache_key(copy, x=1) != key and skewing_store.cache_key(copy, x=2) != skewing_store.cache_key(copy, x=1)
