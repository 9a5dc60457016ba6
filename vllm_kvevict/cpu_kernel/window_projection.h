// AnDPro's window scores (core/scoring/window_scores.py, kind "andpro") from
// dense window queries, keys and values.
//
// Included by column_sums.cpp inside its anonymous namespace, after the
// instruction-path helpers it reuses (exp2_512, dot_bf16, amx_configure,
// amx_chunk, amx_load_queries, exp256, hmax256, hsum256, supports, ROWS), so it
// includes nothing itself.
//
// For each batch row b, KV head h, window query t and query head g of h's GQA
// group (row t * G + g; query t is the token at resident index n - w + t and
// sees tokens [0, n - w + t], as window_scores.window_attention):
//
//     a[t, i] = softmax_i(q . k_i * scale)
//     y_t     = sum_i a[t, i] v_i                    (the pre-eviction output)
//     out[b, h, i] = sum_{t, g} a[t, i] * z[t, i],   z[t, i] = <y_t, v_i>
//
// which is AnDPro's s_i = <(A^T Y)_i, v_i> summed in another order. One task
// is a (b, h) pair (or part of its rows), in blocks of R query rows:
//   1. L = Q K^T, an R x n float32 tile;
//   2. E = exp(scale * (L - row max)) in place, zero past each row's horizon,
//      and r_j = 1 / sum_i E[j, i] (so A = r E);
//   3. Y = r^2 (E V) (R x D): a[j, i] z[j, i] = e[j, i] <r_j^2 (E V)_j, v_i>;
//   4. per 16 keys: the R x 16 tile Z = Y V^T, then out_i += sum_rows E * Z.
// Nothing larger than the R x n tile and the task's packed keys and values.
//
// Precision, per path (docs/design.md, the precision table, row "AnDPro"):
//   amx, avx512bf16  (bf16 q, k, v)
//     1. bf16 x bf16 products, exact in float32, accumulated in float32
//        (AMX tdpbf16ps / vdpbf16ps): float32-accurate logits, as column_sums.
//     2. float32 exp (polynomial, about 1 ulp), max and sums.
//     3. E is split into two bf16 numbers, e_hi = bf16(e), e_lo = bf16(e - e_hi)
//        (round to nearest even), so e_hi + e_lo holds e to 2^-16 relative;
//        E V = E_hi V + E_lo V, each product exact, accumulated in float32;
//        the r^2 scaling in float32.
//     4. Y split the same way; Z = Y_hi V^T + Y_lo V^T, products exact,
//        accumulated in float32; e * z (e the float32 exp) and the sums in
//        float32. Nothing is rounded to the model dtype: the only departure
//        from float32 is the 2^-16 representation of E and Y in steps 3-4
//        (float32 holds them to 2^-24).
//     With split false (avx512bf16 only; the caller's default, the papers'
//     model-dtype contract): E and Y are e_hi and y_hi alone, i.e. rounded to
//     bf16 (2^-9 relative) before steps 3 and 4; products still exact and
//     accumulated in float32, the exps, 1/sum, e * z and sums float32. Three
//     bf16 passes instead of five; |s - s_exact| <= 2^-8 sum_t a[t, i]
//     <ybar_t, |v_i|> (ybar_t = sum_j a[t, j] |v_j|) to first order.
//   avx2  (any of bf16 / fp16 / fp32, one dtype) every input widened to
//        float32 (exact) and float32 FMA throughout: float32 like the torch
//        path (A normalised before Y = A V).

// K or V read in place from vLLM's paged cache (window_projection_paged):
// the [NB, H, BS, D] view's first element and block stride, the layout's
// element offsets and their TokenMap, and the (B, H, n) slots, oldest first.
// A task copies its (b, h)'s n tokens into a thread's staging rows, which
// then stand where the dense (n, D) rows of k or v would: the arithmetic, and
// so every bit of the result, is the dense path's.
struct PagedRows {
  const void* base;
  int64_t s0, bs;
  const int64_t* off;
  token_moves::TokenMap map;
  const int64_t* slots;

  template <typename T>
  const T* rows(int64_t bh, int64_t h, int64_t n, int64_t d, T* staging) const {
    token_moves::read_row<T>(static_cast<const T*>(base), s0, bs, d, map, off, h, slots + bh * n, n,
                             staging);
    return staging;
  }
};

// Task bh's (n, D) rows of K or V: dense, or read in place into `staging`.
template <typename T>
inline const T* task_rows(const T* dense, const PagedRows* paged, int64_t bh, int64_t h, int64_t n,
                          int64_t d, T* staging) {
  return paged ? paged->rows<T>(bh, h, n, d, staging) : dense + bh * n * d;
}

// ---------------------------------------------------------------- avx512bf16, amx
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

struct ProjTask {
  const uint16_t *q, *k, *v;  // bf16 bits: (B, w, H_q, D), (B, H, n, D) x2, contiguous
  int64_t w, hq, h, g, n, d;
  float scale;
  bool split;  // E and Y as bf16 hi + lo (float32-accurate), or hi alone (model dtype)
  const PagedRows *pk = nullptr, *pv = nullptr;  // K, V read in place instead of k, v
};

