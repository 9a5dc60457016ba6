"""Counts would-be host-device syncs of code run on CPU tensors (or real ones).

Used by tests/test_cuda_syncs.py (the CUDA path's Python on CPU tensors) and by
`vllm_kvevict.gpu_check` (each kernel's launch path, on a GPU beside torch's own
sync debug mode). How a sync is recognised when every tensor is on the CPU:

* device tensors are the marked seeds (`mark`), real CUDA tensors, and
  everything an aten op computes from one (a TorchDispatchMode propagates the
  mark through every op); host tensors are the rest;
* a sync is
  - a read of a device value on the host: ``aten._local_scalar_dense`` (``.item()``,
    ``int(t)``, ``bool(t)``), and ``Tensor.cpu`` / ``.tolist`` / ``.numpy`` of a
    device tensor (patched: on CPU they are no-ops the dispatcher never sees);
  - an op whose output size depends on device data: ``nonzero``, ``masked_select``,
    ``unique*``, ``repeat_interleave`` without ``output_size``, indexing or
    index_put with a boolean mask;
  - a blocking host -> device copy: ``Tensor.to(device)`` of a host tensor without
    ``non_blocking=True`` (PyTorch's blocking copy is ``cudaMemcpyAsync`` +
    ``cudaStreamSynchronize``), and indexing a device tensor with a host index
    tensor (PyTorch copies the index over, blocking);
  - ``copy_`` between a host and a device tensor without ``non_blocking``.
  Every ``.to(<a device>)`` in the CUDA path means "to the GPU" (it never moves
  data back with ``.to``), which is how the patched ``Tensor.to`` reads it.
  A host tensor uploaded with ``non_blocking=True`` is an `upload`, not a sync.

Factories (``torch.arange``, ``zeros``, ...) are patched too: with a ``device=``
they make a device tensor (in the CUDA path's code a given device is the GPU),
and ``torch.tensor(data, device=)`` is a blocking upload.

Limits: code that moves data to the host with ``.to("cpu")`` or copies a device
tensor into a host buffer some other way than ``copy_`` would be misread; the
CUDA path does neither.
"""
from __future__ import annotations

import contextlib
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

