"""Greedy token ids from engines at given tensor-parallel sizes, plus what vLLM's
scheduler-side KV managers counted (compactions, evicted tokens, blocks).

    python tests/tp_generate.py MODEL RUNS [--dtype float32] [--max-tokens 100] < prompts.json

RUNS is a JSON list of engines to run one after the other in this process, e.g.
`[{"tp": 1, "policy": "h2o", "budget": 32}, {"tp": 2, "policy": "h2o", "budget": 32}]`;
`"backend": "ray"` runs a tp > 1 engine on vLLM's Ray executor (default `mp`)
over a local Ray instance this process starts (on 127.0.0.1 only) and stops.
Policy `stock` runs vLLM with our plugin disabled (VLLM_PLUGINS=""); since
plugins load once per process, either every run is `stock` or none is.

Why a separate process: vLLM caches its environment variables once an engine
has started (`enable_envs_cache`), so VLLM_CPU_OMP_THREADS_BIND="0|1", which
the `mp` executor needs to bind one core per rank, must be set before the
first engine of the process; and VLLM_PLUGINS="" before vLLM loads plugins.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by
conftest), so its scheduler is readable; with tp 2 the two workers are `mp`
processes. With tp 1 the worker runs in this process (uniprocessor executor,
which ignores the binding variable).

Prints one line `RESULT=<json>`: a list with, per run, `ids` (per prompt),
`seconds` (engine start to shutdown) and, with the plugin, `compactions`,
`evicted` (token slots returned, summed over requests), `max_blocks` (the most
blocks one request held in any step) and `pool_whole` (no block in use at the end).
"""

import argparse
import json
import os
import sys
import time


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


def record_compactions(worker) -> dict:
    """In a worker: who am I, is the plugin live here, and from now on keep
    every compaction's kept logical positions (per layer and local KV head)."""
    import os

    from vllm.distributed import get_tensor_model_parallel_rank

    from vllm_kvevict.integration.worker import worker_state

    state = worker_state()
    info = {"pid": os.getpid(), "rank": get_tensor_model_parallel_rank(),
            "plugin": state is not None, "ray_actor": None,
            "cpus": process_cpus()}
    try:
        import ray

        if ray.is_initialized():
            info["ray_actor"] = ray.get_runtime_context().get_actor_id()
            info["ray_node_ip"] = ray.util.get_node_ip_address()
    except ImportError:
        pass
    if state is None:
        return info
    state.record_kept, state.history, order = True, [], {}
    compact = state._compact

    def recording(plan):
        compact(plan)
        rec = state.kept.get(plan.req_id)
        if rec is not None:
            req = order.setdefault(plan.req_id, len(order))
            state.history.append([req, plan.logical_len, rec.positions.tolist()])

    state._compact = recording
    return info


def compaction_history(worker) -> dict:
    """The KV heads this rank scores, and its compactions: [request (first-seen
    order), logical length, kept positions (L, H_local, n)]."""
    from vllm_kvevict.integration.worker import worker_state

    state = worker_state()
    return {"kv_heads": sorted({lc.scores.shape[0] for lc in state.layers.values()}),
            "history": sorted(state.history, key=lambda h: (h[0], h[1]))}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("runs", type=json.loads)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()

    stock = {run["policy"] == "stock" for run in args.runs}
    assert len(stock) == 1, "stock and plugin runs need separate processes"
    stock = stock.pop()
    if stock:
        os.environ["VLLM_PLUGINS"] = ""  # not even our backend subclass is registered
    if any(run.get("backend") == "ray" for run in args.runs):
        # Ray on loopback only. On Linux Ray turns 127.0.0.1 into the host's
        # routable address (ray._private.services.resolve_ip_for_localhost) and
        # listens on every interface, unless its single-node switch is off: then
        # the node, GCS, raylet, and the addresses vLLM asks Ray for (gloo
        # rendezvous, message queues) are all 127.0.0.1. Read when ray is
        # imported, so before vLLM or the plugin imports it.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    max_tp = max(run["tp"] for run in args.runs)
    if max_tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(max_tp))
    from conftest import close, make_llm  # sets VLLM_ENABLE_V1_MULTIPROCESSING=0

    from vllm import SamplingParams

    prompts = json.load(sys.stdin)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    for run in args.runs:
        t0 = time.perf_counter()
        kw = {"tensor_parallel_size": run["tp"], "dtype": args.dtype,
              "block_size": args.block_size, "enable_prefix_caching": False}
        if run["tp"] > 1:
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
            # stay: tests/test_ray.py kills this process's whole session after.
            ray.init(address="local", num_cpus=run["tp"], include_dashboard=False,
                     object_store_memory=200 << 20, _node_ip_address="127.0.0.1")
        llm = make_llm(args.model, **kw)
        if not stock:
            from vllm_kvevict.integration.probe import attach

            probe = attach(llm)
            # Runs in every worker (pickled by value from __main__, so Ray
            # workers need no access to this file).
            workers = llm.collective_rpc(record_compactions)
        outs = llm.generate(prompts, params)
        result = {"ids": [list(o.outputs[0].token_ids) for o in outs]}
        if not stock:
            result["workers"] = workers
            result["kept"] = llm.collective_rpc(compaction_history)
        if not stock:
            managers = probe.managers()
            result["compactions"] = sum(getattr(m, "num_compactions", 0) for m in managers)
            result["evicted"] = sum(getattr(m, "num_tokens_evicted", 0) for m in managers)
            result["max_blocks"] = probe.max_blocks_per_request
            result["pool_whole"] = probe.used_blocks() == 0
        close(llm)
        if run.get("backend") == "ray":
            ray.shutdown()
        result["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(result)
    if stock:
        assert "vllm_kvevict" not in sys.modules, "plugin loaded despite VLLM_PLUGINS=''"
    print("RESULT=" + json.dumps(results), flush=True)
