"""InfiniGen offload in vLLM against H2O and the full cache, in one run.

    VLLM_CPU_OMP_THREADS_BIND=0 taskset -c 0 python benchmarks/infinigen.py
        [--requests 8] [--prompt 512] [--tokens 256] [--budget 128]
        [--dtype float32] [--json out.json] [--plot out.png]

Every engine gets the same requests: passages of Austen novels from the
fidelity harness's texts, `--prompt` tokens each, then `--tokens` greedy
tokens (ignore_eos). Engines, one after the other in this process:

  full               stock vLLM (the plugin loaded, eviction off)
  h2o                H2O, --kv-budget B: evicted tokens are gone
  infinigen          sinks + recent window resident (B tokens), the rest in
                     the host pool, fetched back by speculation (alpha 4, cap 20 %)
  h2o+offload        H2O chooses the B resident tokens, the rest offloaded and
                     speculated as above
  infinigen/<victim> the host pool cut to 80 % of what infinigen's run held at
                     its peak, for each victim policy (the paper's Table 2)

Columns: wall clock of the generate call and output tok/s; agreement = mean
fraction of each request's tokens equal to the full cache's before the first
difference; KV traffic per generated token (offloaded to / fetched from the
host tier, token-granular: what a real transfer moves, prefetched and on
demand together); pool kept = offloaded entries still in the host pool at the
end (a dropped block takes its entries and their partial keys with it, so
selection never picks them: core/offload/host_tier.py); spec. recall = entries the layer's own query needed that the
KV connector had already prefetched from layer i-1's input (the paper's
speculation), spec. precision = prefetched entries that were needed (both per
query head); attended = mean tokens each
query head attended per layer and step (resident + fetched); peak blocks =
the most KV blocks one request held in vLLM's BlockPool.

Where offload's time goes (offload engines only, "-" otherwise), in ms per
generated token: a stage's time summed over the timed generate call (every
layer of every step) divided by the tokens generated, so comparable with
1000 / tok/s. Timers wrap plugin functions from this script only (common.py's
Timers: exclusive time, nested timed calls subtracted from their caller):
  spec.     the KV connector's speculation for layer i+1 after layer i
            (offload_connector.host_prefetch): the step's rows with host
            entries, the resident keys, the predicted query (layer i's input
            through layer i+1's qkv_proj and RoPE), its selection and the
            prefetch of what it selected from the host pool, all of it
  select    the layer's own-query selection in host decode (offload.
            select_entries outside speculation: partial logits of resident
            and host entries, top-k)
  fetch     the on-demand fetch from the host pool of what the own query
            selected and speculation had not brought (HostTier.fetch outside
            speculation)
  host attn the rest of host decode (cpu_backend.host_decode less the two
            above): the step's rows, the resident K/V gather, taking the
            prefetch's hits (offload.take_prefetched), the second attention
            pass over resident + host entries and the output rows' overwrite
The stock attention pass over the resident cache, compaction and offloading
evicted tokens to the host tier are in none of them.

float32 by default: on AVX2-only CPUs vLLM-cpu's bf16 path is several times
slower. Both tiers are host memory here: the wall clock shows the compute cost
of the mechanism (a second, torch attention pass for rows with host entries),
not transfer overlap, which needs a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

from vllm_kvevict.inprocess import close

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

DOCS = ("austen_emma", "austen_persuasion", "austen_prideprejudice", "austen_mansfieldpark")


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    from vllm_kvevict import calibrate

    return [calibrate.calibration_ids(tokenizer, DOCS[i % len(DOCS)], 100 + i, length)[0].tolist()
            for i in range(n)]


def agreement(ids: list[int], ref: list[int]) -> float:
    for i, (a, b) in enumerate(zip(ids, ref)):
        if a != b:
            return i / len(ref)
    return 1.0


STAGES = {"speculation": "spec_ms_per_tok", "own selection": "select_ms_per_tok",
          "host fetch": "fetch_ms_per_tok", "host attention": "host_attn_ms_per_tok"}


def install_timers():
    """Time offload's stages (module docstring), wrapping each function where it
    is looked up. select_entries and HostTier.fetch serve both selections: they
    are timed on their own only outside speculation, whose time keeps them."""
    from common import Timers

    from vllm_kvevict.core.offload.decode_attention import host_tier, offload
    from vllm_kvevict.integration import cpu_backend, offload_connector

    t = Timers()
    speculating = [0]
    t.patch(offload_connector, "host_prefetch", "speculation")  # called by save_kv_layer
    timed_prefetch = offload_connector.host_prefetch

    @functools.wraps(timed_prefetch)
    def prefetch(*a, **kw):
        speculating[0] += 1
        try:
            return timed_prefetch(*a, **kw)
        finally:
            speculating[0] -= 1

    offload_connector.host_prefetch = prefetch

    def outside_speculation(owner, name: str, category: str) -> None:
        plain = getattr(owner, name)
        t.patch(owner, name, category)
        timed = getattr(owner, name)

        @functools.wraps(plain)
        def routed(*a, **kw):
            return (plain if speculating[0] else timed)(*a, **kw)

        setattr(owner, name, routed)

    t.patch(cpu_backend, "host_decode", "host attention")  # called by the backend's forward
    # select_entries: looked up in offload by decode_attention and speculate
    outside_speculation(offload, "select_entries", "own selection")
    outside_speculation(host_tier.HostTier, "fetch", "host fetch")
    return t


def run(model: str, name: str, extra: dict, reqs, args, timers) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_kvevict.probe import attach
    from vllm_kvevict.integration.worker import worker_state

    llm = LLM(model, enforce_eager=True, seed=0, dtype=args.dtype, block_size=32,
              max_model_len=args.prompt + args.tokens + 32,
              kv_cache_memory_bytes=args.pool_mib << 20, additional_config=extra)
    probe = attach(llm)
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": reqs[0][:64]}], SamplingParams(max_tokens=4),
                 use_tqdm=False)  # warm-up: one-off allocator / oneDNN costs
    state = worker_state()
    if state is not None and state.host is not None:
        state.host.stats.__init__()
        state.host.pool.reset_stats()
    probe.max_blocks_per_request = 0
    timers.reset()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r} for r in reqs], sp, use_tqdm=False)
    wall = time.perf_counter() - t
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    row = dict(name=name, config=extra, wall_s=wall, tok_s=gen / wall, generated=gen,
               ids=[list(o.outputs[0].token_ids) for o in outs],
               peak_blocks=probe.max_blocks_per_request)
    host = None if state is None else state.host
    if host is not None:
        s, p = host.stats, host.pool.stats
        heads = host.num_kv_heads * (args.q_heads // host.num_kv_heads)
        row.update(offloaded_b_per_tok=s.bytes_offloaded / gen,
                   fetched_b_per_tok=s.bytes_fetched / gen,
                   pool_kept=1 - s.entries_dropped / max(1, s.entries_offloaded),
                   spec_recall=s.speculation_hits / max(1, s.prefetch_needed),
                   spec_precision=s.speculation_hits / max(1, s.entries_speculated),
                   attended=s.attended_tokens / max(1, s.decode_rows * heads),
                   pool_peak_bytes=p.peak_blocks * host.pool.block_bytes,
                   pool_evictions=p.evictions,
                   **{k: 1000 * timers.seconds.get(c, 0.0) / gen for c, k in STAGES.items()},
                   timer_calls=dict(timers.calls))
    close(llm)
    return row


def table(rows: list[dict]) -> str:
    ref = rows[0]["ids"]
    out = ["| engine | wall s | tok/s | agreement | offloaded B/tok | fetched B/tok | "
           "pool kept | spec. recall | spec. precision | attended | peak blocks | "
           "spec. ms/tok | select ms/tok | fetch ms/tok | host attn ms/tok |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        agree = sum(agreement(a, b) for a, b in zip(r["ids"], ref)) / len(ref)
        r["agreement"] = agree
        f = (lambda k, fmt: fmt.format(r[k]) if k in r else "-")
        out.append(f"| {r['name']} | {r['wall_s']:.1f} | {r['tok_s']:.1f} | {agree:.3f} | "
                   f"{f('offloaded_b_per_tok', '{:,.0f}')} | {f('fetched_b_per_tok', '{:,.0f}')} | "
                   f"{f('pool_kept', '{:.3f}')} | {f('spec_recall', '{:.3f}')} | "
                   f"{f('spec_precision', '{:.3f}')} | {f('attended', '{:.0f}')} | "
                   f"{r['peak_blocks']} | "
                   + " | ".join(f(k, "{:.2f}") for k in STAGES.values()) + " |")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["tok_s"], r["agreement"], label=r["name"])
    ax.set_xlabel("output tokens / s")
    ax.set_ylabel("agreement with the full cache")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--pool-mib", type=int, default=512, help="vLLM's KV pool")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--victims", default="counter,lru,fifo")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from vllm_kvevict.calibrate import calibrate
    from vllm_kvevict.models import ensure_smollm2

    model = ensure_smollm2()
    calibrate(model)  # the offload engines' skewing file (kept when already there)
    args.q_heads = AutoConfig.from_pretrained(model).num_attention_heads
    reqs = prompts(AutoTokenizer.from_pretrained(model), args.requests, args.prompt)
    b = {"kv_budget": args.budget}
    engines = [("full", {}), ("h2o", {"kv_eviction": "h2o", **b}),
               ("infinigen", {"kv_eviction": "infinigen", **b}),
               ("h2o+offload", {"kv_eviction": "h2o", "kv_swap_space": "4GiB", **b})]
    timers = install_timers()
    rows = []
    for name, extra in engines:
        rows.append(run(model, name, extra, reqs, args, timers))
        print(f"{name}: {rows[-1]['wall_s']:.1f} s", flush=True)
    peak = rows[2]["pool_peak_bytes"]
    for victim in filter(None, args.victims.split(",")):
        extra = {"kv_eviction": "infinigen", "kv_swap_space": f"{int(0.8 * peak)}B",
                 "kv_host_victim": victim, **b}
        rows.append(run(model, f"infinigen/{victim} 80%", extra, reqs, args, timers))
        print(f"{victim}: {rows[-1]['wall_s']:.1f} s", flush=True)
    print(f"\n{args.requests} requests x ({args.prompt} prompt + {args.tokens} generated), "
          f"budget {args.budget}, {args.dtype}; 80% pool = {0.8 * peak / 2**20:.1f} MiB\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
