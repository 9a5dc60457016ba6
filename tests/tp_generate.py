"""Greedy token ids from engines at given tensor-parallel sizes, plus what vLLM's
scheduler-side KV managers counted (compactions, evicted tokens, blocks).

    python tests/tp_generate.py MODEL RUNS [--dtype float32] [--max-tokens 100]
        [--block-size 32] [--kv-bytes N] < prompts.json

RUNS is a JSON list of engines to run one after the other in this process, e.g.
`[{"tp": 1, "policy": "h2o", "budget": 32}, {"tp": 2, "policy": "h2o", "budget": 32}]`;
`"pp": 2` adds pipeline parallel (default 1), `"compiled": true` runs with
torch.compile instead of eager; `"backend": "ray"` runs an engine of
more than one worker (tp x pp > 1) on vLLM's Ray executor (default `mp`)
over a local Ray instance this process starts (on 127.0.0.1 only) and stops.
Policy `stock` runs vLLM with our plugin disabled (VLLM_PLUGINS=""); since
plugins load once per process, either every run is `stock` or none is.

`"passes": [32, null]` has one engine (server budget `budget`) generate the
prompts once per entry, one pass after the other: an int is a per-request
budget (`SamplingParams(extra_args={"kv_budget": n})`, at most `budget`), null
the server's own, `"length-1"` each request's own length (prompt + max tokens)
less one: above every token it writes (the last sampled token is never
written), so nothing compacts, yet under its length, so it is scored. Without
`passes` a run generates once, at the server's budget.

Why a separate process: vLLM caches its environment variables once an engine
has started (`enable_envs_cache`), so VLLM_CPU_OMP_THREADS_BIND="0|1", which
the `mp` executor needs to bind one core per rank, must be set before the
first engine of the process; and VLLM_PLUGINS="" before vLLM loads plugins.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set
here), so its scheduler is readable; with tp 2 the two workers are `mp`
processes (or Ray actors). With tp 1 the worker runs in this process
(uniprocessor executor, which ignores the binding variable). Engines are built
with the suite's settings (conftest.make_llm's: eager, seed 0, max_model_len
2048, a KV pool of --kv-bytes), written out here rather than imported: conftest
imports vllm_kvevict, which a stock process must not even import.

Prints one line `RUN=<json>` as each run ends (so the runs before a failing one
are still read) and, after the last, one line `RESULT=<json>`: the list of all.
A run's result has `seconds` (engine start to shutdown) and, with the plugin,
`workers` (per worker: pid, TP rank, PP stage, plugin live, Ray actor and node,
CPUs). Per pass
it has `ids` (per prompt) and, with the plugin, `compactions`, `evicted` (token
slots returned, summed over requests), `max_blocks` (the most blocks one request
held in any step), `pool_whole` (no block in use at the end) and `kept` (per
worker: its layers, KV heads, compactions and H2O score mass, see
`compaction_history`), each counted over that pass alone. A run with `passes` reports them as `passes` (a list, in order,
each with its `budget` and `seconds`); a run without, at the top level of its
result, as one pass.
"""

import argparse
import atexit
import dataclasses
import gc
import json
import os
import sys
import time


def pass_budgets(llm, prompts: list[str], budget, max_tokens: int) -> list:
    """Each prompt's per-request budget in a pass (see `passes` above)."""
    if budget != "length-1":
        return [budget] * len(prompts)
    tok = llm.get_tokenizer()
    return [len(tok(p)["input_ids"]) + max_tokens - 1 for p in prompts]


def process_cpus() -> list[int]:
    """The CPUs any thread of this process may run on (after
    VLLM_CPU_OMP_THREADS_BIND, one rank's cores)."""
    import os

    cpus = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            pass  # ended meanwhile
    return sorted(cpus)


def shm_segments() -> dict:
    """In a worker: for each of its TP / PP groups that all-reduces through
    vLLM's CPU shared memory, the group's segment names still in /dev/shm
    (patches/cpu_shm_unlink.py: none, once the engine has started)."""
    import os

    from vllm.distributed import get_pp_group, get_tp_group

    from vllm_kvevict.patches.cpu_shm_unlink import segment_name

    found = {}
    for group in (get_tp_group(), get_pp_group()):
        dist = getattr(group.device_communicator, "dist_module", None)
        if type(dist).__name__ == "_CPUSHMDistributed":
            names = [segment_name(dist.group_name, r) for r in range(group.world_size)]
            found[group.unique_name] = [n for n in names if os.path.exists(f"/dev/shm/{n}")]
    return found