constexpr int64_t PROJ_ROWS = 16;  // query rows per block (one AMX tile's rows)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// 16 x 16 int32 transpose in registers: r[i][j] -> r[j][i].
inline void transpose16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c]: columns c, c+4, c+8, c+12 of rows 4i..4i+3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[c + 8] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    r[c + 4] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[c + 12] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

// Rows [0, n) of src (n, D) bf16 as keys: [n16/16][D/2][16][2], the operand
// format of column_sums' pack_bf16 (vdpbf16ps, AMX B tiles); tokens >= n zero.
// A token's dim pair is one int32, so 16 tokens x 16 pairs is one transpose.
void pack_keys_dense(const uint16_t* src, int64_t n, int64_t n16, int64_t d, uint16_t* out) {
  const int64_t hp = d / 2, full = hp / 16 * 16;
  std::vector<uint16_t> tail(16 * d, 0);
  for (int64_t c = 0; c < n16 / 16; ++c) {
    const uint16_t* rows = src + c * 16 * d;
    if (c * 16 + 16 > n) {  // the last, partial chunk: from a zero-padded copy
      std::fill(tail.begin(), tail.end(), 0);
      std::memcpy(tail.data(), rows, (n - c * 16) * d * sizeof(uint16_t));
      rows = tail.data();
    }
    const int32_t* r32 = reinterpret_cast<const int32_t*>(rows);
    int32_t* o32 = reinterpret_cast<int32_t*>(out + c * 16 * d);
    for (int64_t p0 = 0; p0 < full; p0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(r32 + i * hp + p0);
      transpose16_epi32(r);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(o32 + (p0 + p) * 16, r[p]);
    }
    for (int64_t p = full; p < hp; ++p)
      for (int64_t i = 0; i < 16; ++i) o32[p * 16 + i] = r32[i * hp + p];
  }
}

// Rows [0, n) of src (n, D) bf16 as the right operand of A V:
// [n32/32][D/16][16 token pairs][16 dims][2] (an AMX B tile per 32 tokens x 16
// dims; for vdpbf16ps, token pair p's 16 dims are one operand); tokens >= n zero.
void pack_value_pairs(const uint16_t* src, int64_t n, int64_t n32, int64_t d, uint16_t* out) {
  const int64_t nd = d / 16;
  alignas(64) int16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = i, lo_idx[2 * i + 1] = 32 + i;
    hi_idx[2 * i] = 16 + i, hi_idx[2 * i + 1] = 48 + i;
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  std::vector<uint16_t> zero(d, 0);
  for (int64_t pr = 0; pr < n32 / 2; ++pr) {
    const uint16_t* r0 = 2 * pr < n ? src + 2 * pr * d : zero.data();
    const uint16_t* r1 = 2 * pr + 1 < n ? src + (2 * pr + 1) * d : zero.data();
    uint16_t* dst = out + ((pr / 16) * nd * 16 + pr % 16) * 32;  // + dc * 512
    int64_t dc = 0;
    for (; dc + 2 <= nd; dc += 2) {
      const __m512i a = _mm512_loadu_si512(r0 + dc * 16), b = _mm512_loadu_si512(r1 + dc * 16);
      _mm512_storeu_si512(dst + dc * 512, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(dst + (dc + 1) * 512, _mm512_permutex2var_epi16(a, hi, b));
    }
    if (dc < nd) {  // D % 32 == 16: the last 16 dims
      const __m512i a = _mm512_maskz_loadu_epi16(0xFFFF, r0 + dc * 16);
      const __m512i b = _mm512_maskz_loadu_epi16(0xFFFF, r1 + dc * 16);
      _mm512_storeu_si512(dst + dc * 512, _mm512_permutex2var_epi16(a, lo, b));
    }
  }
}

// x[0, m) (m a multiple of 16) as hi = bf16(x), lo = bf16(x - hi) (lo only
// where given), both round to nearest even: hi + lo = x to 2^-16 relative
// (vcvtneps2bf16 flushes values under 2^-126 to zero, which no score can tell
// from zero).
void split_bf16(const float* x, int64_t m, uint16_t* hi, uint16_t* lo) {
  for (int64_t i = 0; i < m; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm256_storeu_si256((__m256i*)(hi + i), h);
    if (lo != nullptr) _mm256_storeu_si256((__m256i*)(lo + i), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)));
  }
}

