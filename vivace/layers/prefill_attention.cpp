// Causal prefill attention on AVX-512 (or AVX2), flash style, reading K/V straight from the
// paged cache.
//
// Registers vivace::paged_prefill_attention(q, kv_cache, block_table, seq_len, scale): q is
// [q_len, heads, head_dim], the last q_len positions of a seq_len-token sequence whose keys and
// values sit in the blocks block_table lists of kv_cache [2, num_blocks, block_size, kv_heads,
// head_dim]. Query j (position seq_len - q_len + j) sees keys 0..its position.
//
// Plan: (1) pack each kv head's keys, transposed, into float32 chunks of 64 keys [head_dim][64]
// and its values into float32 rows [key][head_dim] (one pass over the cache, no gather copy
// through PyTorch); (2) one task per (kv head, block of query positions) holding every query head
// of that kv head's group as its rows, so each K/V chunk is read once for the whole group. For
// each 64-key chunk at or left of the block's diagonal: scores S = Q Kt (rows x 16-key tiles,
// 16 keys per vector, each sum in the decode kernel's order), an online softmax per row (running
// max and sum, base 2: Q is prescaled by scale * log2 e), then O = O * alpha + P V. On AVX-512 the
// arithmetic is attention_math.h's, shared with the decode kernel: a row gets the same bits from
// either (the AVX2 twins below keep their own order: there the two kernels agree to tolerance only).
// Chunks right of the diagonal are never touched; the diagonal chunk is computed only as far as
// the tile's last row sees and masked per row. Tasks are balanced over threads by their cost.
// Scores, softmax and accumulators are float32 whatever the dtypes; the cache may be narrower
// than q (float32 queries over a float16 or bfloat16 cache, as the decode kernel takes them).
// On a CPU with AVX2 only (the SIMDe build) the tiles, softmax and packing are their 256-bit
// twins below (#else of VIVACE_SIMDE); the plan, tasks and results are the same.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_math.h"
#include "simd.h"

namespace {

using namespace vivace_simd;

using vivace_attention::BK;      // keys per chunk
constexpr int TARGET_ROWS = 48;  // query rows (positions x group) per task

struct Problem {
  int64_t q_len, seq_len, heads, kv_heads, group, block_size, num_chunks;
  float scale;
};

struct Scratch {
  std::vector<float> q, s, o, m, l, alpha;
  std::vector<int64_t> pos;

  // For the task (kv head h, positions [p0, p0 + np)): its query rows (row p * group + g) in
  // float32, prescaled by scale * log2 e, with their positions; accumulators cleared (max -inf,
  // sums 0).
  template <typename T>
  void start(const T* queries, int64_t q_stride, int64_t h, int64_t p0, int64_t np, const Problem& t, int64_t D) {
    const int64_t G = t.group, rows = np * G, first = t.seq_len - t.q_len;
    const float qscale = vivace_attention::query_scale(t.scale);
    q.resize(rows * D);
    pos.resize(rows);
    for (int64_t p = 0; p < np; ++p) {
      const T* src = queries + (p0 + p) * q_stride + h * G * D;
      for (int64_t g = 0; g < G; ++g) {
        pos[p * G + g] = first + p0 + p;
        for (int64_t i = 0; i < D; ++i) q[(p * G + g) * D + i] = static_cast<float>(src[g * D + i]) * qscale;
      }
    }
    s.resize(rows * BK);
    o.assign(rows * D, 0.0f);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.0f);
    alpha.resize(rows);
  }
};

