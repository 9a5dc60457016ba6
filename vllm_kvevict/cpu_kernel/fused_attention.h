// Causal attention and H2O's column sums in one pass, from vLLM's paged CPU
// cache (included by column_sums.cpp, whose helpers it uses).
//
// One call per layer and step, over vLLM's own batch description: row r has
// queries [starts[r], starts[r + 1]) and seq[r] keys (physical), its query t
// seeing keys [0, seq[r] - len + 1 + t). For every query row and head:
//
//     out[tok, head] = sum_i softmax_i(q . k_i * scale) v_i              (bf16, RNE)
//     scores[h, slot(r, i)] += sum over its GQA group and queries of softmax_i
//                                                     (only where score_rows[r])
//
// Precision: logits as the scoring kernel computes them (bf16 products exact,
// float32 accumulation by vdpbf16ps), softmax, column sums and P V in float32
// (values widened), the output rounded to bf16 once. vLLM's CPU attention
// (its vec path: float32 logits, probabilities and P V) computes the same
// quantities in the same precision in another order: the two outputs differ
// in a few bf16 roundings per 10,000 (tests/test_fused_attention.py).
//
// Decode rows (one query) read their keys and values in place instead
// (run_decode): logits for the G heads of the group straight from the vec
// layout's [D][BS] keys, P V widening values as it reads them, as vLLM's own
// kernel reads a decode's cache once (decode steps: 0.6-1.0x the time of
// vLLM's attention, which computes no scores).
//
// A decode row reads its blocks as the loop reaches them, and in the engine
// they come from memory: a layer's keys and values were last read a step ago,
// and the whole pool (30 layers) is several times the L3. The hardware
// prefetcher starts over at every 4 KB page, and a (block, head)'s keys are
// about a page (32 x 64 bf16) wherever vLLM put the block, so decode loops prefetch the block
// they read next one line per iteration of the current one (a block ahead:
// next keys, then the first values, next values, then the keys of the task
// the counter hands out next). In-loop it takes 30-35% off the cold pass
// (scripts/measure/decode_pass_cold.py); a whole task's lines prefetched at
// its start, tried and not kept, took 6-9%.
//
// On CPUs without AVX-512 BF16, and for float32 models, the same pass runs
// on AVX2 + FMA (fused_attention_avx2.h: float32 arithmetic, keys and values
// read in place for every row); the tasks and their merge below serve both.
//
// Work: tasks (r, h, split), a (row, KV head)'s query rows in blocks of ROWS
// interleaved over its splits (causal rows balance), sized by their logits
// and pulled by the threads from a shared counter, largest first. A task packs
// its keys (pack_keys_bf16) and widens its values once, then per row block:
// logits tile, exps in place, column sums, P V. Values must lie as vLLM's vec
// layouts keep them, a token's D dims contiguous ([BS][D] per block and head),
// or, on the AVX-512 BF16 path, as its amx layout does: token pairs
// ([D/16][BS/2][16][2]; a 32-bit lane is one dim of two tokens, widened to
// float32 by a shift and a mask). vLLM picks amx for bf16 on AMX CPUs; its
// keys there ([BS/16][D/2][16][2]) are vdpbf16ps operands as stored, which
// decode rows read in place.
#include <algorithm>
#include <atomic>

namespace fused {

struct Task {
  int64_t r, h, split, splits, work;
  int64_t col;  // offset of its column sums in the shared buffer, or -1 (none there)
  bool direct;  // its column sums go straight into the scores at its slots (amx decode rows)
};

struct Batch {
  const int64_t *starts, *seq, *blocks;
  const bool* score;
  int64_t nblk, bs, d, g, hq;
  int64_t qs0, qs1;  // query strides (token, head), in elements
  bool v_amx;  // values in vLLM's amx layout, [D/16][BS/2][16][2] per block and head
  bool tiles;  // the amx path: decode rows on that layout take AMX tiles (fused_attention_amx.h)
  float* scores;  // (H, slots) where `direct` tasks add their column sums
  int64_t slots;
};

// Rows (token, head, visible) of a task, in token order.
void task_rows(const Batch& b, const Task& t, std::vector<int64_t>& tok, std::vector<int64_t>& head,
               std::vector<int64_t>& vis) {
  tok.clear(); head.clear(); vis.clear();
  const int64_t s0 = b.starts[t.r], len = b.starts[t.r + 1] - s0, past = b.seq[t.r] - len;
  int64_t n = 0;
  for (int64_t i = 0; i < len; ++i)
    for (int64_t gg = 0; gg < b.g; ++gg, ++n) {
      if ((n / ROWS) % t.splits != t.split) continue;
      tok.push_back(s0 + i);
      head.push_back(t.h * b.g + gg);
      vis.push_back(past + 1 + i);
    }
}

// The first byte of (row r's block k, head h) in a [NB, H, BS, D] cache view
// (keys or values, any dtype): where the decode loops prefetch.
inline const char* block_bytes(const at::Tensor& cache, const Batch& b, int64_t r, int64_t h, int64_t k) {
  return static_cast<const char*>(cache.data_ptr()) +
         (b.blocks[r * b.nblk + k] * cache.stride(0) + h * cache.stride(1)) * cache.element_size();
}

}  // namespace fused

