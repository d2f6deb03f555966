// The arithmetic the decode and prefill attention kernels share, so that a query row gets the same
// bits from either (a prefix-cache hit on an earlier answer, whose K/V the decode kernel made,
// against a miss, where the same positions are a prompt's): the query prescale, the order of a
// score's sum, the online softmax over absolute chunks of BK keys, and the final division.
//
// A score is q . k with q prescaled by scale * log2 e (float32): lane l of 16 holds the products of
// dims l, 16 + l, ... (the first a fmadd onto zero, then fmadd in order), and the 16 lanes are
// added by the tree ((s0 + s1) + (s2 + s3)), s_j = (x[4j] + x[4j+2]) + (x[4j+1] + x[4j+3]): the
// decode kernel's hsum16 over key rows, the prefill kernel's score tile over transposed keys.
// Per chunk c (keys [BK c, BK c + BK)) a row takes m' = max(m, its scores), alpha = exp2(m - m'),
// p = exp2(score - m'), l = fma(l, alpha, sum p) (sum: 16-lane vectors added in key order, then
// _mm512_reduce_add_ps), o = o * alpha then o = fmadd(p[k], v[k], o) for the chunk's keys in order;
// the result is o * (1 / l). Every mul, add and fma is written out as one (no contraction can merge them).
// AVX-512 only: the AVX2 (SIMDe) kernels keep their own orders (see decode_attention.cpp).
#pragma once

#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace vivace_attention {

constexpr int BK = 64;  // keys per softmax chunk, at absolute key indices BK c
constexpr float LOG2E = 1.4426950408889634f;

// The factor both kernels multiply a query by (float32 scale times log2 e).
inline float query_scale(double scale) { return static_cast<float>(scale) * LOG2E; }

#ifndef VIVACE_SIMDE
// 2^x for x <= 0: x - floor(x) in one VREDUCEPS, a degree-5 fit of 2^r on [0, 1) (relative
// error 1.6e-7), and 2^floor(x) applied by VSCALEFPS (which floors its second operand itself).
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 r = _mm512_reduce_ps(x, 0x09);  // keep 0 fraction bits, round down, no exceptions
  __m512 p = _mm512_set1_ps(1.8762329127639532e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.99258442223072e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.582360550761223e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4015453457832336e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931529641151428e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999999403953552e-1f));
  return _mm512_scalef_ps(p, x);
}

// The score tree's sum of 16 lane vectors p[0..15] (vertical: lane u of the result is key u's).
inline __m512 lane_tree(const __m512* p) {
  __m512 s[4];
  for (int j = 0; j < 4; ++j)
    s[j] = _mm512_add_ps(_mm512_add_ps(p[4 * j], p[4 * j + 2]), _mm512_add_ps(p[4 * j + 1], p[4 * j + 3]));
  return _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3]));
}

// The same tree over each of v[0..15]'s own 16 lanes, as one vector (lane u: v[u]'s sum).
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x88), _mm512_shuffle_f32x4(p, q, 0xDD));
}

// One row's online-softmax step over a chunk: row[k] holds the score of the chunk's key k; keys
// [lo, n) count. Updates the row's running max m and sum l, leaves row[k] = 2^(score - m) for
// those keys and 0 for the other BK, and returns alpha (1 when no key counts: nothing changes).
inline float softmax_chunk(float* row, int64_t lo, int64_t n, float& m, float& l) {
  n = std::min<int64_t>(n, BK);
  if (n <= lo) {
    for (int v = 0; v < BK / 16; ++v) _mm512_storeu_ps(row + 16 * v, _mm512_setzero_ps());
    return 1.0f;
  }
  static_assert(BK == 64, "a chunk's keys are one 64-bit mask");
  const uint64_t keys = (n == BK ? ~uint64_t{0} : (uint64_t{1} << n) - 1) & ~((uint64_t{1} << lo) - 1);
  __mmask16 mask[BK / 16];
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int v = 0; v < BK / 16; ++v) {
    mask[v] = static_cast<__mmask16>(keys >> (16 * v));
    mx = _mm512_mask_max_ps(mx, mask[v], mx, _mm512_loadu_ps(row + 16 * v));
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(mx));
  // exp2(0) is 1 exactly: a chunk that leaves the max where it was (most, past the first few)
  // skips the libm call. 0 on a row's first chunk (m = -inf).
  const float alpha = m == m_new ? 1.0f : std::exp2(m - m_new);
  const __m512 top = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int v = 0; v < BK / 16; ++v) {
    const __m512 e = _mm512_maskz_mov_ps(mask[v], exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(row + 16 * v), top)));
    sum = _mm512_add_ps(sum, e);
    _mm512_storeu_ps(row + 16 * v, e);
  }
  l = std::fma(l, alpha, _mm512_reduce_add_ps(sum));
  m = m_new;
  return alpha;
}
#endif

}  // namespace vivace_attention
