"""Per-layer buffers of logged queries: the decode log's (H2O) and the query
window's (SnapKV, AnDPro).

    buffers[layer]: (R, cols, H_q, D) query dtype; a query's cell is row * cols + col

The layers' buffers are views of one (L, R, cols, H_q, D) tensor wherever
their queries agree in shape, dtype and device (every model here), so that a
read across layers (`take`: a flush of every layer's log) is one copy, not a
gather per layer and a concatenation of them.

Each layer's attention hands over its step's queries (`hold`, with the step's
`StepPlacement`: which tokens go to which cells). Where the compiled CPU kernel
copies them, they are not copied then: the layer's query tensor is kept by
reference, and every layer's queries are copied into place at once, in one
call, before anything reads the buffers (`commit`, run by every read and by
the next step's first `hold`). A copy per layer in the forward cost far more
than its bytes (a kernel call and a few tensor views, each time with the
caches cold from the layer's matrix products). For the same reason a step
whose every token is logged is opened once (`by_reference`, from the metadata
builder), and each layer's hand-over is then one append (`hold_ref`): in the
engine, with the caches cold, the general `hold` and the calls around it cost
about 50 us per layer.

Holding a query by reference is safe because nothing writes it after
attention: it is the model's own post-RoPE tensor (on the CPU backend, a slice
of the layer's fresh qkv output, which the model drops after the layer, and
which our reference keeps from being reused). Inference tensors carry no
version counter to check this at run time; the engine tests that hold H2O's
and the window's kept sets to dense references (tests/test_h2o_reference.py,
tests/test_window_reference.py) would see a clobbered query. A mixed step's decode rows are gathered (copied) at once, so a long
prefill chunk's qkv is never held. Elsewhere (CUDA, the torch path) each layer's
queries are stored when handed over: a CUDA graph may reuse a layer's query
memory later in the same step.
"""

from __future__ import annotations

import torch


