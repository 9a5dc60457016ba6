// The fused pass on AMX tiles, on vLLM's bf16 amx layout (included by
// fused_attention.h; the `amx` path of attend_add_column_sums).
//
// vLLM attends with AMX tiles on AMX CPUs; the AVX-512 BF16 tasks took
// 1.35-1.84x its time on decode rows there and 4x on prompt chunks. Here a
// task's query rows, up to 16 at a time (a decode row's G heads; a prompt
// chunk's rows in token order), take both products as tile products, as in
// vLLM's kernel:
//
//   logits  C (rows x 16 keys) += Q (rows x 32 dims) K (16 dim pairs x 16 keys x 2)
//           K's amx layout, [BS/16][D/2][16][2], is that operand as stored
//   P V     C (rows x 16 dims) += P (rows x 32 tokens) V (16 token pairs x 16 dims x 2)
//           V's amx layout, [D/16][BS/2][16][2], is that operand as stored
//
// Between them, as on the other paths: exps and their sums in float32 (each
// row to its own causal horizon), the scored rows' column sums from the
// float32 probabilities. Precision: logits float32-accurate (bf16 products
// exact, float32 sums); P rounded to bf16 (RNE) for the tile product, as
// vLLM's amx kernel rounds it; P V summed in float32, scaled by 1 / sum in
// float32 and rounded to bf16 once. The last 32-token group of a block of
// rows reads its values through a copy with the slots past the rows' last
// key zeroed: those slots are unwritten (0 x NaN is NaN).
//
// Tiles: 0-3 queries (one per 32 dims) while the logits run, then P V's
// accumulators (four 16-dim blocks at a time); 4 and 7 two chunks' logits,
// then 4 holds P; 5 and 6 keys or values. Rows: the block's on 0-4 and 7
// (configured again when a block's row count changes), 16 on 5 and 6.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")

