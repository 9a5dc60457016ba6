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
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace token_moves {

struct Move {
  const int64_t *src_blk, *src_off, *dst_blk, *dst_off, *head;
  int64_t n;
};

// A layout's element map split as off[h][t][e] = base[h * BS + t] + pat[e]
// (every layout vLLM writes: vec K strided by BS, vec V contiguous, amx K in
// VNNI pairs, amx V strided by 2), with `run` the length of the contiguous
// runs in pat (D: one memcpy per token; 2: bf16 pairs copied as 32 bits).
// Reading a token's D offsets from the (H, BS, D) int64 table cost more than
// the token's bytes; through this map a copy reads D offsets that stay in
// cache. A map that does not split so goes element by element (`separable`
// false).
struct TokenMap {
  bool separable = false;
  int64_t run = 1;
  std::vector<int64_t> base, pat;
};

TokenMap token_map(const at::Tensor& offsets) {
  const int64_t hb = offsets.size(0) * offsets.size(1), d = offsets.size(2);
  const int64_t* off = offsets.data_ptr<int64_t>();
  TokenMap m;
  if (hb == 0 || d == 0) return m;
  m.pat.resize(d);
  m.base.resize(hb);
  for (int64_t e = 0; e < d; ++e) m.pat[e] = off[e] - off[0];
  for (int64_t i = 0; i < hb; ++i) {
    m.base[i] = off[i * d];
    for (int64_t e = 0; e < d; ++e)
      if (off[i * d + e] - m.base[i] != m.pat[e]) return m;  // not separable
  }
  m.separable = true;
  for (int64_t r : {d, int64_t(2)}) {
    if (d % r) continue;
    bool runs = true;
    for (int64_t e = 0; e < d && runs; ++e) runs = m.pat[e] == m.pat[e - e % r] + e % r;
    if (runs) { m.run = r; break; }
  }
  return m;
}

// Tokens per task of a parallel copy: about 16K elements, so a compaction's
// thousands of token copies split across torch's threads (vLLM binds one per
// core) while a handful stays on the calling thread.
inline int64_t grain(int64_t d) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d)); }

// dst[pat[e]] = src[pat[e]] for one token (pat: the map's D offsets).
template <typename T>
inline void copy_token(T* dst, const T* src, const TokenMap& m, int64_t d) {
  const int64_t* pat = m.pat.data();
  if (m.run == d) {
    std::memcpy(dst, src, d * sizeof(T));
  } else if (m.run == 2 && sizeof(T) == 2) {
    for (int64_t e = 0; e < d; e += 2) std::memcpy(dst + pat[e], src + pat[e], 4);
  } else {
    for (int64_t e = 0; e < d; ++e) dst[pat[e]] = src[pat[e]];
  }
}

template <typename T>
void copy_tokens(const at::Tensor& cache, const at::Tensor& offsets, const Move& m) {
  T* base = reinterpret_cast<T*>(cache.data_ptr());
  const int64_t s0 = cache.stride(0), bs = cache.size(2), d = cache.size(3);
  const int64_t* off = offsets.data_ptr<int64_t>();
  const TokenMap map = token_map(offsets);
  // Moves write distinct slots and read slots no move writes: any order, any
  // split across torch's threads.
  at::parallel_for(0, m.n, grain(d), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const T* src = base + m.src_blk[i] * s0;
      T* dst = base + m.dst_blk[i] * s0;
      if (map.separable) {
        copy_token(dst + map.base[m.head[i] * bs + m.dst_off[i]],
                   src + map.base[m.head[i] * bs + m.src_off[i]], map, d);
        continue;
      }
      const int64_t* so = off + (m.head[i] * bs + m.src_off[i]) * d;
      const int64_t* dof = off + (m.head[i] * bs + m.dst_off[i]) * d;
      for (int64_t e = 0; e < d; ++e) dst[dof[e]] = src[so[e]];
    }
  });
}

void copy_cache(const at::Tensor& cache, const at::Tensor& offsets, const Move& m) {
  switch (cache.element_size()) {  // 1: an fp8 cache's bytes
    case 1: copy_tokens<uint8_t>(cache, offsets, m); break;
    case 2: copy_tokens<uint16_t>(cache, offsets, m); break;
    case 4: copy_tokens<uint32_t>(cache, offsets, m); break;
    default: TORCH_CHECK(false, "cache element size ", cache.element_size(), ": expected 1, 2 or 4");
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

// slots: contiguous int64 (rows, H, n) of slots (block * BS + offset) inside
// `cache` [NB, H, BS, D], each checked before anything is read.
void check_slots(const at::Tensor& slots, const at::Tensor& cache) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 3 &&
              slots.size(1) == cache.size(1), "slots: contiguous int64 (L, H, n)");
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t limit = cache.size(0) * cache.size(2);
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(s[i] >= 0 && s[i] < limit, "slot ", s[i], " outside the cache");
}