def record_compactions(worker) -> dict:
    """In a worker: who am I, is the plugin live here, and from now on keep
    every compaction's kept logical positions (per layer and local KV head).
    Called again (the next pass), it starts a new history: requests are then
    numbered from 0 again."""
    import os

    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    from vllm_kvevict.integration.worker import worker_state

    state = worker_state()
    info = {"pid": os.getpid(), "rank": get_tensor_model_parallel_rank(),
            "stage": get_pp_group().rank_in_group,
            "plugin": state is not None, "ray_actor": None,
            "cpus": process_cpus(), "shm_segments": shm_segments()}
    try:
        import ray

        if ray.is_initialized():
            info["ray_actor"] = ray.get_runtime_context().get_actor_id()
            info["ray_node_ip"] = ray.util.get_node_ip_address()
    except ImportError:
        pass
    if state is None:
        return info
    import torch

    with torch.inference_mode():  # the buffers are inference tensors
        for st in state._stacks():
            st.scores.zero_()  # nothing runs between passes: `scored` counts this pass's
    if getattr(state, "kept_recorder", None) is None:
        state.kept_recorder = kept_positions.KeptRecorder(state)
    state.kept_recorder.compactions.clear()  # this pass's
    return info


def compaction_history(worker) -> dict:
    """The layers this worker holds (its pipeline stage's, in the order of the
    kept positions' first axis), the KV heads it scores, its compactions:
    [request (first-seen order), logical length, kept positions (L, H_local, n)],
    and `scored`: the H2O attention mass its score buffers took this pass
    (> 0: the scoring path ran here)."""
    from vllm_kvevict.integration.worker import worker_state

    state = worker_state()
    stacks = state._stacks()
    order = {}  # req_id -> first-seen number, this pass
    history = [[order.setdefault(plan.req_id, len(order)), plan.logical_len, kept.tolist()]
               for plan, kept in state.kept_recorder.compactions]
    return {"layers": [name for st in stacks for name in st.names],
            "kv_heads": sorted({lc.scores.shape[0] for lc in state.layers.values()}),
            "scored": sum(float(st.scores.sum()) for st in stacks),
            "history": sorted(history, key=lambda h: (h[0], h[1]))}


def make_llm(model: str, kv_bytes: int, eager: bool = True, **kwargs):
    """An engine with conftest.make_llm's settings (eager=False: torch.compile)."""
    from vllm import LLM

    kwargs.setdefault("max_model_len", 2048)
    return LLM(model, enforce_eager=eager, seed=0, kv_cache_memory_bytes=kv_bytes, **kwargs)


def close(llm) -> None:
    """vllm_kvevict.inprocess.close, written out: a stock process must not
    import vllm_kvevict. Shut down now, then freeze the heap for the next
    engine's start (that function says why)."""
    llm.llm_engine.engine_core.shutdown()
    freeze()


def freeze() -> None:
    """vllm_kvevict.inprocess.freeze, written out (see close); main
    unfreezes at exit."""
    gc.collect()
    gc.freeze()