#include "fused_attention_amx.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace fused {

// Values [0, n) of (r, h) widened to float32, [n][D].
void widen_values(const at::Tensor& vc, const Batch& b, int64_t r, int64_t h, int64_t n, float* out) {
  const uint16_t* base = reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < n; i += b.bs) {
    const uint16_t* src = base + b.blocks[r * b.nblk + i / b.bs] * vc.stride(0) + h * vc.stride(1);
    if (b.v_amx) {  // a 32-bit lane holds one dim of a token pair: low half, high half
      const int64_t m = std::min(b.bs, n - i);
      for (int64_t k = 0; k < m; k += 2)
        for (int64_t c = 0; c < b.d / 16; ++c) {
          const __m512i w = _mm512_loadu_si512(src + c * b.bs * 16 + k * 16);
          float* dst = out + (i + k) * b.d + c * 16;
          _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
          if (k + 1 < m)
            _mm512_storeu_ps(dst + b.d, _mm512_castsi512_ps(
                _mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xFFFF0000u)))));
        }
      continue;
    }
    const int64_t m = std::min(b.bs, n - i) * b.d;  // a block's tokens are contiguous rows
    float* dst = out + i * b.d;
    for (int64_t k = 0; k < m; k += 16) {
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + k)));
      _mm512_storeu_ps(dst + k, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
  }
}

// acc[j] += p[j * ld] * vr for JN rows of exps, one value row of DV 16-dim vectors.
template <int JN, int DV>
inline void pv_add(__m512 (&acc)[JN][DV], const __m512 (&vr)[DV], const float* p, int64_t ld) {
  for (int j = 0; j < JN; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j * ld]);
    for (int c = 0; c < DV; ++c) acc[j][c] = _mm512_fmadd_ps(pj, vr[c], acc[j][c]);
  }
}

// dst[j] = acc[j] * inv[j], rounded to bf16 once.
template <int JN, int DV>
inline void pv_store(const __m512 (&acc)[JN][DV], const float* inv, uint16_t* const* dst) {
  for (int j = 0; j < JN; ++j) {
    const __m512 s = _mm512_set1_ps(inv[j]);
    for (int c = 0; c < DV; ++c) {
      const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[j][c], s));
      std::memcpy(dst[j] + c * 16, &o, 32);
    }
  }
}

// out rows = inv * sum_i p[j, i] v_i for JN rows of exps (zero past a row's
// horizon), DV 16-dim vectors per head: each value row loaded once per JN rows.
template <int JN, int DV>
inline void pv_rows(const float* p, int64_t ld, const int64_t* vis, const float* inv, const float* v,
                    uint16_t* const* dst) {
  int64_t top = 0;
  for (int j = 0; j < JN; ++j) top = std::max(top, vis[j]);
  __m512 acc[JN][DV];
  for (int j = 0; j < JN; ++j)
    for (int c = 0; c < DV; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < top; ++i) {
    __m512 vr[DV];
    for (int c = 0; c < DV; ++c) vr[c] = _mm512_loadu_ps(v + i * DV * 16 + c * 16);
    pv_add<JN, DV>(acc, vr, p + i, ld);
  }
  pv_store<JN, DV>(acc, inv, dst);
}

