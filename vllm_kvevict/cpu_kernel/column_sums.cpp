// H2O / SnapKV column sums straight from vLLM's paged CPU KV cache.
//
// For each row r (a request, or a (layer, request) pair of a stacked flush),
// KV head h, query t of the row and query head g of h's GQA group:
//
//     out[r, h, i] += softmax_i(q[r, t, h*G + g] . k[r, h, i] * scale)   i < visible[r, t]
//
// i.e. the summed attention each key receives; visible[r, t] == 0 marks a
// padding query, which adds nothing. Keys are read in place through the
// block table and the in-block tile layout that KVLayout discovered (no gather
// in torch), one task's keys packed once into a small buffer and reused by all
// its queries; logits live in a (8 or 16 rows x keys) float32 tile, never a
// queries x keys matrix.
//
// Three instruction paths, chosen at run time by the caller (vllm_kvevict.cpu_kernel):
//   amx         bf16 q and k, AMX tile products (16 queries x 16 keys x 32 dims)
//   avx512bf16  bf16 q and k, vdpbf16ps (16 keys x 2 dims per instruction)
//               both: bf16 products are exact in float32 and accumulated in
//               float32, so the logits are float32-accurate
//   avx2        any cache dtype widened to float32, FMA (float32 throughout)
// Softmax, exp and the column sums are float32 on all three. An fp8 cache (its
// float8_e4m3fn / float8_e5m2 view) runs avx512bf16 or avx2: every float8
// value is exact in bf16, so its keys are decoded into the same operands.
//
// AnDPro's window scores (A V and its projections) live in window_projection.h,
// attention with H2O's scores in one pass in fused_attention.h, both included
// near the end of this file; compaction's copies in token_moves.h.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "token_moves.h"

namespace {

constexpr int ROWS = 8;  // query rows per register block

// Where element (t, d) of one (block, head) lives: KVLayout's tiled map
// base + t / T0 * st1 + t % T0 * st0 + d / D0 * sd1 + d % D0 * sd0, which is a
// token part plus a dim part, tabulated once per call (no divisions per element).
struct Tiles {
  std::vector<int64_t> tok, dim;  // (BS,) and (D,) offsets, base in tok
  bool amx;  // [BS/16][D/2][16][2]: 16 tokens are one vdpbf16ps operand as stored
  bool rows;  // [D][BS] (vLLM's vec layout): a dim's tokens are contiguous
  Tiles(const std::vector<int64_t>& t, int64_t bs, int64_t d) : tok(bs), dim(d) {
    for (int64_t i = 0; i < bs; ++i) tok[i] = t[2] + i / t[0] * t[3] + i % t[0] * t[4];
    for (int64_t k = 0; k < d; ++k) dim[k] = k / t[1] * t[5] + k % t[1] * t[6];
    amx = t[0] == 16 && t[1] == 2 && t[4] == 2 && t[5] == 32 && t[6] == 1 && t[3] == 16 * d;
    rows = t[0] == bs && t[4] == 1 && t[1] == d && t[6] == bs && t[2] == 0;
  }
  int64_t at(int64_t t, int64_t d) const { return tok[t] + dim[d]; }
};

// What every task reads. A task is (row r, KV head h, split s): the row
// blocks s, s + splits, ... of its query rows (interleaved: balances causal chunks).
struct Work {
  const at::Tensor& cache;  // [NB, H, BS, D] strided view
  const int64_t* blocks;    // (R, nblk)
  int64_t nblk, bs, d, g, nq, hq;
  const int64_t* visible;   // (R, Q)
  Tiles tiles;
  float scale;
};

struct RowList {
  std::vector<int64_t> t, head;  // query index and query head per row
  std::vector<int64_t> vis;
};

// The task's query rows: (t, g) with visible > 0, in t order.
RowList rows_of(const Work& w, int64_t r, int64_t h, int64_t split, int64_t splits,
                int64_t block = ROWS) {
  RowList out;
  int64_t n = 0;
  for (int64_t t = 0; t < w.nq; ++t) {
    int64_t v = w.visible[r * w.nq + t];
    if (v <= 0) continue;
    for (int64_t g = 0; g < w.g; ++g, ++n) {
      if ((n / block) % splits != split) continue;
      out.t.push_back(t);
      out.head.push_back(h * w.g + g);
      out.vis.push_back(v);
    }
  }
  return out;
}

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// The (block, head) base of token t of row r, in the cache's storage type.
template <typename T>
inline const T* key_base(const Work& w, int64_t r, int64_t h, int64_t t) {
  const int64_t blk = w.blocks[r * w.nblk + t / w.bs];
  return w.cache.data_ptr<T>() + blk * w.cache.stride(0) + h * w.cache.stride(1);
}

// bf16 bits of every float8 byte: exact (e4m3 has 4 exponent and 3 mantissa
// bits, e5m2 5 and 2; bf16 8 and 7), NaN and the e5m2 infinities included.
template <typename F8>
const uint16_t* fp8_to_bf16() {
  static const std::array<uint16_t, 256> table = [] {
    std::array<uint16_t, 256> t{};
    for (int b = 0; b < 256; ++b)
      t[b] = c10::BFloat16(static_cast<float>(F8(static_cast<uint8_t>(b), F8::from_bits()))).x;
    return t;
  }();
  return table.data();
}

// ---------------------------------------------------------------- avx512bf16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

// 2^t for t <= 0: t = n + f with n integer and |f| <= 1/2, 2^f by its degree-6
// Taylor polynomial (relative error under 1.3e-7, about one float32 ulp), 2^n by
// scalef. The softmax below computes exp(x) as 2^(x log2 e), the log2 e folded
// into the scale: 10 vector operations per 16 values instead of 14.
inline __m512 exp2_512(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-150.0f));  // 2^-150 rounds to 0
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// `nb` rows of raw (unscaled) logits, row j over [0, vis[j]) with row stride
// ld, turned into exp(scale * (l - max)) in place, zero past their horizon up
// to n16 (a multiple of 16, past every vis); inv[j] = 1 / row j's sum.
void exp_rows_512(float* l, int64_t ld, const int64_t* vis, int64_t nb, int64_t n16,
                  float scale, float* inv) {
  const float c = scale * 1.44269504088896341f;  // exp(scale * x) = 2^(c * x)
  const __m512 vc = _mm512_set1_ps(c);
  for (int64_t j = 0; j < nb; ++j) {
    float* row = l + j * ld;
    const int64_t v = vis[j], full = v / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (v - full)) - 1);
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < full; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + i));
    if (tail) m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, row + full));
    const __m512 mc = _mm512_set1_ps(_mm512_reduce_max_ps(m) * c);
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i += 16) {
      __m512 e = exp2_512(_mm512_fmsub_ps(_mm512_loadu_ps(row + i), vc, mc));
      _mm512_storeu_ps(row + i, e);
      s = _mm512_add_ps(s, e);
    }
    int64_t i = full;
    if (tail) {
      __m512 e = exp2_512(_mm512_fmsub_ps(_mm512_loadu_ps(row + full), vc, mc));
      e = _mm512_maskz_mov_ps(tail, e);
      _mm512_storeu_ps(row + full, e);
      s = _mm512_add_ps(s, e);
      i += 16;
    }
    for (; i < n16; i += 16) _mm512_storeu_ps(row + i, _mm512_setzero_ps());
    inv[j] = 1.0f / _mm512_reduce_add_ps(s);
  }
}

