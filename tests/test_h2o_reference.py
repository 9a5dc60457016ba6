"""H2O in vLLM against a dense plain-torch H2O reference on the same model.

The reference (first half of this file) runs SmolLM2 with Hugging Face's own
modules (embeddings, RoPE, projections, norms, MLP, lm_head) but its own
attention loop, over dense (layer, KV head, position) tensors, so that every
KV head of every layer can hold a different set of resident tokens. It follows
H2O's Algorithm 1 (Zhang et al. 2023, arXiv:2306.14048):

  * Score: each resident key's score is the attention it has received, summed
    over every query so far (prompt queries through the causal prefill, then
    one per decode step) and over the query heads sharing the KV head (GQA).
    Softmaxes run over resident keys only (evicted keys are gone).
  * Evict: lines 11-13 of Algorithm 1, "drop u = the resident token whose
    removal keeps the most attention mass", i.e. the lowest score, repeated
    one token at a time until the cache is back at the budget. The newest
    `recent` resident tokens are never candidates (the paper's recent window).

What the reference shares with the plugin is only the *schedule* (when and to
what size to evict), which is vLLM's block bookkeeping rather than H2O itself:
before feeding the token at logical position L with P tokens resident, evict
down to budget - block_size if P > budget (before a prompt chunk) or P >= budget
(before a decode step): the budget is a cap, and a compaction leaves one block
free; see vllm_kvevict/core/eviction/planner.py. Scores are frozen during
one eviction batch (the plugin evicts a block's worth of tokens at once). RoPE
positions stay logical.

The vLLM half runs the plugin in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
records the kept logical positions of every compaction (tests/kept_positions.py),
and the tests compare them, and the greedy tokens, with the reference: exact in fp32, every
(layer, KV head) kept set of every compaction (270/270 per prompt, 180/180
with the prefix hit; a tie in the reference's scores fails H2O's tests too).
The last test serves a prefix-cache hit: the request's scores of the shared
tokens live in private rows (core/scoring/private_scores.py), and its reference counts
only the queries it computed.
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker in this process

import pytest
import torch
from kept_positions import KeptRecorder

from vllm_kvevict.core.eviction.kernel_dispatch import cpu_copier

BUDGET, RECENT, BLOCK = 64, 16, 32
CHUNK = 128  # max_num_batched_tokens: the 150-token prompt is prefilled in 2 chunks
MAX_TOKENS = 72
TIE_RTOL, TIE_ATOL = 1e-4, 1e-6  # reference scores this close count as ties


# ---------------------------------------------------------------------------
# Dense reference
# ---------------------------------------------------------------------------

class DenseH2O:
    """Greedy decoding of an HF Llama with per-(layer, KV head) resident masks.

    K, V:      (layers, kv_heads, T, head_dim)  post-RoPE keys / values by logical position
    Q:         (layers, q_heads, T, head_dim)   post-RoPE queries (for window policies)
    resident:  (layers, kv_heads, T) bool       token t is in head h's cache
    score:     (layers, kv_heads, T) float64    accumulated attention (H2O's F_score terms)

    windowed: (layers,) bool  a hybrid model's sliding-window layers: each query sees
                              the newest `window` positions (itself included), and
                              they never evict (tests/test_sliding_window.py)
    """

    def __init__(self, model, total_len: int, windowed: list[bool] | None = None,
                 window: int | None = None) -> None:
        self.model, cfg = model, model.config
        self.nl, self.hq, self.hk = (cfg.num_hidden_layers, cfg.num_attention_heads,
                                     cfg.num_key_value_heads)
        self.d = cfg.head_dim
        self.windowed, self.window = windowed or [False] * self.nl, window
        self.evicting = [li for li in range(self.nl) if not self.windowed[li]]
        shape = (self.nl, self.hk, total_len)
        self.K = torch.zeros(*shape, self.d)
        self.V = torch.zeros(*shape, self.d)
        self.Q = torch.zeros(self.nl, self.hq, total_len, self.d)
        self.resident = torch.zeros(shape, dtype=torch.bool)
        self.score = torch.zeros(shape, dtype=torch.float64)

    @torch.no_grad()
    def forward(self, ids: list[int], pos: torch.Tensor) -> torch.Tensor:
        """Feed tokens `ids` at logical positions `pos`; return the last token's logits."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        m = self.model.model
        n, hq, hk, d = len(ids), self.hq, self.hk, self.d
        g = hq // hk
        x = m.embed_tokens(torch.tensor([ids]))  # (1, n, hidden)
        cos, sin = m.rotary_emb(x, pos[None])
        kpos = torch.arange(self.K.shape[2])
        for li, layer in enumerate(m.layers):
            at = layer.self_attn
            h = layer.input_layernorm(x)
            q = at.q_proj(h).view(1, n, hq, d).transpose(1, 2)  # (1, hq, n, d)
            k = at.k_proj(h).view(1, n, hk, d).transpose(1, 2)
            v = at.v_proj(h).view(1, n, hk, d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.K[li][:, pos], self.V[li][:, pos] = k[0], v[0]
            self.Q[li][:, pos] = q[0]
            self.resident[li][:, pos] = True  # a new token starts resident, score 0
            # Query i may see key t iff t is resident in this head and t <= pos[i].
            visible = self.resident[li][:, None, :] & (kpos[None, None, :] <= pos[None, :, None])
            if self.windowed[li]:
                visible &= kpos[None, None, :] > pos[None, :, None] - self.window
            qg = q[0].view(hk, g, n, d)  # query heads grouped by their KV head
            logits = torch.einsum("hgnd,htd->hgnt", qg, self.K[li]) * at.scaling
            logits = logits.masked_fill(~visible[:, None], float("-inf"))
            probs = logits.softmax(dim=-1)  # (hk, g, n, T), zero on evicted/future keys
            self.score[li] += probs.sum(dim=(1, 2)).double()  # accumulate over group and queries
            o = torch.einsum("hgnt,htd->hgnd", probs, self.V[li])  # (hk, g, n, d)
            o = o.reshape(hq, n, d).transpose(0, 1).reshape(1, n, hq * d)
            x = x + at.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(m.norm(x))[0, -1]

    def evict(self, target: int, recent: int) -> None:
        """Algorithm 1, lines 11-13, repeated until each head holds `target` tokens."""
        for li in self.evicting:
            for h in range(self.hk):
                res, s = self.resident[li, h], self.score[li, h]
                order = res.nonzero().flatten()  # resident positions, oldest first
                candidates = order[: len(order) - recent]  # the recent window is exempt
                for _ in range(len(order) - target):
                    alive = candidates[res[candidates]]
                    u = alive[s[alive].argmin()]  # least attended: removing it loses least
                    res[u] = False

    def held(self) -> int:
        """Tokens resident in an evicting layer's cache (every head holds as many)."""
        return int(self.resident[self.evicting[0], 0].sum())

    def kept(self) -> torch.Tensor:
        """(evicting layers, kv_heads, P) resident logical positions, ascending."""
        res = self.resident[self.evicting]
        return res.nonzero()[:, 2].view(len(self.evicting), self.hk, -1)

    def set_kept(self, kept: torch.Tensor) -> None:
        res = torch.zeros_like(self.resident[self.evicting])
        self.resident[self.evicting] = res.scatter_(2, kept, True)


def h2o_generate(model, prompt: list[int], max_tokens: int, budget: int, recent: int,
                 block_size: int, chunk: int | None = None, on_evict=None, make_ref=DenseH2O,
                 cached: int = 0, schedule=None):
    """Greedy tokens and, per eviction, (logical_len, kept positions, scores before).

    The plugin's schedule (planner.py), checked before feeding position L with
    P tokens resident: between prompt chunks evict when P > budget, in decode
    when P >= budget; both evict down to `budget - block_size` (budget >= two
    blocks here), `recent` of them the newest.

    on_evict(L, kept, scores) -> kept, if given, sees each eviction and may
    overrule it (the test adopts the engine's choice between tied scores, so
    one tie does not make every later step incomparable). make_ref builds the
    dense model (another policy's subclass reuses this schedule). cached: the
    first `cached` prompt tokens come from the prefix cache: their KV is there,
    but their queries are not run again, so they add nothing to any score.
    schedule: the logical lengths at which decode evicts, instead of the rule
    above (speculative decoding compacts a step early when its drafts would
    not fit: tests/test_speculative_decoding.py).
    """
    assert budget >= 2 * block_size, "the schedule below assumes a whole block of room"
    ref = make_ref(model, len(prompt) + max_tokens)
    evictions = []

    def maybe_evict(L: int, limit: int, decode: bool = False) -> None:
        if (L in schedule) if decode and schedule is not None else ref.held() > limit:
            ref.evict(budget - block_size, recent)
            scores = ref.score[ref.evicting].clone()  # what the eviction ranked by (evict leaves it)
            kept = ref.kept()
            if on_evict is not None:
                kept = on_evict(L, kept, scores)
                ref.set_kept(kept)
            evictions.append((L, kept, scores))

    if cached:
        ref.forward(prompt[:cached], torch.arange(cached))
        ref.score.zero_()
    chunk = chunk or len(prompt) - cached
    for c0 in range(cached, len(prompt), chunk):
        if c0 > cached:  # between chunks; a hit is followed by its prompt's rest
            maybe_evict(c0, budget)
        ids = prompt[c0:c0 + chunk]
        logits = ref.forward(ids, torch.arange(c0, c0 + len(ids)))
    out = [int(logits.argmax())]
    for L in range(len(prompt), len(prompt) + max_tokens - 1):
        maybe_evict(L, budget - 1, decode=True)
        out.append(int(ref.forward([out[-1]], torch.tensor([L])).argmax()))
    return out, evictions


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------

def _prompts(tokenizer) -> list[list[int]]:
    chat = [
        "Explain, step by step and in detail, how a hash table handles collisions. "
        "Cover separate chaining, open addressing with linear and quadratic probing, "
        "double hashing, load factors and resizing, and give the time complexity of "
        "insert, lookup and delete in the average and the worst case for each scheme. "
        "Finish with advice on choosing a hash function for string keys.",
        "Write a short story about a lighthouse keeper on a remote island who finds a "
        "message in a bottle. The story should have a beginning, a middle and an end, "
        "describe the weather, the sea, the keeper's daily routine and the old lamp, "
        "and end with a surprising twist about who wrote the message and why.",
    ]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": c}],
                                         add_generation_prompt=True, tokenize=False)
           for c in chat]
    ids = [tokenizer(s, add_special_tokens=False).input_ids for s in ids]
    with open("/usr/share/common-licenses/Apache-2.0") as f:
        text = f.read()
    start = text.index("2. Grant of Copyright License.")
    ids.append(tokenizer(text[start:], add_special_tokens=False).input_ids[:150])
    return ids