template <int DV>
void pv_block(const float* p, int64_t ld, const int64_t* vis, const float* inv, const float* v,
              uint16_t* const* dst, int64_t nb) {
  constexpr int JN = DV <= 4 ? 4 : 2;  // JN x DV accumulators within 32 registers
  int64_t j = 0;
  for (; j + JN <= nb; j += JN) pv_rows<JN, DV>(p + j * ld, ld, vis + j, inv + j, v, dst + j);
  for (; j < nb; ++j) pv_rows<1, DV>(p + j * ld, ld, vis + j, inv + j, v, dst + j);
}

// --- decode rows: one query per (row, head), keys and values read in place.
// Packing keys and widening values (run_task) pays for itself over a chunk's
// many queries; a decode row reads each key once, so it reads them straight
// from vLLM's vec layouts (a dim's tokens contiguous: [D][BS] per block and
// head) as vLLM's own kernel does, with logits for the G heads of its group
// and P V into G rows of registers.

// The line at byte `at` of `block` (a (block, head)'s keys or values) on its
// way to L1; a null block (nothing next) prefetches nothing.
inline void prefetch_line(const char* block, int64_t at) {
  if (block != nullptr) _mm_prefetch(block + at, _MM_HINT_T0);
}

// l[j * ld + i] = q_j . k_i for i in [0, n16) (n16 a multiple of 16, within
// the row's blocks; slots past its length are read and masked later).
// `after`: the block read after the last keys (prefetched during them).
template <int G>
void decode_logits(const Work& w, int64_t r, int64_t h, int64_t n16, const int32_t* qp, int64_t hp,
                   float* l, int64_t ld, const char* after) {
  const __m512i idx = pair_index();
  for (int64_t t = 0; t < n16; t += 16) {
    const uint16_t* block = reinterpret_cast<const uint16_t*>(key_base<at::BFloat16>(w, r, h, t));
    __m512 acc[G];
    for (int j = 0; j < G; ++j) acc[j] = _mm512_setzero_ps();
    if (w.tiles.amx) {  // [BS/16][D/2][16][2]: dims 2p, 2p + 1 of 16 tokens stored as one operand
      // even and odd dim pairs into separate sums: twice the independent
      // vdpbf16ps chains (a group of 3 heads alone waits on their latency)
      const uint16_t* base = block + w.tiles.tok[t % w.bs];
      __m512 odd[G];
      for (int j = 0; j < G; ++j) odd[j] = _mm512_setzero_ps();
      for (int64_t p = 0; p < hp; p += 2) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(base + p * 32);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(base + p * 32 + 32);
        for (int j = 0; j < G; ++j) {
          acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(qp[j * hp + p]), k0);
          odd[j] = _mm512_dpbf16_ps(odd[j], (__m512bh)_mm512_set1_epi32(qp[j * hp + p + 1]), k1);
        }
      }
      for (int j = 0; j < G; ++j) acc[j] = _mm512_add_ps(acc[j], odd[j]);
    } else {
      const uint16_t* base = block + t % w.bs;
      // a block's BS x D keys are BS / 16 tiles of D / 2 pairs: one line each
      const char* next = t + w.bs < n16
          ? reinterpret_cast<const char*>(key_base<at::BFloat16>(w, r, h, t + w.bs)) : after;
      const int64_t line0 = (t % w.bs) / 16 * hp;
      for (int64_t p = 0; p < hp; ++p) {  // dims 2p, 2p + 1 of 16 tokens, as pack_bf16 makes them
        prefetch_line(next, (line0 + p) * 64);
        const __m512bh kv = (__m512bh)dim_pair_bf16(base + 2 * p * w.bs, base + (2 * p + 1) * w.bs, idx);
        for (int j = 0; j < G; ++j)
          acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(qp[j * hp + p]), kv);
      }
    }
    for (int j = 0; j < G; ++j) _mm512_storeu_ps(l + j * ld + t, acc[j]);
  }
}