// exp_rows_512's rows, each times its inv, summed into `col` over [0, n16),
// 16 keys at a time over all rows: `col` is read and written once per block.
void add_rows_512(const float* l, int64_t ld, const float* inv, int64_t nb, int64_t n16, float* col) {
  for (int64_t i = 0; i < n16; i += 16) {
    __m512 acc = _mm512_loadu_ps(col + i);
    for (int64_t j = 0; j < nb; ++j)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(l + j * ld + i), _mm512_set1_ps(inv[j]), acc);
    _mm512_storeu_ps(col + i, acc);
  }
}

// Softmax of the rows (exp_rows_512) added to `col` (add_rows_512).
void softmax_block_512(float* l, int64_t ld, const int64_t* vis, int64_t nb, int64_t n16,
                       float scale, float* col) {
  float inv[32];
  exp_rows_512(l, ld, vis, nb, n16, scale, inv);
  add_rows_512(l, ld, inv, nb, n16, col);
}

// vpermw's index that interleaves two 16-lane halves: lanes 0-15 (dim 2p of
// 16 tokens) and 16-31 (dim 2p + 1) become 16 (2p, 2p + 1) pairs.
inline __m512i pair_index() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

// Dims 2p (at `lo`) and 2p + 1 (at `hi`) of 16 tokens, bf16, as one vdpbf16ps
// operand: 16 (2p, 2p + 1) pairs. vLLM's vec layout keeps a dim's tokens contiguous.
inline __m512i dim_pair_bf16(const uint16_t* lo, const uint16_t* hi, __m512i idx) {
  const __m256i a = _mm256_loadu_si256((const __m256i*)lo);
  const __m256i b = _mm256_loadu_si256((const __m256i*)hi);
  return _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}

// Keys [0, n) (n a multiple of 16) of (r, h) as vdpbf16ps operands:
// [n/16][D/2][16][2] bf16. vLLM's amx layout already is this, per 16 tokens.
void pack_bf16(const Work& w, int64_t r, int64_t h, int64_t n, uint16_t* out) {
  const int64_t d = w.d;
  const Tiles& T = w.tiles;
  for (int64_t c = 0; c < n / 16; ++c) {
    const int64_t t = c * 16;
    const uint16_t* src = reinterpret_cast<const uint16_t*>(key_base<at::BFloat16>(w, r, h, t));
    uint16_t* dst = out + c * 16 * d;
    if (T.amx) {
      std::memcpy(dst, src + T.tok[t % w.bs], 16 * d * sizeof(uint16_t));
      continue;
    }
    if (T.rows) {  // interleave dims 2p and 2p + 1 of 16 tokens: one vpermw
      const __m512i idx = pair_index();
      const uint16_t* base = src + t % w.bs;
      for (int64_t p = 0; p < d / 2; ++p)
        _mm512_storeu_si512(dst + p * 32,
                            dim_pair_bf16(base + 2 * p * w.bs, base + (2 * p + 1) * w.bs, idx));
      continue;
    }
    for (int64_t i = 0; i < 16; ++i)
      for (int64_t k = 0; k < d; ++k)
        dst[(k / 2) * 32 + i * 2 + (k % 2)] = src[T.at((t + i) % w.bs, k)];
  }
}