def reset_probe(probe) -> None:
    """Start the probe's counts afresh: one probe per engine, reset per pass."""
    for f in dataclasses.fields(probe):
        if f.name != "scheduler":
            setattr(probe, f.name, f.default_factory() if callable(f.default_factory)
                    else f.default)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("runs", type=json.loads)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    # conftest.kv_bytes: the suite's pool, 96 MiB of bf16 (the same blocks in fp32).
    p.add_argument("--kv-bytes", type=int, default=None)
    args = p.parse_args()

    stock = {run["policy"] == "stock" for run in args.runs}
    assert len(stock) == 1, "stock and plugin runs need separate processes"
    stock = stock.pop()
    if stock:
        os.environ["VLLM_PLUGINS"] = ""  # not even our backend subclass is registered
        assert all(run.get("passes", [None]) == [None] for run in args.runs), \
            "stock vLLM has no per-request budget"
    if any(run.get("backend") == "ray" for run in args.runs):
        # Ray on loopback only. On Linux Ray turns 127.0.0.1 into the host's
        # routable address (ray._private.services.resolve_ip_for_localhost) and
        # listens on every interface, unless its single-node switch is off: then
        # the node, GCS, raylet, and the addresses vLLM asks Ray for (gloo
        # rendezvous, message queues) are all 127.0.0.1. Read when ray is
        # imported, so before vLLM or the plugin imports it.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    max_workers = max(run["tp"] * run.get("pp", 1) for run in args.runs)
    if max_workers > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(max_workers))
    # In-process engine core: its scheduler (the KV managers, the BlockPool) is read.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kv_bytes = args.kv_bytes or (96 << 20) * (2 if args.dtype == "float32" else 1)
    from vllm import SamplingParams

    if not stock:
        # record_compactions runs in every worker, pickled by value from
        # __main__; what it uses of tests/kept_positions.py goes by value too,
        # so Ray workers need no access to tests/.
        import cloudpickle
        import kept_positions

        cloudpickle.register_pickle_by_value(kept_positions)
    freeze()  # the first engine's start then collects only what is new (see close)
    atexit.register(gc.unfreeze)  # else Triton's nanobind types report leaks at exit
    prompts = json.load(sys.stdin)
    results = []
    for run in args.runs:
        t0 = time.perf_counter()
        kw = {"tensor_parallel_size": run["tp"], "dtype": args.dtype,
              "block_size": args.block_size, "enable_prefix_caching": False,
              "pipeline_parallel_size": run.get("pp", 1)}
        if run["tp"] * run.get("pp", 1) > 1:
            kw["distributed_executor_backend"] = run.get("backend", "mp")
        if not stock:
            kw["additional_config"] = {"kv_eviction": run["policy"], "kv_budget": run["budget"]}
        if run.get("backend") == "ray":
            import ray

            # A new local Ray instance on loopback (see above; "local": never
            # join a cluster already running here), one CPU per rank; vLLM
            # finds it initialised and only adds its placement group. It stops at
            # ray.shutdown() below, or at this process's exit on an error (Ray's
            # atexit hook); if this process is killed, Ray's agent processes
            # stay: tests/tp_runs.py kills this process's whole session after.
            ray.init(address="local", num_cpus=run["tp"] * run.get("pp", 1),
                     include_dashboard=False,
                     object_store_memory=200 << 20, _node_ip_address="127.0.0.1")
        llm = make_llm(args.model, kv_bytes, eager=not run.get("compiled"), **kw)
        result, passes = {}, []
        if not stock:
            from vllm_kvevict.probe import attach

            probe = attach(llm)
            managers = probe.managers()
        for budget in run.get("passes", [None]):
            t1 = time.perf_counter()
            params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                     extra_args=None if budget is None else {"kv_budget": b})
                      for b in pass_budgets(llm, prompts, budget, args.max_tokens)]
            if not stock:
                reset_probe(probe)
                counted = [(sum(getattr(m, "num_compactions", 0) for m in managers),
                            sum(getattr(m, "num_tokens_evicted", 0) for m in managers))]
                # Runs in every worker (pickled by value from __main__, so Ray
                # workers need no access to this file).
                workers = llm.collective_rpc(record_compactions)
                result.setdefault("workers", workers)
            outs = llm.generate(prompts, params, use_tqdm=False)
            done = {"budget": budget, "ids": [list(o.outputs[0].token_ids) for o in outs]}
            if not stock:
                done["kept"] = llm.collective_rpc(compaction_history)
                counted.append((sum(getattr(m, "num_compactions", 0) for m in managers),
                                sum(getattr(m, "num_tokens_evicted", 0) for m in managers)))
                done["compactions"] = counted[1][0] - counted[0][0]
                done["evicted"] = counted[1][1] - counted[0][1]
                done["max_blocks"] = probe.max_blocks_per_request
                done["pool_whole"] = probe.used_blocks() == 0
            done["seconds"] = round(time.perf_counter() - t1, 1)
            passes.append(done)
        close(llm)
        if run.get("backend") == "ray":
            ray.shutdown()
        if "passes" in run:
            result["passes"] = passes
        else:
            (single,) = passes
            del single["budget"], single["seconds"]
            result.update(single)
        result["seconds"] = round(time.perf_counter() - t0, 1)
        if stock:
            assert "vllm_kvevict" not in sys.modules, "plugin loaded despite VLLM_PLUGINS=''"
        results.append(result)
        print("RUN=" + json.dumps(result), flush=True)
    print("RESULT=" + json.dumps(results), flush=True)