// dst[j] = inv[j] * sum_i p[j, i] v_i over i in [0, n), JN rows, DV 16-dim
// vectors a head; values widened from the paged cache as they are read
// (`after`, the block read next, prefetched during the last).
template <int JN, int DV>
void decode_pv(const at::Tensor& vc, const Batch& b, int64_t r, int64_t h, int64_t n, const float* p,
               int64_t ld, const float* inv, uint16_t* const* dst, const char* after) {
  const uint16_t* cache = reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>());
  __m512 acc[JN][DV];
  for (int j = 0; j < JN; ++j)
    for (int c = 0; c < DV; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t i0 = 0; i0 < n; i0 += b.bs) {
    const uint16_t* src = cache + b.blocks[r * b.nblk + i0 / b.bs] * vc.stride(0) + h * vc.stride(1);
    const int64_t m = std::min(b.bs, n - i0);
    if (b.v_amx) {  // token pairs: a 32-bit lane holds one dim of both (low, high half)
      const __m512i hi_half = _mm512_set1_epi32(int32_t(0xFFFF0000u));
      for (int64_t i = 0; i < m; i += 2) {
        const bool pair = i + 1 < m;  // an odd tail's partner slot is unwritten: never read it
        __m512 p0[JN], p1[JN];
        for (int j = 0; j < JN; ++j) {
          p0[j] = _mm512_set1_ps(p[j * ld + i0 + i]);
          p1[j] = _mm512_set1_ps(pair ? p[j * ld + i0 + i + 1] : 0.0f);
        }
        for (int c = 0; c < DV; ++c) {
          const __m512i w = _mm512_loadu_si512(src + c * b.bs * 16 + i * 16);
          const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
          for (int j = 0; j < JN; ++j) acc[j][c] = _mm512_fmadd_ps(p0[j], lo, acc[j][c]);
          if (pair) {
            const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(w, hi_half));
            for (int j = 0; j < JN; ++j) acc[j][c] = _mm512_fmadd_ps(p1[j], hi, acc[j][c]);
          }
        }
      }
      continue;
    }
    const char* next = i0 + b.bs < n ? block_bytes(vc, b, r, h, i0 / b.bs + 1) : after;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t at = 0; at < b.d * 2; at += 64) prefetch_line(next, i * b.d * 2 + at);  // its D dims
      __m512 vr[DV];
      for (int c = 0; c < DV; ++c)
        vr[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + i * b.d + c * 16))), 16));
      pv_add<JN, DV>(acc, vr, p + i0 + i, ld);
    }
  }
  pv_store<JN, DV>(acc, inv, dst);
}

// decode_pv over nb rows, as many at a time as registers hold
// ((JN + 1) x DV vectors within 32): each value read once per JN rows.
template <int DV>
void decode_pv_rows(const at::Tensor& vc, const Batch& b, int64_t r, int64_t h, int64_t n,
                    const float* p, int64_t ld, const float* inv, uint16_t* const* dst, int64_t nb,
                    const char* after) {
  constexpr int MAXJ = DV <= 4 ? 4 : DV <= 6 ? 3 : 2;
  for (int64_t j = 0; j < nb;) {
    const int64_t k = std::min<int64_t>(MAXJ, nb - j);
    const float* pj = p + j * ld;
    switch (k) {
      case 4: if constexpr (MAXJ >= 4) decode_pv<4, DV>(vc, b, r, h, n, pj, ld, inv + j, dst + j, after); break;
      case 3: if constexpr (MAXJ >= 3) decode_pv<3, DV>(vc, b, r, h, n, pj, ld, inv + j, dst + j, after); break;
      case 2: decode_pv<2, DV>(vc, b, r, h, n, pj, ld, inv + j, dst + j, after); break;
      default: decode_pv<1, DV>(vc, b, r, h, n, pj, ld, inv + j, dst + j, after);
    }
    j += k;
  }
}