// 32 float8 bytes -> their 32 bf16 bit patterns: the 7-bit magnitude looked
// up in fp8_to_bf16's first 128 entries (two vpermt2w of 64, then a blend),
// the sign moved to bf16's sign bit (table[b | 0x80] == table[b] | 0x8000).
inline __m512i fp8x32_to_bf16(__m256i bytes, const __m512i lut[4]) {
  const __m512i x = _mm512_cvtepu8_epi16(bytes);
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7F));
  const __m512i lo = _mm512_permutex2var_epi16(lut[0], mag, lut[1]);
  const __m512i hi = _mm512_permutex2var_epi16(lut[2], mag, lut[3]);
  const __mmask32 upper = _mm512_test_epi16_mask(mag, _mm512_set1_epi16(0x40));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8);
  return _mm512_or_si512(_mm512_mask_blend_epi16(upper, lo, hi), sign);
}

// pack_bf16 for an fp8 cache, each byte decoded to bf16: vLLM's vec layout
// (a dim's tokens contiguous) 32 bytes at a time, then interleaved as
// pack_bf16 does; any other layout element by element through the
// discovered map (vLLM's amx fp8 K holds two bytes per 16-bit lane, not
// pack_bf16's amx format).
template <typename F8>
void pack_fp8(const Work& w, int64_t r, int64_t h, int64_t n, uint16_t* out) {
  const int64_t d = w.d;
  const uint16_t* bf16 = fp8_to_bf16<F8>();
  __m512i lut[4];
  for (int i = 0; i < 4; ++i) lut[i] = _mm512_loadu_si512(bf16 + 32 * i);
  const __m512i idx = pair_index();
  for (int64_t c = 0; c < n / 16; ++c) {
    const int64_t t = c * 16;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(key_base<F8>(w, r, h, t));
    uint16_t* dst = out + c * 16 * d;
    if (w.tiles.rows) {
      const uint8_t* base = src + t % w.bs;
      for (int64_t p = 0; p < d / 2; ++p) {
        const __m128i a = _mm_loadu_si128((const __m128i*)(base + 2 * p * w.bs));
        const __m128i b = _mm_loadu_si128((const __m128i*)(base + (2 * p + 1) * w.bs));
        const __m512i ab = fp8x32_to_bf16(_mm256_set_m128i(b, a), lut);
        _mm512_storeu_si512(dst + p * 32, _mm512_permutexvar_epi16(idx, ab));
      }
      continue;
    }
    for (int64_t i = 0; i < 16; ++i)
      for (int64_t k = 0; k < d; ++k)
        dst[(k / 2) * 32 + i * 2 + (k % 2)] = bf16[src[w.tiles.at((t + i) % w.bs, k)]];
  }
}

// Keys [0, n) of (r, h) as vdpbf16ps operands, from whichever cache dtype
// the bf16 path takes.
void pack_keys_bf16(const Work& w, int64_t r, int64_t h, int64_t n, uint16_t* out) {
  switch (w.cache.scalar_type()) {
    case at::kFloat8_e4m3fn: pack_fp8<c10::Float8_e4m3fn>(w, r, h, n, out); break;
    case at::kFloat8_e5m2: pack_fp8<c10::Float8_e5m2>(w, r, h, n, out); break;
    default: pack_bf16(w, r, h, n, out);
  }
}

// Logits of ROWS query rows against NC chunks of 16 packed keys:
// out[j * ld + c * 16 + i] = q_j . k_(c*16+i) (unscaled). Each key vector loaded
// serves ROWS rows and each broadcast query pair NC chunks. With `lo` (not
// null), each query is the sum of two bf16 operands, qp + lo, accumulated in
// float32 (window_projection.h: a float32 value as a hi + lo bf16 pair).
template <int NC>
inline void dot_bf16(const uint16_t* kc, const int32_t* qp, int64_t hp, float* out,
                     int64_t ld, const int32_t* lo = nullptr) {
  __m512 acc[ROWS][NC];
  for (int j = 0; j < ROWS; ++j)
    for (int c = 0; c < NC; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < hp; ++p) {
    __m512bh kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kc + c * 16 * 2 * hp + p * 32);
    for (int j = 0; j < ROWS; ++j) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(qp[j * hp + p]);
      for (int c = 0; c < NC; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], qv, kv[c]);
      if (lo != nullptr) {
        const __m512bh lv = (__m512bh)_mm512_set1_epi32(lo[j * hp + p]);
        for (int c = 0; c < NC; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], lv, kv[c]);
      }
    }
  }
  for (int j = 0; j < ROWS; ++j)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + j * ld + c * 16, acc[j][c]);
}

