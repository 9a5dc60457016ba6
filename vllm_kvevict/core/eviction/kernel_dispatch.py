"""The one place that chooses where the hot paths run: Triton on CUDA, the
compiled CPU kernel on CPU, torch where neither applies.

    VLLM_KVEVICT_KERNELS = auto (default) | triton | torch

  auto    Triton kernels (`vllm_kvevict.triton_kernels`) for CUDA tensors when
          Triton imports; the compiled CPU kernel (`vllm_kvevict.cpu_kernel`)
          for the CPU backend's ISA-packed cache when it is built; the
          plain-torch paths otherwise.
  triton  the Triton kernels wherever the data allows, CUDA or not: tests run
          them on CPU tensors with TRITON_INTERPRET=1 (the CPU kernel as in auto).
  torch   never a kernel (to compare, or to rule them out).

The paged kernels read the FlashAttention cache (`NHDLayout`) only; the window
and partial-attention kernels take dense tensors.

`upload` is how the per-step paths move small host tensors to the GPU without
a host-device sync (tests/test_cuda_syncs.py counts those).
"""
from __future__ import annotations

import functools
import importlib
import logging

import torch

from vllm_kvevict.core.config.env import env_choice

MODES = ("auto", "triton", "torch")  # the first is the default


def mode() -> str:
    return env_choice("VLLM_KVEVICT_KERNELS", MODES)


@functools.lru_cache(maxsize=None)
def _triton_imports() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor, layout=None) -> bool:
    """Whether the Triton kernel runs for data on x's device (and, for the paged
    kernels, in the cache `layout`)."""
    m = mode()
    if m == "torch" or not _triton_imports():
        return False
    if layout is not None:
        from vllm_kvevict.core.layouts.nhd_layout import NHDLayout

        if not isinstance(layout, NHDLayout) or layout.block_size < 16 \
                or layout.block_size & (layout.block_size - 1):
            return False  # the kernels tile one block of a power-of-two size
    return m == "triton" or x.is_cuda


def cpu_path() -> str:
    """One line: which scoring path runs on CPU tensors here, and why."""
    from vllm_kvevict import cpu_kernel

    if mode() == "torch":
        return "torch (VLLM_KVEVICT_KERNELS=torch)"
    if cpu_kernel.module() is None:
        return ("torch (the CPU kernel is not built for this source and torch: "
                "run scripts/setup.sh or python -m vllm_kvevict.cpu_kernel build)")
    chosen = cpu_kernel.isa()
    return f"cpu-kernel {chosen}" if chosen else "torch (this CPU has neither AVX-512 BF16 nor AVX2+FMA)"


@functools.lru_cache(maxsize=None)
def log_cpu_path_once() -> None:
    """Log `cpu_path()` and `projection_precision()` once per process (the
    worker calls this at startup, so a bad VLLM_KVEVICT_SCORE_PRECISION stops
    it there, not at its first compaction); under vLLM's "vllm" logger, so it
    prints with vLLM's own lines."""
    logging.getLogger("vllm.kvevict").info(
        "vllm_kvevict scoring on CPU tensors: %s; AnDPro's bf16 projection in %s precision "
        "(VLLM_KVEVICT_SCORE_PRECISION)", cpu_path(), projection_precision())


def cpu_kernel_isa(queries: torch.Tensor, keys: torch.Tensor, layout=None) -> str | None:
    """The compiled CPU kernel's instruction path for scoring these queries
    against `keys` (the paged CPU cache in `layout`, or with layout None dense
    (B, H, n, D) keys), or None (the torch path runs).

    The bf16 paths (amx, avx512bf16) need bf16 queries and keys, and amx a
    head size of 32-128 in steps of 32; the next path down runs otherwise
    (float32 data: avx2, which any AVX2 CPU runs). An fp8 cache's float8
    keys go to avx512bf16 (decoded to bf16 there, exactly) or avx2."""
    from vllm_kvevict.core.layouts.cpu_layout import FP8_VIEWS, KVLayout

    if mode() == "torch" or keys.device.type != "cpu" or queries.shape[-1] % 2:
        return None
    fp8 = keys.dtype in FP8_VIEWS  # an fp8 cache's view
    if keys.dtype not in (torch.bfloat16, torch.float16, torch.float32) and not fp8:
        return None
    if layout is not None and (not isinstance(layout, KVLayout) or layout.k_tiles is None
                               or layout.block_size % 16):
        return None
    from vllm_kvevict import cpu_kernel

    isa = cpu_kernel.isa()
    d = queries.shape[-1]
    if isa == "amx" and (d % 32 or d > 128 or fp8):
        isa = "avx512bf16"  # (fp8 keys: decoded to bf16 in the vdpbf16ps path)
    if isa in ("amx", "avx512bf16") and not (
            queries.dtype == torch.bfloat16 and (keys.dtype == torch.bfloat16 or fp8)):
        isa = "avx2"
    return isa if isa is None or cpu_kernel.module().supports(isa) else None


