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
CPU side runs the plain-torch paths (VLLM_KVEVICT_KERNELS=torch). Checked at
every compaction: the same kept sets, bit-identical caches; after every step,
the score buffers within float32 rounding. Then InfiniGen's decode math
(`core.offload`) on device tensors against the CPU.
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
        from vllm_kvevict.core.nhd_layout import NHDLayout

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
        self.layout.write_tokens(self.kc, self.vc, blk, (s % self.bs).expand(h, -1),
                                 k.transpose(0, 1).to(self.device), v.transpose(0, 1).to(self.device))


def simulate(t: Target, policy_name: str, mode: str, device, inputs, steps: int) -> list:
    """Run the batch on `device` with kernels `mode`; returns per-step snapshots."""
    from vllm_kvevict.core.compaction import compact, move_scores
    from vllm_kvevict.core.config import EvictionConfig
    from vllm_kvevict.core.planner import compaction_target
    from vllm_kvevict.core.policies import make_policy
    from vllm_kvevict.core.scores import accumulate_scores

    q_all, k_all, v_all, prompts = inputs  # (R, L, H_q | H, D) on the CPU
    num_req, _, hq, d = q_all.shape
    h, bs = k_all.shape[2], 16
    cfg = EvictionConfig.from_dict({"kv_eviction": policy_name, "kv_budget": BUDGET})
    policy = make_policy(cfg.policy, cfg.sink, cfg.window)
    max_blocks = -(-(max(prompts) + steps) // bs) + 1
    side = Side(device, k_all.dtype, num_req, max_blocks, h, d, bs)
    scale = d ** -0.5
    phys, logical = list(prompts), list(prompts)
    window_q = [q_all[r, :n] for r, n in enumerate(prompts)]  # the newest queries, by age
    snaps = []

    def score(q, lens, starts):
        """One step's queries (sum(lens), H_q, D), each request's `lens[r]`
        new tokens already written at physical starts[r]."""
        if not policy.needs_scores:
            return
        qsl = torch.tensor([0] + lens).cumsum(0).int()
        seq = torch.tensor([s + n for s, n in zip(starts, lens)]).int()
        slots = torch.cat([side.slots(r, s, n) for r, (s, n) in enumerate(zip(starts, lens))])
        dev = side.device
        accumulate_scores(side.scores, side.layout, side.kc, q.to(dev), qsl.to(dev), seq.to(dev),
                          side.table.to(dev), slots.to(dev), scale, decode=True,
                          query_start_loc_cpu=qsl, seq_lens_cpu=seq)

    with kernels(mode):
        for r, n in enumerate(prompts):  # prefill: every prompt one chunk
            side.write(r, 0, k_all[r, :n], v_all[r, :n])
        score(torch.cat(window_q), list(prompts), [0] * num_req)
        for step in range(steps):
            q = torch.stack([q_all[r, logical[r]] for r in range(num_req)])
            for r in range(num_req):
                side.write(r, phys[r], k_all[r, logical[r]][None], v_all[r, logical[r]][None])
                window_q[r] = torch.cat([window_q[r], q[r][None]])[-cfg.window:]
            score(q, [1] * num_req, phys)
            phys, logical = [p + 1 for p in phys], [n + 1 for n in logical]
            kept = {}
            for r in range(num_req):
                new = compaction_target(cfg, phys[r], logical[r], False, bs)
                if new is None:
                    continue
                old = phys[r]
                recent = cfg.recent_tokens(new, logical[r])
                src_blocks = side.table[r:r + 1, : -(-old // bs)]
                dst_blocks = side.table[r:r + 1, : -(-new // bs)]
                src = side.slots(r, 0, old)[None]
                if policy.window:
                    kk = side.layout.gather_keys(side.kc, src_blocks)[:, :, :old]
                    vv = side.layout.gather_values(side.vc, src_blocks)[:, :, :old]
                    s = policy.scores(window_q[r][None].to(device), kk, vv, scale, recent)[0]
                elif policy.needs_scores:
                    s = side.scores[:, src[0].to(device)]
                else:
                    s = torch.zeros(h, old, device=device)
                keep = policy.select(s, new, recent)[None]  # (1, H, new)
                kept[r] = keep.cpu()
                dst = side.slots(r, 0, dst_blocks.shape[1] * bs)[None]
                from vllm_kvevict.core.kernel_dispatch import triton_module, use_triton
                sc = side.scores if policy.needs_scores else None
                if use_triton(side.kc, side.layout):  # as the worker does on CUDA
                    triton_module("compaction").compact_in_place(side.kc, side.vc, sc, src, dst,
                                                                 keep)
                else:
                    compact(side.layout, side.kc, side.vc, src_blocks, dst_blocks, keep)
                    if sc is not None:
                        move_scores(sc, src, dst[:, :new], keep)
                phys[r] = new
            resident = torch.cat([side.slots(r, 0, p) for r, p in enumerate(phys)])
            snaps.append({"kept": kept, "phys": list(phys),
                          "k": side.kc.reshape(-1, h, d)[resident].cpu(),
                          "v": side.vc.reshape(-1, h, d)[resident].cpu(),
                          "scores": side.scores[:, resident.to(device)].cpu()})
    return snaps


def batch_inputs(t: Target, dtype, steps: int):
    gen = torch.Generator().manual_seed(11)
    h, g, d = 2, 3, 32 if t.dry else 64
    prompts = [40, 70, 100]
    n = max(prompts) + steps
    q = torch.randn(len(prompts), n, h * g, d, generator=gen).to(dtype)
    k = torch.randn(len(prompts), n, h, d, generator=gen).to(dtype)
    v = torch.randn(len(prompts), n, h, d, generator=gen).to(dtype)
    return q, k, v, prompts


def policy_check(t: Target, policy: str) -> dict:
    steps = 24 if t.dry else 60
    dtype = torch.float32 if t.dry else torch.bfloat16
    rec = {"check": f"{policy}: prefill + {steps} decode steps, 3 requests, budget {BUDGET}",
           "dtype": str(dtype).removeprefix("torch.")}
    try:
        inputs = batch_inputs(t, dtype, steps)
        dev_mode = "triton" if t.dry else "auto"
        got = simulate(t, policy, dev_mode, t.device, inputs, steps)
        want = simulate(t, policy, "torch", torch.device("cpu"), inputs, steps)
        compactions = sum(len(s["kept"]) for s in want)
        same_kept = all(a["kept"].keys() == b["kept"].keys()
                        and all(torch.equal(a["kept"][r], b["kept"][r]) for r in a["kept"])
                        for a, b in zip(got, want))
        same_cache = all(a["phys"] == b["phys"] and torch.equal(a["k"], b["k"])
                         and torch.equal(a["v"], b["v"]) for a, b in zip(got, want))
        err = max(rel_err(a["scores"], b["scores"]) for a, b in zip(got, want))
        rec.update(compactions=compactions, same_kept=same_kept, same_cache=same_cache,
                   scores_err=err, scores_tol=SCORE_TOL,
                   ok=same_kept and same_cache and err <= SCORE_TOL and compactions > 0)
    except Exception as e:  # noqa: BLE001 - reported
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=6))
    return rec


def offload_check(t: Target) -> dict:
    """InfiniGen's decode math (`core.offload`) on device tensors vs the CPU."""
    from vllm_kvevict.core import offload

    rec = {"check": "offload: partial logits, host-entry selection, attention over "
                    "resident + fetched entries", "dtype": "float32"}
    try:
        gen = torch.Generator().manual_seed(12)
        r, h, g, s, n, d, c, kk = 3, 2, 3, 40, 64, 32, 10, 8
        x = {"qp": torch.randn(r, h * g, c, generator=gen), "kp_res": torch.randn(r, h, s, c, generator=gen),
             "kp_host": torch.randn(r, h, n, c, generator=gen), "q": torch.randn(r, h * g, d, generator=gen),
             "k_res": torch.randn(r, h, s, d, generator=gen), "v_res": torch.randn(r, h, s, d, generator=gen),
             "k_host": torch.randn(r, h * g, kk, d, generator=gen),
             "v_host": torch.randn(r, h * g, kk, d, generator=gen),
             "mask": torch.rand(r, h * g, kk, generator=gen) > 0.3,
             "res_len": torch.tensor([s, 7, 1]), "cap": torch.tensor([16, 4, 64])}

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
    return [policy_check(t, p) for p in ("h2o", "snapkv", "andpro", "streaming")] \
        + [offload_check(t)]