// One row of raw logits over [0, vis) -> e = exp(scale * (l - max l)) in
// place, [vis, end) set to zero (end a multiple of 16), and e as hi + lo bf16
// (split_bf16) over [0, end), lo only where given; returns 1 / sum e. The
// softmax is e / sum e: the caller folds the 1 / sum into Y (see proj_*),
// which saves a pass over the row.
float exp_row_512(float* row, int64_t vis, int64_t end, float scale, uint16_t* hi, uint16_t* lo) {
  const float c = scale * 1.44269504088896341f;  // exp(scale * x) = 2^(c * x)
  const __m512 vc = _mm512_set1_ps(c);
  const int64_t full = vis / 16 * 16;
  const __mmask16 tail = (__mmask16)((1u << (vis - full)) - 1);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = ninf, m1 = ninf, m2 = ninf, m3 = ninf;  // four chains: vmaxps latency
  int64_t i = 0;
  for (; i + 64 <= full; i += 64) {
    m = _mm512_max_ps(m, _mm512_loadu_ps(row + i));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(row + i + 16));
    m2 = _mm512_max_ps(m2, _mm512_loadu_ps(row + i + 32));
    m3 = _mm512_max_ps(m3, _mm512_loadu_ps(row + i + 48));
  }
  for (; i < full; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + i));
  if (tail) m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, row + full));
  m = _mm512_max_ps(_mm512_max_ps(m, m1), _mm512_max_ps(m2, m3));
  const __m512 mc = _mm512_set1_ps(_mm512_reduce_max_ps(m) * c);
  __m512 s = _mm512_setzero_ps();
  for (i = 0; i < end; i += 16) {
    const __mmask16 live = i < full ? (__mmask16)0xFFFF : i == full ? tail : (__mmask16)0;
    __m512 e = _mm512_setzero_ps();
    if (live) {
      e = exp2_512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, row + i), vc, mc));
      e = _mm512_maskz_mov_ps(live, e);
      s = _mm512_add_ps(s, e);
    }
    _mm512_storeu_ps(row + i, e);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(e);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm256_storeu_si256((__m256i*)(hi + i), h);
    if (lo != nullptr)
      _mm256_storeu_si256((__m256i*)(lo + i), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, hf)));
  }
  return 1.0f / _mm512_reduce_add_ps(s);
}

// y[j, :] *= f[j]^2 for rows j < nb, D a multiple of 16.
inline void scale_rows_512(float* y, const float* f, int64_t nb, int64_t d) {
  for (int64_t j = 0; j < nb; ++j) {
    const __m512 f2 = _mm512_set1_ps(f[j] * f[j]);
    for (int64_t k = 0; k < d; k += 16) _mm512_storeu_ps(y + j * d + k, _mm512_mul_ps(_mm512_loadu_ps(y + j * d + k), f2));
  }
}


// col[i] += sum_{j < nb} a[j * lda + i] * z[j * ldz + i], i in [0, m), m a multiple of 16.
inline void add_products_512(const float* a, int64_t lda, const float* z, int64_t ldz, int64_t nb,
                             int64_t m, float* col) {
  for (int64_t i = 0; i < m; i += 16) {
    __m512 acc = _mm512_loadu_ps(col + i);
    for (int64_t j = 0; j < nb; ++j)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j * lda + i), _mm512_loadu_ps(z + j * ldz + i), acc);
    _mm512_storeu_ps(col + i, acc);
  }
}

// Y rows j0..j0+3, dims [dc0 * 16, (dc0 + NDC) * 16): sum over token pairs p <
// np of (a_hi + a_lo)[j, 2p..2p+1] . V[2p..2p+1, dims] (vdpbf16ps); a_hi
// alone unless LO.
template <int NDC, bool LO>
inline void av_bf16(const int32_t* ahi, const int32_t* alo, int64_t lda32, const uint16_t* vp,
                    int64_t nd, int64_t dc0, int64_t np, float* y, int64_t d) {
  __m512 acc[4][NDC];
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < NDC; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    const uint16_t* base = vp + (((p >> 4) * nd + dc0) * 16 + (p & 15)) * 32;
    __m512bh vv[NDC];
    for (int c = 0; c < NDC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(base + c * 512);
    for (int j = 0; j < 4; ++j) {
      const __m512bh h = (__m512bh)_mm512_set1_epi32(ahi[j * lda32 + p]);
      for (int c = 0; c < NDC; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], h, vv[c]);
      if (LO) {
        const __m512bh l = (__m512bh)_mm512_set1_epi32(alo[j * lda32 + p]);
        for (int c = 0; c < NDC; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], l, vv[c]);
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < NDC; ++c) _mm512_storeu_ps(y + j * d + (dc0 + c) * 16, acc[j][c]);
}

// An uninitialised array (every reader below reads only what was written first).
template <typename T>
struct Buf {
  std::unique_ptr<T[]> p;
  explicit Buf(int64_t n) : p(new T[n]) {}
  T* data() { return p.get(); }
  const T* data() const { return p.get(); }
};