def cpu_projection_isa(queries: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor) -> str | None:
    """The compiled CPU kernel's path for AnDPro's window scores of dense
    (B, w, H_q, D) queries and (B, H, n, D) keys and values
    (`cpu_kernel.window_projection_sums(queries, keys, values, scale, isa)`),
    or None: `window_scores.raw_scores_torch` runs.

    The kernel takes head sizes that are multiples of 16 and n >= w. By
    default it runs wherever it beats torch's float32 GEMMs at the demo's
    shapes (benchmarks/window_scores_cpu.py, all 30 layers of a request, one
    thread): its amx path on AMX (bf16 data, head size 32 or 64; 2.9-4.1x torch
    at n 192-1040 on a Xeon); and every path on a CPU whose GEMMs are not
    full-width AVX-512 (`_torch_gemms_full_width`): the avx512bf16 path 1.9-3.4x
    torch at n 1040-192 on a Zen 4 EPYC, the avx2 path 1.2-1.5x on an AVX2-only
    EPYC. On an Intel CPU with AVX-512 torch's GEMMs beat the avx512bf16 and
    avx2 paths, so there torch runs unless AMX applies. VLLM_KVEVICT_CPU_ISA set
    to a path runs that path wherever the kernel can (tests force each)."""
    if values.shape != keys.shape or values.device != keys.device:
        return None
    return cpu_projection_isa_of(queries, keys, values.dtype, keys.shape[2])


def cpu_projection_isa_of(queries: torch.Tensor, keys: torch.Tensor, value_dtype: torch.dtype,
                          n: int) -> str | None:
    """`cpu_projection_isa` for n tokens whose keys have the dtype and device
    of `keys` (dense keys, or the paged key cache the kernel reads in place:
    `cpu_kernel.window_projection_paged`) and whose values have `value_dtype`."""
    d = queries.shape[-1]
    if d % 16 or n < queries.shape[1]:
        return None
    isa = cpu_kernel_isa(queries, keys)
    if isa is None:
        return None
    if isa in ("amx", "avx512bf16") and value_dtype != torch.bfloat16:
        isa = "avx2"
    from vllm_kvevict import cpu_kernel

    forced = cpu_kernel.forced_isa() != "auto"
    faster = (isa == "amx" and d in (32, 64)) or not _torch_gemms_full_width()
    return isa if forced or faster else None


PRECISIONS = ("model", "float32")  # the first is the default


def projection_precision() -> str:
    """What AnDPro's window scores on the bf16 kernel path (avx512bf16) carry
    between their products, from VLLM_KVEVICT_SCORE_PRECISION:

      model    (default) the papers' contract: the exps E and the outputs Y are
               rounded to bf16 (the model dtype) before E V and Y V^T; every
               product is still exact and accumulated in float32, the softmax,
               e * z and the sums float32. Three bf16 GEMM passes, not five.
      float32  E and Y as hi + lo bf16 pairs (2^-16 relative): float32-accurate
               scores, as the torch, avx2 and amx paths always give.

    The amx path always splits (its tiles have room for both halves); the
    other paths are float32 whatever this says (docs/design.md, the precision
    table)."""
    return env_choice("VLLM_KVEVICT_SCORE_PRECISION", PRECISIONS)


@functools.lru_cache(maxsize=1)
def _torch_gemms_full_width() -> bool:
    """Whether torch's float32 GEMMs here run 512-bit FMAs at full rate: an
    Intel CPU with AVX-512 (then only the amx path beats them at AnDPro's window
    shapes). AMD's Zen 4 runs AVX-512 on 256-bit units, so its float32 GEMMs
    peak where AVX2's do (MKL SGEMM 1024^3 at 86 GFLOP/s on one 2.6 GHz core:
    32 flops a cycle), while vdpbf16ps does twice the multiply-adds of an FMA;
    without AVX-512 the GEMMs are AVX2 like the kernel's avx2 path."""
    from vllm_kvevict import cpu_kernel

    flags = cpu_kernel.cpu_flags()
    if flags == "?":
        return True  # unknown: keep torch
    return "avx512f" in flags.split() and cpu_kernel.cpu_vendor() == "GenuineIntel"


def cpu_token_mover(layout, cache: torch.Tensor):
    """The compiled CPU kernel's module when it moves tokens of `cache` (the
    CPU backend's paged cache, `KVLayout`, bf16/fp16/fp32 or an fp8 cache's
    float8 view: the mover copies elements as bytes), else None (torch)."""
    from vllm_kvevict.core.layouts.cpu_layout import KVLayout

    if not isinstance(layout, KVLayout) or cache.element_size() not in (1, 2, 4):
        return None
    return cpu_copier(cache)


def cpu_copier(x: torch.Tensor | None = None):
    """The compiled CPU kernel's module for copies of CPU data (`copy_rows`,
    `move_tokens`, `copy_blocks`; x: the data, None for CPU), or None (torch)."""
    if mode() == "torch" or (x is not None and x.device.type != "cpu"):
        return None
    from vllm_kvevict import cpu_kernel

    mod = cpu_kernel.module()
    return mod if mod is not None and hasattr(mod, "copy_rows") else None


def triton_module(name: str):
    """A launcher module of `vllm_kvevict.triton_kernels`, imported on first use
    (importing Triton costs time, and nothing on the CPU path needs it)."""
    return importlib.import_module(f"vllm_kvevict.triton_kernels.{name}")


def upload(x: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device`, without waiting for the GPU.

    A blocking ``x.to(cuda)`` is a copy and then a stream synchronisation (the
    host waits for every kernel queued before it). Here the data is staged in
    pinned memory and copied asynchronously, in stream order; PyTorch's caching
    host allocator keeps the pinned buffer until the copy has run. A tensor
    already on `device` is returned as is."""
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu" and not x.is_pinned():
        x = x.pin_memory()
    return x.to(device, non_blocking=True)
