"""The vLLM-free core driving a simulated batch on the device, checked against
the same batch on the CPU, step by step.

Each policy runs the worker's loop on an NHD paged cache: a prompt per request,
written and scored as one chunk, then decode steps; after each step the planner
(`core.planner.compaction_target`) says which requests compact and to what
length; the policy picks the kept tokens from its scores (H2O's accumulated
attention, SnapKV/AnDPro's window scores, none for StreamingLLM) and the cache
is compacted. On the device side everything goes where `kernel_dispatch` sends
a CUDA tensor (the fused Triton decode scorer, the window kernel, the in-place
compaction kernel; under the dry run the same kernels in the interpreter); the
CPU side runs the plain-torch paths (VLLM_KVEVICT_KERNELS=torch). The two run
in lockstep: at each compaction both apply the device's kept set (so the caches
stay comparable) and the CPU's own choice is compared with it (overlap per
request and KV head); after every step the resident caches must be
bit-identical and the score buffers within float32 rounding. Then InfiniGen's
decode math (`core.offload`) on device tensors against the CPU.
"""
from __future__ import annotations

import contextlib
import os
import traceback

import torch

from vllm_kvevict.gpu_check.cases import Target
from vllm_kvevict.gpu_check.correctness import rel_err

SCORE_TOL = 1e-5
BUDGET = 48


@contextlib.contextmanager
def kernels(mode: str):
    old = os.environ.get("VLLM_KVEVICT_KERNELS")
    os.environ["VLLM_KVEVICT_KERNELS"] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ["VLLM_KVEVICT_KERNELS"]
        else:
            os.environ["VLLM_KVEVICT_KERNELS"] = old


