// Moving tokens inside vLLM's paged CPU KV cache: compaction's hot loop
// (core/compaction.fill_holes), included by column_sums.cpp (one extension).
//
// A token's D elements lie wherever the stock writer put them (vec: K as
// [D][BS] per block; amx: K in VNNI tiles): the caller passes the layout's
// discovered map as element offsets, (H, BS, D) int64, from the first element
// of a block in the [NB, H, BS, D] view it passes. So one loop serves every
// layout, and a copy is D element moves, not an advanced-index scatter per
// element (torch's index_put_ ran near 0.25 GB/s here, a copy near 25).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace token_moves {

struct Move {
  const int64_t *src_blk, *src_off, *dst_blk, *dst_off, *head;
  int64_t n;
};

template <typename T>
void copy_tokens(const at::Tensor& cache, const at::Tensor& offsets, const Move& m) {
  T* base = reinterpret_cast<T*>(cache.data_ptr());
  const int64_t s0 = cache.stride(0), bs = cache.size(2), d = cache.size(3);
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < m.n; ++i) {
    const T* src = base + m.src_blk[i] * s0;
    T* dst = base + m.dst_blk[i] * s0;
    const int64_t* so = off + (m.head[i] * bs + m.src_off[i]) * d;
    const int64_t* dof = off + (m.head[i] * bs + m.dst_off[i]) * d;
    for (int64_t e = 0; e < d; ++e) dst[dof[e]] = src[so[e]];
  }
}

void copy_cache(const at::Tensor& cache, const at::Tensor& offsets, const Move& m) {
  switch (cache.element_size()) {
    case 2: copy_tokens<uint16_t>(cache, offsets, m); break;
    case 4: copy_tokens<uint32_t>(cache, offsets, m); break;
    default: TORCH_CHECK(false, "cache element size ", cache.element_size(), ": expected 2 or 4");
  }
}

// Offsets (H, BS, D) int64 of a layout's elements inside one block of `cache`
// ([NB, H, BS, D]): an offset outside one block's span would reach into
// another block.
void check_offsets(const at::Tensor& offsets, const at::Tensor& cache) {
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() && offsets.dim() == 3 &&
              offsets.size(0) == cache.size(1) && offsets.size(1) == cache.size(2) &&
              offsets.size(2) == cache.size(3), "offsets: contiguous int64 (H, BS, D)");
  TORCH_CHECK(offsets.numel() == 0 || (offsets.min().item<int64_t>() >= 0 &&
                                       offsets.max().item<int64_t>() < cache.stride(0)),
              "offsets reach outside a block");
}

// Move tokens i = 0..M-1 from slot (src_blk[i], src_off[i]) to (dst_blk[i],
// dst_off[i]) in head head[i] of both caches, and their scores (H, NB * BS)
// float32 (slot = block * BS + offset) when given. Sources and destinations are
// distinct slots (fill_holes moves tokens from past the new length into the
// holes below it), so the copies may run in any order. Every index is checked
// before anything is written.
void move_tokens(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& k_offsets,
                 const at::Tensor& v_offsets, const at::Tensor& src_blk, const at::Tensor& src_off,
                 const at::Tensor& dst_blk, const at::Tensor& dst_off, const at::Tensor& head,
                 c10::optional<at::Tensor> scores) {
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
              value_cache.stride(0) == key_cache.stride(0) &&
              value_cache.scalar_type() == key_cache.scalar_type(),
              "key_cache, value_cache: [NB, H, BS, D] views of one dtype and block stride");
  const int64_t nb = key_cache.size(0), h = key_cache.size(1), bs = key_cache.size(2);
  const int64_t n = src_blk.numel();
  for (const at::Tensor* t : {&src_blk, &src_off, &dst_blk, &dst_off, &head})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == n,
                "moves: five contiguous int64 tensors of one length");
  Move m{src_blk.data_ptr<int64_t>(), src_off.data_ptr<int64_t>(), dst_blk.data_ptr<int64_t>(),
         dst_off.data_ptr<int64_t>(), head.data_ptr<int64_t>(), n};
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(m.src_blk[i] >= 0 && m.src_blk[i] < nb && m.dst_blk[i] >= 0 && m.dst_blk[i] < nb &&
                m.src_off[i] >= 0 && m.src_off[i] < bs && m.dst_off[i] >= 0 && m.dst_off[i] < bs &&
                m.head[i] >= 0 && m.head[i] < h, "move ", i, " names a slot outside the cache");
  check_offsets(k_offsets, key_cache);
  check_offsets(v_offsets, value_cache);
  if (scores) {
    TORCH_CHECK(scores->scalar_type() == at::kFloat && scores->dim() == 2 && scores->stride(1) == 1 &&
                scores->size(0) == h && scores->size(1) == nb * bs,
                "scores: float32 (H, NB * BS), slots contiguous");
  }
  copy_cache(key_cache, k_offsets, m);
  copy_cache(value_cache, v_offsets, m);
  if (scores) {
    float* sc = scores->data_ptr<float>();
    const int64_t row = scores->stride(0);
    for (int64_t i = 0; i < n; ++i)
      sc[m.head[i] * row + m.dst_blk[i] * bs + m.dst_off[i]] =
          sc[m.head[i] * row + m.src_blk[i] * bs + m.src_off[i]];
  }
}