#ifndef VIVACE_SIMDE
// s[r][0 .. 16C) = q[r] . kt[:, 0 .. 16C) for R rows, each sum in the decode kernel's order
// (attention_math.h): lane l's products (dims l, 16 + l, ...) chained per key, the 16 chains added by
// lane_tree. Two chains at a time (l and l + 2, which the tree adds first), C key vectors each.
template <int ND, int R, int C>
void score_tile(const float* q, const float* kt, float* s) {
  constexpr int D = 16 * ND;
  __m512 quarter[4][R][C];
  for (int j = 0; j < 4; ++j) {
    __m512 half[2][R][C];
    for (int h = 0; h < 2; ++h) {
      const int a = 4 * j + h;  // lanes a and a + 2
      __m512 pa[R][C], pb[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) pa[r][c] = pb[r][c] = _mm512_setzero_ps();
      for (int i = 0; i < ND; ++i) {
        __m512 ka[C], kb[C];
        for (int c = 0; c < C; ++c) {
          ka[c] = _mm512_loadu_ps(kt + (16 * i + a) * BK + 16 * c);
          kb[c] = _mm512_loadu_ps(kt + (16 * i + a + 2) * BK + 16 * c);
        }
        for (int r = 0; r < R; ++r) {
          const __m512 qa = _mm512_set1_ps(q[r * D + 16 * i + a]), qb = _mm512_set1_ps(q[r * D + 16 * i + a + 2]);
          for (int c = 0; c < C; ++c) {
            pa[r][c] = _mm512_fmadd_ps(qa, ka[c], pa[r][c]);
            pb[r][c] = _mm512_fmadd_ps(qb, kb[c], pb[r][c]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) half[h][r][c] = _mm512_add_ps(pa[r][c], pb[r][c]);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) quarter[j][r][c] = _mm512_add_ps(half[0][r][c], half[1][r][c]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(s + r * BK + 16 * c, _mm512_add_ps(_mm512_add_ps(quarter[0][r][c], quarter[1][r][c]),
                                                          _mm512_add_ps(quarter[2][r][c], quarter[3][r][c])));
}

using ScoreTile = void (*)(const float*, const float*, float*);

// Rows of a score tile: 4 x 2 key vectors keep 16 chains in flight and stay fma-bound.
constexpr int RS = 4;

template <int ND, int C>
ScoreTile score_tile_for(int r) {
  switch (r) {
    case 1: return score_tile<ND, 1, C>;
    case 2: return score_tile<ND, 2, C>;
    case 3: return score_tile<ND, 3, C>;
    default: return score_tile<ND, 4, C>;
  }
}

// Scores of R rows over the chunk's first n keys (whole vectors of 16), two vectors per tile.
template <int ND>
void score_rows(int64_t R, int64_t n, const float* q, const float* kt, float* s) {
  const int64_t nv = (n + 15) / 16;
  int64_t v = 0;
  for (; v + 2 <= nv; v += 2) score_tile_for<ND, 2>(R)(q, kt + 16 * v, s + 16 * v);
  if (v < nv) score_tile_for<ND, 1>(R)(q, kt + 16 * v, s + 16 * v);
}

// o[r] = o[r] * alpha[r] + sum_{k < n} p[r][k] v[k] for R rows; p rows of BK, v[k] and o rows of 16 ND.
template <int ND, int R>
void value_tile(const float* p, const float* const* v, int64_t n, const float* alpha, float* o) {
  constexpr int D = 16 * ND;
  __m512 acc[R][ND];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int i = 0; i < ND; ++i) acc[r][i] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * i), a);
  }
  for (int64_t k = 0; k < n; ++k) {
    __m512 w[R];
    for (int r = 0; r < R; ++r) w[r] = _mm512_set1_ps(p[r * BK + k]);
    for (int i = 0; i < ND; ++i) {
      const __m512 x = _mm512_loadu_ps(v[k] + 16 * i);
      for (int r = 0; r < R; ++r) acc[r][i] = _mm512_fmadd_ps(w[r], x, acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < ND; ++i) _mm512_storeu_ps(o + r * D + 16 * i, acc[r][i]);
}

using ValueTile = void (*)(const float*, const float* const*, int64_t, const float*, float*);

template <int ND>
constexpr int value_rows() { return std::min(8, 24 / ND); }  // accumulators: at most 24 registers

template <int ND>
ValueTile value_tile_for(int r) {
  switch (std::min(r, value_rows<ND>())) {
    case 1: return value_tile<ND, 1>;
    case 2: return value_tile<ND, 2>;
    case 3: return value_tile<ND, std::min(3, value_rows<ND>())>;
    case 4: return value_tile<ND, std::min(4, value_rows<ND>())>;
    case 5: return value_tile<ND, std::min(5, value_rows<ND>())>;
    case 6: return value_tile<ND, std::min(6, value_rows<ND>())>;
    case 7: return value_tile<ND, std::min(7, value_rows<ND>())>;
    default: return value_tile<ND, value_rows<ND>()>;
  }
}

// One task: kv head h, query positions [p0, p0 + np). Rows are position-major (row = p * group + g),
// so a row's position never decreases with its index.
template <typename T, int ND>
void attend_block(const T* q, int64_t q_stride, T* out, const float* kt_all, const float* const* v_all, int64_t h,
                  int64_t p0, int64_t np, const Problem& s, Scratch& w) {
  constexpr int D = 16 * ND;
  constexpr int RV = value_rows<ND>();
  const int64_t G = s.group, rows = np * G;
  w.start(q, q_stride, h, p0, np, s, D);
  const int64_t* pos = w.pos.data();
  float *Q = w.q.data(), *S = w.s.data(), *O = w.o.data(), *M = w.m.data(), *L = w.l.data(), *A = w.alpha.data();
  const int64_t last_chunk = pos[rows - 1] / BK;
  for (int64_t c = 0; c <= last_chunk; ++c) {
    const int64_t k0 = c * BK;
    const float* kt = kt_all + (h * s.num_chunks + c) * D * BK;
    const float* const* vv = v_all + (h * s.num_chunks + c) * BK;
    for (int64_t r0 = 0; r0 < rows; r0 += RS) {
      const int64_t R = std::min<int64_t>(RS, rows - r0);
      const int64_t n = std::min<int64_t>(BK, pos[r0 + R - 1] - k0 + 1);
      if (n > 0) score_rows<ND>(R, n, Q + r0 * D, kt, S + r0 * BK);
    }
    for (int64_t r = 0; r < rows; ++r)  // a row that sees none of the chunk: alpha 1, zeros for a tile that spans it
      A[r] = vivace_attention::softmax_chunk(S + r * BK, 0, pos[r] - k0 + 1, M[r], L[r]);
    for (int64_t r0 = 0; r0 < rows; r0 += RV) {
      const int64_t R = std::min<int64_t>(RV, rows - r0);
      const int64_t n = std::min<int64_t>(BK, pos[r0 + R - 1] - k0 + 1);
      if (n > 0) value_tile_for<ND>(static_cast<int>(R))(S + r0 * BK, vv, n, A + r0, O + r0 * D);
    }
  }
  for (int64_t p = 0; p < np; ++p) {
    T* dst = out + (p0 + p) * s.heads * D + h * G * D;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = p * G + g;
      const __m512 inv = _mm512_set1_ps(1.0f / L[r]);
      for (int i = 0; i < ND; ++i) store16(dst + g * D + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(O + r * D + 16 * i), inv));
    }
  }
}

// Transpose 16 rows of 16 floats in registers: r[j] becomes column j.
inline void transpose16(__m512* r) {
  __m512 t[16], c[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // c[4g + k]: lane L holds column 4L + k of rows 4g .. 4g + 3.
  for (int g = 0; g < 4; ++g) {
    const __m512d lo01 = _mm512_castps_pd(t[4 * g]), hi01 = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d lo23 = _mm512_castps_pd(t[4 * g + 2]), hi23 = _mm512_castps_pd(t[4 * g + 3]);
    c[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo01, lo23));
    c[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo01, lo23));
    c[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi01, hi23));
    c[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi01, hi23));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 x = _mm512_shuffle_f32x4(c[k], c[4 + k], 0x88), y = _mm512_shuffle_f32x4(c[k], c[4 + k], 0xDD);
    const __m512 x2 = _mm512_shuffle_f32x4(c[8 + k], c[12 + k], 0x88), y2 = _mm512_shuffle_f32x4(c[8 + k], c[12 + k], 0xDD);
    r[k] = _mm512_shuffle_f32x4(x, x2, 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(x, x2, 0xDD);
    r[4 + k] = _mm512_shuffle_f32x4(y, y2, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(y, y2, 0xDD);
  }
}