@pytest.fixture(scope="module")
def prompts(hf):
    ps = _prompts(hf[1])
    assert all(BUDGET < len(p) <= 200 for p in ps), [len(p) for p in ps]
    return ps


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for the reference and the engine. On this 2-core box,
    shared with other jobs, vLLM's default (one OMP thread bound to each core)
    makes every op wait for a busy core: measured ~1 s per token instead of ~35 ms.
    torch._C.set_num_threads is what torch.set_num_threads is; vLLM's CPU
    worker replaces the latter with a no-op once an engine exists."""
    old = torch.get_num_threads()
    torch._C.set_num_threads(1)
    yield
    torch._C.set_num_threads(old)


@pytest.fixture(scope="module")
def llm(model_path, engines):
    from vllm import LLM

    from vllm_kvevict.integration.worker import worker_state

    engines.close()  # one in-process engine at a time
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # keep the single thread
        engine = LLM(model_path, enforce_eager=True, dtype="float32", block_size=BLOCK,
                     max_model_len=1024, kv_cache_memory_bytes=64 << 20, seed=0,
                     max_num_batched_tokens=CHUNK,
                     additional_config={"kv_eviction": "h2o", "kv_budget": BUDGET,
                                        "kv_recent": RECENT})
    torch._C.set_num_threads(1)
    assert worker_state() is not None, "no in-process worker state: is multiprocessing on?"
    yield engine
    from conftest import close

    close(engine)


def _vllm_generate(llm, prompt: list[int], max_tokens: int, extra_args: dict | None = None,
                   salt: str | None = None, kernel_selects: bool = False):
    """Greedy tokens; per compaction (plan, kept positions (L, H, new_len)); and
    the number of prompt tokens served from the prefix cache. `extra_args`: the
    request's own settings (e.g. {"kv_prefill_cap": 0}); `salt`: a cache_salt
    (requests with different salts never share prefix-cache blocks);
    kernel_selects: assert that every compaction's kept set came from the
    compiled kernel's selection (`select_and_fill_holes`) where it is built."""
    from vllm import SamplingParams

    from vllm_kvevict.integration.worker import worker_state

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                        extra_args=extra_args)
    recorder = KeptRecorder(worker_state())
    try:
        [res] = llm.generate([{"prompt_token_ids": prompt,
                               **({"cache_salt": salt} if salt else {})}], sp, use_tqdm=False)
    finally:
        recorder.remove()
    snaps = recorder.compactions
    assert len({p.req_id for p, _ in snaps}) <= 1, "one request per generate call"
    if kernel_selects and cpu_copier() is not None:
        assert recorder.selected_by == {"kernel": len(snaps), "select": 0}, recorder.selected_by
    return list(res.outputs[0].token_ids), snaps, res.num_cached_tokens


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

