// PROTOTYPE (not wired into the plugin): causal attention and H2O column sums
// in one pass over bf16 logits, for one request's prefill chunk of nq queries
// over n keys (query t sees n - nq + 1 + t keys). Dense per-head K, V.
//   q: (nq, Hq, D) bf16; k, v: (H, n, D) bf16  ->  out (nq, Hq, D) bf16, col (H, n) f32
// Logits: vdpbf16ps (bf16 products exact, float32 accumulation); softmax and
// P V in float32 (V widened), output rounded to bf16 (RNE).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace {
constexpr int ROWS = 8;

inline __m512 exp2_512(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-150.0f));
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

template <int NC>
inline void dot_bf16(const uint16_t* kc, const int32_t* qp, int64_t hp, float* out, int64_t ld) {
  __m512 acc[ROWS][NC];
  for (int j = 0; j < ROWS; ++j)
    for (int c = 0; c < NC; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < hp; ++p) {
    __m512bh kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kc + c * 16 * 2 * hp + p * 32);
    for (int j = 0; j < ROWS; ++j) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(qp[j * hp + p]);
      for (int c = 0; c < NC; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], qv, kv[c]);
    }
  }
  for (int j = 0; j < ROWS; ++j)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + j * ld + c * 16, acc[j][c]);
}

// rows -> exp(scale (l - max)) in place (zero past vis, up to n16); inv[j] = 1 / row sum
void softmax_rows(float* l, int64_t ld, const int64_t* vis, int64_t nb, int64_t n16, float scale,
                  float* inv) {
  const float c = scale * 1.44269504088896341f;
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
      __m512 e = _mm512_maskz_mov_ps(tail, exp2_512(_mm512_fmsub_ps(_mm512_loadu_ps(row + full), vc, mc)));
      _mm512_storeu_ps(row + full, e);
      s = _mm512_add_ps(s, e);
      i += 16;
    }
    for (; i < n16; i += 16) _mm512_storeu_ps(row + i, _mm512_setzero_ps());
    inv[j] = 1.0f / _mm512_reduce_add_ps(s);
  }
}

// out rows = inv * sum_i p[j, i] v_i for JN rows (exps past a row's horizon are 0)
template <int JN>
inline void pv_rows(const float* p, int64_t ld, const int64_t* vis, const float* inv, const float* vh,
                    int64_t d, uint16_t* od, const int64_t* ts, const int64_t* heads, int64_t hq) {
  int64_t top = 0;
  for (int jj = 0; jj < JN; ++jj) top = std::max(top, vis[jj]);
  __m512 acc[JN][4];
  for (int jj = 0; jj < JN; ++jj)
    for (int cc = 0; cc < 4; ++cc) acc[jj][cc] = _mm512_setzero_ps();
  for (int64_t i = 0; i < top; ++i) {
    const float* vr = vh + i * d;
    const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16),
                 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
    for (int jj = 0; jj < JN; ++jj) {
      const __m512 b = _mm512_set1_ps(p[jj * ld + i]);
      acc[jj][0] = _mm512_fmadd_ps(b, v0, acc[jj][0]);
      acc[jj][1] = _mm512_fmadd_ps(b, v1, acc[jj][1]);
      acc[jj][2] = _mm512_fmadd_ps(b, v2, acc[jj][2]);
      acc[jj][3] = _mm512_fmadd_ps(b, v3, acc[jj][3]);
    }
  }
  for (int jj = 0; jj < JN; ++jj) {
    uint16_t* dst = od + (ts[jj] * hq + heads[jj]) * d;
    const __m512 s = _mm512_set1_ps(inv[jj]);
    for (int cc = 0; cc < 4; ++cc) {
      __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[jj][cc], s));
      std::memcpy(dst + cc * 16, &b, 32);
    }
  }
}

}  // namespace