class Side:
    """One copy of the batch's state (cache, scores, lengths) on one device."""

    def __init__(self, device, dtype, num_req, max_blocks, h, d, bs):
        from vllm_kvevict.core.layouts.nhd_layout import NHDLayout

        kv = torch.zeros(num_req * max_blocks, h, bs, 2 * d, dtype=dtype, device=device)
        self.layout = NHDLayout.for_cache(kv)
        self.kc, self.vc = self.layout.split(kv)
        self.scores = torch.zeros(h, kv.shape[0] * bs, device=device)
        # Request r owns blocks r * max_blocks ...: host block table, as vLLM's.
        self.table = torch.arange(num_req * max_blocks).view(num_req, max_blocks)
        self.device, self.bs = device, bs

    def slots(self, r: int, start: int, n: int) -> torch.Tensor:
        pos = torch.arange(start, start + n)
        return self.table[r, pos // self.bs] * self.bs + pos % self.bs

    def write(self, r: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (n, H, D) new tokens of request r at physical positions start..."""
        s = self.slots(r, start, k.shape[0])
        h = k.shape[1]
        blk = (s // self.bs).expand(h, -1)
        k, v = (x.transpose(0, 1).to(self.device) for x in (k, v))
        self.layout.write_tokens(self.kc, self.vc, blk, (s % self.bs).expand(h, -1), k, v)


class Batch:
    """One side of the lockstep run: a Side plus the request lengths and the
    newest queries, stepped with kernels `mode`."""

    def __init__(self, device, mode, policy, cfg, inputs, steps):
        q_all, k_all, _, prompts = inputs
        num_req, _, _, d = q_all.shape
        self.bs, self.mode, self.policy, self.cfg = 16, mode, policy, cfg
        max_blocks = -(-(max(prompts) + steps) // self.bs) + 1
        self.side = Side(device, k_all.dtype, num_req, max_blocks, k_all.shape[2], d, self.bs)
        self.device, self.scale = torch.device(device), d ** -0.5
        self.phys = list(prompts)
        self.window_q = [q_all[r, :n] for r, n in enumerate(prompts)]  # newest queries, by age

    def score(self, q, lens, starts):
        """Score one step's queries (sum(lens), H_q, D); request r's lens[r] new
        tokens are already written at physical positions starts[r]..."""
        from vllm_kvevict.core.policies import Record
        from vllm_kvevict.core.scoring.scores import accumulate_scores

        if self.policy.records is not Record.ATTENTION:
            return  # the window's queries are kept by lockstep (window_q); nothing else
        side, dev = self.side, self.device
        qsl = torch.tensor([0] + lens).cumsum(0).int()
        seq = torch.tensor([s + n for s, n in zip(starts, lens)]).int()
        slots = torch.cat([side.slots(r, s, n) for r, (s, n) in enumerate(zip(starts, lens))])
        with kernels(self.mode):
            accumulate_scores(side.scores, side.layout, side.kc, q.to(dev), qsl.to(dev),
                              seq.to(dev), side.table.to(dev), slots.to(dev), self.scale,
                              decode=True, query_start_loc_cpu=qsl, seq_lens_cpu=seq)

    def selection_scores(self, r: int, recent: int) -> torch.Tensor:
        """(H, old) the policy's scores of request r's resident tokens, oldest
        first: its `compaction_scores` over what the worker's context would give."""
        from vllm_kvevict.core.policies import DenseContext

        side, old = self.side, self.phys[r]
        src_blocks = side.table[r:r + 1, : -(-old // self.bs)]
        with kernels(self.mode):
            kk = side.layout.gather_keys(side.kc, src_blocks)[:, :, :old]
            vv = side.layout.gather_values(side.vc, src_blocks)[:, :, :old]
            ctx = DenseContext(kk, vv, recent=recent,
                               accumulated=side.scores[:, side.slots(r, 0, old).to(self.device)][None],
                               window=(self.window_q[r][None].to(self.device), self.scale))
            return self.policy.compaction_scores(ctx)[0]

    def compact(self, r: int, keep: torch.Tensor) -> None:
        """Request r keeps tokens keep (H, new) (ascending), moved as the worker
        moves them: the Triton kernel where kernel_dispatch picks it, else its
        plain reference (ordered, like the kernel). Scores move under every
        policy (zeros where nothing accumulates)."""
        from vllm_kvevict.core.eviction.kernel_dispatch import triton_module, use_triton
        from vllm_kvevict.triton_kernels.reference import compact_ref

        side, old, new = self.side, self.phys[r], keep.shape[1]
        keep = keep[None].to(self.device)
        src = side.slots(r, 0, old)[None]
        n_dst = -(-new // self.bs)
        dst = side.slots(r, 0, n_dst * self.bs)[None]
        sc = side.scores
        with kernels(self.mode):
            if use_triton(side.kc, side.layout):
                triton_module("compaction").compact_in_place(side.kc, side.vc, sc, src, dst, keep)
            else:
                compact_ref(side.layout, side.kc, side.vc, sc, src, dst, keep)
        self.phys[r] = new

    def resident(self):
        side = self.side
        slots = torch.cat([side.slots(r, 0, p) for r, p in enumerate(self.phys)])
        h, d = side.layout.num_kv_heads, side.layout.head_size
        return (side.kc.reshape(-1, h, d)[slots].cpu(), side.vc.reshape(-1, h, d)[slots].cpu(),
                side.scores[:, slots.to(self.device)].cpu())


def lockstep(t: Target, policy_name: str, inputs, steps: int) -> dict:
    """The batch on the device (kernels where kernel_dispatch sends CUDA data;
    the interpreter under the dry run) and on the CPU (torch paths), step by
    step. At each compaction both sides apply the device's kept set, so the
    caches stay comparable; the CPU's own choice is compared with it."""
    from vllm_kvevict.core.config.settings import EvictionConfig
    from vllm_kvevict.core.eviction.planner import compaction_target
    from vllm_kvevict.core.policies import make_policy

    q_all, k_all, v_all, prompts = inputs
    num_req = q_all.shape[0]
    cfg = EvictionConfig(policy=policy_name, budget=BUDGET)
    policy = make_policy(cfg.policy, cfg.sink, cfg.window)
    dev = Batch(t.device, "triton" if t.dry else "auto", policy, cfg, inputs, steps)
    cpu = Batch("cpu", "torch", policy, cfg, inputs, steps)
    logical = list(prompts)
    res = {"compactions": 0, "overlap_min": 1.0, "scores_err": 0.0, "selection_err": 0.0,
           "same_cache": True}
    both = (dev, cpu)
    for b in both:  # prefill: every prompt one chunk
        for r, n in enumerate(prompts):
            b.side.write(r, 0, k_all[r, :n], v_all[r, :n])
        b.score(torch.cat(b.window_q), list(prompts), [0] * num_req)
    for _ in range(steps):
        q = torch.stack([q_all[r, logical[r]] for r in range(num_req)])
        for b in both:
            starts = list(b.phys)
            for r in range(num_req):
                b.side.write(r, starts[r], k_all[r, logical[r]][None], v_all[r, logical[r]][None])
                b.window_q[r] = torch.cat([b.window_q[r], q[r][None]])[-cfg.window:]
            b.score(q, [1] * num_req, starts)
            b.phys = [p + 1 for p in b.phys]
        logical = [n + 1 for n in logical]
        for r in range(num_req):
            new = compaction_target(cfg, dev.phys[r], logical[r], False, dev.bs)
            if new is None:
                continue
            recent = cfg.recent_tokens(new, logical[r])
            s_dev, s_cpu = dev.selection_scores(r, recent), cpu.selection_scores(r, recent)
            finite = torch.isfinite(s_cpu)
            res["selection_err"] = max(res["selection_err"], rel_err(
                s_dev.cpu()[finite], s_cpu[finite]))
            keep = policy.select(s_dev, new, recent)
            mine = policy.select(s_cpu, new, recent)
            overlap = min(len(set(a.tolist()) & set(b.tolist())) / new
                          for a, b in zip(keep.cpu(), mine))
            res["overlap_min"] = min(res["overlap_min"], overlap)
            for b in both:
                b.compact(r, keep.cpu())
            res["compactions"] += 1
        got, want = dev.resident(), cpu.resident()
        res["same_cache"] &= torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        res["scores_err"] = max(res["scores_err"], rel_err(got[2], want[2]))
    return res


def batch_inputs(t: Target, dtype, steps: int):
    gen = torch.Generator().manual_seed(11)
    h, g, d = 2, 3, 32 if t.dry else 64
    prompts = [40, 70, 100]
    n = max(prompts) + steps
    q = torch.randn(len(prompts), n, h * g, d, generator=gen).to(dtype)
    k = torch.randn(len(prompts), n, h, d, generator=gen).to(dtype)
    v = torch.randn(len(prompts), n, h, d, generator=gen).to(dtype)
    return q, k, v, prompts


# Kept-set overlap the device's choice must reach with the CPU's, per (request,
# KV head), over every compaction. The paths are float32-accurate except AnDPro
# in half precision: its kernel rounds P and y to the cache dtype for its two
# products (the papers' own precision: model-dtype products), so tokens near
# the cut may swap.
OVERLAP = {"andpro": 0.9}


def policy_check(t: Target, policy: str) -> dict:
    steps = 24 if t.dry else 60
    dtype = torch.float32 if t.dry else torch.bfloat16
    rec = {"check": f"{policy}: prefill + {steps} decode steps, 3 requests, budget {BUDGET}",
           "dtype": str(dtype).removeprefix("torch.")}
    try:
        rec.update(lockstep(t, policy, batch_inputs(t, dtype, steps), steps))
        bound = OVERLAP.get(policy, 1.0) if dtype != torch.float32 else 1.0
        rec.update(overlap_bound=bound, scores_tol=SCORE_TOL)
        rec["ok"] = (rec["compactions"] > 0 and rec["same_cache"]
                     and rec["overlap_min"] >= bound and rec["scores_err"] <= SCORE_TOL)
    except Exception as e:  # noqa: BLE001 - reported
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=6))
    return rec


def offload_check(t: Target) -> dict:
    """InfiniGen's decode math (`core.offload`) on device tensors vs the CPU."""
    from vllm_kvevict.core.offload import decode_attention as offload

    rec = {"check": "offload: partial logits, host-entry selection, attention over "
                    "resident + fetched entries", "dtype": "float32"}
    try:
        gen = torch.Generator().manual_seed(12)
        r, h, g, s, n, d, c, kk = 3, 2, 3, 40, 64, 32, 10, 8
        shapes = {"qp": (r, h * g, c), "kp_res": (r, h, s, c), "kp_host": (r, h, n, c),
                  "q": (r, h * g, d), "k_res": (r, h, s, d), "v_res": (r, h, s, d),
                  "k_host": (r, h * g, kk, d), "v_host": (r, h * g, kk, d)}
        x = {key: torch.randn(shape, generator=gen) for key, shape in shapes.items()}
        x.update(mask=torch.rand(r, h * g, kk, generator=gen) > 0.3,
                 res_len=torch.tensor([s, 7, 1]), cap=torch.tensor([16, 4, 64]))

        def run(dev):
            y = {key: val.to(dev) for key, val in x.items()}
            lr = offload.partial_logits(y["qp"], y["kp_res"], 0.5)
            lh = offload.partial_logits(y["qp"], y["kp_host"], 0.5)
            pad = torch.arange(s, device=dev)[None, None] >= y["res_len"][:, None, None]
            lr = lr.masked_fill(pad, float("-inf"))
            sel = offload.select_host_entries(lr, lh, y["cap"], 4.0)
            out = offload.attend_resident_and_host(y["q"], y["k_res"], y["v_res"], y["res_len"],
                                                   y["k_host"], y["v_host"], y["mask"], 0.125)
            return lh.cpu(), sel.cpu(), out.cpu()

        got, want = run(t.device), run(torch.device("cpu"))
        rec.update(logits_err=rel_err(got[0], want[0]), out_err=rel_err(got[2], want[2]),
                   same_selection=torch.equal(got[1], want[1]))
        rec["ok"] = rec["logits_err"] <= SCORE_TOL and rec["out_err"] <= SCORE_TOL \
            and rec["same_selection"]
    except Exception as e:  # noqa: BLE001 - reported
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=6))
    return rec


def run(t: Target) -> list[dict]:
    from vllm_kvevict.core.policies import POLICIES

    return [policy_check(t, p) for p in POLICIES] \
        + [offload_check(t)]