// Keys ks[0 .. present) of kPackKeys, D values each, transposed into kt[d][0 .. kPackKeys)
// (rows BK apart), zeros for the missing keys; and one row widened to float32.
constexpr int64_t kPackKeys = 16;

template <typename T>
void transpose_keys(const T* const* ks, int64_t present, int64_t D, float* kt) {
  for (int64_t i = 0; i < D / 16; ++i) {  // 16 keys x 16 dims at a time, transposed in registers
    __m512 r[16];
    for (int64_t u = 0; u < 16; ++u) r[u] = u < present ? load16(ks[u] + 16 * i) : _mm512_setzero_ps();
    transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_storeu_ps(kt + (16 * i + j) * BK, r[j]);
  }
}

template <typename T>
void widen_row(const T* src, int64_t D, float* dst) {
  for (int64_t i = 0; i < D / 16; ++i) _mm512_storeu_ps(dst + 16 * i, load16(src + 16 * i));
}
#else
// AVX2 (the SIMDe build). The code above holds up to 24 __m512 accumulators, pairs of the 16 ymm
// registers: through SIMDe it spilled and ran slower than PyTorch's attention. Here the same
// plan in native 256-bit code, tiles sized for 16 registers: scores 6 rows x 16 keys (12
// accumulators), values 6 rows x 16 dims, the softmax 8 lanes at a time.
constexpr int RT = 6;  // query rows per score and value tile