// What a thread keeps, reused by its tasks: one (b, h)'s packed keys and
// values, and one row block's tiles.
struct ProjBuffers {
  int64_t n16, n32;
  Buf<uint16_t> keys, vkeys, vpairs;  // [n16/16][D/2][16][2] x2, [n32/32][D/16][16][16][2]
  Buf<float> a, y, z;                 // R x n32 (L, then A), R x D, R x 64 (Z tiles)
  Buf<uint16_t> qb, ahi, alo, yhi, ylo;
  Buf<uint16_t> kst, vst;  // (n, D) staging rows where K and V are read in place
  ProjBuffers(int64_t n, int64_t d, bool paged)
      : n16(round_up(n, 16)), n32(round_up(n, 32)), keys(n16 * d), vkeys(n16 * d), vpairs(n32 * d),
        a(PROJ_ROWS * n32), y(PROJ_ROWS * d), z(PROJ_ROWS * 64), qb(PROJ_ROWS * d),
        ahi(PROJ_ROWS * n32), alo(PROJ_ROWS * n32), yhi(PROJ_ROWS * d), ylo(PROJ_ROWS * d),
        kst(paged ? n * d : 0), vst(paged ? n * d : 0) {}
};

// The row block's queries into b.qb (zero past nb) and each row's horizon.
inline void load_block(const ProjTask& p, int64_t bb, int64_t h, int64_t r0, int64_t nb,
                       ProjBuffers& b, int64_t* vis) {
  std::fill(b.qb.data(), b.qb.data() + PROJ_ROWS * p.d, 0);
  for (int64_t j = 0; j < nb; ++j) {
    const int64_t t = (r0 + j) / p.g, g = (r0 + j) % p.g;
    vis[j] = p.n - p.w + t + 1;
    std::memcpy(b.qb.data() + j * p.d, p.q + ((bb * p.w + t) * p.hq + h * p.g + g) * p.d, p.d * sizeof(uint16_t));
  }
}

// The block's logits rows -> E = exp(scale * (L - row max)), in place, and E
// as bf16 pairs; rows past nb zero. inv[j]: 1 / row j's sum (A = E * inv).
inline void block_softmax(const ProjTask& p, ProjBuffers& b, const int64_t* vis, int64_t nb, int64_t e32,
                          float* inv) {
  for (int64_t j = 0; j < PROJ_ROWS; ++j) {
    float* row = b.a.data() + j * b.n32;
    uint16_t *hi = b.ahi.data() + j * b.n32, *lo = b.alo.data() + j * b.n32;
    if (j < nb) {
      inv[j] = exp_row_512(row, vis[j], e32, p.scale, hi, p.split ? lo : nullptr);
    } else {
      std::fill(row, row + e32, 0.0f);
      std::fill(hi, hi + e32, 0);
      if (p.split) std::fill(lo, lo + e32, 0);
    }
  }
}

// Y = E V for the block's rows (step 3), E as bf16 hi (+ lo where LO).
template <bool LO>
void y_from_e(ProjBuffers& b, int64_t nb, int64_t nd, int64_t e32, int64_t d) {
  const int32_t* ahi = reinterpret_cast<const int32_t*>(b.ahi.data());
  const int32_t* alo = reinterpret_cast<const int32_t*>(b.alo.data());
  for (int64_t j0 = 0; j0 < nb; j0 += 4)
    for (int64_t dc = 0; dc < nd; dc += 4) {
      const int32_t *h32 = ahi + j0 * b.n32 / 2, *l32 = alo + j0 * b.n32 / 2;
      float* y = b.y.data() + j0 * d;
      switch (std::min<int64_t>(4, nd - dc)) {
        case 1: av_bf16<1, LO>(h32, l32, b.n32 / 2, b.vpairs.data(), nd, dc, e32 / 2, y, d); break;
        case 2: av_bf16<2, LO>(h32, l32, b.n32 / 2, b.vpairs.data(), nd, dc, e32 / 2, y, d); break;
        case 3: av_bf16<3, LO>(h32, l32, b.n32 / 2, b.vpairs.data(), nd, dc, e32 / 2, y, d); break;
        default: av_bf16<4, LO>(h32, l32, b.n32 / 2, b.vpairs.data(), nd, dc, e32 / 2, y, d); break;
      }
    }
}