// One (row, head)'s n tokens at slots sl[0, n), in that order, into out
// (n, D) dense: the layout's map read once per token (see TokenMap).
// base/s0: the [NB, H, BS, D] view's first element and block stride.
template <typename T>
inline void read_row(const T* base, int64_t s0, int64_t bs, int64_t d, const TokenMap& map,
                     const int64_t* off, int64_t h, const int64_t* sl, int64_t n, T* out) {
  const int64_t* pat = map.pat.data();
  for (int64_t i = 0; i < n; ++i, out += d) {
    const int64_t s = sl[i];
    const T* src = base + (s / bs) * s0;
    if (map.separable) {
      src += map.base[h * bs + s % bs];
      if (map.run == d) {
        std::memcpy(out, src, d * sizeof(T));
      } else if (map.run == 2 && sizeof(T) == 2) {
        for (int64_t e = 0; e < d; e += 2) std::memcpy(out + e, src + pat[e], 4);
      } else {
        for (int64_t e = 0; e < d; ++e) out[e] = src[pat[e]];
      }
      continue;
    }
    const int64_t* o = off + (h * bs + s % bs) * d;
    for (int64_t e = 0; e < d; ++e) out[e] = src[o[e]];
  }
}

// out[l, h, i, :] = the key (or value) of head h at slot slots[l, h, i]
// (block * BS + offset) of `cache`: a compaction's K and V, read oldest first
// for the window policies (integration/recorders.StackContext). One pass over
// the tokens through the layout's element offsets; torch needed three (whole
// blocks, unpacking the tiles, then the age order).
template <typename T>
void read_tokens_as(const at::Tensor& cache, const at::Tensor& offsets, const int64_t* slot, T* out,
                    int64_t rows, int64_t heads, int64_t n) {
  const T* base = reinterpret_cast<const T*>(cache.data_ptr());
  const int64_t s0 = cache.stride(0), bs = cache.size(2), d = cache.size(3);
  const int64_t* off = offsets.data_ptr<int64_t>();
  const TokenMap map = token_map(offsets);
  // One task per (row, head) range: each writes its own n tokens of `out`.
  const int64_t rows_per_task = std::max<int64_t>(1, grain(d) / std::max<int64_t>(1, n));
  at::parallel_for(0, rows * heads, rows_per_task, [&](int64_t lo, int64_t hi) {
    for (int64_t rh = lo; rh < hi; ++rh)
      read_row<T>(base, s0, bs, d, map, off, rh % heads, slot + rh * n, n, out + rh * n * d);
  });
}

