"""One adapter for reading and moving tokens in vLLM's paged CPU KV cache.

The CPU backend stores a layer's cache as ``[num_blocks, H, BS, 2*D]``, split
by ``split_kv_cache`` into key/value caches of logical shape ``[num_blocks, H,
BS, D]`` whose ``[BS, D]`` interior is ISA-packed by the C++ writer
(``cpu_attn_reshape_and_cache``). We do not hard-code that packing: ``discover``
is handed that writer (the vLLM layer passes it: integration/cpu_backend.py, so
this module imports no vLLM), writes index-coded tokens with it into a one-block scratch cache
and reads back where each (head, token, dim) landed. If the result is an affine
"tiled permutation" (token and dim axes each split at most once into
outer/inner digits, e.g. vec K = [D][BS], amx bf16 K = [BS/16][D/2][16][2]) we
read through zero-copy ``as_strided`` views; anything else falls back to
element gathers through the discovered map.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Code digits are 0..255: bf16 holds integers exactly only up to 256.
_BASE = 256
# fp8 caches (vLLM's `--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`, which the CPU
# writer stores as uint8 bytes in the float8 bit formats): digits 0..7, the
# integers e5m2 still holds exactly (e4m3 holds 0..16).
_FP8_BASE = 8
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                    "fp8_e5m2": torch.float8_e5m2}
FP8_VIEWS = (torch.float8_e4m3fn, torch.float8_e5m2)  # the dtypes of those caches' views


def cache_dtype_name(dtype: torch.dtype) -> str:
    """vLLM's `kv_cache_dtype` string for a typed cache view's dtype."""
    return {torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8_e5m2"}.get(dtype, "auto")

# vLLM's cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
# slot_mapping, isa[, kv_cache_dtype=...]): key/value (T, H, D), caches as
# ``split_kv_cache`` gives them (uint8 for an fp8 cache).
StockWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        torch.Tensor, str], None]


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[NB, H, BS, 2D]`` -> (key_cache, value_cache), each ``[NB, H, BS, D]``
    views, exactly as ``cpu_attn.py`` splits it."""
    nb, h, bs, _ = kv_cache.shape
    return kv_cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)