void proj_bf16(const ProjTask& p, int64_t bh, int64_t split, int64_t splits, float* col, ProjBuffers& b) {
  const int64_t d = p.d, hp = d / 2, nd = d / 16, rows = p.w * p.g;
  const int64_t bb = bh / p.h, h = bh % p.h;
  const uint16_t* k = task_rows(p.k, p.pk, bh, h, p.n, d, b.kst.data());
  const uint16_t* v = task_rows(p.v, p.pv, bh, h, p.n, d, b.vst.data());
  pack_keys_dense(k, p.n, b.n16, d, b.keys.data());
  pack_keys_dense(v, p.n, b.n16, d, b.vkeys.data());
  pack_value_pairs(v, p.n, b.n32, d, b.vpairs.data());
  const int32_t* q32 = reinterpret_cast<const int32_t*>(b.qb.data());
  int64_t vis[PROJ_ROWS];
  float inv[PROJ_ROWS];
  for (int64_t r0 = split * PROJ_ROWS; r0 < rows; r0 += splits * PROJ_ROWS) {
    const int64_t nb = std::min(PROJ_ROWS, rows - r0);
    load_block(p, bb, h, r0, nb, b, vis);
    const int64_t bhi = vis[nb - 1], nc = (bhi + 15) / 16, e32 = round_up(bhi, 32);
    for (int64_t half = 0; half < nb; half += ROWS) {  // 1. logits, 8 rows at a time
      float* out = b.a.data() + half * b.n32;
      int64_t c = 0;
      for (; c + 1 < nc; c += 2) dot_bf16<2>(b.keys.data() + c * 16 * d, q32 + half * hp, hp, out + c * 16, b.n32);
      if (c < nc) dot_bf16<1>(b.keys.data() + c * 16 * d, q32 + half * hp, hp, out + c * 16, b.n32);
    }
    block_softmax(p, b, vis, nb, e32, inv);  // 2.
    std::fill(b.y.data(), b.y.data() + PROJ_ROWS * d, 0.0f);  // 3. Y = E V
    if (p.split) y_from_e<true>(b, nb, nd, e32, d);
    else y_from_e<false>(b, nb, nd, e32, d);
    scale_rows_512(b.y.data(), inv, nb, d);  // a * <y, v> = e * <inv^2 E V, v>
    split_bf16(b.y.data(), PROJ_ROWS * d, b.yhi.data(), p.split ? b.ylo.data() : nullptr);
    const int32_t* yh = reinterpret_cast<const int32_t*>(b.yhi.data());
    const int32_t* yl = reinterpret_cast<const int32_t*>(b.ylo.data());
    for (int64_t c = 0; c < nc; c += 2) {  // 4. Z tiles and the products
      const int64_t nc2 = std::min<int64_t>(2, nc - c);
      for (int64_t half = 0; half < nb; half += ROWS) {
        const int32_t* lo = p.split ? yl + half * hp : nullptr;
        if (nc2 == 2) dot_bf16<2>(b.vkeys.data() + c * 16 * d, yh + half * hp, hp, b.z.data() + half * 32, 32, lo);
        else dot_bf16<1>(b.vkeys.data() + c * 16 * d, yh + half * hp, hp, b.z.data() + half * 32, 32, lo);
      }
      add_products_512(b.a.data() + c * 16, b.n32, b.z.data(), 32, nb, nc2 * 16, col + c * 16);
    }
  }
}

#pragma GCC pop_options

// ---------------------------------------------------------------- amx
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")

// The AMX path for head sizes 32 and 64 (KB = D / 32 blocks of 32 dims): the
// Y accumulators (D / 16 tiles) and Y_hi, Y_lo (2 KB tiles) must fit in the
// eight tile registers beside their operands. Tiles as amx_configure sets them:
// 16 rows x 64 bytes each.
template <int KB>
void proj_amx(const ProjTask& p, int64_t bh, int64_t split, int64_t splits, float* col, ProjBuffers& b) {
  constexpr int64_t ND = 2 * KB;
  const int64_t d = p.d, rows = p.w * p.g;
  const int64_t bb = bh / p.h, h = bh % p.h;
  const uint16_t* k = task_rows(p.k, p.pk, bh, h, p.n, d, b.kst.data());
  const uint16_t* v = task_rows(p.v, p.pv, bh, h, p.n, d, b.vst.data());
  pack_keys_dense(k, p.n, b.n16, d, b.keys.data());
  pack_keys_dense(v, p.n, b.n16, d, b.vkeys.data());
  pack_value_pairs(v, p.n, b.n32, d, b.vpairs.data());
  int64_t vis[PROJ_ROWS];
  float inv[PROJ_ROWS];
  amx_configure();
  for (int64_t r0 = split * PROJ_ROWS; r0 < rows; r0 += splits * PROJ_ROWS) {
    const int64_t nb = std::min(PROJ_ROWS, rows - r0);
    load_block(p, bb, h, r0, nb, b, vis);
    const int64_t bhi = vis[nb - 1], nc = (bhi + 15) / 16, e32 = round_up(bhi, 32);
    // 1. logits: tiles 2.. queries, 0/1 logits, 6/7 keys (column_sums' amx_chunk)
    amx_load_queries<KB>(b.qb.data(), d);
    for (int64_t c = 0; c < nc; ++c)
      amx_chunk<KB>(b.keys.data() + c * 16 * d, b.a.data() + c * 16, b.n32 * 4, c);
    block_softmax(p, b, vis, nb, e32, inv);  // 2.
    // 3. Y = E_hi V + E_lo V: tiles 0..ND-1 Y (16 rows x 16 dims), 4 A_hi, 5 A_lo
    // (16 rows x 32 tokens), 6/7 V (16 token pairs x 16 dims x 2)
    _tile_zero(0); _tile_zero(1);
    if (ND > 2) { _tile_zero(2); _tile_zero(3); }
    for (int64_t c32 = 0; c32 < e32 / 32; ++c32) {
      const uint16_t* vp = b.vpairs.data() + c32 * ND * 512;
      _tile_loadd(4, b.ahi.data() + c32 * 32, b.n32 * 2);
      _tile_loadd(5, b.alo.data() + c32 * 32, b.n32 * 2);
      _tile_loadd(6, vp, 64); _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(0, 5, 6);
      _tile_loadd(7, vp + 512, 64); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(1, 5, 7);
      if (ND > 2) {
        _tile_loadd(6, vp + 1024, 64); _tile_dpbf16ps(2, 4, 6); _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, vp + 1536, 64); _tile_dpbf16ps(3, 4, 7); _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, b.y.data(), d * 4);
    _tile_stored(1, b.y.data() + 16, d * 4);
    if (ND > 2) { _tile_stored(2, b.y.data() + 32, d * 4); _tile_stored(3, b.y.data() + 48, d * 4); }
    scale_rows_512(b.y.data(), inv, nb, d);  // a * <y, v> = e * <inv^2 E V, v>
    split_bf16(b.y.data(), PROJ_ROWS * d, b.yhi.data(), b.ylo.data());
    // 4. Z = Y_hi V^T + Y_lo V^T per 16 keys: tiles 2/3 (and 4/5) Y_hi/Y_lo per
    // 32 dims, 0 Z, 6/7 V as keys; then the products into col
    _tile_loadd(2, b.yhi.data(), d * 2);
    _tile_loadd(3, b.ylo.data(), d * 2);
    if (KB > 1) { _tile_loadd(4, b.yhi.data() + 32, d * 2); _tile_loadd(5, b.ylo.data() + 32, d * 2); }
    for (int64_t c0 = 0; c0 < nc; c0 += 4) {  // 4 tiles stored before they are read back
      const int64_t cn = std::min<int64_t>(4, nc - c0);
      for (int64_t c = c0; c < c0 + cn; ++c) {
        const uint16_t* vk = b.vkeys.data() + c * 16 * d;
        _tile_zero(0);
        _tile_loadd(6, vk, 64); _tile_dpbf16ps(0, 2, 6); _tile_dpbf16ps(0, 3, 6);
        if (KB > 1) { _tile_loadd(7, vk + 512, 64); _tile_dpbf16ps(0, 4, 7); _tile_dpbf16ps(0, 5, 7); }
        _tile_stored(0, b.z.data() + (c - c0) * 16, 256);
      }
      add_products_512(b.a.data() + c0 * 16, b.n32, b.z.data(), 64, nb, cn * 16, col + c0 * 16);
    }
  }
  _tile_release();
}