// Query heads [j0, j0 + G) of a decode task's group: logits, softmax, their
// column sums added into `col`, P V; `next_keys` (the next task's first keys,
// or null) prefetched during its last values.
template <int G>
void decode_row(const Work& w, const at::Tensor& vc, const Batch& b, const Task& t, int64_t j0,
                const uint16_t* q, uint16_t* out, float* col, std::vector<float>& logits,
                std::vector<int32_t>& qp, const char* next_keys) {
  const int64_t d = b.d, hp = d / 2, tok = b.starts[t.r], n = b.seq[t.r];
  const int64_t n16 = (n + 15) / 16 * 16;
  logits.resize(G * n16);
  qp.resize(G * hp);
  uint16_t* dst[G];
  int64_t vis[G];
  float inv[G];
  for (int j = 0; j < G; ++j) {
    const int64_t head = t.h * b.g + j0 + j;
    std::memcpy(&qp[j * hp], q + tok * b.qs0 + head * b.qs1, d * 2);
    dst[j] = out + (tok * b.hq + head) * d;
    vis[j] = n;
  }
  float* l = logits.data();
  decode_logits<G>(w, t.r, t.h, n16, qp.data(), hp, l, n16, block_bytes(vc, b, t.r, t.h, 0));
  exp_rows_512(l, n16, vis, G, n16, w.scale, inv);
  if (col != nullptr) add_rows_512(l, n16, inv, G, n16, col);
  switch (d / 16) {
    case 1: decode_pv_rows<1>(vc, b, t.r, t.h, n, l, n16, inv, dst, G, next_keys); break;
    case 2: decode_pv_rows<2>(vc, b, t.r, t.h, n, l, n16, inv, dst, G, next_keys); break;
    case 3: decode_pv_rows<3>(vc, b, t.r, t.h, n, l, n16, inv, dst, G, next_keys); break;
    case 4: decode_pv_rows<4>(vc, b, t.r, t.h, n, l, n16, inv, dst, G, next_keys); break;
    case 5: decode_pv_rows<5>(vc, b, t.r, t.h, n, l, n16, inv, dst, G, next_keys); break;
    case 6: decode_pv_rows<6>(vc, b, t.r, t.h, n, l, n16, inv, dst, G, next_keys); break;
    case 7: decode_pv_rows<7>(vc, b, t.r, t.h, n, l, n16, inv, dst, G, next_keys); break;
    default: decode_pv_rows<8>(vc, b, t.r, t.h, n, l, n16, inv, dst, G, next_keys); break;
  }
}

// A decode task (one query, unsplit, keys in vLLM's vec layouts) in place,
// its group's heads at most 8 at a time; false where it is not one (run_task packs).
bool run_decode(const Work& w, const at::Tensor& vc, const Batch& b, const Task& t, const uint16_t* q,
                uint16_t* out, float* col, std::vector<float>& logits, std::vector<int32_t>& qp,
                const char* next_keys) {
  if (!(w.tiles.rows || w.tiles.amx) || t.splits != 1 || b.starts[t.r + 1] - b.starts[t.r] != 1) return false;
  for (int64_t j0 = 0; j0 < b.g; j0 += 8) {
    switch (std::min<int64_t>(8, b.g - j0)) {
      case 1: decode_row<1>(w, vc, b, t, j0, q, out, col, logits, qp, next_keys); break;
      case 2: decode_row<2>(w, vc, b, t, j0, q, out, col, logits, qp, next_keys); break;
      case 3: decode_row<3>(w, vc, b, t, j0, q, out, col, logits, qp, next_keys); break;
      case 4: decode_row<4>(w, vc, b, t, j0, q, out, col, logits, qp, next_keys); break;
      case 5: decode_row<5>(w, vc, b, t, j0, q, out, col, logits, qp, next_keys); break;
      case 6: decode_row<6>(w, vc, b, t, j0, q, out, col, logits, qp, next_keys); break;
      case 7: decode_row<7>(w, vc, b, t, j0, q, out, col, logits, qp, next_keys); break;
      default: decode_row<8>(w, vc, b, t, j0, q, out, col, logits, qp, next_keys); break;
    }
  }
  return true;
}

struct Scratch {
  std::vector<uint16_t> keys;
  std::vector<float> values, logits;
  std::vector<int32_t> qp;
  std::vector<int64_t> tok, head, vis;
};