def token_slots(blocks: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """Slot ids (block * BS + offset) of the first ``n`` tokens of block rows:
    ``blocks: [..., nblk]`` -> ``[..., n]`` int64, n <= nblk * BS."""
    if n > blocks.shape[-1] * block_size:
        raise IndexError(f"{n} tokens do not fit {blocks.shape[-1]} blocks of {block_size}")
    # Every block's slots, then the first n: three small ops (an index by
    # j // BS took five, and grew with the rows).
    offsets = torch.arange(block_size, device=blocks.device)
    return (blocks.long().unsqueeze(-1) * block_size + offsets).flatten(-2)[..., :n]


def _stock_map(write: StockWriter, isa: str, dtype: torch.dtype, bs: int, d: int, h: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block maps ``[H, BS, D]`` -> flat logical index into ``cache[b]``
    (i.e. ``h*BS*D + row*D + col``) where the stock writer puts each element.

    For a float8 ``dtype`` (the typed view of an fp8 cache) the writer gets
    bf16 tokens and a uint8 cache with ``kv_cache_dtype``, as vLLM calls it."""
    n = h * bs * d
    fp8 = dtype in FP8_VIEWS
    base = _FP8_BASE if fp8 else _BASE
    code = torch.arange(n).view(h, bs, d)
    dec = [torch.zeros(h, bs, d, dtype=torch.long) for _ in range(2)]
    hit = [torch.ones(h, bs, d, dtype=torch.bool) for _ in range(2)]
    for p in range(max(1, math.ceil(math.log(n, base)))):
        digit = ((code // base**p) % base).transpose(0, 1).contiguous()
        kv = torch.full((1, h, bs, 2 * d), -1.0, dtype=dtype)  # -1 = never written
        kc, vc = split_kv_cache(kv)
        if fp8:
            digit = digit.to(torch.bfloat16)
            kcu, vcu = split_kv_cache(kv.view(torch.uint8))
            write(digit, digit, kcu, vcu, torch.arange(bs), isa,
                  kv_cache_dtype=cache_dtype_name(dtype))
        else:
            write(digit.to(dtype), digit.to(dtype), kc, vc, torch.arange(bs), isa)
        for i, c in enumerate((kc[0].float(), vc[0].float())):
            hit[i] &= c >= 0
            dec[i] += c.clamp(min=0).long() * base**p
    maps = []
    for i, name in enumerate("KV"):
        src = dec[i][hit[i]]
        if src.numel() != n or not torch.equal(src.sort().values, torch.arange(n)):
            raise RuntimeError(f"{isa}/{dtype}: stock writer is not a bijection for {name}")
        m = torch.empty(n, dtype=torch.long)
        m[src] = torch.arange(n).view(h, bs, d)[hit[i]]  # element code -> position
        maps.append(m.view(h, bs, d))
    return maps[0], maps[1]


def _fit_tiles(m: torch.Tensor) -> tuple[int, ...] | None:
    """Find ``(T0, D0, base, s_t1, s_t0, s_d1, s_d0)`` with
    ``m[h,t,d] == h*BS*D + base + t//T0*s_t1 + t%T0*s_t0 + d//D0*s_d1 + d%D0*s_d0``.
    Untiled candidates come first, so a plain permutation gets T0=BS, D0=D."""
    h, bs, d = m.shape
    if not bool(((m - m[:1]) == torch.arange(h).view(h, 1, 1) * bs * d).all()):
        return None  # heads interleaved: no per-head strided view
    p, t, e = m[0], torch.arange(bs).view(bs, 1), torch.arange(d).view(1, d)
    divs = lambda n: [x for x in range(n, 0, -1) if n % x == 0]  # noqa: E731
    for t0 in divs(bs):
        for d0 in divs(d):
            base = int(p[0, 0])
            st0 = int(p[1, 0]) - base if t0 > 1 else 0
            st1 = int(p[t0, 0]) - base if t0 < bs else 0
            sd0 = int(p[0, 1]) - base if d0 > 1 else 0
            sd1 = int(p[0, d0]) - base if d0 < d else 0
            pred = base + t // t0 * st1 + t % t0 * st0 + e // d0 * sd1 + e % d0 * sd0
            if torch.equal(pred, p):
                return (t0, d0, base, st1, st0, sd1, sd0)
    return None


@functools.lru_cache(maxsize=64)
def _element_offsets(layout: "KVLayout", which: str, strides: tuple[int, ...]) -> torch.Tensor:
    """KVLayout.element_offsets of K or V for one view's strides (layouts hash
    by identity and live as long as `discover`'s cache, so this is computed once)."""
    m = layout.k_map if which == "k" else layout.v_map
    _, bs, d = m.shape
    return (m // (bs * d) * strides[1] + m // d % bs * strides[2] + m % d * strides[3]).contiguous()


@dataclass(frozen=True, eq=False)
class KVLayout:
    """In-block layout of K and V for one (isa, dtype, BS, D, H) combination.

    ``k_map``/``v_map``: ``[H, BS, D]`` flat logical index into ``cache[b]``.
    ``k_tiles``/``v_tiles``: ``_fit_tiles`` result, or None (gather fallback).
    """

    isa: str
    dtype: torch.dtype
    block_size: int
    head_size: int
    num_kv_heads: int
    k_map: torch.Tensor
    v_map: torch.Tensor
    k_tiles: tuple[int, ...] | None
    v_tiles: tuple[int, ...] | None

    @classmethod
    @functools.lru_cache(maxsize=None)
    def discover(cls, write: StockWriter, isa: str, dtype: torch.dtype, block_size: int,
                 head_size: int, num_kv_heads: int) -> "KVLayout":
        """Probe the stock writer (vLLM's C++ op) once per argument tuple."""
        km, vm = _stock_map(write, isa, dtype, block_size, head_size, num_kv_heads)
        return cls(isa, dtype, block_size, head_size, num_kv_heads, km, vm,
                   _fit_tiles(km), _fit_tiles(vm))

    @staticmethod
    def split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cache -> (key_cache, value_cache); see ``split_kv_cache``."""
        return split_kv_cache(kv_cache)

    @classmethod
    def for_cache(cls, write: StockWriter, kv_cache: torch.Tensor, isa: str) -> "KVLayout":
        """The layout of a CPU backend layer cache ``[NB, H, BS, 2*D]``."""
        _, h, bs, d2 = kv_cache.shape
        return cls.discover(write, isa, kv_cache.dtype, bs, d2 // 2, h)

    # -- strided views ---------------------------------------------------
    def _view6(self, cache: torch.Tensor, tiles) -> torch.Tensor:
        """``[NB, H, BS/T0, T0, D/D0, D0]`` zero-copy view of ``cache``."""
        nb, h, bs, d = cache.shape
        assert (h, bs, d) == (self.num_kv_heads, self.block_size, self.head_size)
        assert cache.dtype == self.dtype and cache.stride(-1) == 1 and cache.stride(-2) == d
        t0, d0, base, st1, st0, sd1, sd0 = tiles
        return cache.as_strided((nb, h, bs // t0, t0, d // d0, d0),
                                (cache.stride(0), cache.stride(1), st1, st0, sd1, sd0),
                                cache.storage_offset() + base)

    def _plain(self, cache: torch.Tensor, tiles) -> torch.Tensor | None:
        if tiles is None or tiles[0] != self.block_size or tiles[1] != self.head_size:
            return None
        return self._view6(cache, tiles).flatten(2, 3).flatten(3, 4)  # stays a view

    def keys_view(self, key_cache: torch.Tensor) -> torch.Tensor | None:
        """``[NB, H, BS, D]`` strided view in token order, or None if K is tiled/irregular."""
        return self._plain(key_cache, self.k_tiles)

    def values_view(self, value_cache: torch.Tensor) -> torch.Tensor | None:
        """``[NB, H, BS, D]`` strided view in token order, or None if V is tiled/irregular."""
        return self._plain(value_cache, self.v_tiles)

    # -- token reads / writes --------------------------------------------
    def _index(self, cache, tiles, m, blk, off, heads=None):
        """(tensor, index tuple, value shape) addressing the ``[..., D]`` elements
        of tokens (blk, off) of head ``heads`` (default: row h of ``[H, N]`` is head h)."""
        blk, off = blk.long(), off.long()
        h = (torch.arange(self.num_kv_heads).view(-1, 1).expand_as(blk) if heads is None
             else heads.long())
        if tiles is not None:
            t0, d0 = tiles[0], tiles[1]
            idx = (blk, h, off // t0, off % t0)
            return self._view6(cache, tiles), idx, (*blk.shape, -1, d0)
        bs, d = self.block_size, self.head_size
        assert cache.dtype == self.dtype and cache.shape[1:] == self.k_map.shape
        f = m[h, off]  # [..., D] flat positions inside the block
        idx = (blk.unsqueeze(-1), f // (bs * d), f // d % bs, f % d)
        return cache, idx, (*blk.shape, d)

    def read_tokens(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_ids: torch.Tensor, offsets: torch.Tensor,
                    heads: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``block_ids, offsets: [H, N]`` -> (k, v) ``[H, N, D]`` fresh copies (never
        views), so callers may overwrite the source slots afterwards. With
        ``heads`` (same shape as block_ids, any shape) each token names its head."""
        out = []
        for c, t, m in ((key_cache, self.k_tiles, self.k_map),
                        (value_cache, self.v_tiles, self.v_map)):
            src, idx, _ = self._index(c, t, m, block_ids, offsets, heads)
            out.append(src[idx].reshape(*block_ids.shape, self.head_size))
        return out[0], out[1]

    def write_tokens(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_ids: torch.Tensor, offsets: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, heads: torch.Tensor | None = None) -> None:
        """Inverse of ``read_tokens``: ``k, v: [H, N, D]`` (or ``[..., D]`` with
        ``heads``) into the given slots (distinct; cast to the cache dtype). The
        usual move is read-all-then-write, which is safe for overlapping
        source/destination because reads return copies."""
        for c, t, m, x in ((key_cache, self.k_tiles, self.k_map, k),
                           (value_cache, self.v_tiles, self.v_map, v)):
            dst, idx, shape = self._index(c, t, m, block_ids, offsets, heads)
            if x.untyped_storage().data_ptr() == c.untyped_storage().data_ptr():
                x = x.clone()  # a view of the cache itself could be clobbered mid-scatter
            dst[idx] = x.to(self.dtype).reshape(shape)

    def element_offsets(self, key_cache: torch.Tensor, value_cache: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) ``[H, BS, D]`` int64: where element (head, token, dim) of a block
        lies, in elements from the block's first element of that ``[NB, H, BS,
        D]`` view: the discovered map in the view's strides (any layout, tiled
        or not). What the compiled token mover reads tokens through."""
        return (_element_offsets(self, "k", key_cache.stride()),
                _element_offsets(self, "v", value_cache.stride()))

    # -- whole blocks ----------------------------------------------------
    def write_blocks(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite whole (distinct) blocks: ``block_ids: [B, n]``, ``k, v:
        [B, H, n*BS, D]`` in token order (the inverse of ``gather_keys`` /
        ``gather_values``). One block-indexed copy per cache instead of an
        element scatter, which is many times slower (docs/results.md)."""
        b, n = block_ids.shape
        h, bs, d = self.num_kv_heads, self.block_size, self.head_size
        blocks = block_ids.long().flatten()
        for c, t, m, x in ((key_cache, self.k_tiles, self.k_map, k),
                           (value_cache, self.v_tiles, self.v_map, v)):
            x = x.to(self.dtype).reshape(b, h, n, bs, d).transpose(1, 2).reshape(b * n, h, bs, d)
            if t is None:  # element scatter through the discovered map
                tok = torch.arange(b * n * bs)
                blk, off = blocks[tok // bs].expand(h, -1), (tok % bs).expand(h, -1)
                dst, idx, _ = self._index(c, t, m, blk, off)
                dst[idx] = x.transpose(0, 1).reshape(h, -1, d)
                continue
            t0, d0 = t[0], t[1]
            self._view6(c, t)[blocks] = x.view(b * n, h, bs // t0, t0, d // d0, d0)

    # -- whole-block gathers ---------------------------------------------
    def _gather(self, cache, tiles, m, block_table, num_blocks):
        bt = block_table[:, :num_blocks].long()
        b, nblk = bt.shape
        if tiles is not None:
            # Two bulk passes beat one element-wise advanced-index gather (measured):
            # index_select copies whole packed blocks (memcpy-like), then a single
            # permute-copy unpacks the tiles and moves H in front of the block axis.
            raw = cache.flatten(2).index_select(0, bt.flatten()).view(b * nblk, *cache.shape[1:])
            out = self._view6(raw, tiles).unflatten(0, (b, nblk)).transpose(1, 2)
        else:
            bs, d = self.block_size, self.head_size
            f = m.view(1, -1, 1, bs, d)
            out = cache[bt[:, None, :, None, None], f // (bs * d), f // d % bs, f % d]
        return out.reshape(b, self.num_kv_heads, nblk * self.block_size, self.head_size)

    def gather_keys(self, key_cache, block_table, num_blocks=None) -> torch.Tensor:
        """``block_table: [B, max_blocks]`` -> keys ``[B, H, num_blocks*BS, D]``
        (a fresh tensor in logical token order; padded table entries read
        whatever block they name, so mask by seq_lens)."""
        return self._gather(key_cache, self.k_tiles, self.k_map, block_table, num_blocks)

    def gather_keys_t(self, key_cache, block_table, num_blocks,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Keys transposed, ``[B, H, D, num_blocks*BS]`` in ``dtype``, ready for
        ``q @ K^T``. For the ``vec`` layout (K stored ``[D][BS]`` per block) this
        copies runs of BS contiguous elements instead of transposing every
        element, and casts in the same pass: about half the time of
        ``gather_keys().float()`` (docs/results.md)."""
        if self.k_tiles is None:
            return self.gather_keys(key_cache, block_table, num_blocks).transpose(2, 3).to(dtype)
        bt = block_table[:, :num_blocks].long()
        b, nblk = bt.shape
        raw = key_cache.flatten(2).index_select(0, bt.flatten()).view(b * nblk, *key_cache.shape[1:])
        v6 = self._view6(raw, self.k_tiles).unflatten(0, (b, nblk))  # B,n,H,t1,t0,d1,d0
        v = v6.permute(0, 2, 5, 6, 1, 3, 4)  # B,H,d1,d0,n,t1,t0
        out = torch.empty(v.shape, dtype=dtype, device=key_cache.device)
        out.copy_(v)
        return out.view(b, self.num_kv_heads, self.head_size, nblk * self.block_size)

    def gather_values(self, value_cache, block_table, num_blocks=None) -> torch.Tensor:
        """Same as ``gather_keys`` for values."""
        return self._gather(value_cache, self.v_tiles, self.v_map, block_table, num_blocks)