#pragma GCC pop_options

// ---------------------------------------------------------------- avx2
#pragma GCC push_options
#pragma GCC target("avx2,fma")

struct ProjTaskF {
  const void *q, *k, *v;
  int64_t w, hq, h, g, n, d;
  float scale;
  const PagedRows *pk = nullptr, *pv = nullptr;  // K, V read in place instead of k, v
};

// One row of raw (already scaled) logits over [0, vis) -> softmax, normalised,
// in place; [vis, end) zero (end a multiple of 8).
void softmax_row_256(float* l, int64_t vis, int64_t end) {
  const int64_t full = vis / 8 * 8;
  const float inv = exp_row_256(l, vis);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < full; i += 8) _mm256_storeu_ps(l + i, _mm256_mul_ps(_mm256_loadu_ps(l + i), vinv));
  for (int64_t i = full; i < vis; ++i) l[i] *= inv;
  for (int64_t i = vis; i < end; ++i) l[i] = 0.0f;
}

// Rows [0, n) of src (n, D) widened to float32 as [n8/8][D][8], tokens >= n zero.
template <typename T>
void pack_f32_dense(const T* src, int64_t n, int64_t n8, int64_t d, float* out) {
  for (int64_t c = 0; c < n8 / 8; ++c)
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t t = c * 8 + i;
      for (int64_t k = 0; k < d; ++k) out[(c * d + k) * 8 + i] = t < n ? to_float(src[t * d + k]) : 0.0f;
    }
}