void run_bf16(const Work& w, const at::Tensor& q, int64_t r, int64_t h, int64_t split,
              int64_t splits, float* col) {
  RowList rows = rows_of(w, r, h, split, splits);
  if (rows.t.empty()) return;
  const int64_t d = w.d, hp = d / 2;
  const int64_t hi = (*std::max_element(rows.vis.begin(), rows.vis.end()) + 15) / 16 * 16;
  std::vector<uint16_t> keys(hi * d);
  pack_keys_bf16(w, r, h, hi, keys.data());
  std::vector<float> logits(ROWS * hi);
  std::vector<int32_t> qp(ROWS * hp);
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  for (size_t b0 = 0; b0 < rows.t.size(); b0 += ROWS) {
    const int64_t nb = std::min<int64_t>(ROWS, rows.t.size() - b0);
    int64_t bhi = 0;
    std::fill(qp.begin(), qp.end(), 0);
    for (int64_t j = 0; j < nb; ++j) {
      const uint16_t* src = qd + ((r * w.nq + rows.t[b0 + j]) * w.hq + rows.head[b0 + j]) * d;
      std::memcpy(&qp[j * hp], src, d * sizeof(uint16_t));
      bhi = std::max(bhi, rows.vis[b0 + j]);
    }
    const int64_t nc = (bhi + 15) / 16;
    int64_t c = 0;
    for (; c + 1 < nc; c += 2) dot_bf16<2>(keys.data() + c * 16 * d, qp.data(), hp, logits.data() + c * 16, hi);
    if (c < nc) dot_bf16<1>(keys.data() + c * 16 * d, qp.data(), hp, logits.data() + c * 16, hi);
    softmax_block_512(logits.data(), hi, rows.vis.data() + b0, nb, nc * 16, w.scale, col);
  }
}

bool has_avx512bf16() { return __builtin_cpu_supports("avx512bf16"); }

#pragma GCC pop_options

// ---------------------------------------------------------------- amx
// Intel AMX: one tdpbf16ps multiplies a 16 x 32 bf16 tile of queries by a
// 32 x 16 tile of keys (as [16 pairs][16 keys][2], the packed format above)
// into 16 x 16 float32 logits; exact bf16 products accumulated in float32.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")

constexpr int AMX_ROWS = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 logits (alternating chunks), 2-5 queries (one per 32 dims),
// 6, 7 keys. Configured per thread (tile state is per thread).
void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}

template <int KB>
inline void amx_chunk(const uint16_t* kc, float* out, int64_t ld_bytes, int c) {
  // one 16-key chunk: C = sum over 32-dim blocks of Q_kk x K_kk
  if (c % 2 == 0) {
    _tile_zero(0);
    _tile_loadd(6, kc, 64); _tile_dpbf16ps(0, 2, 6);
    if (KB > 1) { _tile_loadd(7, kc + 512, 64); _tile_dpbf16ps(0, 3, 7); }
    if (KB > 2) { _tile_loadd(6, kc + 1024, 64); _tile_dpbf16ps(0, 4, 6); }
    if (KB > 3) { _tile_loadd(7, kc + 1536, 64); _tile_dpbf16ps(0, 5, 7); }
    _tile_stored(0, out, ld_bytes);
  } else {
    _tile_zero(1);
    _tile_loadd(7, kc, 64); _tile_dpbf16ps(1, 2, 7);
    if (KB > 1) { _tile_loadd(6, kc + 512, 64); _tile_dpbf16ps(1, 3, 6); }
    if (KB > 2) { _tile_loadd(7, kc + 1024, 64); _tile_dpbf16ps(1, 4, 7); }
    if (KB > 3) { _tile_loadd(6, kc + 1536, 64); _tile_dpbf16ps(1, 5, 6); }
    _tile_stored(1, out, ld_bytes);
  }
}

template <int KB>
inline void amx_load_queries(const uint16_t* q, int64_t d) {
  _tile_loadd(2, q, d * 2);
  if (KB > 1) _tile_loadd(3, q + 32, d * 2);
  if (KB > 2) _tile_loadd(4, q + 64, d * 2);
  if (KB > 3) _tile_loadd(5, q + 96, d * 2);
}

// Head sizes up to 64 (two 32-dim blocks): 32 query rows per block, in two
// 16-row halves (tiles 2-3 and 4-5) that share each loaded key tile, so a key
// tile is read from cache once per 32 rows, not 16.
template <int KB>
inline void amx_chunk_pair(const uint16_t* kc, float* out, int64_t ld) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_loadd(6, kc, 64);
  _tile_dpbf16ps(0, 2, 6);
  _tile_dpbf16ps(1, 4, 6);
  if (KB > 1) {
    _tile_loadd(7, kc + 512, 64);
    _tile_dpbf16ps(0, 3, 7);
    _tile_dpbf16ps(1, 5, 7);
  }
  _tile_stored(0, out, ld * 4);
  _tile_stored(1, out + 16 * ld, ld * 4);
}