// `next_keys`: the first keys of the task likely to come next (see decode_row).
void run_task(const Work& w, const at::Tensor& vc, const Batch& b, const Task& t, const uint16_t* q,
              uint16_t* out, float* col, Scratch& s, const char* next_keys) {
  if (run_decode(w, vc, b, t, q, out, col, s.logits, s.qp, next_keys)) return;
  task_rows(b, t, s.tok, s.head, s.vis);
  if (s.tok.empty()) return;
  const int64_t d = b.d, hp = d / 2;
  const int64_t top = *std::max_element(s.vis.begin(), s.vis.end());  // keys the task's rows see
  const int64_t hi = (top + 15) / 16 * 16;
  s.keys.resize(hi * d);
  s.values.resize(hi * d);
  s.logits.resize(ROWS * hi);
  s.qp.assign(ROWS * hp, 0);
  pack_keys_bf16(w, t.r, t.h, hi, s.keys.data());
  widen_values(vc, b, t.r, t.h, top, s.values.data());
  float inv[ROWS];
  uint16_t* dst[ROWS];
  for (size_t b0 = 0; b0 < s.tok.size(); b0 += ROWS) {
    const int64_t nb = std::min<int64_t>(ROWS, s.tok.size() - b0);
    int64_t bhi = 0;
    std::fill(s.qp.begin(), s.qp.end(), 0);
    for (int64_t j = 0; j < nb; ++j) {
      std::memcpy(&s.qp[j * hp], q + s.tok[b0 + j] * b.qs0 + s.head[b0 + j] * b.qs1, d * 2);
      dst[j] = out + (s.tok[b0 + j] * b.hq + s.head[b0 + j]) * d;
      bhi = std::max(bhi, s.vis[b0 + j]);
    }
    const int64_t nc = (bhi + 15) / 16;
    float* l = s.logits.data();
    int64_t c = 0;
    for (; c + 1 < nc; c += 2) dot_bf16<2>(s.keys.data() + c * 16 * d, s.qp.data(), hp, l + c * 16, hi);
    if (c < nc) dot_bf16<1>(s.keys.data() + c * 16 * d, s.qp.data(), hp, l + c * 16, hi);
    const int64_t* vis = s.vis.data() + b0;
    exp_rows_512(l, hi, vis, nb, nc * 16, w.scale, inv);
    if (col != nullptr) add_rows_512(l, hi, inv, nb, nc * 16, col);
    switch (d / 16) {
      case 1: pv_block<1>(l, hi, vis, inv, s.values.data(), dst, nb); break;
      case 2: pv_block<2>(l, hi, vis, inv, s.values.data(), dst, nb); break;
      case 3: pv_block<3>(l, hi, vis, inv, s.values.data(), dst, nb); break;
      case 4: pv_block<4>(l, hi, vis, inv, s.values.data(), dst, nb); break;
      case 5: pv_block<5>(l, hi, vis, inv, s.values.data(), dst, nb); break;
      case 6: pv_block<6>(l, hi, vis, inv, s.values.data(), dst, nb); break;
      case 7: pv_block<7>(l, hi, vis, inv, s.values.data(), dst, nb); break;
      default: pv_block<8>(l, hi, vis, inv, s.values.data(), dst, nb); break;
    }
  }
}

}  // namespace fused

#pragma GCC pop_options

#include "fused_attention_avx2.h"