aten = torch.ops.aten
DATA_DEPENDENT = {aten.nonzero, aten.masked_select, aten._unique, aten._unique2,
                  aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
# torch functions that make a tensor where `device=` says: with a device given,
# in the CUDA path's code, that is the GPU.
FACTORIES = ("arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint",
             "linspace", "eye")
HOST_DATA_FACTORIES = ("tensor", "as_tensor")  # with device=: host data copied up, blocking


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


class _Setattr:
    """What `patch_tensor_methods` needs of pytest's monkeypatch, outside pytest."""

    @staticmethod
    def setattr(target, name, value):
        setattr(target, name, value)


class SyncCounter(TorchDispatchMode):
    """Counts would-be host-device syncs (see the module docstring). `events`
    lists (kind, where) with `where` the innermost vllm / vllm_kvevict frame."""

    def __init__(self) -> None:
        super().__init__()
        self.dev = WeakTensorKeyDictionary()
        self.events: list[tuple[str, str]] = []
        self.uploads: list[str] = []
        self._paused = 0

    # --- bookkeeping ------------------------------------------------------------
    def mark(self, *tensors) -> None:
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self.dev[t] = True

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (t.is_cuda or t in self.dev)

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def pausing(self, fn):
        def run(*args, **kwargs):
            with self.paused():
                return fn(*args, **kwargs)
        return run

    @staticmethod
    def _where() -> str:
        for frame in reversed(traceback.extract_stack()[:-3]):
            f = frame.filename
            if "vllm_kvevict" in f or "triton_kernels" in f or "/vllm/" in f:
                # Relative to site-packages or to this checkout, wherever it lives.
                short = f.split("site-packages/")[-1].removeprefix(REPO_ROOT)
                return f"{short}:{frame.lineno} {frame.name}"
        return "?"

    def sync(self, kind: str) -> None:
        if not self._paused:
            self.events.append((kind, self._where()))

    # --- the dispatch mode ---------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused:
            return out
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(self.on_device(t) for t in tensors):
            return out
        packet = func.overloadpacket
        if func is aten._local_scalar_dense.default:
            self.sync("item")
        elif packet in DATA_DEPENDENT:
            self.sync(packet.__name__)
        elif packet is aten.repeat_interleave and kwargs.get("output_size") is None \
                and (len(args) < 3 or args[-1] is None):
            self.sync("repeat_interleave without output_size")
        elif packet in INDEXING:
            indices = [i for i in (args[1] if len(args) > 1 else []) if i is not None]
            if any(i.dtype in (torch.bool, torch.uint8) for i in indices):
                self.sync("boolean-mask indexing")
            elif self.on_device(args[0]) and any(not self.on_device(i) for i in indices):
                self.sync("host index into a device tensor")
        elif packet is aten.copy_:
            dst, src = args[0], args[1]
            if self.on_device(dst) != self.on_device(src) and not (
                    kwargs.get("non_blocking") or (len(args) > 2 and args[2])):
                self.sync("copy_ host<->device")
            if not self.on_device(dst):
                return out  # a host buffer stays a host buffer
        self.mark(out)
        return out

    # --- the Tensor methods the dispatcher does not see on CPU ---------------------
    @contextlib.contextmanager
    def patch_tensor_methods(self, monkeypatch=_Setattr):
        counter = self
        cpu, tolist, numpy, to = (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy,
                                  torch.Tensor.to)

        def reader(orig, kind):
            def read(self, *args, **kwargs):
                if counter.on_device(self):
                    counter.sync(kind)
                    if orig is cpu and not self.is_cuda:  # a host copy, not the tensor itself
                        with counter.paused():
                            return self.clone()
                return orig(self, *args, **kwargs)
            return read

        def to_device(self, *args, **kwargs):
            target = kwargs.get("device") is not None or any(
                isinstance(a, (torch.device, str, torch.Tensor)) for a in args[:1])
            if not target or counter.on_device(self) or counter._paused:
                return to(self, *args, **kwargs)
            if kwargs.get("non_blocking") or any(a is True for a in args[1:3]):
                if not counter._paused:
                    counter.uploads.append(counter._where())
            else:
                counter.sync("blocking .to(device) of a host tensor")
            with counter.paused():
                moved = to(self, *args, **kwargs)
                moved = moved.clone() if moved is self else moved
            counter.mark(moved)
            return moved

        def factory(orig, copies_host_data):
            def make(*args, **kwargs):
                out = orig(*args, **kwargs)
                if kwargs.get("device") is not None and not counter._paused:
                    if copies_host_data:  # torch.tensor(data, device=...): a blocking copy
                        counter.sync("blocking torch.tensor(..., device=)")
                    counter.mark(out)
                return out
            return make

        factories = {name: getattr(torch, name) for name in FACTORIES + HOST_DATA_FACTORIES}
        for name, orig in factories.items():
            monkeypatch.setattr(torch, name, factory(orig, name in HOST_DATA_FACTORIES))
        monkeypatch.setattr(torch.Tensor, "cpu", reader(cpu, "Tensor.cpu()"))
        monkeypatch.setattr(torch.Tensor, "tolist", reader(tolist, "Tensor.tolist()"))
        monkeypatch.setattr(torch.Tensor, "numpy", reader(numpy, "Tensor.numpy()"))
        monkeypatch.setattr(torch.Tensor, "to", to_device)
        try:
            yield self
        finally:
            for name, orig in factories.items():
                monkeypatch.setattr(torch, name, orig)
            monkeypatch.setattr(torch.Tensor, "cpu", cpu)
            monkeypatch.setattr(torch.Tensor, "tolist", tolist)
            monkeypatch.setattr(torch.Tensor, "numpy", numpy)
            monkeypatch.setattr(torch.Tensor, "to", to)