template <typename T>
void proj_f32(const ProjTaskF& p, int64_t bh, int64_t split, int64_t splits, float* col) {
  const int64_t d = p.d, rows = p.w * p.g, n = p.n, n16 = round_up(n, 16);  // dot_4x16 takes 16 keys at a time
  const int64_t bb = bh / p.h, h = bh % p.h;
  std::vector<T> kst(p.pk ? n * d : 0), vst(p.pv ? n * d : 0);
  const T* k = task_rows(static_cast<const T*>(p.k), p.pk, bh, h, n, d, kst.data());
  const T* v = task_rows(static_cast<const T*>(p.v), p.pv, bh, h, n, d, vst.data());
  const T* q = static_cast<const T*>(p.q);
  std::vector<float> keys(n16 * d), vkeys(n16 * d), vals(n16 * d, 0.0f);
  pack_f32_dense<T>(k, n, n16, d, keys.data());
  pack_f32_dense<T>(v, n, n16, d, vkeys.data());
  for (int64_t i = 0; i < n * d; ++i) vals[i] = to_float(v[i]);  // (n, D) row-major
  std::vector<float> a(ROWS * n16), y(ROWS * d), qf(ROWS * d);
  int64_t vis[ROWS];
  const __m256 scale = _mm256_set1_ps(p.scale);
  for (int64_t r0 = split * ROWS; r0 < rows; r0 += splits * ROWS) {
    const int64_t nb = std::min<int64_t>(ROWS, rows - r0);
    std::fill(qf.begin(), qf.end(), 0.0f);
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t t = (r0 + j) / p.g, g = (r0 + j) % p.g;
      vis[j] = n - p.w + t + 1;
      const T* src = q + ((bb * p.w + t) * p.hq + h * p.g + g) * d;
      for (int64_t e = 0; e < d; ++e) qf[j * d + e] = to_float(src[e]);
    }
    const int64_t nc = (vis[nb - 1] + 15) / 16, e16 = nc * 16;  // 16-key chunks
    for (int64_t c = 0; c < nc; ++c)  // 1. logits (scaled); a half of zero rows is skipped
      for (int64_t j0 = 0; j0 < nb; j0 += 4)
        logits_4x16(qf.data(), j0, keys.data() + c * 16 * d, d, scale, a.data() + c * 16, n16);
    for (int64_t j = 0; j < ROWS; ++j) {  // 2. softmax; rows past nb zero
      if (j < nb) softmax_row_256(a.data() + j * n16, vis[j], e16);
      else std::fill(a.begin() + j * n16, a.begin() + j * n16 + e16, 0.0f);
    }
    for (int64_t j0 = 0; j0 < ROWS; j0 += 4)  // 3. Y = A V, 4 rows x 16 dims at a time
      for (int64_t d0 = 0; d0 < d; d0 += 16) {
        __m256 ya[4][2];
        for (int j = 0; j < 4; ++j) ya[j][0] = ya[j][1] = _mm256_setzero_ps();
        if (j0 < nb)
          for (int64_t i = 0; i < e16; ++i) {
            const __m256 v0 = _mm256_loadu_ps(vals.data() + i * d + d0);
            const __m256 v1 = _mm256_loadu_ps(vals.data() + i * d + d0 + 8);
            for (int j = 0; j < 4; ++j) {
              const __m256 aj = _mm256_set1_ps(a[(j0 + j) * n16 + i]);
              ya[j][0] = _mm256_fmadd_ps(aj, v0, ya[j][0]);
              ya[j][1] = _mm256_fmadd_ps(aj, v1, ya[j][1]);
            }
          }
        for (int j = 0; j < 4; ++j) {
          _mm256_storeu_ps(y.data() + (j0 + j) * d + d0, ya[j][0]);
          _mm256_storeu_ps(y.data() + (j0 + j) * d + d0 + 8, ya[j][1]);
        }
      }
    for (int64_t c = 0; c < nc; ++c) {  // 4. Z = Y V^T per 16 keys, and the products
      __m256 s0 = _mm256_loadu_ps(col + c * 16), s1 = _mm256_loadu_ps(col + c * 16 + 8);
      for (int64_t j0 = 0; j0 < nb; j0 += 4) {
        __m256 z0[4], z1[4];
        dot_4x16(y.data(), j0, vkeys.data() + c * 16 * d, d, z0, z1);
        for (int64_t j = j0; j < std::min<int64_t>(j0 + 4, nb); ++j) {
          const float* aj = a.data() + j * n16 + c * 16;
          s0 = _mm256_fmadd_ps(_mm256_loadu_ps(aj), z0[j - j0], s0);
          s1 = _mm256_fmadd_ps(_mm256_loadu_ps(aj + 8), z1[j - j0], s1);
        }
      }
      _mm256_storeu_ps(col + c * 16, s0);
      _mm256_storeu_ps(col + c * 16 + 8, s1);
    }
  }
}

#pragma GCC pop_options

// ---------------------------------------------------------------- entry

