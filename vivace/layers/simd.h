// AVX-512 helpers shared by vivace's native layer ops: 16-lane loads and stores of float32,
// bfloat16 and float16 (arithmetic always in float32 registers), masked tails, and exp.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <cstdint>

namespace vivace_simd {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Round to nearest even, as c10::BFloat16's conversion does for finite values.
inline __m256i to_bf16(__m512 x) {
  __m512i bits = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(at::BFloat16* p, __m512 x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
inline void store16(at::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

// Lanes [0, n) of 16 (all of them for n >= 16).
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

inline __m512 maskload16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 maskload16(const at::BFloat16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void maskstore16(float* p, __mmask16 m, __m512 x) { _mm512_mask_storeu_ps(p, m, x); }
inline void maskstore16(at::BFloat16* p, __mmask16 m, __m512 x) { _mm256_mask_storeu_epi16(p, m, to_bf16(x)); }

// The value a store to T and a load back would give (T picked by the pointer's type).
inline __m512 round_to(const float*, __m512 x) { return x; }
inline __m512 round_to(const at::BFloat16*, __m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}

// Asks the cache for `rows` rows of `width` elements each, `stride` elements apart, from
// `first` on, ahead of their use: a paged sequence's blocks lie anywhere in the KV pool, and the
// hardware prefetcher stops at each block's end (decode attention over a 16-sequence batch at
// ~160 tokens each went from ~8 to ~5.7 ms with the next block's rows asked for).
template <typename C>
inline void prefetch_rows(const C* first, int64_t rows, int64_t stride, int64_t width) {
  const int64_t bytes = width * static_cast<int64_t>(sizeof(C));
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(first + r * stride);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

#ifdef VIVACE_SIMDE
// The AVX2 (SIMDe build) kernels' 8-lane loads and stores, as load16 and store16.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(at::BFloat16* p, __m256 x) {  // round to nearest even, as store16
  __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store8(at::Half* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// exp_ps's polynomial on 8 lanes (AVX2), 2^n built in the exponent bits (n in [-126, 127] after
// the clamp). SIMDe's VRNDSCALEPS and VSCALEFPS go lane by lane: through them silu_mul of a
// 512-token prompt step's [512, 1536] took 4.2 ms a layer.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
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
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
}

inline __m512 exp_ps(__m512 x) {
  simde__m512_private halves = simde__m512_to_private(x);
  halves.m256[0] = exp8(halves.m256[0]);
  halves.m256[1] = exp8(halves.m256[1]);
  return simde__m512_from_private(halves);
}
#else
// exp on [-87, 88] (inputs clamped there): Cephes' expf polynomial, 2^n applied with scalef.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace vivace_simd