// 2^x for x <= 0: exp2_ps's reduction and polynomial on 8 lanes, 2^floor(x) built in the
// exponent bits (floor(x) >= -126 after the clamp).
inline __m256 exp2_8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_floor_ps(x);
  const __m256 r = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.8762329127639532e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.99258442223072e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.582360550761223e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.4015453457832336e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.931529641151428e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.999999403953552e-1f));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
}

// Lanes [0, n) of 8 set (all of them for n >= 8).
inline __m256 lanes8(int64_t n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// s[r][0 .. 16) = q[r] . kt[:, 0 .. 16) for R rows; q rows of D floats, kt [D][BK], s rows of BK.
// (Two arrays of R accumulators, not one of 2R: GCC keeps an array of up to 256 bytes in
// registers, and stored a larger one to the stack on every iteration, at half the speed.)
template <int R>
void score_tile(const float* q, int64_t D, const float* kt, float* s) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * BK), k1 = _mm256_loadu_ps(kt + d * BK + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(q + r * D + d);
      lo[r] = _mm256_fmadd_ps(b, k0, lo[r]);
      hi[r] = _mm256_fmadd_ps(b, k1, hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(s + r * BK, lo[r]);
    _mm256_storeu_ps(s + r * BK + 8, hi[r]);
  }
}

// Columns [col, col + 16) of o: o[r] * alpha[r] + sum_{k < n} p[r][k] v[k] for R rows; p rows
// of BK, o rows of D floats.
template <int R>
void value_tile(const float* p, const float* const* v, int64_t n, const float* alpha, float* o, int64_t D,
                int64_t col) {
  o += col;
  __m256 lo[R], hi[R];  // two arrays, as in score_tile
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 a = _mm256_set1_ps(alpha[r]);
    lo[r] = _mm256_mul_ps(_mm256_loadu_ps(o + r * D), a);
    hi[r] = _mm256_mul_ps(_mm256_loadu_ps(o + r * D + 8), a);
  }
  for (int64_t k = 0; k < n; ++k) {
    const __m256 x0 = _mm256_loadu_ps(v[k] + col), x1 = _mm256_loadu_ps(v[k] + col + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * BK + k);
      lo[r] = _mm256_fmadd_ps(w, x0, lo[r]);
      hi[r] = _mm256_fmadd_ps(w, x1, hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(o + r * D, lo[r]);
    _mm256_storeu_ps(o + r * D + 8, hi[r]);
  }
}

// The R-row tile functions for R = 1 .. RT, by R.
template <template <int> class F, int... R>
constexpr auto by_rows(std::integer_sequence<int, R...>) {
  return std::array{F<R + 1>::fn...};
}
template <int R> struct ScoreFn { static constexpr auto fn = score_tile<R>; };
template <int R> struct ValueFn { static constexpr auto fn = value_tile<R>; };
constexpr auto kScoreTiles = by_rows<ScoreFn>(std::make_integer_sequence<int, RT>());
constexpr auto kValueTiles = by_rows<ValueFn>(std::make_integer_sequence<int, RT>());