namespace fused {

inline void amx_configure_rows(int rows) {
  TileConfig cfg;
  for (int t : {0, 1, 2, 3, 4, 7}) { cfg.rows[t] = rows; cfg.colsb[t] = 64; }
  for (int t : {5, 6}) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  // GCC drops these stores as dead (ldtilecfg is not seen to read them):
  // a compiler barrier keeps them
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

inline void amx_release() { _tile_release(); }

template <int KB>  // KB = D / 32 query tiles
inline void amx_decode_logits(const Work& w, int64_t r, int64_t h, int64_t n32, const uint16_t* qb,
                              int64_t d, float* l, int64_t ld) {
  _tile_loadd(0, qb, d * 2);
  if (KB > 1) _tile_loadd(1, qb + 32, d * 2);
  if (KB > 2) _tile_loadd(2, qb + 64, d * 2);
  if (KB > 3) _tile_loadd(3, qb + 96, d * 2);
  // two 16-key chunks in flight (logits in 4 and 7, keys in 5 and 6): tiles
  // are not renamed, so one chunk alone would wait on every load and product
  for (int64_t t = 0; t < n32; t += 32) {  // a 32-token group lies in one block
    const uint16_t* ka = reinterpret_cast<const uint16_t*>(key_base<at::BFloat16>(w, r, h, t)) +
                         w.tiles.tok[t % w.bs];
    const uint16_t* kb = ka + 16 * d;  // the next 16 tokens: [BS/16][D/2][16][2]
    _tile_zero(4);
    _tile_zero(7);
    _tile_loadd(5, ka, 64); _tile_loadd(6, kb, 64);
    _tile_dpbf16ps(4, 0, 5); _tile_dpbf16ps(7, 0, 6);
    if (KB > 1) {
      _tile_loadd(5, ka + 512, 64); _tile_loadd(6, kb + 512, 64);
      _tile_dpbf16ps(4, 1, 5); _tile_dpbf16ps(7, 1, 6);
    }
    if (KB > 2) {
      _tile_loadd(5, ka + 1024, 64); _tile_loadd(6, kb + 1024, 64);
      _tile_dpbf16ps(4, 2, 5); _tile_dpbf16ps(7, 2, 6);
    }
    if (KB > 3) {
      _tile_loadd(5, ka + 1536, 64); _tile_loadd(6, kb + 1536, 64);
      _tile_dpbf16ps(4, 3, 5); _tile_dpbf16ps(7, 3, 6);
    }
    _tile_stored(4, l + t, ld * 4);
    _tile_stored(7, l + t + 16, ld * 4);
  }
}

struct AmxScratch {
  std::vector<float> logits;
  std::vector<uint16_t> pb, qb;
  std::vector<int64_t> tok, head, vis;
  int rows = 0;  // the rows the tiles are configured for (a decode row's G heads: G)
};

// Up to 16 query rows of task t (row j: token tok[j], query head head[j],
// keys [0, vis[j])): logits, exps, column sums (into the scores at the row's
// slots where the task is `direct`, else into `col`), P V into `out`.
void amx_block(const Work& w, const at::Tensor& vc, const Batch& b, const Task& t,
               const int64_t* tok, const int64_t* head, const int64_t* vis, int64_t nb,
               const uint16_t* q, uint16_t* out, float* col, AmxScratch& s) {
  const int64_t d = b.d;
  const int64_t top = *std::max_element(vis, vis + nb);
  const int64_t n32 = (top + 31) / 32 * 32;  // within the row's blocks: BS is a multiple of 32
  if (s.rows != nb) {  // fewer rows, fewer tile operations: a decode row has G
    amx_configure_rows(int(nb));
    s.rows = int(nb);
  }
  s.logits.resize(nb * n32);
  s.pb.resize(nb * n32);
  s.qb.resize(nb * d);
  float inv[16];
  for (int64_t j = 0; j < nb; ++j) std::memcpy(&s.qb[j * d], q + tok[j] * b.qs0 + head[j] * b.qs1, d * 2);
  float* l = s.logits.data();
  switch (d / 32) {
    case 1: amx_decode_logits<1>(w, t.r, t.h, n32, s.qb.data(), d, l, n32); break;
    case 2: amx_decode_logits<2>(w, t.r, t.h, n32, s.qb.data(), d, l, n32); break;
    case 3: amx_decode_logits<3>(w, t.r, t.h, n32, s.qb.data(), d, l, n32); break;
    default: amx_decode_logits<4>(w, t.r, t.h, n32, s.qb.data(), d, l, n32); break;
  }
  exp_rows_512(l, n32, vis, nb, n32, w.scale, inv);  // zero past each row's horizon, up to n32
  if (t.direct)  // into the scores at the row's slots, a block at a time
    for (int64_t i0 = 0; i0 < n32; i0 += b.bs)
      add_rows_512(l + i0, n32, inv, nb, std::min(b.bs, n32 - i0),
                   b.scores + t.h * b.slots + b.blocks[t.r * b.nblk + i0 / b.bs] * b.bs);
  else if (col != nullptr)  // the task's buffer holds its keys rounded up to 16
    add_rows_512(l, n32, inv, nb, (top + 15) / 16 * 16, col);
  for (int64_t j = 0; j < nb; ++j)  // P in bf16, 32 tokens a row of the A tile
    for (int64_t i = 0; i < n32; i += 32) {
      const __m512bh p2 = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(l + j * n32 + i + 16),
                                              _mm512_loadu_ps(l + j * n32 + i));
      _mm512_storeu_si512(&s.pb[j * n32 + i], (__m512i)p2);
    }
  const uint16_t* cache = reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>());
  alignas(64) uint16_t tail[512];  // a last partial group's values, unwritten slots zeroed
  alignas(64) float acc[4][16 * 16];
  for (int64_t c0 = 0; c0 < d / 16; c0 += 4) {
    const int nc = int(std::min<int64_t>(4, d / 16 - c0));
    _tile_zero(0);  // tile numbers are immediates
    if (nc > 1) _tile_zero(1);
    if (nc > 2) _tile_zero(2);
    if (nc > 3) _tile_zero(3);
    for (int64_t i = 0; i < n32; i += 32) {
      const uint16_t* blk = cache + b.blocks[t.r * b.nblk + i / b.bs] * vc.stride(0) +
                            t.h * vc.stride(1) + (i % b.bs) * 16;
      _tile_loadd(4, s.pb.data() + i, n32 * 2);
      const int64_t m = std::min<int64_t>(32, top - i);
      for (int c = 0; c < nc; ++c) {
        const uint16_t* src = blk + (c0 + c) * b.bs * 16;
        if (m < 32) {
          std::memset(tail, 0, sizeof(tail));
          std::memcpy(tail, src, (m / 2) * 64);
          if (m % 2)  // the last pair's low halves only
            for (int k = 0; k < 16; ++k) tail[(m / 2) * 32 + 2 * k] = src[(m / 2) * 32 + 2 * k];
          src = tail;
        }
        switch (c) {  // values alternate between tiles 5 and 6
          case 0: _tile_loadd(5, src, 64); _tile_dpbf16ps(0, 4, 5); break;
          case 1: _tile_loadd(6, src, 64); _tile_dpbf16ps(1, 4, 6); break;
          case 2: _tile_loadd(5, src, 64); _tile_dpbf16ps(2, 4, 5); break;
          default: _tile_loadd(6, src, 64); _tile_dpbf16ps(3, 4, 6); break;
        }
      }
    }
    if (nc > 0) _tile_stored(0, acc[0], 64);
    if (nc > 1) _tile_stored(1, acc[1], 64);
    if (nc > 2) _tile_stored(2, acc[2], 64);
    if (nc > 3) _tile_stored(3, acc[3], 64);
    for (int64_t j = 0; j < nb; ++j) {
      uint16_t* dst = out + (tok[j] * b.hq + head[j]) * d + c0 * 16;
      const __m512 sc = _mm512_set1_ps(inv[j]);
      for (int c = 0; c < nc; ++c) {
        const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc[c] + j * 16), sc));
        std::memcpy(dst + c * 16, &o, 32);
      }
    }
  }
}

// A task on tiles: a decode row's G heads as one block of rows, or a prompt
// chunk's rows (task_rows: its split's rows, in token order) 16 at a time.
void run_task_amx(const Work& w, const at::Tensor& vc, const Batch& b, const Task& t,
                  const uint16_t* q, uint16_t* out, float* col, AmxScratch& s) {
  const int64_t g = b.g, len = b.starts[t.r + 1] - b.starts[t.r];
  if (len == 1 && t.splits == 1) {
    int64_t tok[16], head[16], vis[16];
    for (int64_t j = 0; j < g; ++j) {
      tok[j] = b.starts[t.r];
      head[j] = t.h * g + j;
      vis[j] = b.seq[t.r];
    }
    amx_block(w, vc, b, t, tok, head, vis, g, q, out, col, s);
    return;
  }
  task_rows(b, t, s.tok, s.head, s.vis);
  for (size_t j = 0; j < s.tok.size(); j += 16)
    amx_block(w, vc, b, t, &s.tok[j], &s.head[j], &s.vis[j],
              std::min<int64_t>(16, s.tok.size() - j), q, out, col, s);
}

}  // namespace fused

#pragma GCC pop_options
