"""core/scoring/query_buffers.py: the query logs' buffers, every layer's a view
of one stack, and `take`, the flush's read of every layer at once.

Each test logs random queries step by step through `hold` (as the decode log
does: request row r's t-th query in cell r * cols + t), keeps what it logged
in a dense reference, and reads it back, on the compiled copier's store and
on torch's (VLLM_KVEVICT_KERNELS)."""

import pytest
import torch

from vllm_kvevict.core.scoring.decode_log import StepPlacement
from vllm_kvevict.core.scoring.query_buffers import QueryBuffers

COLS, D = 8, 16


def _log(bufs: QueryBuffers, ref: dict, layers: dict[str, int], rows: list[int], steps: int,
         gen: torch.Generator) -> None:
    """`steps` decode steps of the requests in buffer `rows`, each step one
    query per row in every layer (layers: name -> query heads); ref[name] is
    the (R, COLS, H, D) dense copy."""
    for _ in range(steps):
        cells = []
        for r in rows:
            t = ref["count"].get(r, 0)
            ref["count"][r] = t + 1
            cells.append(r * COLS + t)
        placement = StepPlacement(torch.arange(len(rows)), torch.tensor(cells))
        need = max(rows) + 1
        for name, heads in layers.items():
            q = torch.randn(len(rows), heads, D, generator=gen).to(torch.bfloat16)
            bufs.hold(name, q, placement, rows=need, scale=0.125)
            dense = ref.setdefault(name, torch.zeros(0, COLS, heads, D, dtype=torch.bfloat16))
            if dense.shape[0] < need:
                dense = torch.cat([dense, dense.new_zeros(need - dense.shape[0], *dense.shape[1:])])
            for i, c in enumerate(cells):
                dense[c // COLS, c % COLS] = q[i]
            ref[name] = dense


def _expected(ref: dict, layers: list[str], rows, n: int) -> torch.Tensor:
    return torch.cat([ref[name][rows, :n] for name in layers])


@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_take_reads_every_layer_in_one_copy_across_growth(mode, monkeypatch):
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", mode)
    gen = torch.Generator().manual_seed(0)
    layers = {f"layer.{i}": 3 for i in range(5)}
    bufs, ref = QueryBuffers(COLS), {"count": {}}
    nothing = StepPlacement(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    for name in layers:  # a step that logs nothing (all prefill) comes first, rows=0
        bufs.hold(name, torch.zeros(4, 3, D, dtype=torch.bfloat16), nothing, rows=0, scale=0.125)
    assert bufs  # the layers have buffers, empty
    _log(bufs, ref, layers, [0, 1, 2], 3, gen)
    _log(bufs, ref, layers, [0, 4, 11], 4, gen)  # row 11: the stack grows past 8 rows
    names = list(layers)
    assert bufs._stacked == names and bufs._stack.shape[:3] == (5, 16, COLS)
    assert all(bufs[name].data_ptr() == bufs._stack[i].data_ptr() for i, name in enumerate(names))

    def no_cat(*a, **k):
        raise AssertionError("take of the whole stack concatenated per-layer gathers")

    for rows in (torch.tensor([0, 2, 4, 11]), torch.tensor([1]), slice(0, 3), slice(4, 12)):
        for n in (1, 4, COLS):
            want = _expected(ref, names, rows, n)
            with monkeypatch.context() as m:
                m.setattr(torch, "cat", no_cat)
                got = bufs.take(names, rows, n)
            assert got.is_contiguous() and torch.equal(got, want)
            # consecutive layers in the stack: the same one-copy read
            want = _expected(ref, names[1:4], rows, n)
            with monkeypatch.context() as m:
                m.setattr(torch, "cat", no_cat)
                got = bufs.take(names[1:4], rows, n)
            assert torch.equal(got, want)
            # not consecutive: a gather per layer, same values
            assert torch.equal(bufs.take(names[::2], rows, n), _expected(ref, names[::2], rows, n))
    assert bufs.take(names, torch.tensor([0, 4]), 4).abs().sum() > 0


def test_a_layer_of_another_shape_ends_the_stack_and_reads_stay_right(monkeypatch):
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "torch")
    gen = torch.Generator().manual_seed(1)
    layers = {"a": 3, "b": 3}
    bufs, ref = QueryBuffers(COLS), {"count": {}}
    _log(bufs, ref, layers, [0, 1], 2, gen)
    assert bufs._stacked == ["a", "b"]
    odd = {"a": 3, "b": 3, "c": 5}  # c has 5 query heads
    _log(bufs, ref, odd, [0, 1, 9], 3, gen)  # grows: a and b grow alone now
    assert bufs._stack is None and bufs._stacked == []
    for name in odd:
        rows = torch.tensor([0, 1, 9])
        assert torch.equal(bufs.take([name], rows, 5), _expected(ref, [name], rows, 5))
    rows = slice(0, 2)
    assert torch.equal(bufs.take(["a", "b"], rows, 5), _expected(ref, ["a", "b"], rows, 5))


def _gathered(ref: dict, layers: list[str], cells: torch.Tensor) -> torch.Tensor:
    """(P * L, k, H, D), row p * L + l: ref's layer l at flat cells[p]."""
    return torch.stack([torch.stack([ref[name].flatten(0, 1)[c] for name in layers])
                        for c in cells]).flatten(0, 1)


@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_gather_reads_a_window_of_every_layer_per_request(mode, monkeypatch):
    """`gather` (the query window's read at a compaction): cells per request,
    any order and wrapping around a row; one index_select over the stack where
    the layers are consecutive in it, one per layer elsewhere, same values."""
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", mode)
    gen = torch.Generator().manual_seed(2)
    layers = {f"layer.{i}": 3 for i in range(5)}
    bufs, ref = QueryBuffers(COLS), {"count": {}}
    _log(bufs, ref, layers, [0, 3, 9], COLS, gen)
    names = list(layers)
    cells = torch.tensor([[9 * COLS + 6, 9 * COLS + 7, 9 * COLS + 0],  # a ring's wrap
                          [0 * COLS + 1, 0 * COLS + 2, 0 * COLS + 3]])
    for subset in (names, names[1:4], names[::2], names[:1]):
        got = bufs.gather(subset, cells)
        assert got.shape == (2 * len(subset), 3, 3, D) and got.is_contiguous()
        assert torch.equal(got, _gathered(ref, subset, cells))
    assert bufs.gather(names, cells).abs().sum() > 0
    assert bufs.has(names) and not bufs.has(names + ["layer.9"])