// attend_block on AVX2 (the same task, arguments and results).
template <typename T, int ND>
void attend_block(const T* q, int64_t q_stride, T* out, const float* kt_all, const float* const* v_all, int64_t h,
                  int64_t p0, int64_t np, const Problem& s, Scratch& w) {
  constexpr int D = 16 * ND, N8 = 2 * ND;
  const int64_t G = s.group, rows = np * G;
  w.start(q, q_stride, h, p0, np, s, D);
  const int64_t* pos = w.pos.data();
  float *Q = w.q.data(), *S = w.s.data(), *O = w.o.data(), *M = w.m.data(), *L = w.l.data(), *A = w.alpha.data();
  const int64_t last_chunk = pos[rows - 1] / BK;
  for (int64_t c = 0; c <= last_chunk; ++c) {
    const int64_t k0 = c * BK;
    const float* kt = kt_all + (h * s.num_chunks + c) * D * BK;
    const float* const* vv = v_all + (h * s.num_chunks + c) * BK;
    for (int64_t r0 = 0; r0 < rows; r0 += RT) {
      const int64_t R = std::min<int64_t>(RT, rows - r0);
      const int64_t n = std::min<int64_t>(BK, pos[r0 + R - 1] - k0 + 1);
      for (int64_t k = 0; k < n; k += 16) kScoreTiles[R - 1](Q + r0 * D, D, kt + k, S + r0 * BK + k);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::min<int64_t>(BK, pos[r] - k0 + 1);
      float* row = S + r * BK;
      if (n <= 0) {  // sees none of this chunk: no rescale, and zeros for a value tile that spans it
        A[r] = 1.0f;
        for (int v = 0; v < BK / 8; ++v) _mm256_storeu_ps(row + 8 * v, _mm256_setzero_ps());
        continue;
      }
      const int64_t nv = (n + 7) / 8;
      const __m256 tail = lanes8(n - 8 * (nv - 1)), minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      __m256 mx = minus_inf;
      for (int64_t v = 0; v < nv; ++v) {
        const __m256 x = _mm256_loadu_ps(row + 8 * v);
        mx = _mm256_max_ps(mx, v == nv - 1 ? _mm256_blendv_ps(minus_inf, x, tail) : x);
      }
      const float m_new = std::max(M[r], hmax8(mx));
      const float alpha = std::exp2(M[r] - m_new);  // 0 on the first chunk (M = -inf)
      const __m256 top = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t v = 0; v < BK / 8; ++v) {
        __m256 e = _mm256_setzero_ps();
        if (v < nv) {
          e = exp2_8(_mm256_sub_ps(_mm256_loadu_ps(row + 8 * v), top));
          if (v == nv - 1) e = _mm256_and_ps(e, tail);
          sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(row + 8 * v, e);
      }
      L[r] = L[r] * alpha + vivace_simde::hsum(sum);
      M[r] = m_new;
      A[r] = alpha;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += RT) {
      const int64_t R = std::min<int64_t>(RT, rows - r0);
      const int64_t n = std::min<int64_t>(BK, pos[r0 + R - 1] - k0 + 1);
      if (n <= 0) continue;
      for (int64_t d = 0; d < D; d += 16) kValueTiles[R - 1](S + r0 * BK, vv, n, A + r0, O + r0 * D, D, d);
    }
  }
  for (int64_t p = 0; p < np; ++p) {
    T* dst = out + (p0 + p) * s.heads * D + h * G * D;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = p * G + g;
      const __m256 inv = _mm256_set1_ps(1.0f / L[r]);
      for (int i = 0; i < N8; ++i) store8(dst + g * D + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(O + r * D + 8 * i), inv));
    }
  }
}

// Transpose 8 rows of 8 floats in registers: r[j] becomes column j.
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}

// As above, 8 keys at a time.
constexpr int64_t kPackKeys = 8;

template <typename T>
void transpose_keys(const T* const* ks, int64_t present, int64_t D, float* kt) {
  for (int64_t i = 0; i < D / 8; ++i) {
    __m256 r[8];
    for (int64_t u = 0; u < 8; ++u) r[u] = u < present ? load8(ks[u] + 8 * i) : _mm256_setzero_ps();
    transpose8(r);
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(kt + (8 * i + j) * BK, r[j]);
  }
}

template <typename T>
void widen_row(const T* src, int64_t D, float* dst) {
  for (int64_t i = 0; i < D / 8; ++i) _mm256_storeu_ps(dst + 8 * i, load8(src + 8 * i));
}
#endif