def test_reference_without_eviction_is_the_hf_model(hf, prompts):
    """The dense attention loop reproduces HF's own forward pass (no eviction)."""
    model, _ = hf
    p = prompts[0][:80]
    ref = DenseH2O(model, len(p))
    mine = torch.stack([ref.forward(p[:40], torch.arange(40))]
                       + [ref.forward([t], torch.tensor([i])) for i, t in enumerate(p[40:], 40)])
    with torch.no_grad():
        theirs = model(torch.tensor([p])).logits[0, 39:]
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    # H2O scores: every query's attention sums to 1 per query head.
    cfg = model.config
    assert torch.allclose(ref.score.sum(dim=(1, 2)),
                          torch.full((cfg.num_hidden_layers,),
                                     float(cfg.num_attention_heads * len(p)),
                                     dtype=torch.float64))


def _tie_explained(scores: torch.Tensor, ref_kept: torch.Tensor, got: torch.Tensor,
                   recent_from: int) -> bool:
    """Do the disagreeing positions all score within tolerance of the boundary?"""
    heavy = ref_kept[ref_kept < recent_from]
    if heavy.numel() == 0:
        return False
    boundary = scores[heavy].min()  # the weakest heavy hitter the reference kept
    diff = set(ref_kept.tolist()) ^ set(got.tolist())
    s = scores[torch.tensor(sorted(diff))]
    return bool(((s - boundary).abs() <= TIE_RTOL * boundary.abs() + TIE_ATOL).all())