template <int KB>
inline void amx_load_query_pair(const uint16_t* q, int64_t d) {
  _tile_loadd(2, q, d * 2);
  _tile_loadd(4, q + 16 * d, d * 2);
  if (KB > 1) {
    _tile_loadd(3, q + 32, d * 2);
    _tile_loadd(5, q + 16 * d + 32, d * 2);
  }
}

template <int KB>
void run_amx(const Work& w, const at::Tensor& q, int64_t r, int64_t h, int64_t split,
             int64_t splits, float* col) {
  constexpr bool pair = KB <= 2;  // 32 rows per block (amx_chunk_pair), else 16
  constexpr int64_t block = pair ? 2 * AMX_ROWS : AMX_ROWS;
  RowList rows = rows_of(w, r, h, split, splits, block);
  if (rows.t.empty()) return;
  const int64_t d = w.d;
  const int64_t hi = (*std::max_element(rows.vis.begin(), rows.vis.end()) + 15) / 16 * 16;
  std::vector<uint16_t> keys(hi * d);
  pack_bf16(w, r, h, hi, keys.data());
  std::vector<float> logits(block * hi);
  std::vector<uint16_t> qb(block * d);
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  amx_configure();
  for (size_t b0 = 0; b0 < rows.t.size(); b0 += block) {
    const int64_t nb = std::min<int64_t>(block, rows.t.size() - b0);
    int64_t bhi = 0;
    std::fill(qb.begin(), qb.end(), 0);
    for (int64_t j = 0; j < nb; ++j) {
      const uint16_t* src = qd + ((r * w.nq + rows.t[b0 + j]) * w.hq + rows.head[b0 + j]) * d;
      std::memcpy(&qb[j * d], src, d * sizeof(uint16_t));
      bhi = std::max(bhi, rows.vis[b0 + j]);
    }
    const int64_t nc = (bhi + 15) / 16;
    if (pair) {
      amx_load_query_pair<KB>(qb.data(), d);
      for (int64_t c = 0; c < nc; ++c)
        amx_chunk_pair<KB>(keys.data() + c * 16 * d, logits.data() + c * 16, hi);
    } else {
      amx_load_queries<KB>(qb.data(), d);
      for (int64_t c = 0; c < nc; ++c)
        amx_chunk<KB>(keys.data() + c * 16 * d, logits.data() + c * 16, hi * 4, c);
    }
    softmax_block_512(logits.data(), hi, rows.vis.data() + b0, nb, nc * 16, w.scale, col);
  }
  _tile_release();
}

// AMX needs the kernel's permission for the tile state, once per process.
bool has_amx() {
  if (!__builtin_cpu_supports("amx-bf16") || !has_avx512bf16()) return false;
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

#pragma GCC pop_options

// ---------------------------------------------------------------- avx2
#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // 2^n stays a normal float
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hsum256(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// One row of raw (already scaled) logits over [0, vis): exp(l - max) in place;
// returns 1 / their sum. Shared with window_projection.h's avx2 path.
float exp_row_256(float* l, int64_t vis) {
  const int64_t full = vis / 8 * 8;
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < full; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(l + i));
  float mx = hmax256(m);
  for (int64_t i = full; i < vis; ++i) mx = std::max(mx, l[i]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 s = _mm256_setzero_ps();
  for (int64_t i = 0; i < full; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(l + i), vmx));
    _mm256_storeu_ps(l + i, e);
    s = _mm256_add_ps(s, e);
  }
  float sum = hsum256(s);
  for (int64_t i = full; i < vis; ++i) sum += (l[i] = std::exp(l[i] - mx));
  return 1.0f / sum;
}

// col[i] += l[i] * inv over [0, vis): one row of exps, normalised, into the
// column sums. Shared with fused_attention_avx2.h.
void add_row_256(const float* l, int64_t vis, float inv, float* col) {
  const int64_t full = vis / 8 * 8;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < full; i += 8)
    _mm256_storeu_ps(col + i, _mm256_fmadd_ps(_mm256_loadu_ps(l + i), vinv, _mm256_loadu_ps(col + i)));
  for (int64_t i = full; i < vis; ++i) col[i] += l[i] * inv;
}

void softmax_into_256(float* l, int64_t vis, float* col) { add_row_256(l, vis, exp_row_256(l, vis), col); }