std::vector<at::Tensor> attend_sums(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    double scale) {
  const int64_t nq = q.size(0), hq = q.size(1), d = q.size(2), h = k.size(0), n = k.size(1);
  const int64_t g = hq / h, hp = d / 2, n16 = (n + 15) / 16 * 16;
  TORCH_CHECK(d == 64, "prototype: D = 64");
  at::Tensor out = at::empty({nq, hq, d}, q.options());
  // packed keys [H][n16/16][D/2][16][2], float values [H][n16][D]
  std::vector<uint16_t> kp(h * n16 * d, 0);
  std::vector<float> vf(h * n16 * d, 0.0f);
  const uint16_t* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  at::parallel_for(0, h, 1, [&](int64_t b, int64_t e) {
    for (int64_t hh = b; hh < e; ++hh)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t kk = 0; kk < d; ++kk) {
          kp[hh * n16 * d + (t / 16) * 16 * d + (kk / 2) * 32 + (t % 16) * 2 + kk % 2] = kd[(hh * n + t) * d + kk];
          uint32_t bits = uint32_t(vd[(hh * n + t) * d + kk]) << 16;
          std::memcpy(&vf[(hh * n16 + t) * d + kk], &bits, 4);
        }
  });
  const int64_t row_blocks = (nq * g + ROWS - 1) / ROWS;
  const int64_t threads = at::get_num_threads();
  std::vector<float> cols(threads * h * n16, 0.0f);
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, h * row_blocks, 1, [&](int64_t begin, int64_t end) {
    float* col0 = cols.data() + at::get_thread_num() * h * n16;
    std::vector<float> logits(ROWS * n16);
    std::vector<int32_t> qp(ROWS * hp);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t hh = task % h, rb = task / h;
      int64_t ts[ROWS], heads[ROWS], vis[ROWS];
      int64_t nb = 0, bhi = 0;
      std::fill(qp.begin(), qp.end(), 0);
      for (int64_t x = rb * ROWS; x < std::min((rb + 1) * ROWS, nq * g); ++x, ++nb) {
        ts[nb] = x / g; heads[nb] = hh * g + x % g; vis[nb] = n - nq + 1 + ts[nb];
        std::memcpy(&qp[nb * hp], qd + (ts[nb] * hq + heads[nb]) * d, d * 2);
        bhi = std::max(bhi, vis[nb]);
      }
      const int64_t nc = (bhi + 15) / 16;
      const uint16_t* kh = kp.data() + hh * n16 * d;
      int64_t c = 0;
      for (; c + 1 < nc; c += 2) dot_bf16<2>(kh + c * 16 * d, qp.data(), hp, logits.data() + c * 16, n16);
      if (c < nc) dot_bf16<1>(kh + c * 16 * d, qp.data(), hp, logits.data() + c * 16, n16);
      float inv[ROWS];
      softmax_rows(logits.data(), n16, vis, nb, nc * 16, (float)scale, inv);
      float* col = col0 + hh * n16;
      for (int64_t i = 0; i < nc * 16; i += 16) {
        __m512 acc = _mm512_loadu_ps(col + i);
        for (int64_t j = 0; j < nb; ++j)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(logits.data() + j * n16 + i), _mm512_set1_ps(inv[j]), acc);
        _mm512_storeu_ps(col + i, acc);
      }
      // P V, four rows at a time: each value row loaded once per four queries
      const float* vh = vf.data() + hh * n16 * d;
      int64_t j0 = 0;
      for (; j0 + 4 <= nb; j0 += 4) pv_rows<4>(logits.data() + j0 * n16, n16, vis + j0, inv + j0, vh, d, od, ts + j0, heads + j0, hq);
      for (; j0 < nb; ++j0) pv_rows<1>(logits.data() + j0 * n16, n16, vis + j0, inv + j0, vh, d, od, ts + j0, heads + j0, hq);
    }
  });
  at::Tensor col = at::zeros({h, n}, at::TensorOptions().dtype(at::kFloat));
  float* cp = col.data_ptr<float>();
  for (int64_t th = 0; th < threads; ++th)
    for (int64_t hh = 0; hh < h; ++hh)
      for (int64_t t = 0; t < n; ++t) cp[hh * n + t] += cols[(th * h + hh) * n16 + t];
  return {out, col};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("attend_sums", &attend_sums); }
