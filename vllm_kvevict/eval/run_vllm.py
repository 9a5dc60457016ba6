"""Run task instances through vLLM with the plugin: one engine per (model, policy, budget).

Per engine, every task's instances go through one ``llm.generate`` call
(token-id prompts, greedy, seed 0, bfloat16, chunked prefill so eviction runs
between prompt chunks). NOTE: one call per task, not one for all tasks, so
that each task's wall time is its own: in a mixed batch every request shares
every step and no per-task time could be told apart.

Policy ``none`` (the full cache) runs first, once: its agreement outputs are
the reference the other engines are scored against.

Result rows (one per model x task x policy x budget)::

    {"framework": "vllm_kvevict", "model": str, "task": str, "policy": str,
     "budget": float (fraction of the request's current length; 1.0 for none),
     "query_mode": "aware", "score": float | None (perplexity: lower is better),
     "n": int (instances), "wall_s": float (that task's generate call),
     "detail": {...per task, see _score_task...}}
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# In-process engine core: lets the probe read vLLM's block pool (tokens
# evicted) and lets us shut one engine down before the next starts.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm_kvevict.eval import tasks as T
from vllm_kvevict.inprocess import close

FRAMEWORK = "vllm_kvevict"


@dataclass(frozen=True)
class EngineSpec:
    """What every engine of one model shares.

    max_model_len: tokens (longest prompt + its max_tokens, rounded up to a block).
    kv_pool_mib: KV cache size in MiB (the full-cache engine queues or preempts
        requests when it runs out; evicting engines hold far less).
    chunk_tokens: max_num_batched_tokens, i.e. the chunked-prefill chunk size.
    dtype: model and KV dtype.
    kv_cache_dtype: vLLM's --kv-cache-dtype of every engine ("auto": the
        model dtype; "fp8" / "fp8_e5m2": an fp8 cache, AVX-512 CPUs).
    prefill_cap: --kv-prefill-cap of the evicting engines (None: the default,
        compress once the prompt is complete; 0: between every chunk).
    """

    model_dir: str
    max_model_len: int
    kv_pool_mib: int = 512
    chunk_tokens: int = 512
    block_size: int = 32
    dtype: str = "bfloat16"
    prefill_cap: int | None = None
    kv_cache_dtype: str = "auto"


def build_llm(spec: EngineSpec, policy: str, budget: float):
    from vllm import LLM

    extra = {"kv_eviction": policy}
    if policy != "none":
        extra["kv_budget"] = float(budget)  # a float is a fraction, even 1.0
        if spec.prefill_cap is not None:
            extra["kv_prefill_cap"] = spec.prefill_cap
    return LLM(spec.model_dir, enforce_eager=True, dtype=spec.dtype, seed=0,
               kv_cache_dtype=spec.kv_cache_dtype,
               block_size=spec.block_size, max_model_len=spec.max_model_len,
               kv_cache_memory_bytes=spec.kv_pool_mib << 20,
               enable_chunked_prefill=True, max_num_batched_tokens=spec.chunk_tokens,
               # Prefix hits would skip prefill (and its eviction) for shared
               # haystack prefixes under some policies only: off for all.
               enable_prefix_caching=False,
               additional_config=extra)


def sampling_params(instance: dict, evicting: bool):
    from vllm import SamplingParams

    if instance["task"] == "perplexity":
        # prompt_logprobs=0: the logprob of each actual prompt token only.
        # Prompt perplexity measures what evicting while reading costs the next
        # tokens (InfiniGen's Figure 12): a prompt compressed only once it is
        # complete (the default) would be scored with the full cache, so this
        # task compacts between chunks.
        extra = {"kv_prefill_cap": 0} if evicting else None
        return SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                              extra_args=extra)
    return SamplingParams(temperature=0, max_tokens=instance["max_tokens"],
                          ignore_eos=bool(instance["meta"].get("ignore_eos")))


def warm_up(llm, max_model_len: int) -> None:
    """One short untimed request (prefill with prompt logprobs, then decode).

    NOTE: a fresh engine's first steps pay one-off costs (oneDNN primitive
    creation, allocator growth) that would otherwise land in the first task's
    wall time.
    """
    from vllm import SamplingParams

    n = min(300, max_model_len - 16)
    prompt = {"prompt_token_ids": [(7 * i) % 1000 + 100 for i in range(n)]}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                          prompt_logprobs=0, detokenize=False), use_tqdm=False)


def _tokens_evicted(probe) -> int:
    return sum(getattr(m, "num_tokens_evicted", 0) for m in probe.managers())


def _score_task(task: str, instances, prompts, outputs, reference) -> tuple[float | None, dict]:
    """(score, detail) for one task's outputs (vLLM RequestOutputs, in instance order).

    reference: {instance id: full-cache token ids} for agreement, or None when
    this engine *is* the full cache.
    """
    per = []
    if task == "perplexity":
        nlls = []
        for inst, ids, out in zip(instances, prompts, outputs):
            # prompt_logprobs[i]: {token id: Logprob} for prompt token i; [0] is None.
            nll = [None] + [-out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
            nlls.append(nll)
            window = inst["meta"]["window"]
            per.append(dict(id=inst["id"], ppl=T.pooled_perplexity([nll]),
                            windows=T.window_perplexity(nll, window)))
        pooled_windows = [T.pooled_perplexity([n[s:s + window] for n in nlls])
                          for s in range(0, max(map(len, nlls)), window)]
        return T.pooled_perplexity(nlls), dict(window=window, windows=pooled_windows,
                                               instances=per)
    if task == "agreement":
        for inst, out in zip(instances, outputs):
            ids = list(out.outputs[0].token_ids)
            if reference is None:
                score, first = 1.0, None
            else:
                score, first = T.agreement(ids, reference[inst["id"]])
            per.append(dict(id=inst["id"], score=score, first_divergence=first, token_ids=ids,
                            text=out.outputs[0].text))
        firsts = [p["first_divergence"] for p in per if p["first_divergence"] is not None]
        return (sum(p["score"] for p in per) / len(per),
                dict(instances=per, mean_first_divergence=(sum(firsts) / len(firsts)
                                                           if firsts else None),
                     diverged=len(firsts)))
    for inst, out in zip(instances, outputs):  # niah, kv_retrieval
        text = out.outputs[0].text
        row = dict(id=inst["id"], score=T.score_text(inst, text), output=text)
        if task == "niah":
            row.update(depth=inst["meta"]["depth"], length=inst["meta"]["length"])
        per.append(row)
    return sum(p["score"] for p in per) / len(per), dict(instances=per)


def run_engine(spec: EngineSpec, model: str, policy: str, budget: float,
               by_task: dict[str, list[dict]], prompts: dict[str, list[list[int]]],
               reference: dict | None, on_task=None) -> list[dict]:
    """All tasks through one engine; returns one row per task.

    by_task / prompts: task -> instances / their token-id prompts (same order).
    on_task(): called after each task (progress bars).
    """
    from vllm_kvevict.probe import attach

    t0 = time.perf_counter()
    llm = build_llm(spec, policy, budget)
    start_s = time.perf_counter() - t0
    rows = []
    try:
        warm_up(llm, spec.max_model_len)
        probe = attach(llm)
        for task, instances in by_task.items():
            evicted0, pre0 = _tokens_evicted(probe), probe.preemptions
            t0 = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[task]],
                                   [sampling_params(i, policy != "none") for i in instances],
                                   use_tqdm=True)
            wall = time.perf_counter() - t0
            score, detail = _score_task(task, instances, prompts[task], outputs, reference)
            detail.update(engine_start_s=round(start_s, 2),
                          tokens_evicted=_tokens_evicted(probe) - evicted0,
                          prompt_tokens=sum(map(len, prompts[task])),
                          preemptions=probe.preemptions - pre0)
            rows.append(dict(framework=FRAMEWORK, model=model, task=task, policy=policy,
                             budget=float(budget), query_mode="aware", score=score,
                             n=len(instances), wall_s=round(wall, 3), detail=detail))
            if on_task:
                on_task()
    finally:
        close(llm)
    return rows


def agreement_reference(rows: list[dict]) -> dict[str, list[int]]:
    """{instance id: token ids} from the full-cache engine's agreement row."""
    for row in rows:
        if row["task"] == "agreement" and row["policy"] == "none":
            return {p["id"]: p["token_ids"] for p in row["detail"]["instances"]}
    return {}
