// vivace's native sources are written with AVX-512 intrinsics. On a CPU with AVX2 but no
// AVX-512 they are compiled against SIMDe (SIMD Everywhere, the simde-py package's headers),
// whose _mm512_* functions run on pairs of 256-bit registers: this header, force-included
// before each source (vivace.layers.native), takes its aliases and adds those of the
// intrinsics vivace uses that the SIMDe release lacks, on the same pairs.
#pragma once

#include <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

namespace vivace_simde {

inline simde__m512i cvtepi8_epi32(simde__m128i a) {
  simde__m512i_private r;
  r.m256i[0] = _mm256_cvtepi8_epi32(a);
  r.m256i[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8));
  return simde__m512i_from_private(r);
}

// Truncating, as VPMOVDW.
inline simde__m256i cvtepi32_epi16(simde__m512i a) {
  const simde__m512i_private a_ = simde__m512i_to_private(a);
  const __m256i mask = _mm256_set1_epi32(0xFFFF);
  const __m256i packed = _mm256_packus_epi32(_mm256_and_si256(a_.m256i[0], mask), _mm256_and_si256(a_.m256i[1], mask));
  return _mm256_permute4x64_epi64(packed, 0xD8);
}

inline simde__m256i cvtps_ph(simde__m512 a, const int rounding) {
  const simde__m512_private a_ = simde__m512_to_private(a);
  const __m128i lo = rounding == _MM_FROUND_TO_NEAREST_INT ? _mm256_cvtps_ph(a_.m256[0], _MM_FROUND_TO_NEAREST_INT)
                                                          : _mm256_cvtps_ph(a_.m256[0], _MM_FROUND_CUR_DIRECTION);
  const __m128i hi = rounding == _MM_FROUND_TO_NEAREST_INT ? _mm256_cvtps_ph(a_.m256[1], _MM_FROUND_TO_NEAREST_INT)
                                                          : _mm256_cvtps_ph(a_.m256[1], _MM_FROUND_CUR_DIRECTION);
  return _mm256_set_m128i(hi, lo);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_add_ps(simde__m512 a) {
  const simde__m512_private a_ = simde__m512_to_private(a);
  return hsum(_mm256_add_ps(a_.m256[0], a_.m256[1]));
}

inline int reduce_add_epi32(simde__m512i a) {
  const simde__m512i_private a_ = simde__m512i_to_private(a);
  const __m256i v = _mm256_add_epi32(a_.m256i[0], a_.m256i[1]);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// VPDPBUSD: acc + the sums of four u8 x s8 products a lane. SIMDe's runs lane by lane; here
// VPMADDUBSW on the codes' nibbles (a pair of products of a nibble fits int16 unsaturated) and
// VPMADDWD to int32, the high nibbles' sums weighted by 16: exact for any u8.
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(u, nibble), s);
  const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(u, 4), nibble), s);
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(lo, _mm256_set1_epi16(1)));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(hi, _mm256_set1_epi16(16)));
}

inline simde__m512i dpbusd_epi32(simde__m512i acc, simde__m512i u, simde__m512i s) {
  simde__m512i_private a_ = simde__m512i_to_private(acc);
  const simde__m512i_private u_ = simde__m512i_to_private(u), s_ = simde__m512i_to_private(s);
  a_.m256i[0] = dpbusd256(a_.m256i[0], u_.m256i[0], s_.m256i[0]);
  a_.m256i[1] = dpbusd256(a_.m256i[1], u_.m256i[1], s_.m256i[1]);
  return simde__m512i_from_private(a_);
}

// The same for codes below 64, whose pairs of products fit int16 as they are: one VPMADDUBSW.
inline simde__m512i dpbusd_small(simde__m512i acc, simde__m512i u, simde__m512i s) {
  simde__m512i_private a_ = simde__m512i_to_private(acc);
  const simde__m512i_private u_ = simde__m512i_to_private(u), s_ = simde__m512i_to_private(s);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    a_.m256i[h] = _mm256_add_epi32(a_.m256i[h], _mm256_madd_epi16(_mm256_maddubs_epi16(u_.m256i[h], s_.m256i[h]), ones));
  }
  return simde__m512i_from_private(a_);
}

// SIMDe's masked loads and stores read and write all 16 lanes (a store writes zeros where the
// mask is off): past the end of a row's tail. These touch only the lanes the mask keeps; a full
// mask (every chunk of a row but its tail) is a plain load or store (VMASKMOVPS is slow on AMD).
inline __m256i lanes(unsigned bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), bit), bit);
}

inline simde__m512 maskz_loadu_ps(simde__mmask16 k, const void* p) {
  const float* f = static_cast<const float*>(p);
  if (k == 0xFFFF) return simde_mm512_loadu_ps(f);
  simde__m512_private r;
  r.m256[0] = _mm256_maskload_ps(f, lanes(k & 0xFF));
  r.m256[1] = _mm256_maskload_ps(f + 8, lanes(k >> 8));
  return simde__m512_from_private(r);
}

inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 a) {
  float* f = static_cast<float*>(p);
  if (k == 0xFFFF) return simde_mm512_storeu_ps(f, a);
  const simde__m512_private a_ = simde__m512_to_private(a);
  _mm256_maskstore_ps(f, lanes(k & 0xFF), a_.m256[0]);
  _mm256_maskstore_ps(f + 8, lanes(k >> 8), a_.m256[1]);
}

inline simde__m256i maskz_loadu_epi16(simde__mmask16 k, const void* p) {
  if (k == 0xFFFF) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint16_t lane[16] = {};
  const uint16_t* h = static_cast<const uint16_t*>(p);
  for (int i = 0; i < 16; ++i) {
    if (k >> i & 1) lane[i] = h[i];
  }
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(lane));
}

inline void mask_storeu_epi16(void* p, simde__mmask16 k, simde__m256i a) {
  if (k == 0xFFFF) return _mm256_storeu_si256(static_cast<__m256i*>(p), a);
  alignas(32) uint16_t lane[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane), a);
  uint16_t* h = static_cast<uint16_t*>(p);
  for (int i = 0; i < 16; ++i) {
    if (k >> i & 1) h[i] = lane[i];
  }
}

}  // namespace vivace_simde

#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32(a) vivace_simde::cvtepi8_epi32(a)
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(a) vivace_simde::cvtepi32_epi16(a)
#undef _mm512_cvtps_ph
#define _mm512_cvtps_ph(a, rounding) vivace_simde::cvtps_ph(a, rounding)
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps(a) vivace_simde::reduce_add_ps(a)
#undef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32(a) vivace_simde::reduce_add_epi32(a)
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) vivace_simde::maskz_loadu_ps(k, p)
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, a) vivace_simde::mask_storeu_ps(p, k, a)
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16(k, p) vivace_simde::maskz_loadu_epi16(k, p)
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16(p, k, a) vivace_simde::mask_storeu_epi16(p, k, a)
#undef _mm512_dpbusd_epi32
#define _mm512_dpbusd_epi32(acc, u, s) vivace_simde::dpbusd_epi32(acc, u, s)