class KeptSetChecker:
    """`on_evict` callback: at each reference eviction, compare the engine's
    kept sets (snaps from `_vllm_generate`, in order) per (layer, KV head) with
    the reference's. A difference the reference's scores call a tie (at the
    boundary of what it kept, below the `recent` window) adopts the engine's
    choice, so one tie does not make every later step incomparable; any other
    difference goes to `report`."""

    def __init__(self, snaps, recent: int) -> None:
        self.engine, self.recent = iter(snaps), recent
        self.exact = self.ties = 0
        self.report: list[str] = []

    @property
    def total(self) -> int:
        return self.exact + self.ties + len(self.report)

    def summary(self) -> str:
        return (f"{self.exact}/{self.total} (layer, head) kept sets exact, {self.ties} ties, "
                f"{len(self.report)} unexplained")

    def __call__(self, L, want, scores):
        plan, got = next(self.engine, (None, None))
        assert plan is not None, f"the reference evicts at L={L}, the engine did not"
        assert plan.logical_len == L, f"engine compacted at {plan.logical_len}, reference at {L}"
        assert got.shape == want.shape, (got.shape, want.shape)
        want = want.clone()
        for li in range(got.shape[0]):
            for h in range(got.shape[1]):
                g, w = got[li, h], want[li, h]
                if torch.equal(g, w):
                    self.exact += 1
                elif _tie_explained(scores[li, h], w, g, L - self.recent):
                    self.ties += 1
                    want[li, h] = g
                else:
                    self.report.append(
                        f"L={L} layer {li} head {h}: engine-only "
                        f"{sorted(set(g.tolist()) - set(w.tolist()))} reference-only "
                        f"{sorted(set(w.tolist()) - set(g.tolist()))}")
        return want


# How the engine prefills a prompt longer than a chunk (CHUNK), and the
# reference's schedule for it: "end", the default, keeps the prompt whole and
# compacts it after its last chunk, which is the reference prefilling it in one
# piece; "chunks" (--kv-prefill-cap 0) compacts between chunks.
PREFILL = {"end": (None, None), "chunks": ({"kv_prefill_cap": 0}, CHUNK)}