// Keys of every kv head transposed into float32 chunks [kv_heads][num_chunks][D][BK] (zero past
// seq_len), and a pointer to every key's float32 value row [kv_heads][num_chunks * BK]: straight
// into the cache when `direct` (float32 only), else into rows copied (converted) into v_rows.
// Pointers past seq_len are null: no row ever weighs a key past its own position.
template <typename T>
void pack_kv(const T* cache, int64_t num_slots, const int64_t* table, const Problem& s, int64_t D,
             float* kt_all, const float** v_all, float* v_rows, bool direct) {
  const T* keys = cache;
  const T* values = cache + num_slots * s.kv_heads * D;
  at::parallel_for(0, s.kv_heads * s.num_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / s.num_chunks, c = task % s.num_chunks;
      // Offset of key k's row of head h in the keys (and in the values).
      const auto row_of = [&](int64_t k) {
        return (table[k / s.block_size] * s.block_size + k % s.block_size) * s.kv_heads * D + h * D;
      };
      float* kt = kt_all + task * D * BK;
      const float** vptr = v_all + task * BK;
      for (int64_t t0 = 0; t0 < BK; t0 += kPackKeys) {
        // The next keys' and values' rows of this head, asked for while these are packed (a
        // block ends every block_size keys, and the hardware prefetcher with it).
        for (int64_t k = c * BK + t0 + kPackKeys; k < std::min(c * BK + t0 + 2 * kPackKeys, s.seq_len); ++k) {
          const int64_t row = row_of(k);
          prefetch_rows(keys + row, 1, 0, D);
          prefetch_rows(values + row, 1, 0, D);
        }
        const T* ks[kPackKeys];
        int64_t present = 0;  // keys of these that exist
        for (int64_t u = 0; u < kPackKeys; ++u) {
          const int64_t k = c * BK + t0 + u;
          if (k >= s.seq_len) {
            vptr[t0 + u] = nullptr;
            continue;
          }
          const int64_t row = row_of(k);
          ks[u] = keys + row;
          const T* vs = values + row;
          if (direct) {
            vptr[t0 + u] = reinterpret_cast<const float*>(vs);
          } else {
            float* row = v_rows + (task * BK + t0 + u) * D;
            widen_row(vs, D, row);
            vptr[t0 + u] = row;
          }
          ++present;
        }
        transpose_keys(ks, present, D, kt + t0);
      }
    }
  });
}

template <typename T, typename C, int ND>
void run(const at::Tensor& q, const at::Tensor& cache, const int64_t* table, const Problem& s, at::Tensor& out) {
  constexpr int D = 16 * ND;
  const int64_t num_slots = cache.size(1) * cache.size(2), packed = s.kv_heads * s.num_chunks * BK * D;
  // Packed K/V live in buffers of the calling thread, reused call after call (no fresh pages to fault in).
  // Float32 values are read in place for a short chunk (each row serves few queries, a copy would
  // cost more than it saves); copied into contiguous rows for a long one (measured ~10% faster at
  // 512 tokens: sequential rather than block-scattered rows) and for 16-bit caches (converted once).
  const bool direct = std::is_same_v<C, float> && s.q_len < 64;
  thread_local std::vector<float> kt_buf, v_buf;
  thread_local std::vector<const float*> vptr_buf;
  if (static_cast<int64_t>(kt_buf.size()) < packed) kt_buf.resize(packed);
  if (!direct && static_cast<int64_t>(v_buf.size()) < packed) v_buf.resize(packed);
  if (static_cast<int64_t>(vptr_buf.size()) < packed / D) vptr_buf.resize(packed / D);
  float* ktp = kt_buf.data();
  const float** vp = vptr_buf.data();
  pack_kv<C>(cache.data_ptr<C>(), num_slots, table, s, D, ktp, vp, v_buf.data(), direct);

  // Tasks: (kv head, block of positions); cost ~ rows x chunks seen. Longest first onto the
  // least loaded thread, so the two halves of a causal triangle come out even.
  // With several threads and a short chunk, smaller blocks: at least 4 tasks per thread where possible.
  int64_t per_task = std::max<int64_t>(1, (TARGET_ROWS + s.group - 1) / s.group);
  const int64_t threads = at::get_num_threads();
  if (threads > 1) per_task = std::max<int64_t>(1, std::min(per_task, s.q_len * s.kv_heads / (4 * threads)));
  const int64_t blocks = (s.q_len + per_task - 1) / per_task, first = s.seq_len - s.q_len;
  struct Task { int64_t h, p0, np, cost; };
  std::vector<Task> tasks;
  for (int64_t h = 0; h < s.kv_heads; ++h)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t p0 = b * per_task, np = std::min(per_task, s.q_len - p0);
      tasks.push_back({h, p0, np, np * ((first + p0 + np - 1) / BK + 1)});
    }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::vector<std::vector<Task>> plan(workers);
  std::vector<int64_t> load(workers, 0);
  for (const Task& t : tasks) {
    const int64_t w = std::min_element(load.begin(), load.end()) - load.begin();
    plan[w].push_back(t);
    load[w] += t.cost;
  }
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t w = begin; w < end; ++w)
      for (const Task& t : plan[w]) attend_block<T, ND>(qp, q.stride(0), op, ktp, vp, t.h, t.p0, t.np, s, scratch);
  });
}