// See the file's head. out, q: (N, H_q, D), the cache's dtype (q strided by
// token and head, out contiguous); key_cache / value_cache [NB, H, BS, D]
// views (KVLayout.split): bf16 on the avx512bf16 path, bf16 or float32 on
// avx2; starts (R + 1,), seq (R,), blocks (R, nblk), all int64; score_rows
// (R,) bool; scores (H, NB * BS) float32, slots contiguous.
void attend_add_column_sums(at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& starts,
                            const at::Tensor& seq, const at::Tensor& blocks,
                            const at::Tensor& score_rows, double scale, std::vector<int64_t> k_tiles,
                            std::vector<int64_t> v_tiles, at::Tensor scores, const std::string& isa) {
  const bool avx2 = isa == "avx2", amx = isa == "amx";
  TORCH_CHECK(avx2 || amx || isa == "avx512bf16", "the fused pass runs amx, avx512bf16 or avx2, not ", isa);
  TORCH_CHECK(supports(isa), "this CPU cannot run the fused pass's ", isa, " path");
  const at::ScalarType dt = key_cache.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || (avx2 && dt == at::kFloat),
              "the ", isa, " pass takes a ", avx2 ? "bf16 or float32" : "bf16", " cache");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == dt && q.stride(2) == 1,
              "q: (N, H_q, D), the cache's dtype, dims contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == dt && out.is_contiguous(),
              "out: contiguous, q's shape and dtype");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.scalar_type() == dt,
              "key_cache, value_cache: [NB, H, BS, D], one dtype");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2), h = key_cache.size(1),
                bs = key_cache.size(2), r = seq.size(0), nblk = blocks.size(1);
  TORCH_CHECK(key_cache.size(3) == d && hq % h == 0 && d % 16 == 0 && d <= 128,
              "head sizes: D a multiple of 16 up to 128, H_q a multiple of H");
  TORCH_CHECK(bs % 16 == 0, "block size must be a multiple of 16");
  TORCH_CHECK(k_tiles.size() == 7 && v_tiles.size() == 7, "tiles: (T0, D0, base, st1, st0, sd1, sd0)");
  const bool v_vec = v_tiles[0] == bs && v_tiles[1] == d && v_tiles[2] == 0 && v_tiles[4] == d &&
                     v_tiles[6] == 1;
  const bool v_amx = v_tiles == std::vector<int64_t>{2, 16, 0, 32, 1, bs * 16, 2};
  TORCH_CHECK(v_vec || (v_amx && !avx2),
              "values: a token's dims contiguous, [BS][D] per block and head (vLLM's vec layouts)",
              avx2 ? "" : ", or token pairs [D/16][BS/2][16][2] (vLLM's amx layout)");
  TORCH_CHECK(!avx2 || (k_tiles[0] == bs && k_tiles[1] == d && k_tiles[2] == 0 && k_tiles[4] == 1 &&
                        k_tiles[6] == bs),
              "keys: a dim's tokens contiguous, [D][BS] per block and head (vLLM's vec layouts)");
  for (const at::Tensor* x : {&starts, &seq, &blocks})
    TORCH_CHECK(x->scalar_type() == at::kLong && x->is_contiguous(), "starts, seq, blocks: contiguous int64");
  TORCH_CHECK(starts.numel() == r + 1 && blocks.size(0) == r && score_rows.numel() == r &&
                  score_rows.scalar_type() == at::kBool && score_rows.is_contiguous(),
              "row counts disagree");
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* sq = seq.data_ptr<int64_t>();
  const int64_t* bl = blocks.data_ptr<int64_t>();
  const bool* sc = score_rows.data_ptr<bool>();
  // With no row scored the pass is attention alone (policies whose scores do
  // not come from it) and scores may be any float32 matrix, (H, 0) included:
  // nothing is written to it.
  const bool any_scored = std::any_of(sc, sc + r, [](bool x) { return x; });
  TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.dim() == 2 &&
                  (!any_scored || (scores.stride(1) == 1 && scores.size(0) == h &&
                                   scores.size(1) == key_cache.size(0) * bs)),
              "scores: float32 (H, NB * BS), slots contiguous");
  TORCH_CHECK(r == 0 || (st[0] == 0 && st[r] == n), "starts must run from 0 to N");
  for (int64_t i = 0; i < r; ++i) {
    const int64_t len = st[i + 1] - st[i];
    TORCH_CHECK(len >= 0 && len <= sq[i] && sq[i] <= nblk * bs, "row ", i, ": lengths disagree");
    for (int64_t k = 0; k < (sq[i] + bs - 1) / bs; ++k)
      TORCH_CHECK(bl[i * nblk + k] >= 0 && bl[i * nblk + k] < key_cache.size(0),
                  "blocks name blocks outside the cache");
  }
  const int64_t g = hq / h;
  fused::Batch b{st, sq, bl, sc, nblk, bs, d, g, hq, q.stride(0), q.stride(1), v_amx,
                 amx && v_amx && g <= 16 && d % 32 == 0 && bs % 32 == 0 &&
                     k_tiles == std::vector<int64_t>{16, 2, 0, 16 * d, 2, 32, 1},
                 scores.data_ptr<float>(), scores.stride(0)};
  Work w{key_cache, bl, nblk, bs, d, g, 0, hq, nullptr, Tiles(k_tiles, bs, d), static_cast<float>(scale)};
  // Splits: about 8 tasks per thread over the step, each (row, head) split in
  // proportion to its logits (causal: len * (seq - len / 2)).
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> rw(r);
  double total = 0;
  for (int64_t i = 0; i < r; ++i) {
    const int64_t len = st[i + 1] - st[i];
    rw[i] = len * g * (sq[i] - len / 2);
    total += double(rw[i]) * h;
  }
  std::vector<fused::Task> tasks;
  int64_t cols = 0;
  for (int64_t i = 0; i < r; ++i) {
    const int64_t len = st[i + 1] - st[i];
    if (len == 0) continue;
    const int64_t blocks_of_rows = (len * g + ROWS - 1) / ROWS;
    const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(
        blocks_of_rows, int64_t(std::ceil(rw[i] * 8.0 * threads / std::max(total, 1.0)))));
    const int64_t m = (sq[i] + 15) / 16 * 16;
    for (int64_t hh = 0; hh < h; ++hh)
      for (int64_t s = 0; s < splits; ++s) {
        // a decode row on tiles (one query, unsplit) adds into its own slots:
        // rows name disjoint blocks, heads are disjoint rows of scores
        const bool direct = sc[i] && b.tiles && len == 1 && splits == 1;
        tasks.push_back({i, hh, s, splits, rw[i] / splits, sc[i] && !direct ? cols : -1, direct});
        if (sc[i] && !direct) cols += m;
      }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const fused::Task& a, const fused::Task& c) { return a.work > c.work; });
  std::vector<float> colbuf(cols, 0.0f);
  std::atomic<size_t> next{0};
  auto col_of = [&](const fused::Task& t) { return t.col < 0 ? nullptr : colbuf.data() + t.col; };
  // The first keys of the task the counter hands out next: this thread's,
  // unless another takes it first (they then warm a neighbour's cache).
  auto next_keys = [&]() {
    const fused::Task& t = tasks[std::min(next.load(std::memory_order_relaxed), tasks.size() - 1)];
    return fused::block_bytes(key_cache, b, t.r, t.h, 0);
  };
  at::parallel_for(0, std::min<int64_t>(threads, tasks.size()), 1, [&](int64_t, int64_t) {
    if (!avx2) {
      const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
      uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
      if (b.tiles) {  // every task on tiles (fused_attention_amx.h); tile state is per thread
        fused::AmxScratch s;  // tiles configured by the first block
        for (size_t i = next++; i < tasks.size(); i = next++)
          fused::run_task_amx(w, value_cache, b, tasks[i], qd, od, col_of(tasks[i]), s);
        fused::amx_release();
      } else {
        fused::Scratch s;
        for (size_t i = next++; i < tasks.size(); i = next++)
          fused::run_task(w, value_cache, b, tasks[i], qd, od, col_of(tasks[i]), s, next_keys());
      }
    } else if (dt == at::kBFloat16) {
      fused256::Scratch s;
      for (size_t i = next++; i < tasks.size(); i = next++)
        fused256::run_task<at::BFloat16>(w, value_cache, b, tasks[i], q.data_ptr<at::BFloat16>(),
                                         out.data_ptr<at::BFloat16>(), col_of(tasks[i]), s, next_keys());
    } else {
      fused256::Scratch s;
      for (size_t i = next++; i < tasks.size(); i = next++)
        fused256::run_task<float>(w, value_cache, b, tasks[i], q.data_ptr<float>(), out.data_ptr<float>(),
                                  col_of(tasks[i]), s, next_keys());
    }
  });
  // Each scored (row, head): its splits' sums, added into its slots (rows
  // name disjoint blocks; heads are disjoint rows of scores).
  std::vector<const fused::Task*> firsts;
  for (const fused::Task& t : tasks)
    if (t.col >= 0 && t.split == 0) firsts.push_back(&t);
  float* sp = scores.data_ptr<float>();
  const int64_t slots = scores.stride(0);
  int64_t adds = 0;
  for (const fused::Task* t : firsts) adds += t->splits * sq[t->r];
  // A decode step's sums are small (50 rows x 3 heads x 160 slots: 24K adds,
  // ~10 us on one core), and a second parallel region costs more than that
  // where OpenMP's threads sleep between regions (OMP_WAIT_POLICY=passive:
  // +0.05 ms a layer, H2O's decode pass 1.36x the unscored one on Zen 4, 1.09x
  // with the threads spinning). Large sums (prompt chunks) keep both threads.
  // Either way each slot gets the same adds in the same order.
  const int64_t grain = adds < (int64_t(1) << 16) ? std::max<int64_t>(1, firsts.size()) : 1;
  at::parallel_for(0, firsts.size(), grain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const fused::Task& t = *firsts[k];
      float* dst = sp + t.h * slots;
      const int64_t m = (sq[t.r] + 15) / 16 * 16;
      // a (row, head)'s splits were laid out consecutively: split s at col + s * m;
      // a block's slots are contiguous
      for (int64_t i0 = 0; i0 < sq[t.r]; i0 += bs) {
        float* slot = dst + bl[t.r * nblk + i0 / bs] * bs;
        const int64_t e = std::min(bs, sq[t.r] - i0);
        for (int64_t s = 0; s < t.splits; ++s) {
          const float* src = colbuf.data() + t.col + s * m + i0;
          for (int64_t i = 0; i < e; ++i) slot[i] += src[i];
        }
      }
    }
  });
}