at::Tensor read_tokens(const at::Tensor& cache, const at::Tensor& offsets, const at::Tensor& slots) {
  TORCH_CHECK(cache.dim() == 4, "cache: [NB, H, BS, D]");
  const int64_t h = cache.size(1), d = cache.size(3);
  check_offsets(offsets, cache);
  check_slots(slots, cache);
  const int64_t* s = slots.data_ptr<int64_t>();
  at::Tensor out = at::empty({slots.size(0), h, slots.size(2), d}, cache.options());
  switch (cache.element_size()) {
    case 1: read_tokens_as<uint8_t>(cache, offsets, s, reinterpret_cast<uint8_t*>(out.data_ptr()),
                                    slots.size(0), h, slots.size(2)); break;
    case 2: read_tokens_as<uint16_t>(cache, offsets, s, reinterpret_cast<uint16_t*>(out.data_ptr()),
                                     slots.size(0), h, slots.size(2)); break;
    case 4: read_tokens_as<uint32_t>(cache, offsets, s, reinterpret_cast<uint32_t*>(out.data_ptr()),
                                     slots.size(0), h, slots.size(2)); break;
    default: TORCH_CHECK(false, "cache element size ", cache.element_size(), ": expected 1, 2 or 4");
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

// Elements in each row of t when its rows run along dim 0 and each row's
// elements are contiguous (any inner shape), else -1.
int64_t row_elements(const at::Tensor& t) {
  int64_t expect = 1;
  for (int64_t k = t.dim() - 1; k >= 1; --k) {
    if (t.size(k) != 1 && t.stride(k) != expect) return -1;
    expect *= t.size(k);
  }
  return t.dim() >= 1 ? expect : -1;
}

// dsts[l] row cells[i] = srcs[l] row i for every pair l: a step's queries of
// every layer stored in the query logs at once (core/scoring/query_buffers.py).
// srcs[l]: rows along dim 0, each row's E elements contiguous (a layer's
// (N, H_q, D) queries as handed over); dsts[l]: contiguous, seen as rows of E
// elements (a (R, cols, H_q, D) buffer: cell = row * cols + col). One memcpy
// per row, no tensor views in Python; torch's index_copy_ moved these element
// by element, one call per layer.
void copy_rows(std::vector<at::Tensor> dsts, const at::Tensor& cells,
               const std::vector<at::Tensor>& srcs) {
  TORCH_CHECK(dsts.size() == srcs.size(), "as many dst as src tensors");
  TORCH_CHECK(cells.scalar_type() == at::kLong && cells.is_contiguous(), "cells: contiguous int64");
  const int64_t n = cells.numel();
  const int64_t* c = cells.data_ptr<int64_t>();
  for (size_t l = 0; l < dsts.size(); ++l) {  // everything checked before anything is written
    const at::Tensor &dst = dsts[l], &src = srcs[l];
    const int64_t e = row_elements(src);
    TORCH_CHECK(e > 0 && dst.is_contiguous() && dst.numel() % e == 0 &&
                dst.scalar_type() == src.scalar_type(),
                "src: rows along dim 0, each contiguous; dst: contiguous, a whole number of "
                "such rows; one dtype");
    TORCH_CHECK(src.size(0) == n, "cells: one per src row");
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(c[i] >= 0 && c[i] < dst.numel() / e, "cell ", c[i], " outside dst");
  }
  for (size_t l = 0; l < dsts.size(); ++l) {
    const at::Tensor &dst = dsts[l], &src = srcs[l];
    const int64_t es = dst.element_size(), bytes = row_elements(src) * es;
    char* d = static_cast<char*>(dst.data_ptr());
    const char* s = static_cast<const char*>(src.data_ptr());
    const int64_t ss = src.stride(0) * es;
    for (int64_t i = 0; i < n; ++i) std::memcpy(d + c[i] * bytes, s + i * ss, bytes);
  }
}

// Compaction's plan for `move_tokens`, from the kept sets: keep (B, H, new_len)
// int64, each (b, h) row's distinct kept indices into old slots [0, old_len),
// in any order; src_blocks (B, n_src), dst_blocks (B, n_dst) int64 the rows'
// blocks before and after. The kept tokens at slots >= new_len fill the
// dropped slots < new_len, paired in ascending order within each row (as
// core/eviction/compaction.hole_moves). Returns (src_blk, src_off, dst_blk,
// dst_off, head), each (M,) int64, and now (B, H, new_len) int64: the slot
// each kept token holds afterwards. One pass over each row with a bitmap; the
// same in torch was about twenty small ops (nonzero, index, scatter).
std::vector<at::Tensor> plan_hole_moves(const at::Tensor& keep, int64_t old_len,
                                        const at::Tensor& src_blocks, const at::Tensor& dst_blocks,
                                        int64_t block_size) {
  TORCH_CHECK(keep.scalar_type() == at::kLong && keep.is_contiguous() && keep.dim() == 3,
              "keep: contiguous int64 (B, H, new_len)");
  const int64_t b = keep.size(0), h = keep.size(1), new_len = keep.size(2), bs = block_size;
  TORCH_CHECK(bs > 0 && new_len <= old_len, "block_size > 0 and new_len <= old_len");
  for (const at::Tensor* t : {&src_blocks, &dst_blocks})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 2 && t->size(0) == b,
                "src_blocks, dst_blocks: contiguous int64 (B, n)");
  const int64_t n_src = src_blocks.size(1), n_dst = dst_blocks.size(1);
  TORCH_CHECK(n_src * bs >= old_len && n_dst * bs >= new_len, "too few blocks for the tokens");
  const int64_t* kp = keep.data_ptr<int64_t>();
  const int64_t *sb = src_blocks.data_ptr<int64_t>(), *db = dst_blocks.data_ptr<int64_t>();
  const int64_t tail_len = old_len - new_len;
  std::vector<int64_t> moves[5];  // src_blk, src_off, dst_blk, dst_off, head
  for (auto& v : moves) v.reserve(b * h * std::min(tail_len, new_len));
  at::Tensor now = at::empty_like(keep);
  int64_t* np = now.data_ptr<int64_t>();
  std::vector<uint8_t> kept(old_len);
  std::vector<int64_t> tail(tail_len);  // tail[j - new_len]: where the token at slot j goes
  for (int64_t r = 0; r < b * h; ++r) {
    const int64_t* k = kp + r * new_len;
    std::fill(kept.begin(), kept.end(), 0);
    for (int64_t i = 0; i < new_len; ++i) {
      TORCH_CHECK(k[i] >= 0 && k[i] < old_len && !kept[k[i]], "keep row ", r,
                  ": indices must be distinct and in [0, old_len), got ", k[i]);
      kept[k[i]] = 1;
    }
    const int64_t* src = sb + (r / h) * n_src;
    const int64_t* dst = db + (r / h) * n_dst;
    int64_t hole = 0;
    for (int64_t j = new_len; j < old_len; ++j) {
      if (!kept[j]) continue;
      while (kept[hole]) ++hole;  // a hole below new_len exists for every mover
      tail[j - new_len] = hole;
      moves[0].push_back(src[j / bs]);
      moves[1].push_back(j % bs);
      moves[2].push_back(dst[hole / bs]);
      moves[3].push_back(hole % bs);
      moves[4].push_back(r % h);
      ++hole;
    }
    int64_t* out = np + r * new_len;
    for (int64_t i = 0; i < new_len; ++i) out[i] = k[i] < new_len ? k[i] : tail[k[i] - new_len];
  }
  std::vector<at::Tensor> result;
  for (auto& v : moves) {
    at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, keep.options());
    std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
    result.push_back(t);
  }
  result.push_back(now);
  return result;
}

