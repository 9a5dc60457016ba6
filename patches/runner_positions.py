"""TARGET: vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs
        (inherited by the CPU model runner)

WHY: a request built from prompt modules has RoPE positions that are not its
     token indices: each module sits at its schema position, wherever its
     blocks are in the request's block table. vLLM derives positions from
     num_computed_tokens, and the slot mapping from those same positions.
HOW: after the stock _prepare_inputs (slot mapping already computed from
     token indices), map the scheduled tokens' positions of such requests
     through their layout: index i < prompt length -> layout position i;
     generated tokens continue after the prompt's last position.
UPSTREAM: explicit per-token positions on a request (M-RoPE has them).
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_kvevict.integration.module_store import LAYOUT_KEY

    def table(self, req_id):
        """(positions of the prompt + [next position]) on the device, or None."""
        state = self.requests.get(req_id)
        cached = getattr(state, "_kvevict_positions", False)
        if cached is False:
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None)
            layout = (extra or {}).get(LAYOUT_KEY)
            cached = None
            if layout is not None:
                pos = list(layout["positions"])
                cached = torch.tensor(pos + [max(pos) + 1], dtype=torch.int64,
                                      device=self.positions.device)
            if state is not None:
                state._kvevict_positions = cached
        return cached

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        out = _prepare_inputs.__kvevict_original__(self, scheduler_output, *args, **kwargs)
        num_reqs = self.input_batch.num_reqs
        qsl = None
        for i, req_id in enumerate(self.input_batch.req_ids[:num_reqs]):
            t = table(self, req_id)
            if t is None:
                continue
            if qsl is None:
                qsl = self.query_start_loc.np[: num_reqs + 1].tolist()
            idx = self.positions[qsl[i]:qsl[i + 1]]
            n = t.numel() - 1  # prompt length
            self.positions[qsl[i]:qsl[i + 1]] = torch.where(
                idx < n, t[idx.clamp(max=n)], t[n] + idx - n)
        return out

    mark_patched(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