template <typename T, typename C>
void dispatch(const at::Tensor& q, const at::Tensor& cache, const int64_t* table, const Problem& s, int64_t D,
              at::Tensor& out) {
  switch (D / 16) {
    case 1: run<T, C, 1>(q, cache, table, s, out); break;
    case 2: run<T, C, 2>(q, cache, table, s, out); break;
    case 3: run<T, C, 3>(q, cache, table, s, out); break;
    case 4: run<T, C, 4>(q, cache, table, s, out); break;
    case 5: run<T, C, 5>(q, cache, table, s, out); break;
    case 6: run<T, C, 6>(q, cache, table, s, out); break;
    case 7: run<T, C, 7>(q, cache, table, s, out); break;
    case 8: run<T, C, 8>(q, cache, table, s, out); break;
    case 16: run<T, C, 16>(q, cache, table, s, out); break;  // Gemma's 256
    default: TORCH_CHECK(false, "paged_prefill_attention: head_dim ", D, " is not a multiple of 16 up to 128, or 256");
  }
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                   int64_t seq_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_table.dim() == 1, "bad ranks");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.size(0) == 2, "kv_cache must be contiguous [2, N, bs, h, d]");
  TORCH_CHECK(block_table.scalar_type() == at::kLong, "block_table must be int64");
  const int64_t q_len = q.size(0), heads = q.size(1), D = q.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && D % 16 == 0 && (D <= 128 || D == 256),
              "head_dim must match and be a multiple of 16 up to 128, or 256");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q_len >= 1 && q_len <= seq_len, "need 1 <= q_len <= seq_len");
  const int64_t used = (seq_len + block_size - 1) / block_size;
  TORCH_CHECK(block_table.size(0) >= used, "seq_len ", seq_len, " does not fit the block table");
  const at::Tensor table = block_table.is_contiguous() ? block_table : block_table.contiguous();
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t j = 0; j < used; ++j)
    TORCH_CHECK(tp[j] >= 0 && tp[j] < kv_cache.size(1), "block ", tp[j], " is outside the cache");
  const at::Tensor qd = (q.stride(2) == 1 && q.stride(1) == D) ? q : q.contiguous();
  at::Tensor out = at::empty({q_len, heads, D}, q.options());
  const Problem s{q_len, seq_len, heads, kv_heads, heads / kv_heads, block_size, (seq_len + BK - 1) / BK,
                  static_cast<float>(scale)};
  const auto qt = q.scalar_type(), ct = kv_cache.scalar_type();
  if (qt == at::kFloat && ct == at::kFloat) dispatch<float, float>(qd, kv_cache, tp, s, D, out);
  else if (qt == at::kFloat && ct == at::kHalf) dispatch<float, at::Half>(qd, kv_cache, tp, s, D, out);
  else if (qt == at::kFloat && ct == at::kBFloat16) dispatch<float, at::BFloat16>(qd, kv_cache, tp, s, D, out);
  else if (qt == at::kBFloat16 && ct == at::kBFloat16) dispatch<at::BFloat16, at::BFloat16>(qd, kv_cache, tp, s, D, out);
  else if (qt == at::kHalf && ct == at::kHalf) dispatch<at::Half, at::Half>(qd, kv_cache, tp, s, D, out);
  else TORCH_CHECK(false, "paged_prefill_attention: unsupported dtypes ", qt, " (q) and ", ct, " (kv_cache)");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vivace, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor kv_cache, Tensor block_table, int seq_len, float scale) -> Tensor");
  // The same kernel under a name only this library registers: native ops that find it (the
  // decode op, for rows that are one sequence's consecutive positions) know it is this code.
  m.def("paged_prefill_attention_native(Tensor q, Tensor kv_cache, Tensor block_table, int seq_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(vivace, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("paged_prefill_attention_native", &paged_prefill_attention);
}