// Rows [j0, j0 + 4) of x (ROWS x D) against 16 packed keys (two [D][8] chunks
// at kc): z0[j] keys 0-7, z1[j] keys 8-15. Four rows by sixteen keys: per
// dimension two key loads and four broadcasts feed eight FMAs (an 8 x 8 tile
// needed nine loads for eight, and the loads, not the FMAs, set its pace on
// AVX2). The sums build in local arrays: __m256 may alias float, so a
// caller's array would be stored back every dimension.
inline void dot_4x16(const float* x, int64_t j0, const float* kc, int64_t d, __m256 z0[4], __m256 z1[4]) {
  __m256 a0[4], a1[4];
  for (int j = 0; j < 4; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
  const float* k1 = kc + 8 * d;
  for (int64_t k = 0; k < d; ++k) {
    const __m256 kv0 = _mm256_loadu_ps(kc + k * 8), kv1 = _mm256_loadu_ps(k1 + k * 8);
    for (int j = 0; j < 4; ++j) {
      const __m256 b = _mm256_set1_ps(x[(j0 + j) * d + k]);
      a0[j] = _mm256_fmadd_ps(b, kv0, a0[j]);
      a1[j] = _mm256_fmadd_ps(b, kv1, a1[j]);
    }
  }
  for (int j = 0; j < 4; ++j) z0[j] = a0[j], z1[j] = a1[j];
}

// dot_4x16 scaled, into out[(j0 + j) * ld + (0..15)].
inline void logits_4x16(const float* qf, int64_t j0, const float* kc, int64_t d, __m256 scale,
                        float* out, int64_t ld) {
  __m256 z0[4], z1[4];
  dot_4x16(qf, j0, kc, d, z0, z1);
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(out + (j0 + j) * ld, _mm256_mul_ps(z0[j], scale));
    _mm256_storeu_ps(out + (j0 + j) * ld + 8, _mm256_mul_ps(z1[j], scale));
  }
}

// Keys [0, n) (n a multiple of 8) of (r, h) as float32 [n/8][D][8].
template <typename T>
void pack_f32(const Work& w, int64_t r, int64_t h, int64_t n, float* out) {
  const int64_t d = w.d;
  for (int64_t c = 0; c < n / 8; ++c) {
    const int64_t t = c * 8;
    const T* src = key_base<T>(w, r, h, t);
    float* dst = out + c * 8 * d;
    for (int64_t k = 0; k < d; ++k)
      for (int64_t i = 0; i < 8; ++i) dst[k * 8 + i] = to_float(src[w.tiles.at((t + i) % w.bs, k)]);
  }
}

template <typename T, typename QT>
void run_f32(const Work& w, const at::Tensor& q, int64_t r, int64_t h, int64_t split,
             int64_t splits, float* col) {
  RowList rows = rows_of(w, r, h, split, splits);
  if (rows.t.empty()) return;
  const int64_t d = w.d;
  const int64_t hi = (*std::max_element(rows.vis.begin(), rows.vis.end()) + 7) / 8 * 8;
  const int64_t hi16 = (hi + 15) / 16 * 16;  // logits_4x16 reads keys in 16s: zero past hi
  std::vector<float> keys(hi16 * d, 0.0f);
  pack_f32<T>(w, r, h, hi, keys.data());
  std::vector<float> logits(ROWS * hi16);
  std::vector<float> qf(ROWS * d);
  const QT* qd = q.data_ptr<QT>();
  const __m256 scale = _mm256_set1_ps(w.scale);
  for (size_t b0 = 0; b0 < rows.t.size(); b0 += ROWS) {
    const int64_t nb = std::min<int64_t>(ROWS, rows.t.size() - b0);
    int64_t bhi = 0;
    std::fill(qf.begin(), qf.end(), 0.0f);
    for (int64_t j = 0; j < nb; ++j) {
      const QT* src = qd + ((r * w.nq + rows.t[b0 + j]) * w.hq + rows.head[b0 + j]) * d;
      for (int64_t k = 0; k < d; ++k) qf[j * d + k] = to_float(src[k]);
      bhi = std::max(bhi, rows.vis[b0 + j]);
    }
    for (int64_t c = 0; c < (bhi + 15) / 16; ++c)  // rows past nb: a half of zero rows is skipped
      for (int64_t j0 = 0; j0 < nb; j0 += 4)
        logits_4x16(qf.data(), j0, keys.data() + c * 16 * d, d, scale, logits.data() + c * 16, hi16);
    for (int64_t j = 0; j < nb; ++j) softmax_into_256(logits.data() + j * hi16, rows.vis[b0 + j], col);
  }
}

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

#pragma GCC pop_options

// ---------------------------------------------------------------- entry

// The threads the tasks below run on: torch's intra-op count where this file
// was compiled with OpenMP (cpu_kernel.CFLAGS), else 1, as at::parallel_for
// then runs every task on the calling thread.
int64_t parallel_threads() {
#ifdef INTRA_OP_PARALLEL
  return at::get_num_threads();
#else
  return 1;
#endif
}

bool supports(const std::string& isa) {
  if (isa == "amx") return has_amx();
  if (isa == "avx512bf16") return has_avx512bf16();
  if (isa == "avx2") return has_avx2();
  return false;
}