class QueryBuffers:
    def __init__(self, cols: int) -> None:
        self.cols = cols
        self._buffers: dict[str, torch.Tensor] = {}
        # The stack the buffers of `_stacked` (in its order) are views of; a
        # layer whose queries differ in shape, dtype or device gets its own.
        self._stack: torch.Tensor | None = None
        self._stacked: list[str] = []
        self.scale: dict[str, float] = {}
        # Held, not yet stored: (layer, queries (N, H_q, D)), all of one step's
        # placement, for buffers of `_rows` rows.
        self._held: list[tuple[str, torch.Tensor]] = []
        self._placement = None
        self._rows = 0

    # --- reads (each commits first) -------------------------------------------

    def __contains__(self, layer: str) -> bool:
        self.commit()
        return layer in self._buffers

    def __getitem__(self, layer: str) -> torch.Tensor:
        self.commit()
        return self._buffers[layer]

    def __bool__(self) -> bool:
        self.commit()
        return bool(self._buffers)

    def take(self, layers: list[str], rows: slice | torch.Tensor, n: int) -> torch.Tensor:
        """(len(layers) * P, n, H_q, D), row l * P + p: the first n cells of
        buffer row rows[p] in layers[l]; rows a slice or (P,) int64. One copy
        when the layers are consecutive in the stack (a flush of every layer),
        else a gather per layer."""
        self.commit()
        span = self._stack_span(layers)
        if span is not None:
            src = self._stack[span, :, :n]
            out = src[:, rows] if isinstance(rows, slice) else src.index_select(1, rows.to(src.device))
            return out.reshape(-1, *out.shape[2:])
        return torch.cat([self._buffers[name][rows, :n] for name in layers])

    def has(self, layers: list[str]) -> bool:
        """Whether every one of `layers` has a buffer (one commit for all)."""
        self.commit()
        return all(name in self._buffers for name in layers)

    def gather(self, layers: list[str], cells: torch.Tensor) -> torch.Tensor:
        """(P * len(layers), k, H_q, D), row p * L + l: the queries in flat
        cells[p] (row * cols + col; cells (P, k) int64) of layers[l]. One
        index_select over the stack when the layers are consecutive in it (a
        compaction's window of every layer), else one per layer."""
        self.commit()
        span = self._stack_span(layers)
        num_p, k = cells.shape
        if span is not None:
            src = self._stack[span]  # (L, R, cols, H_q, D), contiguous
            per_layer = src.shape[1] * src.shape[2]
            idx = torch.arange(len(layers))[None, :, None] * per_layer + cells[:, None, :]
            out = src.flatten(0, 2).index_select(0, idx.flatten().to(src.device))
        else:
            out = torch.stack([self._buffers[name].flatten(0, 1).index_select(
                0, cells.flatten().to(self._buffers[name].device)).view(num_p, k, -1)
                for name in layers], dim=1)
        return out.view(num_p * len(layers), k, *self._buffers[layers[0]].shape[2:])

    def _stack_span(self, layers: list[str]) -> slice | None:
        """The slice of the stack that is exactly `layers`, in order, or None
        where they are not consecutive in it (then a read goes layer by layer)."""
        pos = {name: i for i, name in enumerate(self._stacked)}
        at = [pos.get(name, -1) for name in layers]
        if at and at[0] >= 0 and at == list(range(at[0], at[0] + len(at))):
            return slice(at[0], at[0] + len(at))
        return None

    # --- writes ---------------------------------------------------------------

    def hold(self, layer: str, query: torch.Tensor, placement, rows: int, scale: float) -> None:
        """This step's queries of one layer: query (num_tokens, H_q, D); the
        buffers need `rows` rows for the placement's cells."""
        if placement is not self._placement:
            self.commit()  # the previous step's
        self.scale[layer] = scale
        n = placement.tokens.numel()
        # Placed token indices are distinct and increasing, so placing all of
        # them means all in order (a decode-only step): no gather needed.
        src = query if n == query.shape[0] else query[placement.tokens.to(query.device)]
        if placement.copier is None or query.device.type != "cpu":
            self._store([(layer, src)], placement, rows)
            return
        self._held.append((layer, src))
        self._placement, self._rows = placement, rows

    def by_reference(self, placement, num_tokens: int, rows: int) -> bool:
        """Once per step (the metadata builder): open `placement` for `hold_ref`
        when every layer's queries can be held as they are, i.e. the compiled
        copier stores them (CPU) and all `num_tokens` of the step are placed,
        in order. The buffers need `rows` rows."""
        if placement.copier is None or placement.tokens.numel() != num_tokens:
            return False
        if placement is not self._placement:
            self.commit()  # the previous step's
        self._placement, self._rows = placement, rows
        return True

    def hold_ref(self, layer: str, query: torch.Tensor, scale: float) -> None:
        """`hold` for a step `by_reference` opened: nothing left to decide per
        layer. query: (num_tokens, H_q, D) of this step, every token placed."""
        self.scale[layer] = scale
        self._held.append((layer, query))

    def commit(self) -> None:
        """Store every held query in its cell, for all layers in one call."""
        if not self._held:
            return
        held, self._held = self._held, []
        self._store(held, self._placement, self._rows)

    def _store(self, items: list[tuple[str, torch.Tensor]], placement, rows: int) -> None:
        self._restack(items, rows)
        bufs = [self._buffer(layer, src, rows) for layer, src in items]
        if not placement.tokens.numel():
            return
        if placement.copier is not None and bufs[0].device.type == "cpu":
            # One memcpy per query row into cell row * cols + col of the
            # contiguous buffer (vllm_kvevict/cpu_kernel/token_moves.h).
            placement.copier.copy_rows(bufs, placement.cells, [src for _, src in items])
            return
        for buf, (_, src) in zip(bufs, items):  # index_copy_ on the flat (row, column) axis
            buf.view(-1, *buf.shape[2:]).index_copy_(0, placement.cells.to(buf.device), src)

    def _restack(self, items: list[tuple[str, torch.Tensor]], rows: int) -> None:
        """Before a store: when a layer of `items` has no buffer or one under
        `rows` rows, one new stack for the stacked layers and these (old
        contents copied), grown by doubling. Queries of another shape, dtype or
        device than the stack's end stacking: every layer keeps the buffer it
        has (a view is still a buffer) and grows alone (`_buffer`)."""
        if all(layer in self._buffers and self._buffers[layer].shape[0] >= rows
               for layer, _ in items):
            return
        ref = items[0][1] if self._stack is None else self._stack[0, 0]  # (N, H_q, D)
        if (any(layer in self._buffers and layer not in self._stacked for layer, _ in items)
                or any(src.shape[1:] != ref.shape[1:] or src.dtype != ref.dtype
                       or src.device != ref.device for _, src in items)):
            self._stack, self._stacked = None, []
            return
        old = 0 if self._stack is None else self._stack.shape[1]
        names = self._stacked + [layer for layer, _ in items if layer not in self._stacked]
        size = max(8, 2 * old, rows) if rows > old or self._stack is None else old
        stack = ref.new_zeros(len(names), size, self.cols, *ref.shape[1:])
        if self._stack is not None:
            stack[:len(self._stacked), :old] = self._stack
        self._stack, self._stacked = stack, names
        for i, name in enumerate(names):
            self._buffers[name] = stack[i]

    def _buffer(self, layer: str, like: torch.Tensor, rows: int) -> torch.Tensor:
        """The layer's buffer, grown (by doubling) to at least `rows` rows."""
        buf = self._buffers.get(layer)
        if buf is None or buf.shape[0] < rows:
            old = 0 if buf is None else buf.shape[0]
            grown = like.new_zeros(max(8, 2 * old, rows), self.cols, *like.shape[1:])
            if buf is not None:
                grown[:old] = buf
            self._buffers[layer] = buf = grown
        return buf
