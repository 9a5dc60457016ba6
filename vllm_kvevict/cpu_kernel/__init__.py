"""The compiled CPU scoring kernel: build once, load it, pick its instruction path.

    python -m vllm_kvevict.cpu_kernel build    (scripts/setup.sh runs this)
    python -m vllm_kvevict.cpu_kernel info     (which path this machine runs)

`column_sums.cpp` (with the headers it includes: `token_moves.h`, compaction's
copies, and `window_projection.h`, AnDPro's window scores) is built with
torch's C++ extension tooling and the system compiler into ``~/.cache/vllm_kvevict/cpu_kernel/<key>/`` (``key``: a hash of
the source, the torch version and the Python version, so a changed source or
torch is never loaded stale); a second build finds it there and does nothing.
Serving never compiles: when no built kernel matches, the torch path runs and
`path()` says why (the worker logs it once, /metrics carries it).

The instruction path (`isa()`), best first: ``amx`` where the CPU has AMX-BF16
(tile products, 16 queries x 16 keys x 32 dims per instruction), ``avx512bf16``
where it has AVX-512 BF16 (vdpbf16ps), both bf16 x bf16 products accumulated in
float32; else ``avx2`` (float32 FMA). ``VLLM_KVEVICT_CPU_ISA=avx512bf16`` or
``=avx2`` forces a path (tests run every path the CPU has).
``VLLM_KVEVICT_KERNELS=torch`` turns the kernel off; `kernel_dispatch.cpu_path()`
says which path runs (core/eviction/kernel_dispatch.py).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from vllm_kvevict.core.config.env import env_choice

NAME = "vllm_kvevict_cpu_scores"
SOURCE = Path(__file__).with_name("column_sums.cpp")
HEADERS = [Path(__file__).with_name(h)  # included by SOURCE
           for h in ("token_moves.h", "window_projection.h", "fused_attention.h",
                     "fused_attention_avx2.h", "fused_attention_amx.h")]
# -fopenmp: at::parallel_for is a header template that runs its tasks on one
# thread unless the caller is compiled with OpenMP. Linked against libgomp.so.1,
# the one torch already loaded (same soname), so the kernel shares torch's
# thread pool and vLLM's per-core binding of it.
CFLAGS = ["-O3", "-std=c++17", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
ISAS = ("amx", "avx512bf16", "avx2")  # best first


def build_dir() -> Path:
    """Where this source, built against this torch and Python, lives."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for header in HEADERS:
        h.update(header.read_bytes())
    h.update(f"{torch.__version__}|{sys.version}|{CFLAGS}|{LDFLAGS}".encode())
    base = os.environ.get("VLLM_KVEVICT_KERNEL_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "vllm_kvevict" / "cpu_kernel"
    return root / h.hexdigest()[:16]


def _built() -> Path | None:
    found = sorted(build_dir().glob(f"{NAME}*.so"))
    return found[0] if found else None


def compile_source(source: Path, directory: Path, name: str = NAME, verbose: bool = False) -> None:
    """Compile `source` (and the headers beside it) into `directory` as
    extension `name` with torch's tooling. A process can hold only one
    extension of a name (scripts/measure/kernel_ab.py builds others)."""
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    # Copies: load() appends torch's libraries to the lists it is given, which
    # would change build_dir()'s hash in this process.
    load(name, [str(source)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
         build_directory=str(directory), verbose=verbose)


def load_extension(so: Path, name: str = NAME):
    """The extension module `name` from the built file `so`."""
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(verbose: bool = False):
    """Compile the kernel unless a matching build exists; returns the module."""
    if _built() is None:
        compile_source(SOURCE, build_dir(), verbose=verbose)
    module.cache_clear()
    return module()


@functools.lru_cache(maxsize=None)
def module():
    """The built extension, or None (nothing built for this source and torch)."""
    so = _built()
    return None if so is None else load_extension(so)


def forced_isa() -> str:
    """VLLM_KVEVICT_CPU_ISA: auto (the default: the best path the CPU has) or
    one of ISAS; anything else raises ValueError."""
    return env_choice("VLLM_KVEVICT_CPU_ISA", ("auto", *ISAS))


def isa() -> str | None:
    """The instruction path this process runs, or None (no kernel / no path)."""
    mod = module()
    if mod is None:
        return None
    forced = forced_isa()
    if forced != "auto":
        if not mod.supports(forced):
            raise RuntimeError(f"VLLM_KVEVICT_CPU_ISA={forced}: this CPU lacks it")
        return forced
    return next((i for i in ISAS if mod.supports(i)), None)


def _cpuinfo() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return None


def cpuinfo_field(name: str) -> str | None:
    """The first CPU's `name : value` line of /proc/cpuinfo, or None."""
    for line in (_cpuinfo() or "").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


def cpu_flags() -> str:
    """The CPU flags that decide the paths (for benchmark reports), or "?"."""
    flags = cpuinfo_field("flags")
    if flags is None:
        return "?"
    flags = flags.split()
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), or "?"."""
    return cpuinfo_field("vendor_id") or "?"


def _queries(q: torch.Tensor, cache_dtype: torch.dtype, path_isa: str) -> torch.Tensor:
    if path_isa in ("amx", "avx512bf16"):
        return q.to(torch.bfloat16).contiguous()  # the dispatcher chose it for bf16 queries
    return (q if q.dtype == cache_dtype else q.to(torch.float32)).contiguous()


def column_sums(layout, key_cache: torch.Tensor, queries: torch.Tensor, visible: torch.Tensor,
                block_rows: torch.Tensor, scale: float, path_isa: str) -> torch.Tensor:
    """(R, H, M) float32 summed softmax rows, as `core.scores._column_sums`.

    key_cache: [NB, H, BS, D] (KVLayout.split); queries (R, Q, H_q, D);
    visible (R, Q) int64, 0 = padding; block_rows (R, nblk) int64."""
    return module().column_sums(key_cache, block_rows.long().contiguous(),
                                _queries(queries, key_cache.dtype, path_isa),
                                visible.long().contiguous(), float(scale),
                                list(layout.k_tiles), path_isa)


def add_column_sums(scores: torch.Tensor, layout, key_cache: torch.Tensor, queries: torch.Tensor,
                    visible: torch.Tensor, block_rows: torch.Tensor, scale: float,
                    path_isa: str) -> None:
    """`column_sums` added straight into scores (H, NB * BS) at each row's slots,
    for the keys its queries reach: no (R, H, M) buffer, no scatter in torch.
    Rows must not share a block (shared blocks take private score rows)."""
    module().add_column_sums(scores, key_cache, block_rows.long().contiguous(),
                             _queries(queries, key_cache.dtype, path_isa),
                             visible.long().contiguous(), float(scale),
                             list(layout.k_tiles), path_isa)


def window_column_sums(q: torch.Tensor, k: torch.Tensor, scale: float, path_isa: str) -> torch.Tensor:
    """SnapKV's raw window scores from dense keys: (B, w, H_q, D), (B, H, n, D)
    -> (B, H, n) float32, query t of the window seeing tokens [0, n - w + t]
    (as `core.window_scores.window_attention`). Each (b, h) becomes a row of
    one KV head whose keys are 16-token blocks of a padded copy."""
    b, w, hq, d = q.shape
    h, n = k.shape[1], k.shape[2]
    n16 = -(-n // 16) * 16
    keys = k.new_zeros(b * h, n16, d)
    keys[:, :n] = k.reshape(b * h, n, d)
    cache = keys.view(b * h * (n16 // 16), 1, 16, d)
    rows = torch.arange(b * h * (n16 // 16)).view(b * h, n16 // 16)
    queries = q.view(b, w, h, hq // h, d).transpose(1, 2).reshape(b * h, w, hq // h, d)
    visible = torch.arange(n - w + 1, n + 1).clamp(min=1).expand(b * h, w)
    out = module().column_sums(cache, rows, _queries(queries, cache.dtype, path_isa),
                               visible.contiguous(), float(scale),
                               [16, d, 0, 0, d, 0, 1], path_isa)  # plain [16][D] blocks
    return out.view(b, h, n16)[..., :n]


def window_projection_sums(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           path_isa: str, split: bool = True) -> torch.Tensor:
    """AnDPro's raw window scores from dense tensors: (B, w, H_q, D), (B, H, n, D)
    x2 -> (B, H, n) float32, s_i = sum_{g,t} a[t, i] <y_t, v_i> with y = A V
    (as `core.scoring.window_scores.raw_scores_torch(..., projection=True)`; causal on
    the window's own last w columns). The bf16 paths (amx, avx512bf16) take bf16
    q, k, v; avx2 takes any one of bf16 / fp16 / float32, mixed dtypes are
    widened to float32 here. split: on avx512bf16, the exps E and outputs Y
    carried as hi + lo bf16 pairs (float32-accurate); False rounds them to bf16
    (the papers' model-dtype contract, 3 bf16 passes instead of 5). amx always
    splits; avx2 is float32 either way. Precision per path: window_projection.h."""
    if path_isa not in ("amx", "avx512bf16") and not (
            q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        q, k, v = (x.to(torch.float32) for x in (q, k, v))
    return module().window_projection_sums(q.contiguous(), k.contiguous(), v.contiguous(),
                                           float(scale), path_isa, bool(split))


def window_projection_paged(layout, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            q: torch.Tensor, slots: torch.Tensor, scale: float, path_isa: str,
                            split: bool = True) -> torch.Tensor:
    """`window_projection_sums` with the keys and values read in place from
    the paged CPU cache: key_cache / value_cache [NB, H, BS, D]
    (KVLayout.split), q (B, w, H_q, D) of the cache's dtype, slots (B, H, n)
    int64 each row's tokens oldest first (as `read_tokens`) -> (B, H, n)
    float32, bit for bit the dense function's on `read_tokens`' K and V,
    without those (B, H, n, D) copies."""
    k_offsets, v_offsets = layout.element_offsets(key_cache, value_cache)
    return module().window_projection_paged(q.contiguous(), key_cache, value_cache, k_offsets,
                                            v_offsets, slots.long().contiguous(), float(scale),
                                            path_isa, bool(split))


def fused_isa(dtype: torch.dtype) -> str | None:
    """The path `attend_add_column_sums` takes for a model and cache of
    `dtype`: ``avx512bf16`` for bf16 where this process's path (`isa()`) has
    AVX-512 BF16, else ``avx2`` for bf16 or float32 (float32 FMA, bf16 widened
    exactly); None where the kernel is not built or for any other dtype.
    (VLLM_KVEVICT_KERNELS=torch turns the pass off in the engine:
    integration/fused_attention.enabled.)"""
    path = isa()
    if path in ("amx", "avx512bf16") and dtype == torch.bfloat16:
        return "avx512bf16"
    if path is not None and dtype in (torch.bfloat16, torch.float32) and module().supports("avx2"):
        return "avx2"
    return None


def fused_pass_runs(dtype: torch.dtype, head_size: int, block_size: int) -> bool:
    """Whether `attend_add_column_sums` runs here for these shapes: a path
    for the dtype (`fused_isa`), head size a multiple of 16 up to 128, block
    size a multiple of 16 (the layout: `fuses_attention`)."""
    return (fused_isa(dtype) is not None and head_size % 16 == 0 and head_size <= 128
            and block_size % 16 == 0)


def amx_tiles(block_size: int, head_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(k_tiles, v_tiles) of vLLM's bf16 `amx` layout (KVLayout's tiling):
    keys [BS/16][D/2][16][2] (16 tokens' dim pairs: vdpbf16ps operands),
    values [D/16][BS/2][16][2] (token pairs), per block and head."""
    return (16, 2, 0, 16 * head_size, 2, 32, 1), (2, 16, 0, 32, 1, 16 * block_size, 2)


def _is_amx(layout) -> bool:
    return (layout.k_tiles is not None and layout.v_tiles is not None and
            (tuple(layout.k_tiles), tuple(layout.v_tiles)) ==
            amx_tiles(layout.block_size, layout.head_size))


def fuses_attention(layout, dtype: torch.dtype) -> bool:
    """Whether `attend_add_column_sums` reads this cache: `fused_pass_runs`,
    and vLLM's vec layouts (keys [D][BS]: a dim's tokens contiguous; values
    [BS][D]: a token's dims contiguous, per block and head), or its bf16 amx
    layout (`amx_tiles`) where the pass runs AVX-512 BF16."""
    d, bs = layout.head_size, layout.block_size
    kt, vt = layout.k_tiles, layout.v_tiles
    if not fused_pass_runs(dtype, d, bs) or kt is None or vt is None:
        return False
    if _is_amx(layout):
        return fused_isa(dtype) == "avx512bf16"
    return ((kt[0], kt[1], kt[2], kt[4], kt[6]) == (bs, d, 0, 1, bs)
            and (vt[0], vt[1], vt[2], vt[4], vt[6]) == (bs, d, 0, d, 1))


def attend_add_column_sums(out: torch.Tensor, layout, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, query: torch.Tensor, starts: torch.Tensor,
                           seq: torch.Tensor, blocks: torch.Tensor, score_rows: torch.Tensor,
                           scale: float, scores: torch.Tensor) -> None:
    """Causal attention of a step's queries into `out`, and H2O's column sums
    of the rows in `score_rows` added into `scores`, in one pass over the paged
    cache (fused_attention.h; `fuses_attention` says where it runs).

    out, query: (N, H_q, D), the cache's dtype (out contiguous); key_cache /
    value_cache [NB, H, BS, D] (KVLayout.split), bf16 or float32 (`fused_isa`);
    starts (R + 1,) and seq (R,): each row's queries and physical length
    (vLLM's query_start_loc and seq_lens); blocks (R, nblk) its block table;
    score_rows (R,) bool; scores (H, NB * BS)
    float32, added at each scored row's slots (rows must not share blocks).
    With no row scored the pass is attention alone and scores may be (H, 0)."""
    path, k_tiles, v_tiles = _pass_path(layout, key_cache.dtype,
                                        os.environ.get("VLLM_KVEVICT_CPU_ISA"))
    module().attend_add_column_sums(out, query, key_cache, value_cache, _as(starts, torch.int64),
                                    _as(seq, torch.int64), _as(blocks, torch.int64),
                                    _as(score_rows, torch.bool), float(scale),
                                    k_tiles, v_tiles, scores, path)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a contiguous `dtype` tensor, itself where it already is one (the
    engine's step tensors: a conversion call costs a microsecond or two)."""
    return x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()


@functools.lru_cache(maxsize=64)
def _pass_path(layout, dtype: torch.dtype, forced: str | None) -> tuple[str, list, list]:
    """(path, k_tiles, v_tiles) of `attend_add_column_sums` for a layout and
    cache dtype under VLLM_KVEVICT_CPU_ISA=`forced`: worked out once, since a
    call per layer and step of a small batch takes tens of microseconds, and
    the path's lookups (`isa`, `fused_isa`) took 13 of them (16 x 200 tokens)."""
    path = fused_isa(dtype)
    if path is None:
        raise RuntimeError(f"the fused pass has no path here for a {dtype} cache")
    if path == "avx512bf16" and isa() == "amx" and _is_amx(layout):
        path = "amx"  # decode rows on AMX tiles (fused_attention_amx.h), as vLLM attends there
    return path, list(layout.k_tiles), list(layout.v_tiles)