// The column sums of every (row, KV head), either returned as (R, H, M)
// float32 (scores undefined) or added straight into scores[h, slot] for the
// keys each row's queries reach (slot = block * BS + offset). The scatter is
// race-free only when no two rows name the same block: the caller sends rows
// with shared blocks (private scores) through the returned form.
at::Tensor column_sums_impl(const at::Tensor& key_cache, const at::Tensor& block_rows,
                            const at::Tensor& queries, const at::Tensor& visible, double scale,
                            std::vector<int64_t> tiles, const std::string& isa,
                            const c10::optional<at::Tensor>& scores) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.device().is_cpu(), "key_cache: [NB, H, BS, D] on CPU");
  TORCH_CHECK(queries.dim() == 4 && queries.is_contiguous(), "queries: contiguous (R, Q, H_q, D)");
  TORCH_CHECK(block_rows.dim() == 2 && block_rows.scalar_type() == at::kLong && block_rows.is_contiguous(),
              "block_rows: contiguous (R, nblk) int64");
  TORCH_CHECK(visible.dim() == 2 && visible.scalar_type() == at::kLong && visible.is_contiguous(),
              "visible: contiguous (R, Q) int64");
  TORCH_CHECK(tiles.size() == 7, "tiles: (T0, D0, base, st1, st0, sd1, sd0)");
  TORCH_CHECK(supports(isa), "this CPU cannot run the ", isa, " path");
  const int64_t r = queries.size(0), nq = queries.size(1), hq = queries.size(2), d = queries.size(3);
  const int64_t h = key_cache.size(1), bs = key_cache.size(2), nblk = block_rows.size(1);
  TORCH_CHECK(key_cache.size(3) == d && hq % h == 0 && d % 2 == 0, "head sizes disagree");
  TORCH_CHECK(bs % 16 == 0, "block size must be a multiple of 16");
  TORCH_CHECK(block_rows.size(0) == r && visible.size(0) == r && visible.size(1) == nq, "row counts disagree");
  TORCH_CHECK(block_rows.numel() == 0 || (block_rows.min().item<int64_t>() >= 0 &&
                                          block_rows.max().item<int64_t>() < key_cache.size(0)),
              "block_rows name blocks outside the cache");
  TORCH_CHECK(visible.numel() == 0 || visible.max().item<int64_t>() <= nblk * bs,
              "a query sees past its row's blocks");
  const bool amx = isa == "amx", bf16 = amx || isa == "avx512bf16";
  const at::ScalarType kt = key_cache.scalar_type();
  const bool fp8 = kt == at::kFloat8_e4m3fn || kt == at::kFloat8_e5m2;
  TORCH_CHECK(!bf16 || ((kt == at::kBFloat16 || (fp8 && !amx)) && queries.scalar_type() == at::kBFloat16),
              "the ", isa, " path takes bf16 queries and a bf16 cache",
              amx ? "" : " (or an fp8 cache's float8 view)");
  TORCH_CHECK(!amx || (d % 32 == 0 && d <= 128), "the amx path takes head sizes 32, 64, 96, 128");
  TORCH_CHECK(bf16 || queries.scalar_type() == kt || queries.scalar_type() == at::kFloat,
              "queries: the cache dtype or float32");
  TORCH_CHECK(kt == at::kBFloat16 || kt == at::kHalf || kt == at::kFloat || fp8,
              "cache dtype: bf16, fp16, float32, float8_e4m3fn or float8_e5m2");
  const bool scatter = scores.has_value();
  float* sc = nullptr;
  int64_t slots = 0;  // row stride of scores
  if (scatter) {
    TORCH_CHECK(scores->scalar_type() == at::kFloat && scores->dim() == 2 && scores->stride(1) == 1 &&
                scores->size(0) == h && scores->size(1) == key_cache.size(0) * bs,
                "scores: float32 (H, NB * BS), slots contiguous");
    sc = scores->data_ptr<float>();
    slots = scores->stride(0);
  }
  Work w{key_cache, block_rows.data_ptr<int64_t>(), nblk, bs, d, hq / h, nq, hq,
         visible.data_ptr<int64_t>(),
         Tiles(tiles, bs, d),
         static_cast<float>(scale)};
  const int64_t m = nblk * bs;
  std::vector<int64_t> reach(r, 0);  // keys some query of the row sees
  for (int64_t i = 0; i < r; ++i)
    for (int64_t t = 0; t < nq; ++t) reach[i] = std::max(reach[i], w.visible[i * nq + t]);
  auto run = [&](int64_t row, int64_t head, int64_t s, int64_t splits, float* col) {
    if (amx) {
      switch (d / 32) {
        case 1: run_amx<1>(w, queries, row, head, s, splits, col); break;
        case 2: run_amx<2>(w, queries, row, head, s, splits, col); break;
        case 3: run_amx<3>(w, queries, row, head, s, splits, col); break;
        default: run_amx<4>(w, queries, row, head, s, splits, col); break;
      }
    } else if (bf16) {
      run_bf16(w, queries, row, head, s, splits, col);
    } else if (key_cache.scalar_type() == at::kBFloat16) {
      queries.scalar_type() == at::kFloat ? run_f32<at::BFloat16, float>(w, queries, row, head, s, splits, col)
                                          : run_f32<at::BFloat16, at::BFloat16>(w, queries, row, head, s, splits, col);
    } else if (key_cache.scalar_type() == at::kHalf) {
      queries.scalar_type() == at::kFloat ? run_f32<at::Half, float>(w, queries, row, head, s, splits, col)
                                          : run_f32<at::Half, at::Half>(w, queries, row, head, s, splits, col);
    } else if (kt == at::kFloat8_e4m3fn) {
      run_f32<c10::Float8_e4m3fn, float>(w, queries, row, head, s, splits, col);
    } else if (kt == at::kFloat8_e5m2) {
      run_f32<c10::Float8_e5m2, float>(w, queries, row, head, s, splits, col);
    } else {
      run_f32<float, float>(w, queries, row, head, s, splits, col);
    }
  };
  auto add_to_scores = [&](int64_t row, int64_t head, const float* col) {
    float* dst = sc + head * slots;
    for (int64_t t = 0; t < reach[row]; ++t) dst[w.blocks[row * nblk + t / bs] * bs + t % bs] += col[t];
  };
  // Enough tasks for every thread, even for one request's chunk: a (row, head)
  // pair's query rows are split over `splits` tasks, summed afterwards.
  const int64_t threads = at::get_num_threads();
  const int64_t row_blocks = (nq * w.g + ROWS - 1) / ROWS;
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(row_blocks, (4 * threads + r * h - 1) / (r * h)));
  if (scatter && splits == 1) {  // no (R, H, M) buffer: each task scatters its own sums
    at::parallel_for(0, r * h, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> col(m + 16);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t row = i / h, head = i % h;
        std::fill(col.begin(), col.begin() + std::min(m, (reach[row] + 15) / 16 * 16), 0.0f);
        run(row, head, 0, 1, col.data());
        add_to_scores(row, head, col.data());
      }
    });
    return at::Tensor();
  }
  at::Tensor out = at::zeros({splits, r, h, m}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, splits * r * h, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) run(i / h % r, i % h, i / (r * h), splits, o + i * m);
  });
  at::Tensor sums = splits == 1 ? out[0] : out.sum(0);
  if (!scatter) return sums;
  const float* sp = sums.data_ptr<float>();
  for (int64_t i = 0; i < r * h; ++i) add_to_scores(i / h, i % h, sp + i * m);
  return at::Tensor();
}

