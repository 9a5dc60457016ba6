"""Argument checks shared by the launchers: fail with a message, never launch on bad input."""
from __future__ import annotations

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def float_tensor(name: str, x: torch.Tensor, dim: int, unit_last: bool = True) -> None:
    """`x` has `dim` dims, a float dtype the kernels read, and (by default) unit
    stride on its last dim (the kernels vectorise along it)."""
    expect(x.dim() == dim, f"{name}: expected {dim} dims, got shape {tuple(x.shape)}")
    expect(x.dtype in FLOATS, f"{name}: dtype {x.dtype} is not one of {FLOATS}")
    expect(not unit_last or x.stride(-1) == 1 or x.shape[-1] == 1,
           f"{name}: last dim must have unit stride, strides {x.stride()}")


def index_tensor(name: str, x: torch.Tensor, shape: tuple, device) -> torch.Tensor:
    """An integer tensor of exactly `shape`, returned contiguous on `device`."""
    expect(not x.is_floating_point() and not x.is_complex(), f"{name}: must be integer, got {x.dtype}")
    expect(tuple(x.shape) == tuple(shape), f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    return x.to(device).contiguous()


def same_device(*xs: torch.Tensor) -> None:
    devs = {x.device for x in xs}
    expect(len(devs) == 1, f"tensors on different devices: {sorted(map(str, devs))}")


def pow2_at_least_16(name: str, n: int) -> None:
    expect(n >= 16 and n & (n - 1) == 0, f"{name} must be a power of two >= 16 (tl.dot tiles), got {n}")


def float_vector(name: str, x: torch.Tensor, n: int, device) -> torch.Tensor:
    """A float32 (n,) copy of `x` on `device`."""
    expect(tuple(x.shape) == (n,), f"{name}: expected ({n},), got {tuple(x.shape)}")
    return x.to(device, torch.float32).contiguous()


def in_place_safe(src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """The precondition of an in-place move that reads ahead of where it writes
    (`compaction.compact_in_place`): per row, every dst slot j is src slot j or a
    slot none of that row's sources use. Otherwise a write can land on a token
    the row has yet to read (e.g. a private copy that is the row's own freed
    tail block) and the newest kept tokens come out wrong.

    src_slots (R, old_len), dst_slots (R, n_dst) int, one device. Vectorised:
    one torch.isin over row-tagged slots; the only host read is the final
    .any(), which is free for CPU tensors (the worker builds the slots on the
    CPU) and one host-device sync for device tensors."""
    r, n_src = src_slots.shape
    n = min(n_src, dst_slots.shape[1])
    src = src_slots.long()
    # Only a move between devices is a copy (the worker's plans are both on the host).
    dst = (dst_slots if dst_slots.device == src.device else dst_slots.to(src.device)).long()
    # Rows never match each other. Host plans get a host arange (no device= at
    # all, so the sync counter of gpu_check/sync_counter.py reads it as host too).
    tag = torch.arange(r, device=None if src.device.type == "cpu" else src.device)[:, None] << 32
    clash = torch.isin(dst + tag, src + tag)  # (R, n_dst): dst slot is some source's
    clash[:, :n] &= dst[:, :n] != src[:, :n]  # ... other than its own index's
    if bool(clash.any()):
        row, j = (int(x) for x in clash.nonzero()[0])
        expect(False, f"dst_slots break the in-place precondition: row {row} writes slot "
               f"{int(dst[row, j])} at position {j}, a source of that row at another "
               "position (a destination must be its own source slot or one no source uses)")
