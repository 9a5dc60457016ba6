// The fused pass (fused_attention.h) on AVX2 + FMA: every x86-64 CPU vLLM
// runs on, for a float32 or bf16 model and cache. Float32 throughout: bf16
// keys, values and queries widened exactly (a shift), logits, softmax, column
// sums and P V by FMA, the output rounded once (bf16: to nearest even), as
// vLLM's own vec kernel computes them in another order.
//
// Keys and values are read in place from vLLM's vec layouts (keys [D][BS] per
// block and head: 8 tokens of one dim are one load; values [BS][D]), for
// prefill chunks and decode rows alike. Per row block (ROWS query rows of one
// (row, KV head), e.g. a decode row's GQA group): logits 4 rows x 16 keys at a
// time (dot_4x16's tile, keys loaded once per 4 rows), exps in place, the
// column sums, then P V 3 rows x 32 dims at a time (12 accumulators: each
// value vector loaded, widened, once per 3 rows). As on the AVX-512 path, the
// loops prefetch the block they read next during the current one (keys, the
// first values, values, the next task's first keys).

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace fused256 {

// 8 elements widened to float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 float32 stored as T: bf16 rounded to nearest even, NaN kept a (quiet) NaN.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// out[(j0 + j) * ld + i] = scale * q_(j0+j) . k_i for 4 rows and 16 keys in
// place: kb the first key's dim 0 ([D][BS]: dim k at kb + k * bs).
// column_sums.cpp's dot_4x16 is the same tile on packed float keys. One
// template for both (keys at a stride, widened by load8) gave the same bits
// but moved GCC's inlining: the H2O flush 11-18% or AnDPro's window scores
// 8-12% slower on an AVX2-only EPYC (results/avx2/kernel_ab_dot4x16.md), so
// each keeps its own.
// `pf`: bytes [0, 16 * d * sizeof(T)) prefetched, 16 tokens' worth a dim
// (the matching share of the block read next), or null.
template <typename T>
inline void logits_4x16(const float* qf, int64_t j0, const T* kb, int64_t bs, int64_t d, __m256 scale,
                        float* out, int64_t ld, const char* pf) {
  __m256 a0[4], a1[4];
  for (int j = 0; j < 4; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < d; ++k) {
    if (pf != nullptr) _mm_prefetch(pf + k * 16 * sizeof(T), _MM_HINT_T0);
    const __m256 kv0 = load8(kb + k * bs), kv1 = load8(kb + k * bs + 8);
    for (int j = 0; j < 4; ++j) {
      const __m256 b = _mm256_set1_ps(qf[(j0 + j) * d + k]);
      a0[j] = _mm256_fmadd_ps(b, kv0, a0[j]);
      a1[j] = _mm256_fmadd_ps(b, kv1, a1[j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(out + (j0 + j) * ld, _mm256_mul_ps(a0[j], scale));
    _mm256_storeu_ps(out + (j0 + j) * ld + 8, _mm256_mul_ps(a1[j], scale));
  }
}

// dst[j][c0 + (0..DV*8)] = inv[j] * sum_i p[j * ld + i] v_i[c0 + ...] over
// i < top, JN rows (their exps zero past each horizon), DV 8-dim vectors.
// `after`: the block read after the last values (its slice prefetched).
template <typename T, int JN, int DV>
void pv_slice(const at::Tensor& vc, const fused::Batch& b, int64_t r, int64_t h, int64_t top,
              const float* p, int64_t ld, const float* inv, T* const* dst, int64_t c0, const char* after) {
  const T* cache = vc.data_ptr<T>();
  __m256 acc[JN][DV];
  for (int j = 0; j < JN; ++j)
    for (int c = 0; c < DV; ++c) acc[j][c] = _mm256_setzero_ps();
  for (int64_t i0 = 0; i0 < top; i0 += b.bs) {
    const T* src = cache + b.blocks[r * b.nblk + i0 / b.bs] * vc.stride(0) + h * vc.stride(1) + c0;
    const int64_t m = std::min(b.bs, top - i0);
    const char* next = i0 + b.bs < top ? fused::block_bytes(vc, b, r, h, i0 / b.bs + 1) : after;
    for (int64_t i = 0; i < m; ++i) {
      if (next != nullptr)  // the same token's slice of dims in the next block
        for (int64_t at = 0; at < DV * 8 * int64_t(sizeof(T)); at += 64)
          _mm_prefetch(next + (i * b.d + c0) * sizeof(T) + at, _MM_HINT_T0);
      __m256 pj[JN];
      for (int j = 0; j < JN; ++j) pj[j] = _mm256_set1_ps(p[j * ld + i0 + i]);
      for (int c = 0; c < DV; ++c) {
        const __m256 v = load8(src + i * b.d + c * 8);
        for (int j = 0; j < JN; ++j) acc[j][c] = _mm256_fmadd_ps(pj[j], v, acc[j][c]);
      }
    }
  }
  for (int j = 0; j < JN; ++j) {
    const __m256 s = _mm256_set1_ps(inv[j]);
    for (int c = 0; c < DV; ++c) store8(dst[j] + c0 + c * 8, _mm256_mul_ps(acc[j][c], s));
  }
}

// P V of nb rows: 3 rows at a time, 32 dims at a time (16 for a last half).
template <typename T>
void pv_rows(const at::Tensor& vc, const fused::Batch& b, int64_t r, int64_t h, const float* p,
             int64_t ld, const int64_t* vis, const float* inv, T* const* dst, int64_t nb, const char* after) {
  for (int64_t j = 0; j < nb; j += 3) {
    const int64_t k = std::min<int64_t>(3, nb - j);
    int64_t top = 0;
    for (int64_t i = j; i < j + k; ++i) top = std::max(top, vis[i]);
    const float* pj = p + j * ld;
    for (int64_t c0 = 0; c0 < b.d; c0 += 32) {
      const bool half = b.d - c0 == 16;
      if (k == 3) half ? pv_slice<T, 3, 2>(vc, b, r, h, top, pj, ld, inv + j, dst + j, c0, after)
                       : pv_slice<T, 3, 4>(vc, b, r, h, top, pj, ld, inv + j, dst + j, c0, after);
      else if (k == 2) half ? pv_slice<T, 2, 2>(vc, b, r, h, top, pj, ld, inv + j, dst + j, c0, after)
                            : pv_slice<T, 2, 4>(vc, b, r, h, top, pj, ld, inv + j, dst + j, c0, after);
      else half ? pv_slice<T, 1, 2>(vc, b, r, h, top, pj, ld, inv + j, dst + j, c0, after)
                : pv_slice<T, 1, 4>(vc, b, r, h, top, pj, ld, inv + j, dst + j, c0, after);
    }
  }
}

struct Scratch {
  std::vector<float> qf, logits;
  std::vector<int64_t> tok, head, vis;
};

// One task (fused.h's Task): its rows in blocks of ROWS, keys and values in place.
// `next_keys`: the first keys of the task likely to come next, or null.
template <typename T>
void run_task(const Work& w, const at::Tensor& vc, const fused::Batch& b, const fused::Task& t,
              const T* q, T* out, float* col, Scratch& s, const char* next_keys) {
  fused::task_rows(b, t, s.tok, s.head, s.vis);
  if (s.tok.empty()) return;
  const int64_t d = b.d;
  const int64_t top = *std::max_element(s.vis.begin(), s.vis.end());
  const int64_t hi = (top + 15) / 16 * 16;  // logits in 16s, within the row's blocks (BS % 16 == 0)
  s.logits.resize(ROWS * hi);
  s.qf.resize(ROWS * d);
  const __m256 scale = _mm256_set1_ps(w.scale);
  float inv[ROWS];
  T* dst[ROWS];
  for (size_t b0 = 0; b0 < s.tok.size(); b0 += ROWS) {
    const int64_t nb = std::min<int64_t>(ROWS, s.tok.size() - b0);
    const int64_t* vis = s.vis.data() + b0;
    std::fill(s.qf.begin(), s.qf.end(), 0.0f);
    int64_t bhi = 0;
    for (int64_t j = 0; j < nb; ++j) {
      const T* src = q + s.tok[b0 + j] * b.qs0 + s.head[b0 + j] * b.qs1;
      for (int64_t k = 0; k < d; ++k) s.qf[j * d + k] = static_cast<float>(src[k]);
      dst[j] = out + (s.tok[b0 + j] * b.hq + s.head[b0 + j]) * d;
      bhi = std::max(bhi, vis[j]);
    }
    float* l = s.logits.data();
    const int64_t tiles = (bhi + 15) / 16;
    const char* values = fused::block_bytes(vc, b, t.r, t.h, 0);
    for (int64_t c = 0; c < tiles; ++c) {
      const T* kb = key_base<T>(w, t.r, t.h, c * 16) + c * 16 % b.bs;
      // this tile's share of the block after its own: the next keys, or the first values
      const int64_t nxt = (c * 16 / b.bs + 1) * b.bs;
      const char* pf = (nxt < tiles * 16 ? reinterpret_cast<const char*>(key_base<T>(w, t.r, t.h, nxt)) : values) +
                       c * 16 % b.bs * d * sizeof(T);
      for (int64_t j0 = 0; j0 < nb; j0 += 4)
        logits_4x16(s.qf.data(), j0, kb, b.bs, d, scale, l + c * 16, hi, j0 == 0 ? pf : nullptr);
    }
    for (int64_t j = 0; j < nb; ++j) {
      float* row = l + j * hi;
      inv[j] = exp_row_256(row, vis[j]);
      std::fill(row + vis[j], row + hi, 0.0f);  // P V reads up to the block's widest row
      if (col != nullptr) add_row_256(row, vis[j], inv[j], col);
    }
    pv_rows<T>(vc, b, t.r, t.h, l, hi, vis, inv, dst, nb, next_keys);
  }
}

}  // namespace fused256

#pragma GCC pop_options