// The (B, H, n) float32 scores of q (B, w, H_q, D) against n tokens of H KV
// heads whose keys and values are dense (k, v: (B, H, n, D) of `dtype`) or,
// where pk / pv are given, read in place.
at::Tensor run_projection(const at::Tensor& q, at::ScalarType dtype, int64_t h, int64_t n,
                          const void* k, const void* v, const PagedRows* pk, const PagedRows* pv,
                          double scale, const std::string& isa, bool split) {
  TORCH_CHECK(q.dim() == 4 && q.device().is_cpu() && q.is_contiguous(), "q: contiguous CPU (B, w, H_q, D)");
  const int64_t bsz = q.size(0), w = q.size(1), hq = q.size(2), d = q.size(3);
  TORCH_CHECK(h > 0 && hq % h == 0, "head sizes disagree: query heads not a multiple of the KV heads");
  TORCH_CHECK(d % 16 == 0 && d <= 512, "head size: a multiple of 16, at most 512");
  TORCH_CHECK(w >= 1 && n >= w, "the window's w tokens are the last w of the n resident ones");
  TORCH_CHECK(supports(isa), "this CPU cannot run the ", isa, " path");
  const bool amx = isa == "amx", bf16 = amx || isa == "avx512bf16";
  TORCH_CHECK(q.scalar_type() == dtype, "q, k, v: one dtype");
  TORCH_CHECK(!bf16 || dtype == at::kBFloat16, "the ", isa, " path takes bf16 q, k, v");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
              "dtype: bf16, fp16 or float32");
  const int64_t g = hq / h, pairs = bsz * h;
  const int64_t block = bf16 ? PROJ_ROWS : ROWS;
  const int64_t threads = at::get_num_threads();
  const int64_t row_blocks = (w * g + block - 1) / block;
  const int64_t splits = pairs == 0 ? 1 : std::max<int64_t>(1, std::min<int64_t>(row_blocks, (4 * threads + pairs - 1) / pairs));
  at::Tensor out = at::zeros({splits, pairs, n}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int64_t ncol = round_up(n, 32);
  // amx always splits: its tiles have room for both halves (and it is not
  // measured without).
  ProjTask pb{reinterpret_cast<const uint16_t*>(q.data_ptr()), static_cast<const uint16_t*>(k),
              static_cast<const uint16_t*>(v), w, hq, h, g, n, d, static_cast<float>(scale), split || amx,
              pk, pv};
  ProjTaskF pf{q.data_ptr(), k, v, w, hq, h, g, n, d, static_cast<float>(scale), pk, pv};
  at::parallel_for(0, splits * pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> col(ncol);
    std::unique_ptr<ProjBuffers> buffers(bf16 ? new ProjBuffers(n, d, pk != nullptr) : nullptr);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / pairs, bh = i % pairs;
      std::fill(col.begin(), col.end(), 0.0f);
      if (amx && d == 32) proj_amx<1>(pb, bh, s, splits, col.data(), *buffers);
      else if (amx && d == 64) proj_amx<2>(pb, bh, s, splits, col.data(), *buffers);
      else if (bf16) proj_bf16(pb, bh, s, splits, col.data(), *buffers);  // amx CPUs too, past 64 dims
      else if (dtype == at::kBFloat16) proj_f32<at::BFloat16>(pf, bh, s, splits, col.data());
      else if (dtype == at::kHalf) proj_f32<at::Half>(pf, bh, s, splits, col.data());
      else proj_f32<float>(pf, bh, s, splits, col.data());
      std::memcpy(o + i * n, col.data(), n * sizeof(float));
    }
  });
  return (splits == 1 ? out[0] : out.sum(0)).view({bsz, h, n});
}

// (B, w, H_q, D) queries, (B, H, n, D) keys and values -> (B, H, n) float32
// AnDPro raw scores (see the top of this file). The bf16 paths take bf16
// tensors; avx2 takes bf16, fp16 or float32, all three of one dtype.
at::Tensor window_projection_sums(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  double scale, const std::string& isa, bool split) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(), "q (B, w, H_q, D), k and v (B, H, n, D)");
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "contiguous k and v");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), "head sizes disagree");
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "q, k, v: one dtype");
  return run_projection(q, k.scalar_type(), k.size(1), k.size(2), k.data_ptr(), v.data_ptr(), nullptr,
                        nullptr, scale, isa, split);
}

// The same scores with K and V read in place from the paged CPU cache:
// key_cache / value_cache [NB, H, BS, D] (KVLayout.split), their element
// offsets (H, BS, D) int64 (KVLayout.element_offsets), and slots (B, H, n)
// int64, each row's tokens oldest first (as read_tokens). No (B, H, n, D)
// copy of K or V is made: each (b, h) task reads its tokens into a thread's
// staging rows. Bit for bit the dense function's result on read_tokens' K, V.
at::Tensor window_projection_paged(const at::Tensor& q, const at::Tensor& key_cache,
                                   const at::Tensor& value_cache, const at::Tensor& k_offsets,
                                   const at::Tensor& v_offsets, const at::Tensor& slots, double scale,
                                   const std::string& isa, bool split) {
  TORCH_CHECK(key_cache.device().is_cpu() && value_cache.device().is_cpu(), "CPU caches");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "key_cache and value_cache: [NB, H, BS, D]");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "q, k, v: one dtype");
  token_moves::check_offsets(k_offsets, key_cache);
  token_moves::check_offsets(v_offsets, value_cache);
  const int64_t h = key_cache.size(1), bs = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == q.size(3), "head sizes disagree");
  token_moves::check_slots(slots, key_cache);
  TORCH_CHECK(slots.size(0) == q.size(0), "slots: one row of (H, n) per query row");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const PagedRows pk{key_cache.data_ptr(), key_cache.stride(0), bs, k_offsets.data_ptr<int64_t>(),
                     token_moves::token_map(k_offsets), sl};
  const PagedRows pv{value_cache.data_ptr(), value_cache.stride(0), bs, v_offsets.data_ptr<int64_t>(),
                     token_moves::token_map(v_offsets), sl};
  return run_projection(q, key_cache.scalar_type(), h, slots.size(2), nullptr, nullptr, &pk, &pv, scale,
                        isa, split);
}
