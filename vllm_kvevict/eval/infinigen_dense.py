"""Dense reference evaluation of InfiniGen vs H2O vs the full cache on the HF model.

    python -m vllm_kvevict.eval.infinigen_dense --tokens 2048 --budget 256

Teacher-forced decode, one token at a time, over a real passage (the project's
``perplexity`` instance of ``--doc``), reporting perplexity per ``--window``
tokens for every method. The methods run side by side as the rows of one
batch (same tokens, each row its own KV policy), so the weights are read once
per step for all of them.

One file because it is one experiment, end to end: the attention function, the
methods it compares and the report must change together to stay comparable.

How attention is replaced: a custom attention function is registered with
transformers' ``AttentionInterface`` and selected for the model; it receives
each layer's post-RoPE queries and the layer's full key/value cache (HF's
``DynamicCache`` keeps everything; a method decides what its row may see) and
hands each row to that row's method. A forward pre-hook on every ``self_attn``
records the layer's attention input (``hidden_states`` after the input norm)
and the rotary tables, which InfiniGen's prediction needs. No transformers code
is copied.

Methods (budget B = resident past tokens besides the current one):

  full       every token.
  h2o        H2O (``policies.H2OPolicy``): after each step, every layer and KV
             head keeps the ``recent`` newest tokens + the heaviest older ones by
             accumulated attention (summed over the GQA group), B in all; evicted
             tokens are gone for good. Every layer, layer 0 included.
  infinigen  layer 0 attends its full cache. Layer i >= 1: the speculated query
             is layer i-1's attention input times layer i's W_Q, RoPE'd, skewed
             (:mod:`vllm_kvevict.core.offload.skewing`, post-RoPE, packed) and cut to the
             partial channels; against layer i's partial skewed key cache it
             keeps the tokens above max - alpha, the mean count over heads for
             every head, at most B (:func:`vllm_kvevict.core.offload.skewing.speculate`).
             Layer i then attends those tokens + the current one only.
  infinigen-noskew  the same with A = I (channels still chosen by |Q| + |K|),
             the paper's "w/o skewing" ablation.
  infinigen@key=value...  variants (:func:`parse_method`): another alpha,
             budget, first speculated layer (``first=2``: layers 0 and 1 full),
             partial ``fraction``, ``skew=0``, or ``query=exact`` (oracle: layer
             i's own query instead of the prediction, to separate the
             cross-layer error from the threshold / channel error).
  offload    the rule the vLLM plugin ships (``--kv-eviction infinigen``):
             per layer the sinks + newest tokens stay resident (B, compacted
             by block), the rest is on the host; every layer speculates with
             its own query and attends resident + the host tokens among each
             head's top k (``offload.infinigen_decode_reference``).
             ``offload@alpha=A@cap=F@sink=S@block=N`` variants.
  infinigen+<policy>  InfiniGen with a host pool in the loop
             (:class:`vllm_kvevict.core.offload.host_pool.HostKVPool`, ``--pool-fraction`` of
             the run's offloaded blocks): a full block of a speculated layer is
             offloaded when it completes, the newest partial block stays on the
             device, an evicted block's tokens can no longer be selected, and
             every selected block is a prefetch (counter / LRU update).

Recall per layer (InfiniGen rows): per query head, the fraction of the true
top-B past tokens (by the exact attention of that row's own query over all of
its past tokens) that the prediction selected; also the true attention mass
on the selected tokens + the current one, and the mean selected count. Both
averaged over the steps whose past exceeds B (all steps if none does).

Host-pool policies are also compared on the access trace of the ``infinigen``
row (every offload and every prefetch of a block of a speculated layer), replayed on
a pool of ``--pool-fraction`` of the offloaded blocks: hit rate and bytes moved
per token (the paper's Table 2 setting, 80 %).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from vllm_kvevict import calibrate
from vllm_kvevict.core.offload import skewing as sk
from vllm_kvevict.core.offload.host_pool import HostKVPool, replay
from vllm_kvevict.core.policies import H2OPolicy
from vllm_kvevict.eval.tasks import window_perplexity

ATTN_NAME = "kvevict_dense"


# ---------------------------------------------------------------------------
# Attention of one row
# ---------------------------------------------------------------------------

def attention_probs(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax of one query per head over per-head key sets.

    q: (H_q, D); k: (H, n, D), shared by the G = H_q / H query heads of each KV
    head (H = H_q: each query head its own keys). Returns (H_q, n).
    """
    hq, d = q.shape
    h = k.shape[0]
    logits = torch.matmul(q.view(h, hq // h, d), k.transpose(1, 2)).view(hq, -1)
    return (logits * scaling).softmax(dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> tuple:
    """GQA attention, shapes as :func:`attention_probs` (v like k).
    Returns out (H_q, D), probs (H_q, n)."""
    hq, d = q.shape
    h = k.shape[0]
    probs = attention_probs(q, k, scaling)
    return torch.matmul(probs.view(h, hq // h, -1), v).view(hq, d), probs


@dataclass
class Step:
    """What the hooks saw in the current forward: per layer the attention input
    (R, hidden) of the current token, and the rotary tables (D,) at its position."""

    attn_input: dict = field(default_factory=dict)
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class Method:
    """The KV policy of one batch row."""

    name = "?"

    def reset(self, model, total_len: int) -> None:
        pass

    def attend(self, layer: int, module, q, k, v, step: Step, row: int) -> torch.Tensor:
        """q (H_q, D) of the current token at position t = n - 1; k, v (H, n, D)
        every token so far (post-RoPE keys). Returns (H_q, D)."""
        raise NotImplementedError

    def summary(self) -> dict:
        return {}


class Full(Method):
    name = "full"

    def attend(self, layer, module, q, k, v, step, row):
        return attend(q, k, v, module.scaling)[0]


class H2O(Method):
    """Per layer and KV head: resident positions (H, n) and their accumulated
    attention; the current token joins, then the policy cuts back to B."""

    name = "h2o"

    def __init__(self, budget: int, recent: int | None = None) -> None:
        self.budget = budget
        self.recent = budget // 2 if recent is None else recent
        self.policy = H2OPolicy()

    def reset(self, model, total_len):
        self.pos, self.score = {}, {}

    def attend(self, layer, module, q, k, v, step, row):
        h, n, _ = k.shape
        t = n - 1
        now = torch.full((h, 1), t, dtype=torch.long)
        pos = torch.cat([self.pos[layer], now], 1) if layer in self.pos else now
        score = self.score.get(layer, torch.zeros(h, 0, dtype=torch.float64))
        score = torch.cat([score, torch.zeros(h, 1, dtype=torch.float64)], 1)
        heads = torch.arange(h)[:, None]
        out, probs = attend(q, k[heads, pos], v[heads, pos], module.scaling)
        g = q.shape[0] // h
        score += probs.view(h, g, -1).sum(dim=1).double()
        if pos.shape[1] > self.budget:
            keep = self.policy.select(score, self.budget, self.recent)
            pos, score = pos.gather(1, keep), score.gather(1, keep)
        self.pos[layer], self.score[layer] = pos, score
        return out


class InfiniGen(Method):
    """InfiniGen's speculation at layers >= ``first_layer`` (see the module docstring).

    skewing:     a :class:`~vllm_kvevict.core.offload.skewing.Skewing` (packed here)
    pool:        optional host pool in the loop; trace: record offload/prefetch events
    first_layer: the first speculated layer (the paper: 1); the layers before
                 it attend their full cache and are not offloaded
    query:       "predicted" (InfiniGen: from layer i-1's attention input) or
                 "exact" (an oracle ablation: layer i's own query, same partial
                 channels, threshold and cap; isolates the cross-layer error)
    """

    def __init__(self, budget: int, skewing: sk.Skewing, alpha: float = 4.0,
                 block_size: int = 16, name: str = "infinigen", pool: HostKVPool | None = None,
                 trace: bool = False, recall: bool = True, first_layer: int = 1,
                 query: str = "predicted") -> None:
        if first_layer < 1:
            raise ValueError("layer 0 has no previous layer to predict from: first_layer >= 1")
        if query not in ("predicted", "exact"):
            raise ValueError(f"query must be 'predicted' or 'exact', got {query!r}")
        self.name = name
        self.budget, self.alpha, self.block_size = budget, alpha, block_size
        self.first_layer, self.query = first_layer, query
        self.skewing = skewing if skewing.is_packed else skewing.packed()
        self.c = self.skewing.num_partial
        self.pool = pool
        self.record_trace, self.track_recall = trace, recall

    def reset(self, model, total_len):
        cfg = model.config
        nl, h = cfg.num_hidden_layers, cfg.num_key_value_heads
        self.kpart = torch.zeros(nl, h, total_len, self.c)  # partial skewed key cache
        self.trace: list = []
        self.selected = torch.zeros(nl)     # sum over steps of the selected count
        self.recall = torch.zeros(nl)       # sum of recall@B over counted steps
        self.mass = torch.zeros(nl)         # sum of the true attention mass kept
        self.counted = torch.zeros(nl)      # steps counted for recall / mass
        self.steps = torch.zeros(nl)
        self.binding = False                # some step had a past longer than B

    def _key(self, layer: int, block: int) -> tuple:
        return (self.name, layer, block)

    def _candidates(self, layer: int, t: int) -> torch.Tensor | None:
        """Past positions still selectable (None: all of [0, t)). With a pool:
        tokens of resident full blocks + the device-resident partial tail."""
        if self.pool is None:
            return None
        bs = self.block_size
        full = t // bs
        pos = [p for b in range(full) if self._key(layer, b) in self.pool
               for p in range(b * bs, (b + 1) * bs)]
        return torch.tensor(pos + list(range(full * bs, t)), dtype=torch.long)

    def attend(self, layer, module, q, k, v, step, row):
        h, n, d = k.shape
        t = n - 1
        a = self.skewing.a[layer]
        self.kpart[layer, :, t] = sk.partial_keys(k[:, t:t + 1], a, self.c)[:, 0]
        if layer < self.first_layer or t == 0:
            out = attend(q, k, v, module.scaling)[0]
            self._offload(layer, t)
            return out
        if self.query == "predicted":  # from layer i-1's attention input (paper Fig. 10)
            x = step.attn_input[layer - 1][row]
            qp = sk.partial_queries(x[None], module.q_proj.weight, a, self.c,
                                    step.cos[None], step.sin[None], module.q_proj.bias)
        else:  # oracle: this layer's own (post-RoPE) query
            qp = sk.skew_queries(q[:, None, :], a)[None, :, 0, :self.c]
        cand = self._candidates(layer, t)
        kp = self.kpart[layer, :, :t] if cand is None else self.kpart[layer][:, cand]
        m = kp.shape[1]
        if m:
            sel = sk.speculate(qp, kp[None], torch.tensor([m]), self.alpha, module.scaling,
                               self.budget)[0]  # (H_q, k) into the candidates
            if cand is not None:
                sel = cand[sel]
        else:
            sel = torch.zeros(q.shape[0], 0, dtype=torch.long)
        if self.pool is not None or self.record_trace:
            blocks = sorted(set((sel // self.block_size).flatten().tolist()))
            keys = [self._key(layer, b) for b in blocks if (b + 1) * self.block_size <= t]
            if self.pool is not None:
                self.pool.prefetch(keys)
            if self.record_trace:
                self.trace.append(("prefetch", keys))
        hq = q.shape[0]
        kv_head = torch.arange(hq)[:, None] // (hq // h)
        idx = torch.cat([sel, sel.new_full((hq, 1), t)], dim=1)  # + the current token
        out = attend(q, k[kv_head, idx], v[kv_head, idx], module.scaling)[0]
        self.steps[layer] += 1
        self.selected[layer] += sel.shape[1]
        if self.track_recall:
            self._score(layer, module, q, k, sel, t)
        self._offload(layer, t)
        return out

    def _offload(self, layer: int, t: int) -> None:
        """Token t was written: a block of a speculated layer that just filled
        up goes to the host pool."""
        if layer < self.first_layer or (t + 1) % self.block_size:
            return
        key = self._key(layer, t // self.block_size)
        if self.pool is not None:
            self.pool.insert(key)
        if self.record_trace:
            self.trace.append(("insert", key))

    def _score(self, layer, module, q, k, sel, t) -> None:
        binding = t > self.budget
        if binding and not self.binding:  # from now on count only binding steps
            self.binding = True
            self.recall[:], self.mass[:], self.counted[:] = 0, 0, 0
        if self.binding and not binding:
            return
        probs = attention_probs(q, k, module.scaling)  # (H_q, t + 1), exact
        top = probs[:, :t].topk(min(self.budget, t), dim=1).indices
        hit = torch.zeros_like(probs[:, :t], dtype=torch.bool)
        hit.scatter_(1, sel, True)
        self.recall[layer] += hit.gather(1, top).float().mean().item()
        self.mass[layer] += (probs[:, :t].gather(1, sel).sum(1) + probs[:, t]).mean().item()
        self.counted[layer] += 1

    def summary(self):
        out = dict(selected=(self.selected / self.steps.clamp(min=1)).tolist(),
                   first_layer=self.first_layer)
        if self.track_recall:
            c = self.counted.clamp(min=1)
            out.update(recall=(self.recall / c).tolist(), mass=(self.mass / c).tolist(),
                       binding=self.binding)
        if self.pool is not None:
            out["pool"] = self.pool.stats.as_dict()
        return out


class Offload(Method):
    """What the plugin ships (``--kv-eviction infinigen``), token by token: per
    layer and KV head the resident set is the ``sink`` first + the newest
    tokens, compacted back to B when it reaches B + ``block`` (vLLM's
    amortised rule); the evicted tokens are on the host, all of them present.
    Layers 1.. attend by :func:`vllm_kvevict.core.offload.decode_attention.infinigen_decode_reference`
    with their own query: resident + the host tokens among each head's
    speculated top k (cap: ``cap`` x the tokens so far). Layer 0 attends its
    full cache, as in the paper (resident + every host token)."""

    name = "offload"

    def __init__(self, budget: int, skewing: sk.Skewing, alpha: float = 4.0, cap: float = 0.2,
                 sink: int = 4, block: int = 32) -> None:
        self.budget, self.alpha, self.cap, self.sink, self.block = budget, alpha, cap, sink, block
        self.skewing = skewing if skewing.is_packed else skewing.packed()

    def reset(self, model, total_len):
        self.resident: dict[int, torch.Tensor] = {}  # layer -> (n,) bool, same for all heads
        self.attended = torch.zeros(model.config.num_hidden_layers)
        self.steps = torch.zeros(model.config.num_hidden_layers)

    def attend(self, layer, module, q, k, v, step, row):
        from vllm_kvevict.core.offload.decode_attention import infinigen_decode_reference

        h, n, _ = k.shape
        res = torch.cat([self.resident.get(layer, torch.zeros(0, dtype=torch.bool)),
                         torch.ones(1, dtype=torch.bool)])
        if int(res.sum()) >= self.budget + self.block:  # compact: sinks + newest
            keep = torch.nonzero(res)[:, 0]
            keep = torch.cat([keep[:self.sink], keep[-(self.budget - self.sink):]])
            res = torch.zeros(n, dtype=torch.bool)
            res[keep] = True
        self.resident[layer] = res
        alpha, cap = (math.inf, n) if layer == 0 else (self.alpha, math.ceil(self.cap * n))
        out = infinigen_decode_reference(q, k, v, res.expand(h, -1), self.skewing.a[layer],
                                         self.skewing.num_partial, alpha, cap, module.scaling)
        self.steps[layer] += 1
        return out.to(q.dtype)

    def summary(self):
        return dict(budget=self.budget, alpha=self.alpha, cap=self.cap, sink=self.sink)


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------

def _attention_fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kwargs):
    """The registered attention: one query token per row, each row to its method."""
    run = module.kvevict_run
    if query.shape[2] != 1:
        raise ValueError("the dense evaluation decodes one token per step")
    outs = [meth.attend(module.layer_idx, module, query[r, :, 0], key[r], value[r],
                        run.step, r)
            for r, meth in enumerate(run.methods)]
    return torch.stack(outs)[:, None], None  # (R, 1, H_q, D)


class DenseRun:
    """Teacher-forced decode of ``ids`` with one batch row per method."""

    def __init__(self, model, methods: list[Method]) -> None:
        self.model, self.methods = model, methods
        self.step = Step()

    def _pre_hook(self, module, args, kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.step.attn_input[module.layer_idx] = x[:, -1]
        cos, sin = kwargs["position_embeddings"]
        self.step.cos, self.step.sin = cos[0, -1], sin[0, -1]

    @torch.no_grad()
    def run(self, ids: torch.Tensor, progress: bool = False) -> torch.Tensor:
        """ids (T,) -> (R, T - 1) negative log-likelihood of ids[1:] per row."""
        from transformers import AttentionInterface, DynamicCache

        model, rows = self.model, len(self.methods)
        AttentionInterface.register(ATTN_NAME, _attention_fn)
        previous = model.config._attn_implementation
        attns = [layer.self_attn for layer in model.model.layers]
        hooks = [m.register_forward_pre_hook(self._pre_hook, with_kwargs=True) for m in attns]
        for m in attns:
            m.kvevict_run = self
        model.set_attn_implementation(ATTN_NAME)
        n = ids.shape[0]
        for meth in self.methods:
            meth.reset(model, n)
        nll = torch.zeros(rows, n - 1)
        try:
            cache = DynamicCache(config=model.config)
            t0 = time.time()
            for t in range(n - 1):
                out = model(ids[t].expand(rows, 1), past_key_values=cache, use_cache=True,
                            position_ids=torch.full((rows, 1), t))
                nll[:, t] = -out.logits[:, -1].float().log_softmax(-1)[:, ids[t + 1]]
                if progress and (t + 1) % 128 == 0:
                    rate = (t + 1) / (time.time() - t0)
                    print(f"[infinigen_dense] {t + 1}/{n - 1} tokens, {rate:.1f} tok/s",
                          file=sys.stderr, flush=True)
        finally:
            for hk in hooks:
                hk.remove()
            for m in attns:
                del m.kvevict_run
            model.set_attn_implementation(previous)
        return nll


@dataclass
class Result:
    names: list
    nll: torch.Tensor              # (R, T - 1)
    window: int
    summaries: dict                # name -> Method.summary()
    pool_replay: list = field(default_factory=list)  # dicts, one per policy
    config: dict = field(default_factory=dict)
    seconds: float = 0.0

    def ppl(self, name: str) -> float:
        return math.exp(self.nll[self.names.index(name)].mean().item())

    def windows(self, name: str) -> list[float]:
        """Perplexity of each consecutive ``window`` of targets (the last may be short)."""
        return window_perplexity(self.nll[self.names.index(name)].tolist(), self.window)


SPEC_KEYS = {"h2o": {"budget": int, "recent": int},
             "offload": {"budget": int, "alpha": float, "cap": float, "sink": int,
                         "block": int},
             "infinigen": {"budget": int, "alpha": float, "first": int, "query": str,
                           "fraction": float, "skew": int}}


def parse_method(spec: str) -> tuple[str, dict]:
    """"kind[@key=value...]" -> (kind, options), e.g. "infinigen@alpha=8@first=2",
    "infinigen@query=exact@fraction=1", "h2o@recent=32". "infinigen-noskew" is
    "infinigen@skew=0"."""
    if spec == "infinigen-noskew":
        return "infinigen", {"skew": 0}
    kind, *opts = spec.split("@")
    if kind not in ("full", *SPEC_KEYS):
        raise ValueError(f"unknown method {spec!r}")
    keys = SPEC_KEYS.get(kind, {})
    out = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key not in keys:
            raise ValueError(f"{spec!r}: {kind} takes {sorted(keys)}, not {key!r}")
        out[key] = keys[key](value)
    return kind, out


def evaluate(model, ids: torch.Tensor, budget: int, skewing: sk.Skewing | None = None,
             *, alpha: float = 4.0, recent: int | None = None, block_size: int = 16,
             window: int = 256, methods=("full", "h2o", "infinigen"),
             noskew: sk.Skewing | None = None, skewing_for=None, first_layer: int = 1,
             pool_policies=(), pool_fraction: float = 0.8, block_bytes: int | None = None,
             progress: bool = False) -> Result:
    """Run the methods (specs of :func:`parse_method`) side by side over ``ids``
    (T,) and replay the ``infinigen`` row's block trace on host pools of each
    of ``pool_policies`` (plus InfiniGen rows with those pools in the loop).

    skewing: the default skewing; noskew: the ``skew=0`` one; skewing_for:
    callable (fraction, skew) -> Skewing for specs that ask for others.
    """
    cfg = model.config
    n = ids.shape[0]
    if block_bytes is None:  # one layer's K and V of a block in bfloat16
        block_bytes = 2 * cfg.num_key_value_heads * block_size * cfg.head_dim * 2
    offloaded = (cfg.num_hidden_layers - first_layer) * ((n - 1) // block_size)
    capacity = max(1, int(pool_fraction * offloaded))

    def skewing_of(opts):
        fraction, skew = opts.get("fraction"), opts.get("skew", 1)
        if fraction is None and skew:
            return skewing
        if fraction is None and noskew is not None:
            return noskew
        if skewing_for is None:
            raise ValueError(f"{opts}: needs skewing_for= (or noskew=) to get that skewing")
        return skewing_for(sk.DEFAULT_FRACTION if fraction is None else fraction, bool(skew))

    rows: list[Method] = []
    for spec in methods:
        kind, opts = parse_method(spec)
        if kind == "full":
            rows.append(Full())
        elif kind == "h2o":
            rows.append(H2O(opts.get("budget", budget), opts.get("recent", recent)))
        elif kind == "offload":
            rows.append(Offload(opts.get("budget", budget), skewing, opts.get("alpha", alpha),
                                opts.get("cap", 0.2), opts.get("sink", 4),
                                opts.get("block", 32)))
        else:
            rows.append(InfiniGen(opts.get("budget", budget), skewing_of(opts),
                                  opts.get("alpha", alpha), block_size, name=spec,
                                  trace=spec == "infinigen" and bool(pool_policies),
                                  first_layer=opts.get("first", first_layer),
                                  query=opts.get("query", "predicted")))
        rows[-1].name = spec
    for policy in pool_policies:
        rows.append(InfiniGen(budget, skewing, alpha, block_size, name=f"infinigen+{policy}",
                              pool=HostKVPool(capacity, policy, block_bytes=block_bytes),
                              recall=False, first_layer=first_layer))
    t0 = time.time()
    nll = DenseRun(model, rows).run(ids, progress)
    res = Result([m.name for m in rows], nll, window, {m.name: m.summary() for m in rows},
                 config=dict(tokens=n, budget=budget, alpha=alpha, block_size=block_size,
                             recent=next((m.recent for m in rows if isinstance(m, H2O)), recent),
                             first_layer=first_layer,
                             fraction=None if skewing is None else skewing.num_partial,
                             pool_capacity=capacity, offloaded_blocks=offloaded,
                             block_bytes=block_bytes))
    res.seconds = time.time() - t0
    ig = next((m for m in rows if m.name == "infinigen"), None)
    if ig is not None and pool_policies:
        steps = n - 1
        per_step = [len(e[1]) for e in ig.trace if e[0] == "prefetch"]
        res.pool_replay.append(dict(policy="unlimited", capacity=offloaded, hit_rate=1.0,
                                    bytes_per_token=sum(per_step) * block_bytes / steps,
                                    evictions=0))
        for policy in pool_policies:
            st = replay(ig.trace, capacity, policy, block_bytes)
            res.pool_replay.append(dict(policy=policy, capacity=capacity, hit_rate=st.hit_rate,
                                        bytes_per_token=st.bytes_out / steps,
                                        evictions=st.evictions))
        # every offloaded block of the speculated layers, every step (no speculation)
        full_bytes = sum((t // block_size) for t in range(n - 1)) \
            * (cfg.num_hidden_layers - first_layer) * block_bytes / steps
        res.pool_replay.append(dict(policy="(fetch all offloaded)", capacity=offloaded,
                                    hit_rate=1.0, bytes_per_token=full_bytes, evictions=0))
    return res


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------

def markdown(res: Result) -> str:
    lines = []
    nwin = len(res.windows(res.names[0]))
    t = res.nll.shape[1]
    heads = [f"{i * res.window}-{min((i + 1) * res.window, t)}" for i in range(nwin)]
    lines.append("| method | " + " | ".join(heads) + " | all |")
    lines.append("|---" * (nwin + 2) + "|")
    for name in res.names:
        w = " | ".join(f"{p:.3f}" for p in res.windows(name))
        lines.append(f"| {name} | {w} | {res.ppl(name):.3f} |")
    igs = [n for n in res.names if "recall" in res.summaries[n]]
    if igs:
        lines.append("")
        lines.append("Per layer: recall@B / attention mass kept / mean tokens selected "
                     "(- : full cache).")
        lines.append("")
        lines.append("| layer | " + " | ".join(igs) + " |")
        lines.append("|---" * (1 + len(igs)) + "|")
        nl = len(res.summaries[igs[0]]["recall"])

        def cell(name, li):
            sm = res.summaries[name]
            if li < sm["first_layer"]:
                return "-"
            return f"{sm['recall'][li]:.3f} / {sm['mass'][li]:.3f} / {sm['selected'][li]:.1f}"

        for li in range(nl):
            lines.append(f"| {li} | " + " | ".join(cell(n, li) for n in igs) + " |")
        means = []
        for n in igs:
            sm = res.summaries[n]
            ls = range(sm["first_layer"], nl)
            means.append(" / ".join(f"{sum(sm[key][i] for i in ls) / len(ls):{fmt}}"
                                    for key, fmt in (("recall", ".3f"), ("mass", ".3f"),
                                                     ("selected", ".1f"))))
        lines.append("| mean (speculated layers) | " + " | ".join(means) + " |")
    if res.pool_replay:
        lines.append("")
        lines.append("| pool (trace replay) | capacity (blocks) | hit rate | KiB moved / token "
                     "| evictions |")
        lines.append("|---|---|---|---|---|")
        for r in res.pool_replay:
            lines.append(f"| {r['policy']} | {r['capacity']} | {r['hit_rate']:.4f} | "
                         f"{r['bytes_per_token'] / 1024:.1f} | {r['evictions']} |")
    pooled = [n for n in res.names if "pool" in res.summaries[n]]
    if pooled:
        lines.append("")
        lines.append("| pool in the loop | perplexity | hit rate | KiB moved / token | evictions |")
        lines.append("|---|---|---|---|---|")
        for n in pooled:
            st = res.summaries[n]["pool"]
            lines.append(f"| {n} | {res.ppl(n):.3f} | {st['hit_rate']:.4f} | "
                         f"{st['bytes_out'] / t / 1024:.1f} | {st['evictions']} |")
    return "\n".join(lines)


def passage_ids(tokenizer, doc: str, seed: int, n_tokens: int) -> torch.Tensor:
    """(T,) token ids of the project's perplexity passage of ``doc`` (with BOS
    if the tokenizer adds one), cut to ``n_tokens``."""
    return calibrate.calibration_ids(tokenizer, doc, seed, n_tokens)[0, :n_tokens]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_kvevict.eval.infinigen_dense",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: SmolLM2)")
    ap.add_argument("--doc", default="jargon", help="text of vllm_kvevict.eval.texts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=128, help="resident past tokens B")
    ap.add_argument("--recent", type=int, default=None, help="H2O recent window (B/2)")
    ap.add_argument("--alpha", type=float, default=4.0)
    ap.add_argument("--fraction", type=float, default=sk.DEFAULT_FRACTION,
                    help="partial channels per head")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--first-layer", type=int, default=1,
                    help="first speculated layer of InfiniGen rows (the paper: 1)")
    ap.add_argument("--methods", default="full,h2o,infinigen,infinigen-noskew",
                    help="comma-separated specs: full, h2o[@budget=N@recent=N], "
                         "infinigen[@alpha=A@first=L@query=predicted|exact@fraction=F@skew=0|1"
                         "@budget=N], infinigen-noskew, offload[@alpha=A@cap=F@sink=S"
                         "@block=N@budget=N] (the plugin's rule: resident sinks + recent, "
                         "own-query speculation over the host tokens)")
    ap.add_argument("--pool-policies", default="counter,lru,fifo",
                    help="host-pool victim policies ('' for none)")
    ap.add_argument("--pool-fraction", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the per-token ops are tiny, and more "
                         "threads than free cores makes them crawl; 0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from vllm_kvevict.models import ensure_smollm2

    model_dir = args.model or ensure_smollm2()
    model, tok = calibrate.load_model(model_dir)
    methods = tuple(m for m in args.methods.split(",") if m)
    for m in methods:
        parse_method(m)  # fail before loading anything

    def skewing_for(fraction, skew):
        return calibrate.load_or_compute(model_dir, fraction, skew=skew, model=model, tokenizer=tok)

    skew = skewing_for(args.fraction, True)
    ids = passage_ids(tok, args.doc, args.seed, args.tokens)
    policies = tuple(p for p in args.pool_policies.split(",") if p)
    res = evaluate(model, ids, args.budget, skew, alpha=args.alpha, recent=args.recent,
                   block_size=args.block_size, window=args.window, methods=methods,
                   skewing_for=skewing_for, first_layer=args.first_layer,
                   pool_policies=policies, pool_fraction=args.pool_fraction, progress=True)
    c = res.config
    print(f"model {model_dir}, doc {args.doc} (seed {args.seed}), {c['tokens']} tokens, "
          f"B={c['budget']}, H2O recent={c['recent']}, alpha={c['alpha']}, "
          f"first speculated layer {c['first_layer']}, "
          f"partial channels {skew.num_partial}/{skew.head_dim}, block size {c['block_size']}, "
          f"pool {c['pool_capacity']}/{c['offloaded_blocks']} blocks, {res.seconds:.0f} s\n")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