@pytest.mark.parametrize("idx,prefill", [(0, "end"), (1, "end"), (2, "end"), (2, "chunks")])
def test_h2o_matches_dense_reference(llm, hf, prompts, idx, prefill):
    model, _ = hf
    prompt = prompts[idx]
    extra, chunk = PREFILL[prefill]
    # Its own salt: another case's run of the same prompt must not be a prefix hit.
    got_tokens, snaps, cached = _vllm_generate(llm, prompt, MAX_TOKENS, extra,
                                               salt=f"h2o-{idx}-{prefill}", kernel_selects=True)
    assert cached == 0
    assert all(p.new_len == BUDGET - BLOCK for p, _ in snaps)

    check = KeptSetChecker(snaps, RECENT)
    ref_tokens, evictions = h2o_generate(model, prompt, MAX_TOKENS, BUDGET, RECENT, BLOCK,
                                         chunk=chunk, on_evict=check)
    print(f"\nprompt {idx}: {len(prompt)} tokens, compactions at "
          f"L={[L for L, _, _ in evictions]}, {check.summary()}; "
          f"tokens equal: {got_tokens == ref_tokens}")
    assert [p.logical_len for p, _ in snaps] == [L for L, _, _ in evictions]
    assert len(evictions) >= 2, "the test should exercise repeated compactions"
    if len(prompt) > CHUNK:  # first compacted after its last chunk, or before its second
        assert snaps[0][0].logical_len == (len(prompt) if prefill == "end" else CHUNK)
    assert not check.report, "\n".join(check.report[:20])
    # Every kept set exact, no tie taken (3 compactions x 30 layers x 3 KV heads).
    assert check.exact == check.total == 270, check.summary()
    first_diff = next((i for i, (a, b) in enumerate(zip(got_tokens, ref_tokens)) if a != b),
                      None)
    assert got_tokens == ref_tokens, f"first differing generated token: {first_diff}"


def test_h2o_with_a_prefix_hit_matches_dense_reference(llm, hf):
    """B shares its first 3 blocks (96 tokens) with A, which ran first and left
    them in the prefix cache, holding A's scores at their slots. B gets the
    96-token hit; neither request's compaction writes those blocks; B's scores
    of the shared tokens live in private rows, so B's kept sets and tokens equal
    the reference of B that counts only the queries B computed. Scoring into
    the shared slots instead (A's stale scores plus B's) fails this test."""
    model, tok = hf
    with open("/usr/share/common-licenses/MPL-2.0") as f:
        ids = tok(f.read(), add_special_tokens=False).input_ids
    a, b = ids[:120], ids[:96] + ids[300:400]
    salt = "h2o-prefix-hit"
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    _, a_snaps, a_cached = _vllm_generate(llm, a, 4, salt=salt)
    assert a_cached == 0 and a_snaps, "A compacts after its prompt"
    pool = _block_pool(llm)
    hashed = {h: blk.block_id for h, blk in _cached_blocks(pool)}
    before = _block_bytes(sorted(hashed.values()))
    deferred = _worker().chunk_log.deferred_tokens
    got_tokens, snaps, cached = _vllm_generate(llm, b, 40, salt=salt)
    # B's 100 uncached prompt tokens were scored at the next step's start.
    assert _worker().chunk_log.deferred_tokens == deferred + len(b) - cached
    assert cached == 96, f"B should reuse A's 3 full blocks, got {cached} cached tokens"
    still = [hashed[h] for h, blk in _cached_blocks(pool) if hashed.get(h) == blk.block_id]
    assert len(still) >= 3
    after = _block_bytes(still)
    assert all(torch.equal(before[blk], after[blk]) for blk in still), "a cached block was written"
    assert not _open_private_rows(), "private rows are dropped once B is compacted or done"
    check = KeptSetChecker(snaps, RECENT)
    ref_tokens, evictions = h2o_generate(model, b, 40, BUDGET, RECENT, BLOCK, on_evict=check,
                                         cached=96)
    print(f"\nprefix hit: compactions at L={[L for L, _, _ in evictions]}, {check.summary()}")
    assert [p.logical_len for p, _ in snaps] == [L for L, _, _ in evictions]
    assert len(snaps) >= 2 and snaps[0][0].logical_len == len(b)
    assert not check.report, "\n".join(check.report[:20])
    assert check.exact == check.total == 180, check.summary()  # 2 compactions, no tie
    assert got_tokens == ref_tokens


def _worker():
    from vllm_kvevict.integration.worker import worker_state

    return worker_state()


def _open_private_rows() -> dict:
    return _worker().private.tokens


def _block_pool(engine):
    from vllm_kvevict.probe import scheduler_of

    return scheduler_of(engine).kv_cache_manager.block_pool


def _cached_blocks(pool):
    """(hash, block) of every block in vLLM's prefix cache."""
    table = pool.cached_block_hash_to_block
    out = []
    for h in list(table._cache):
        blk = table.get_one_block(h)
        if blk is not None:
            out.append((h, blk))
    return out


def _block_bytes(block_ids: list[int]) -> dict[int, torch.Tensor]:
    """Every layer's KV of these blocks, copied: block id -> (L, ...) tensor."""
    from vllm_kvevict.integration.worker import worker_state

    layers = worker_state().layers.values()
    return {b: torch.stack([lc.kv_cache[b].clone() for lc in layers]) for b in block_ids}

