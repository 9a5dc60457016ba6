"""Fidelity harness: quality of KV eviction policies vs the full cache, inside vLLM.

    python -m vllm_kvevict.eval.texts                  # setup: real text, once
    python -m vllm_kvevict.eval --config smoke         # run, write results + report
    python -m vllm_kvevict.eval.report results.json [kvpress.json] --out DIR

Modules: texts (+ rdata: R lazy-load reader), tasks (JSON interface, configs,
scoring), instances (task generators), run_vllm (engines), report (+ plots).
Importing this package imports neither vLLM nor torch.
"""