at::Tensor column_sums(const at::Tensor& key_cache, const at::Tensor& block_rows,
                       const at::Tensor& queries, const at::Tensor& visible, double scale,
                       std::vector<int64_t> tiles, const std::string& isa) {
  return column_sums_impl(key_cache, block_rows, queries, visible, scale, tiles, isa, c10::nullopt);
}

void add_column_sums(at::Tensor scores, const at::Tensor& key_cache, const at::Tensor& block_rows,
                     const at::Tensor& queries, const at::Tensor& visible, double scale,
                     std::vector<int64_t> tiles, const std::string& isa) {
  column_sums_impl(key_cache, block_rows, queries, visible, scale, tiles, isa, scores);
}

// AnDPro's window scores: reuses the helpers above, so included here.
#include "window_projection.h"
// Attention and H2O's column sums in one pass: reuses them too.
#include "fused_attention.h"

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("column_sums", &column_sums, "summed softmax attention per key, from the paged CPU cache");
  m.def("add_column_sums", &add_column_sums,
        "the same, added into scores[h, block * BS + offset] (rows must not share blocks)");
  m.def("move_tokens", &token_moves::move_tokens,
        "move tokens (and their scores) between slots of the paged CPU cache, any layout");
  m.def("read_tokens", &token_moves::read_tokens,
        "tokens of the paged CPU cache at given slots, per head, as (L, H, n, D)");
  m.def("plan_hole_moves", &token_moves::plan_hole_moves,
        "compaction's moves (kept tokens past the new length into the holes) and where each kept token ends");
  m.def("select_hole_moves", &token_moves::select_hole_moves,
        "the kept set (recent + top-scored older tokens) and plan_hole_moves' moves, in one call");
  m.def("copy_blocks", &token_moves::copy_blocks, "copy whole blocks of the paged CPU cache, as packed");
  m.def("copy_rows", &token_moves::copy_rows,
        "dsts[l][cells[i]] = srcs[l][i] for every pair l, one memcpy per row");
  m.def("window_projection_sums", &window_projection_sums,
        "AnDPro's window scores: sum over the window of a[t, i] * <y_t, v_i>, y = A V",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("isa"),
        py::arg("split") = true);
  m.def("window_projection_paged", &window_projection_paged,
        "AnDPro's window scores with K and V read in place from the paged CPU cache");
  m.def("attend_add_column_sums", &attend_add_column_sums,
        "causal attention from the paged CPU cache into out, and H2O's column sums of the scored "
        "rows added into scores, in one pass (avx512bf16: bf16; avx2: bf16 or float32)");
  m.def("parallel_threads", &parallel_threads,
        "threads the kernel's tasks run on (torch's intra-op count; 1 without OpenMP)");
  m.def("supports", &supports, "whether this CPU runs the named path (avx512bf16 | avx2)");
}