// A score as an unsigned key in the same order (torch's order: -0.0 equals
// 0.0, NaN above every number).
inline uint64_t score_key(float x) {
  if (x != x) return 0xFFFFFFFFu;
  if (x == 0.0f) x = 0.0f;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The policies' kept set (core/policies/base.recent_plus_top_scored) and
// `plan_hole_moves` in one call: row (b, h) of scores (B, H, n) float32,
// oldest token first, keeps its `recent` newest tokens and the new_len -
// recent older ones with the largest (score, age index) pairs (the newer
// wins a tie), i.e. it drops the lowest. rows (B, H, n) int64 is the slot of
// each token by age (empty: slot = age index). Returns plan_hole_moves'
// tensors, `now` listing the kept tokens in ascending age, then kept
// (B, H, new_len) int64: their age indices, ascending. In torch the
// selection alone was about fifteen small ops (kthvalue, compares, cumsums,
// nonzero, a gather), a few hundred microseconds a compaction in the engine.
std::vector<at::Tensor> select_hole_moves(const at::Tensor& scores, int64_t new_len, int64_t recent,
                                          const at::Tensor& rows, const at::Tensor& src_blocks,
                                          const at::Tensor& dst_blocks, int64_t block_size) {
  TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.is_contiguous() && scores.dim() == 3,
              "scores: contiguous float32 (B, H, n)");
  const int64_t b = scores.size(0), h = scores.size(1), n = scores.size(2), bs = block_size;
  TORCH_CHECK(0 <= recent && recent <= new_len && new_len <= n, "need 0 <= recent <= new_len <= n");
  const bool by_age = rows.numel() > 0;
  TORCH_CHECK(!by_age || (rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                          rows.sizes() == scores.sizes()), "rows: contiguous int64 like scores, or empty");
  const int64_t old = n - recent, drop = n - new_len;  // older tokens; how many of them go
  const float* sp = scores.data_ptr<float>();
  const int64_t* rp = by_age ? rows.data_ptr<int64_t>() : nullptr;
  at::Tensor kept = at::empty({b, h, new_len}, src_blocks.options());
  at::Tensor slots = at::empty({b, h, new_len}, src_blocks.options());
  int64_t *kp = kept.data_ptr<int64_t>(), *slp = slots.data_ptr<int64_t>();
  // Rows split over threads only when long (a 4K-token request's rows); a
  // decode compaction's 96 older tokens a row stay on this thread.
  at::parallel_for(0, b * h, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, old)),
                   [&](int64_t lo, int64_t hi) {
    std::vector<uint64_t> keys(old);
    std::vector<uint8_t> dropped(old);
    for (int64_t r = lo; r < hi; ++r) {
      const float* s = sp + r * n;
      std::fill(dropped.begin(), dropped.end(), 0);
      if (drop > 0) {  // the drop lowest (score, age) keys: distinct, so one exact cut
        for (int64_t j = 0; j < old; ++j) keys[j] = score_key(s[j]) << 32 | static_cast<uint64_t>(j);
        std::nth_element(keys.begin(), keys.begin() + (drop - 1), keys.end());
        for (int64_t i = 0; i < drop; ++i) dropped[keys[i] & 0xFFFFFFFFu] = 1;
      }
      int64_t *age = kp + r * new_len, *slot = slp + r * new_len, m = 0;
      for (int64_t j = 0; j < n; ++j)
        if (j >= old || !dropped[j]) age[m++] = j;
      for (int64_t i = 0; i < new_len; ++i) slot[i] = by_age ? rp[r * n + age[i]] : age[i];
    }
  });
  std::vector<at::Tensor> out = plan_hole_moves(slots, n, src_blocks, dst_blocks, bs);
  out.push_back(kept);
  return out;
}

}  // namespace token_moves