// out[l, h, i, :] = the key (or value) of head h at slot slots[l, h, i]
// (block * BS + offset) of `cache`: a compaction's K and V, read oldest first
// for the window policies (integration/recorders.StackContext). One pass over
// the tokens through the layout's element offsets; torch needed three (whole
// blocks, unpacking the tiles, then the age order).
template <typename T>
void read_tokens_as(const at::Tensor& cache, const int64_t* off, const int64_t* slot, T* out,
                    int64_t rows, int64_t heads, int64_t n) {
  const T* base = reinterpret_cast<const T*>(cache.data_ptr());
  const int64_t s0 = cache.stride(0), bs = cache.size(2), d = cache.size(3);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < n; ++i, out += d) {
        const int64_t s = *slot++;
        const T* src = base + (s / bs) * s0;
        const int64_t* o = off + (h * bs + s % bs) * d;
        for (int64_t e = 0; e < d; ++e) out[e] = src[o[e]];
      }
}

at::Tensor read_tokens(const at::Tensor& cache, const at::Tensor& offsets, const at::Tensor& slots) {
  TORCH_CHECK(cache.dim() == 4, "cache: [NB, H, BS, D]");
  const int64_t nb = cache.size(0), h = cache.size(1), bs = cache.size(2), d = cache.size(3);
  check_offsets(offsets, cache);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 3 &&
              slots.size(1) == h, "slots: contiguous int64 (L, H, n)");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(s[i] >= 0 && s[i] < nb * bs, "slot ", s[i], " outside the cache");
  at::Tensor out = at::empty({slots.size(0), h, slots.size(2), d}, cache.options());
  const int64_t* off = offsets.data_ptr<int64_t>();
  switch (cache.element_size()) {
    case 2: read_tokens_as<uint16_t>(cache, off, s, reinterpret_cast<uint16_t*>(out.data_ptr()),
                                     slots.size(0), h, slots.size(2)); break;
    case 4: read_tokens_as<uint32_t>(cache, off, s, reinterpret_cast<uint32_t*>(out.data_ptr()),
                                     slots.size(0), h, slots.size(2)); break;
    default: TORCH_CHECK(false, "cache element size ", cache.element_size(), ": expected 2 or 4");
  }
  return out;
}

// Copy whole blocks src[i] -> dst[i] of both caches (copy-on-write of shared
// blocks), the packing inside a block as is: one memcpy per (block, head).
void copy_blocks(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& src,
                 const at::Tensor& dst) {
  const int64_t nb = key_cache.size(0), n = src.numel();
  TORCH_CHECK(src.scalar_type() == at::kLong && dst.scalar_type() == at::kLong && src.is_contiguous() &&
              dst.is_contiguous() && dst.numel() == n, "src, dst: contiguous int64 of one length");
  const int64_t *s = src.data_ptr<int64_t>(), *t = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(s[i] >= 0 && s[i] < nb && t[i] >= 0 && t[i] < nb, "block pair ", i, " outside the cache");
  for (at::Tensor* c : {&key_cache, &value_cache}) {
    TORCH_CHECK(c->dim() == 4 && c->size(0) == nb && c->stride(3) == 1 && c->stride(2) == c->size(3),
                "caches: [NB, H, BS, D] with each head's [BS, D] contiguous");
    char* base = static_cast<char*>(c->data_ptr());
    const int64_t es = c->element_size(), bytes = c->size(2) * c->size(3) * es;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < c->size(1); ++h)
        std::memcpy(base + (t[i] * c->stride(0) + h * c->stride(1)) * es,
                    base + (s[i] * c->stride(0) + h * c->stride(1)) * es, bytes);
  }
}

// dsts[l][cells[i]] = srcs[l][i] for every pair l, rows of 2-D views (a row's
// elements contiguous): a step's queries of every layer stored in the query
// logs at once (core/scoring/query_buffers.py). One memcpy per row; torch's
// index_copy_ moved these element by element, one call per layer.
void copy_rows(std::vector<at::Tensor> dsts, const at::Tensor& cells,
               const std::vector<at::Tensor>& srcs) {
  TORCH_CHECK(dsts.size() == srcs.size(), "as many dst as src tensors");
  TORCH_CHECK(cells.scalar_type() == at::kLong && cells.is_contiguous(), "cells: contiguous int64");
  const int64_t n = cells.numel();
  const int64_t* c = cells.data_ptr<int64_t>();
  for (size_t l = 0; l < dsts.size(); ++l) {  // everything checked before anything is written
    const at::Tensor &dst = dsts[l], &src = srcs[l];
    TORCH_CHECK(dst.dim() == 2 && src.dim() == 2 && dst.size(1) == src.size(1) &&
                dst.stride(1) == 1 && src.stride(1) == 1 && dst.scalar_type() == src.scalar_type(),
                "dst (N, E), src (M, E): one dtype, rows contiguous");
    TORCH_CHECK(src.size(0) == n, "cells: one per src row");
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(c[i] >= 0 && c[i] < dst.size(0), "cell ", c[i], " outside dst");
  }
  for (size_t l = 0; l < dsts.size(); ++l) {
    const at::Tensor &dst = dsts[l], &src = srcs[l];
    const int64_t bytes = dst.size(1) * dst.element_size();
    char* d = static_cast<char*>(dst.data_ptr());
    const char* s = static_cast<const char*>(src.data_ptr());
    const int64_t ds = dst.stride(0) * dst.element_size(), ss = src.stride(0) * src.element_size();
    for (int64_t i = 0; i < n; ++i) std::memcpy(d + c[i] * ds, s + i * ss, bytes);
  }
}

}  // namespace token_moves
