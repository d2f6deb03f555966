// Weight-only int8/int6/int5/int4/int3/int2 GEMM for small and large M on AVX-512 VNNI, and on AVX2 (the
// SIMDe build: half_tile_block, the same sums in 256-bit code).
//
// Weights are tiled so that one 64-byte vector holds 16 output rows x 4 consecutive k
// (int8) or 16 rows x 8 k as nibbles (int4: low nibbles k 0..3, high nibbles k 4..7).
// int5 (GGUF Q5_0/Q5_1/Q5_K codes) is int4's four nibble vectors per 32-k group followed by
// one vector of fifth bits: bit 2j (2j + 1) of its byte b is the fifth bit of byte b's low
// (high) nibble in nibble vector j, so a group is 320 bytes, 5 bits a weight.
// int6 (GGUF Q6_K) is int4's four nibble vectors followed by two vectors of top bits: vector v
// covers nibble vectors 2v and 2v + 1 (k 16v..16v+15, one Q6_K sub-block); bits 2f, 2f + 1 of
// its byte b (f = 2j' + h) are the top bits of byte b's low (h = 0) or high (h = 1) nibble in
// nibble vector 2v + j'. A group is 384 bytes, 6 bits a weight.
// int2 (GGUF Q2_K) folds int4's nibble vectors 2v and 2v + 1 into one vector v: bits 2f, 2f + 1
// of its byte b (f = 2j' + h) hold byte b's low (h = 0) or high (h = 1) nibble of nibble vector
// 2v + j', so shifting vector v right by 4j' gives nibble vector 2v + j' in bits 0..1 (low) and
// 2..3 (high). A group is 128 bytes, 2 bits a weight. int3 (GGUF Q3_K) is int2's two vectors of
// the low two bits followed by a vector of third bits laid out as int5's fifth bits: 192 bytes.
// Codes are unsigned; each (row, weight group) has an fp16 scale d and either an fp16
// min m (w = d*q + m) or a fixed zero point z (w = d*(q - z)).
// int4 through a codebook (GGUF IQ4_NL/IQ4_XS: scheme kCodebookZeroPoint) keeps int4's tiles, and
// each nibble q stands for byte cb[q] of a 16-byte table given with the weight (IQ4: ggml's
// kvalues_iq4nl + 128, 1..241, with z = 128): w = d*(cb[q] - z). The loop looks the nibbles up
// right after it extracts them, with a byte shuffle (VPSHUFB, the table in every 128-bit lane),
// and takes the dots of the bytes it gets as the 8-bit loop does (bytes of any size: the full-
// range dot, never dot_small's). The weight streams at 4 bits; the table is an argument, not a
// constant, so that one loop serves any table, and a scheme of its own, so that the other 4-bit
// loops carry no test for it.
// Activations are quantized on the fly to int8 per group of 32 (scale dx, code sum s),
// so every 32-k group is an exact integer dot product done by vpdpbusd, then
//   y += d * dx * dot + m * dx * s        (min)      or
//   y += d * (dx * dot - z * dx * s)      (zero point).
// GGUF K-quants have two levels: d (and m = -dmin) per 256-k super-block, and per sub-block
// int8 scales sc (and mins mi): Q4_K/Q5_K (32-k sub-blocks, with mins)
//   y += (d * sc) * dx * dot + (m * mi) * dx * s,
// the products of the file's numbers being exact in fp32; Q6_K (16-k sub-blocks, z = 32) takes
// one dot per sub-block, dot0 and dot1, and the code sums s0, s1 of the activation's halves:
//   y += dx * ((d * sc0) * (dot0 - z * s0) + (d * sc1) * (dot1 - z * s1)),
// each factor exact in fp32 (the dot differences are integers below 2^17). Q3_K (int3, z = 4)
// takes the same sums, and Q2_K (int2, 16-k sub-blocks with mins mi0, mi1) the dots per
// sub-block and the mins against s0, s1:
//   y += dx * ((d * sc0) * dot0 + (d * sc1) * dot1 + (m * mi0) * s0 + (m * mi1) * s1).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int kTile = 16;   // output rows per vector
constexpr int kGroup = 32;  // activation quantization group
constexpr int64_t kMinWorkPerThread = 128 * 1024;
// How far ahead of the group it multiplies the first row pass asks for a tile's codes, into L2
// (_MM_HINT_T1). With the hardware prefetchers alone, the 73 GEMVs of a Llama-3.2-1B Q4_K_M batch-1
// step took 1.2-1.4x as long as a plain prefetching read of the same codes in the same calls; with
// this, 1.1-1.2x. Measured on two threads, alternating: 0.86-0.92x the GEMVs' time at 4 KiB,
// 2 KiB into L1 0.90-0.91x, 3-8 KiB into L2 within 2% of 4 KiB. (Weights already in L3 run
// slower with it, 1.2x: a batch-1 step never finds them there.)
constexpr int64_t kPrefetchBytes = 4096;

// Per-thread scratch for the quantized activations, reused across calls (no allocation).
struct QuantizedActivations {
  std::vector<int8_t> codes;   // [M, K]
  std::vector<float> scales;   // [M, K/32]: dx
  std::vector<float> offsets;  // [M, K/32]: dx * sum(codes), times -z when a zero point is used
  std::vector<int32_t> sums;   // [M, K/16]: sum(codes) per 16
};

// How a weight's scales apply (file header): one level with a zero point or a min, or the
// K-quants' two levels (sub-blocks of 32 with mins, or of 16 with a zero point or with mins).
// kCodebookZeroPoint: a zero point, int4 codes looked up into a codebook first (file header).
enum Scheme { kZeroPoint, kMin, kSubMin, kSub16ZeroPoint, kSub16Min, kCodebookZeroPoint };

constexpr bool has_min(Scheme s) { return s == kMin || s == kSubMin || s == kSub16Min; }
// Sub-blocks of 16 k: a 32-k group's two halves summed apart (acc, acc_hi).
constexpr bool sub16(Scheme s) { return s == kSub16ZeroPoint || s == kSub16Min; }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T>
void quantize_row(const T* x, int64_t k, float offset_factor, int8_t* q, float* dx, float* off, int32_t* sums) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    __m512 a = load16(x + g * kGroup), b = load16(x + g * kGroup + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    float d = amax / 127.0f;
    __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
    __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup + 16), _mm512_cvtsepi32_epi8(qb));
    dx[g] = d;
    sums[2 * g] = _mm512_reduce_add_epi32(qa);
    sums[2 * g + 1] = _mm512_reduce_add_epi32(qb);
    off[g] = offset_factor * d * static_cast<float>(sums[2 * g] + sums[2 * g + 1]);
  }
}

const QuantizedActivations& quantize_activations(const at::Tensor& x, float offset_factor) {
  thread_local QuantizedActivations out;
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  out.codes.resize(m * k);
  out.scales.resize(m * groups);
  out.offsets.resize(m * groups);
  out.sums.resize(m * groups * 2);
  int8_t* q = out.codes.data();
  float* dx = out.scales.data();
  float* off = out.offsets.data();
  int32_t* sums = out.sums.data();
  AT_DISPATCH_SWITCH(x.scalar_type(), "quantize_activations",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const float* xp = x.data_ptr<float>();
      at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          quantize_row(xp + r * k, k, offset_factor, q + r * k, dx + r * groups, off + r * groups,
                       sums + r * groups * 2);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
      at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          quantize_row(xp + r * k, k, offset_factor, q + r * k, dx + r * groups, off + r * groups,
                       sums + r * groups * 2);
      });
    }));
  return out;
}

struct Problem {
  const uint8_t* codes; const at::Half* scales; const at::Half* mins; const float* bias;
  const int8_t* sub_scales; const int8_t* sub_mins;  // [N/16, K/sub_group, 16] (two-level schemes)
  const uint8_t* codebook;  // [16] (kCodebookZeroPoint)
  const int8_t* xq; const float* dx; const float* off; const int32_t* sums; float* y;
  int64_t m, n, k, weight_group, zero_point;
};

inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc + VPDPBUSD of codes below 64 (int4, int5, int6) against int8 activations: on AVX2 (the
// SIMDe build, layers/simde_avx512.h) one VPMADDUBSW a half, where a code of any size takes two.
inline __m512i dot_small(__m512i acc, __m512i codes, __m512i x) {
#ifdef VIVACE_SIMDE
  return vivace_simde::dpbusd_small(acc, codes, x);
#else
  return _mm512_dpbusd_epi32(acc, codes, x);
#endif
}

// acc + VPDPBUSD of 4-bit codes, or, through a codebook, of the table's bytes they were looked up
// into: bytes of any size, so the full-range dot (tile_block is the AVX-512 loop; AVX2 has its own).
template <Scheme S>
inline __m512i dot_nibbles(__m512i acc, __m512i codes, __m512i x) {
  if constexpr (S == kCodebookZeroPoint) return _mm512_dpbusd_epi32(acc, codes, x);
  else return dot_small(acc, codes, x);
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v);
}

inline __m512i load_int8x16(const int8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// int6: bits 2F, 2F + 1 of each byte of a top-bits vector moved to bits 4, 5 (16-bit shifts:
// the bits a shift carries in from the neighbouring byte land outside 4..5 and are masked off).
template <int F>
inline __m512i top_bits(__m512i plane) {
  const __m512i mask = _mm512_set1_epi8(0x30);
  if constexpr (F == 3) return _mm512_and_si512(_mm512_srli_epi16(plane, 2), mask);
  else if constexpr (F == 2) return _mm512_and_si512(plane, mask);
  else return _mm512_and_si512(_mm512_slli_epi16(plane, 4 - 2 * F), mask);
}

// NT tiles of 16 rows against MB activation rows starting at row m0.
template <int BITS, Scheme S, int MB, int NT>
void tile_block(const Problem& p, int64_t tile0, int64_t m0) {
  constexpr bool HAS_MIN = has_min(S);
  const int64_t groups = p.k / kGroup, wgroups = p.k / p.weight_group;
  const int64_t per_wgroup = p.weight_group / kGroup;
  const int64_t tile_bytes = p.k * kTile * BITS / 8;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // The codebook in each 128-bit lane, for VPSHUFB (which indexes within a lane).
  const __m512i table = S == kCodebookZeroPoint
      ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.codebook))) : nibble;
  __m512 accf[MB][NT];
  for (int i = 0; i < MB; ++i) for (int t = 0; t < NT; ++t) accf[i][t] = _mm512_setzero_ps();
  constexpr int kGroupBytes = kGroup * kTile * BITS / 8;  // a tile's codes of one group, contiguous
  for (int64_t g = 0; g < groups; ++g) {
    if (m0 == 0) {  // later row passes find the codes in cache
      for (int t = 0; t < NT; ++t) {
        const char* ahead = reinterpret_cast<const char*>(p.codes + (tile0 + t) * tile_bytes + g * kGroupBytes);
        for (int line = 0; line < kGroupBytes; line += 64) _mm_prefetch(ahead + kPrefetchBytes + line, _MM_HINT_T1);
      }
    }
    __m512i acc[MB][NT], acc_hi[MB][NT];  // acc_hi: the second 16-k sub-block (sub16)
    for (int i = 0; i < MB; ++i) for (int t = 0; t < NT; ++t) acc[i][t] = acc_hi[i][t] = _mm512_setzero_si512();
    const int8_t* xg = p.xq + m0 * p.k + g * kGroup;
    if constexpr (BITS == 6) {
      const uint8_t* group = p.codes + tile0 * tile_bytes + g * 384;
      for (int t = 0; t < NT; ++t) {
        const uint8_t* tg = group + t * tile_bytes;
        const __m512i plane0 = _mm512_loadu_si512(tg + 256), plane1 = _mm512_loadu_si512(tg + 320);
        auto nibbles = [&](int j, __m512i top_lo, __m512i top_hi, __m512i (&into)[MB][NT]) {
          __m512i w = _mm512_loadu_si512(tg + j * 64);
          __m512i lo = _mm512_or_si512(_mm512_and_si512(w, nibble), top_lo);
          __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w, 4), nibble), top_hi);
          for (int i = 0; i < MB; ++i) {
            into[i][t] = dot_small(into[i][t], lo, bcast4(xg + i * p.k + 8 * j));
            into[i][t] = dot_small(into[i][t], hi, bcast4(xg + i * p.k + 8 * j + 4));
          }
        };
        nibbles(0, top_bits<0>(plane0), top_bits<1>(plane0), acc);
        nibbles(1, top_bits<2>(plane0), top_bits<3>(plane0), acc);
        nibbles(2, top_bits<0>(plane1), top_bits<1>(plane1), acc_hi);
        nibbles(3, top_bits<2>(plane1), top_bits<3>(plane1), acc_hi);
      }
    } else if constexpr (BITS == 5) {
      const uint8_t* group = p.codes + tile0 * tile_bytes + g * 320;
      for (int t = 0; t < NT; ++t) {
        const uint8_t* tg = group + t * tile_bytes;
        const __m512i fifth = _mm512_loadu_si512(tg + 256), sixteen = _mm512_set1_epi8(16);
        for (int j = 0; j < kGroup / 8; ++j) {
          __m512i w = _mm512_loadu_si512(tg + j * 64);
          __m512i lo = _mm512_and_si512(w, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
          lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(fifth, _mm512_set1_epi8(1 << (2 * j))), lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(fifth, _mm512_set1_epi8(2 << (2 * j))), hi, sixteen);
          for (int i = 0; i < MB; ++i) {
            acc[i][t] = dot_small(acc[i][t], lo, bcast4(xg + i * p.k + 8 * j));
            acc[i][t] = dot_small(acc[i][t], hi, bcast4(xg + i * p.k + 8 * j + 4));
          }
        }
      }
    } else if constexpr (BITS <= 3) {
      static_assert(sub16(S), "2- and 3-bit codes come with 16-k sub-blocks");
      const uint8_t* group = p.codes + tile0 * tile_bytes + g * (kGroup * kTile * BITS / 8);
      const __m512i two_bits = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
      for (int t = 0; t < NT; ++t) {
        const uint8_t* tg = group + t * tile_bytes;
        const __m512i third = BITS == 3 ? _mm512_loadu_si512(tg + 128) : _mm512_setzero_si512();
        // Nibble vector j's codes from vector j / 2; called with constant j and accumulators (a
        // loop choosing acc or acc_hi by j kept them in memory: 16-row GEMMs 2x slower).
        auto codes = [&](int j, __m512i (&into)[MB][NT]) {
          const __m512i w = _mm512_srli_epi16(_mm512_loadu_si512(tg + (j / 2) * 64), 4 * (j % 2));
          __m512i lo = _mm512_and_si512(w, two_bits), hi = _mm512_and_si512(_mm512_srli_epi16(w, 2), two_bits);
          if constexpr (BITS == 3) {
            lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(third, _mm512_set1_epi8(1 << (2 * j))), lo, four);
            hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(third, _mm512_set1_epi8(2 << (2 * j))), hi, four);
          }
          for (int i = 0; i < MB; ++i) {
            into[i][t] = dot_small(into[i][t], lo, bcast4(xg + i * p.k + 8 * j));
            into[i][t] = dot_small(into[i][t], hi, bcast4(xg + i * p.k + 8 * j + 4));
          }
        };
        codes(0, acc), codes(1, acc), codes(2, acc_hi), codes(3, acc_hi);
      }
    } else if constexpr (BITS == 8) {
      for (int j = 0; j < kGroup / 4; ++j) {
        for (int t = 0; t < NT; ++t) {
          __m512i w = _mm512_loadu_si512(p.codes + (tile0 + t) * tile_bytes + (g * 8 + j) * 64);
          for (int i = 0; i < MB; ++i) acc[i][t] = _mm512_dpbusd_epi32(acc[i][t], w, bcast4(xg + i * p.k + 4 * j));
        }
      }
    } else {
      for (int j = 0; j < kGroup / 8; ++j) {
        for (int t = 0; t < NT; ++t) {
          __m512i w = _mm512_loadu_si512(p.codes + (tile0 + t) * tile_bytes + (g * 4 + j) * 64);
          __m512i lo = _mm512_and_si512(w, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
          if constexpr (S == kCodebookZeroPoint) {
            lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
          }
          for (int i = 0; i < MB; ++i) {
            acc[i][t] = dot_nibbles<S>(acc[i][t], lo, bcast4(xg + i * p.k + 8 * j));
            acc[i][t] = dot_nibbles<S>(acc[i][t], hi, bcast4(xg + i * p.k + 8 * j + 4));
          }
        }
      }
    }
    const int64_t wg = g / per_wgroup;
    for (int t = 0; t < NT; ++t) {
      const int64_t sidx = ((tile0 + t) * wgroups + wg) * kTile;
      __m512 d = load_half16(p.scales + sidx);
      __m512 mn = HAS_MIN ? load_half16(p.mins + sidx) : d;
      if constexpr (sub16(S)) {
        // d * sc and m * mi are exact in fp32 (11 + 8 bits), and so is each sub-block's dot - z * s
        // (< 2^17): two float multiplies per row cost fewer vector-port cycles than two vpmulld.
        const int64_t sub = ((tile0 + t) * groups * 2 + 2 * g) * kTile;
        const __m512 dsc0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(load_int8x16(p.sub_scales + sub)));
        const __m512 dsc1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(load_int8x16(p.sub_scales + sub + kTile)));
        __m512 mmi0 = mn, mmi1 = mn;
        if constexpr (HAS_MIN) {
          mmi0 = _mm512_mul_ps(mn, _mm512_cvtepi32_ps(load_int8x16(p.sub_mins + sub)));
          mmi1 = _mm512_mul_ps(mn, _mm512_cvtepi32_ps(load_int8x16(p.sub_mins + sub + kTile)));
        }
        for (int i = 0; i < MB; ++i) {
          const int64_t xi = (m0 + i) * groups + g;
          const int32_t* s = p.sums + 2 * xi;
          __m512 dot;
          if constexpr (HAS_MIN) {
            dot = _mm512_fmadd_ps(dsc0, _mm512_cvtepi32_ps(acc[i][t]), _mm512_mul_ps(dsc1, _mm512_cvtepi32_ps(acc_hi[i][t])));
            dot = _mm512_fmadd_ps(mmi0, _mm512_set1_ps(static_cast<float>(s[0])),
                                  _mm512_fmadd_ps(mmi1, _mm512_set1_ps(static_cast<float>(s[1])), dot));
          } else {
            __m512i lo = _mm512_sub_epi32(acc[i][t], _mm512_set1_epi32(static_cast<int32_t>(p.zero_point) * s[0]));
            __m512i hi = _mm512_sub_epi32(acc_hi[i][t], _mm512_set1_epi32(static_cast<int32_t>(p.zero_point) * s[1]));
            dot = _mm512_fmadd_ps(dsc0, _mm512_cvtepi32_ps(lo), _mm512_mul_ps(dsc1, _mm512_cvtepi32_ps(hi)));
          }
          accf[i][t] = _mm512_fmadd_ps(dot, _mm512_set1_ps(p.dx[xi]), accf[i][t]);
        }
        continue;
      }
      if constexpr (S == kSubMin) {
        const int64_t sub = ((tile0 + t) * groups + g) * kTile;
        d = _mm512_mul_ps(d, _mm512_cvtepi32_ps(load_int8x16(p.sub_scales + sub)));
        mn = _mm512_mul_ps(mn, _mm512_cvtepi32_ps(load_int8x16(p.sub_mins + sub)));
      }
      for (int i = 0; i < MB; ++i) {
        const int64_t xi = (m0 + i) * groups + g;
        __m512 dot = _mm512_cvtepi32_ps(acc[i][t]);
        __m512 off = _mm512_set1_ps(p.off[xi]);
        if constexpr (HAS_MIN) {
          accf[i][t] = _mm512_fmadd_ps(d, _mm512_mul_ps(dot, _mm512_set1_ps(p.dx[xi])), accf[i][t]);
          accf[i][t] = _mm512_fmadd_ps(mn, off, accf[i][t]);
        } else {
          accf[i][t] = _mm512_fmadd_ps(d, _mm512_fmadd_ps(dot, _mm512_set1_ps(p.dx[xi]), off), accf[i][t]);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    __m512 b = p.bias ? _mm512_loadu_ps(p.bias + (tile0 + t) * kTile) : _mm512_setzero_ps();
    for (int i = 0; i < MB; ++i)
      _mm512_storeu_ps(p.y + (m0 + i) * p.n + (tile0 + t) * kTile, _mm512_add_ps(accf[i][t], b));
  }
}

#ifdef VIVACE_SIMDE
// AVX2 (the SIMDe build). tile_block's __m512 values live in pairs of the 16 ymm registers, so
// its 8-row passes spill, and SIMDe's wrappers go through memory too: here the same sums in
// native 256-bit code, a tile as two halves of 8 rows (the first and second 32 bytes of each
// 64-byte weight vector, the rows' scales 8 a half), rows_per_pass<BITS>() activation rows a
// pass (below).

inline __m256i bcast4_256(const int8_t* p) {
  int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v);
}

// An empty asm that takes v and gives it back in a register: the compiler cannot see through
// it, so it keeps running sums as written. Without it GCC reassociates a group's sums into a
// tree over every product, all of them live at once: spilled to the stack (~2x slower).
inline void keep(__m256i& v) { asm("" : "+x"(v)); }

// Codes below 64 (lo, hi) against int8 activations (xlo, xhi), four products a 32-bit lane
// summed in its two int16 halves: the two VPMADDUBSW results added in int16 (each at most
// 2 * 63 * 127 = 16,002 in magnitude, so the sum fits).
inline __m256i dot2_pairs(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
}

// Bits `shift` .. `shift` + WIDTH - 1 of each byte of a plane of fifth or third (WIDTH 1) or top
// (WIDTH 2) bits, moved to bit TO and up.
template <int WIDTH, int TO = 4>
inline __m256i plane_bits256(__m256i plane, int shift) {
  const __m256i mask = _mm256_set1_epi8(WIDTH == 1 ? 0x01 : 0x03);
  return _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(plane, _mm256_set1_epi32(shift)), mask), TO);
}

inline __m256 load_half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 load_int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Rows 8 * half .. 8 * half + 7 of tile `tile` against MB activation rows from m0.
template <int BITS, Scheme S, int MB>
void half_tile_block(const Problem& p, int64_t tile, int half, int64_t m0) {
  constexpr bool HAS_MIN = has_min(S);
  const int64_t groups = p.k / kGroup, wgroups = p.k / p.weight_group;
  const int64_t per_wgroup = p.weight_group / kGroup;
  const int64_t tile_bytes = p.k * kTile * BITS / 8;
  const uint8_t* codes = p.codes + tile * tile_bytes + 32 * half;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 accf[MB];
  for (int i = 0; i < MB; ++i) accf[i] = _mm256_setzero_ps();
  int64_t wg = -1, in_wg = per_wgroup;  // weight group of g, counted (an idiv a group cost ~10%)
  for (int64_t g = 0; g < groups; ++g) {
    if (in_wg == per_wgroup) in_wg = 0, ++wg;
    ++in_wg;
    __m256i acc[MB], acc_hi[MB];  // acc_hi: the second 16-k sub-block (sub16)
    for (int i = 0; i < MB; ++i) acc[i] = acc_hi[i] = _mm256_setzero_si256();
    const int8_t* xg = p.xq + m0 * p.k + g * kGroup;
    if constexpr (BITS == 8 || S == kCodebookZeroPoint) {
      // Bytes q - 128 (signed), as in llama.cpp's AVX2 dots: VPMADDUBSW of |q - 128| (at most 128)
      // against x signed like q - 128 (|x| <= 127: no overflow in the negation, and a pair of
      // products at most 2 * 128 * 127 = 32,512), then 128 * sum(x) added back, exact. A codebook's
      // bytes too (up to 241 for IQ4: as they are, a pair of products would saturate VPMADDUBSW's
      // int16), looked up from a table of its entries minus 128.
      auto dot_signed = [&](__m256i w, int column) {  // w: 4 bytes a row, each times x's columns from `column`
        const __m256i magnitude = _mm256_abs_epi8(w);
        for (int i = 0; i < MB; ++i) {
          const __m256i x = _mm256_sign_epi8(bcast4_256(xg + i * p.k + column), w);
          acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), _mm256_set1_epi16(1)));
        }
      };
      const __m256i minus128 = _mm256_set1_epi8(-128);
      const uint8_t* group = codes + g * (kGroup * kTile * BITS / 8);
      if constexpr (BITS == 8) {
        for (int j = 0; j < kGroup / 4; ++j)
          dot_signed(_mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + j * 64)), minus128),
                     4 * j);
      } else {
        const __m256i table = _mm256_xor_si256(
            _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.codebook))), minus128);
        for (int j = 0; j < kGroup / 8; ++j) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + j * 64));
          dot_signed(_mm256_shuffle_epi8(table, _mm256_and_si256(w, nibble)), 8 * j);
          dot_signed(_mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble)), 8 * j + 4);
        }
      }
      for (int i = 0; i < MB; ++i) {
        const int32_t* s = p.sums + 2 * ((m0 + i) * groups + g);
        acc[i] = _mm256_add_epi32(acc[i], _mm256_set1_epi32(128 * (s[0] + s[1])));
      }
    } else {
      // kRun steps of 8 k summed in int16 before one VPMADDWD: a step adds at most 2 pairs of
      // 2 * (2^BITS - 1) * 127 (|x| <= 127), so 4 steps of 4-bit codes (30,480) and 2 of 5-bit
      // (31,496) fit; 6-bit codes take one; 16-k sub-blocks end a run every 2 steps.
      constexpr int kRun = BITS == 6 ? 1 : BITS == 5 || sub16(S) ? 2 : 4;
      __m256i sum16[MB];
      const uint8_t* group = codes + g * (kGroup * kTile * BITS / 8);
#pragma GCC unroll 4
      for (int j = 0; j < kGroup / 8; ++j) {
        __m256i lo, hi;
        if constexpr (BITS <= 3) {  // nibble vector j's codes from vector j / 2 (file header)
          const __m256i two_bits = _mm256_set1_epi8(3);
          const __m256i w = _mm256_srli_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + (j / 2) * 64)), 4 * (j % 2));
          lo = _mm256_and_si256(w, two_bits), hi = _mm256_and_si256(_mm256_srli_epi16(w, 2), two_bits);
        } else {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + j * 64));
          lo = _mm256_and_si256(w, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
        }
        if constexpr (BITS == 3) {  // bit 2j (2j + 1) of the third-bits plane: the low (high) code's
          const __m256i third = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 128));
          lo = _mm256_or_si256(lo, plane_bits256<1, 2>(third, 2 * j));
          hi = _mm256_or_si256(hi, plane_bits256<1, 2>(third, 2 * j + 1));
        } else if constexpr (BITS == 5) {  // bit 2j (2j + 1) of the fifth-bits plane: the low (high) nibble's
          const __m256i fifth = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 256));
          lo = _mm256_or_si256(lo, plane_bits256<1>(fifth, 2 * j));
          hi = _mm256_or_si256(hi, plane_bits256<1>(fifth, 2 * j + 1));
        } else if constexpr (BITS == 6) {  // plane j / 2, bits 2f, 2f + 1 with f = 2 (j % 2) + h
          const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 256 + 64 * (j / 2)));
          lo = _mm256_or_si256(lo, plane_bits256<2>(plane, 4 * (j % 2)));
          hi = _mm256_or_si256(hi, plane_bits256<2>(plane, 4 * (j % 2) + 2));
        }
        for (int i = 0; i < MB; ++i) {
          const int8_t* xr = xg + i * p.k + 8 * j;
          const __m256i pairs = dot2_pairs(lo, bcast4_256(xr), hi, bcast4_256(xr + 4));
          sum16[i] = j % kRun == 0 ? pairs : _mm256_add_epi16(sum16[i], pairs);
          keep(sum16[i]);
        }
        if ((j + 1) % kRun == 0) {
          __m256i (&into)[MB] = sub16(S) && j >= 2 ? acc_hi : acc;
          for (int i = 0; i < MB; ++i)
            into[i] = _mm256_add_epi32(into[i], _mm256_madd_epi16(sum16[i], _mm256_set1_epi16(1)));
        }
      }
    }
    const int64_t sidx = (tile * wgroups + wg) * kTile + 8 * half;
    __m256 d = load_half8(p.scales + sidx);
    __m256 mn = HAS_MIN ? load_half8(p.mins + sidx) : d;
    if constexpr (sub16(S)) {
      const int64_t sub = (tile * groups * 2 + 2 * g) * kTile + 8 * half;
      const __m256 dsc0 = _mm256_mul_ps(d, load_int8x8(p.sub_scales + sub));
      const __m256 dsc1 = _mm256_mul_ps(d, load_int8x8(p.sub_scales + sub + kTile));
      __m256 mmi0 = mn, mmi1 = mn;
      if constexpr (HAS_MIN) {
        mmi0 = _mm256_mul_ps(mn, load_int8x8(p.sub_mins + sub));
        mmi1 = _mm256_mul_ps(mn, load_int8x8(p.sub_mins + sub + kTile));
      }
      for (int i = 0; i < MB; ++i) {
        const int64_t xi = (m0 + i) * groups + g;
        const int32_t* s = p.sums + 2 * xi;
        __m256 dot;
        if constexpr (HAS_MIN) {
          dot = _mm256_fmadd_ps(dsc0, _mm256_cvtepi32_ps(acc[i]), _mm256_mul_ps(dsc1, _mm256_cvtepi32_ps(acc_hi[i])));
          dot = _mm256_fmadd_ps(mmi0, _mm256_set1_ps(static_cast<float>(s[0])),
                                _mm256_fmadd_ps(mmi1, _mm256_set1_ps(static_cast<float>(s[1])), dot));
        } else {
          const __m256i lo = _mm256_sub_epi32(acc[i], _mm256_set1_epi32(static_cast<int32_t>(p.zero_point) * s[0]));
          const __m256i hi = _mm256_sub_epi32(acc_hi[i], _mm256_set1_epi32(static_cast<int32_t>(p.zero_point) * s[1]));
          dot = _mm256_fmadd_ps(dsc0, _mm256_cvtepi32_ps(lo), _mm256_mul_ps(dsc1, _mm256_cvtepi32_ps(hi)));
        }
        accf[i] = _mm256_fmadd_ps(dot, _mm256_set1_ps(p.dx[xi]), accf[i]);
      }
      continue;
    }
    if constexpr (S == kSubMin) {
      const int64_t sub = (tile * groups + g) * kTile + 8 * half;
      d = _mm256_mul_ps(d, load_int8x8(p.sub_scales + sub));
      mn = _mm256_mul_ps(mn, load_int8x8(p.sub_mins + sub));
    }
    for (int i = 0; i < MB; ++i) {
      const int64_t xi = (m0 + i) * groups + g;
      const __m256 dot = _mm256_cvtepi32_ps(acc[i]), off = _mm256_set1_ps(p.off[xi]);
      if constexpr (HAS_MIN) {
        accf[i] = _mm256_fmadd_ps(d, _mm256_mul_ps(dot, _mm256_set1_ps(p.dx[xi])), accf[i]);
        accf[i] = _mm256_fmadd_ps(mn, off, accf[i]);
      } else {
        accf[i] = _mm256_fmadd_ps(d, _mm256_fmadd_ps(dot, _mm256_set1_ps(p.dx[xi]), off), accf[i]);
      }
    }
  }
  const int64_t col = tile * kTile + 8 * half;
  const __m256 b = p.bias ? _mm256_loadu_ps(p.bias + col) : _mm256_setzero_ps();
  for (int i = 0; i < MB; ++i) _mm256_storeu_ps(p.y + (m0 + i) * p.n + col, _mm256_add_ps(accf[i], b));
}

// 6 for 4- and 5-bit codes (against 4, with the int16 sums above: 512-row GEMMs 15-25% faster),
// 4 for 6- and 8-bit ones, whose loops need more registers (at 6 they spilled, and their 16-row
// GEMMs were ~10% slower), for 16-k sub-blocks, whose second sums (acc_hi) need as many, and for
// 4-bit codes through a codebook, which run the 8-bit loop's dots.
template <int BITS, Scheme S>
constexpr int rows_per_pass() { return BITS <= 5 && !sub16(S) && S != kCodebookZeroPoint ? 6 : 4; }
#else
template <int BITS, Scheme S>
constexpr int rows_per_pass() { return 8; }
#endif

template <int BITS, Scheme S, int MB>
void rows_block(const Problem& p, int64_t tile0, int64_t tile1, int64_t m0) {
#ifdef VIVACE_SIMDE
  for (int64_t t = tile0; t < tile1; ++t) {
    half_tile_block<BITS, S, MB>(p, t, 0, m0);
    half_tile_block<BITS, S, MB>(p, t, 1, m0);
  }
#else
  // One tile at a time: its weights are one sequential stream. Interleaving 2 or 4 tiles'
  // streams measured slower for every M (lm_head M=1 1048 -> 865 us, M=4 1796 -> 1017 us,
  // benchmarks/kernels.py --threads 1 --clock cpu).
  for (int64_t t = tile0; t < tile1; ++t) tile_block<BITS, S, MB, 1>(p, t, m0);
#endif
}

// The last `rows` (< rows_per_pass<BITS, S>()) activation rows from m0 in one pass over the weights (a
// verify step's k + 1 = 5 rows took as long as 8 when split into 4 + 1).
template <int BITS, Scheme S, int R>
void rest_block(const Problem& p, int64_t tile0, int64_t tile1, int64_t m0, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) rows_block<BITS, S, R>(p, tile0, tile1, m0);
    else rest_block<BITS, S, R - 1>(p, tile0, tile1, m0, rows);
  }
}

template <int BITS, Scheme S>
void run(const Problem& p) {
  const int64_t tiles = p.n / kTile;
  // Output tiles split across threads one tile at a time, so that the threads' shares differ by
  // at most a tile (in blocks of 4 tiles, a 576-wide layer's 9 blocks split 5 : 4, and the thread
  // with 5 set the pace); within a thread's share, blocks of 4 tiles, every activation row reusing
  // a block's weights from cache. A thread gets at least kMinWorkPerThread (weight bytes times
  // 8-row passes) so that the smallest GEMVs stay on one thread: waking a second one costs more
  // than it saves. 128 KiB: served batch-1 median ITL 5.0-5.6 ms against 5.7-6.3 at 512 KiB
  // (three alternating runs each) and 5.6-5.7 at 48 KiB.
  const int64_t tile_work = kTile * p.k * BITS / 8 * ((p.m + 7) / 8);
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / tile_work);
  at::parallel_for(0, tiles, grain, [&](int64_t first, int64_t last) {
    for (int64_t t0 = first; t0 < last; t0 += 4) {  // blocks outer: a block's weights stay in L1 across rows
      const int64_t t1 = std::min(last, t0 + 4);
      int64_t m0 = 0;
      constexpr int kRows = rows_per_pass<BITS, S>();
      for (; m0 + kRows <= p.m; m0 += kRows) rows_block<BITS, S, kRows>(p, t0, t1, m0);
      rest_block<BITS, S, kRows - 1>(p, t0, t1, m0, p.m - m0);
    }
  });
}

at::Tensor quant_linear(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias,
                        int64_t bits, int64_t out_features, int64_t weight_group, int64_t zero_point,
                        const c10::optional<at::Tensor>& sub_scales, const c10::optional<at::Tensor>& sub_mins,
                        int64_t sub_group, const c10::optional<at::Tensor>& codebook) {
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(bits >= 2 && bits <= 8 && bits != 7, "bits must be 2, 3, 4, 5, 6 or 8");
  const int64_t k = input.size(-1), n = scales.size(0) * kTile;
  const at::Tensor x = input.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  TORCH_CHECK(k % kGroup == 0 && weight_group % kGroup == 0 && k % weight_group == 0 && out_features <= n,
              "need K % 32 == 0 and a weight group that is a multiple of 32 dividing K");
  TORCH_CHECK(codes.numel() == n * k * bits / 8 && scales.numel() == n * (k / weight_group), "packed sizes mismatch");
  const bool has_min = mins.has_value();
  TORCH_CHECK(scales.scalar_type() == at::kShort && (!has_min || mins->scalar_type() == at::kShort),
              "scales and mins must be float16 bit patterns stored as int16");
  const bool two_level = sub_scales.has_value(), looked_up = codebook.has_value();
  const Scheme scheme = looked_up   ? kCodebookZeroPoint
                        : !two_level ? (has_min ? kMin : kZeroPoint)
                                     : sub_group == 16 ? (has_min ? kSub16Min : kSub16ZeroPoint) : kSubMin;
  const bool known = scheme == kSub16ZeroPoint      ? bits == 3 || bits == 6
                     : scheme == kSub16Min          ? bits == 2
                     : scheme == kSubMin            ? sub_group == 32 && has_min && (bits == 4 || bits == 5)
                     : scheme == kCodebookZeroPoint ? bits == 4 && !has_min && !two_level
                                                    : bits == 4 || bits == 5 || bits == 8;
  TORCH_CHECK(known, "codes and scales of no known form: 4-, 5- or 8-bit codes with one level of scales, or two "
              "levels with sub_group 32 and mins for 4- or 5-bit codes (Q4_K, Q5_K), 16 and a zero point for 3- or "
              "6-bit codes (Q3_K, Q6_K), 16 and mins for 2-bit codes (Q2_K); a codebook with 4-bit codes, a zero "
              "point and one level of scales (IQ4_NL, IQ4_XS)");
  TORCH_CHECK(!looked_up || (codebook->scalar_type() == at::kByte && codebook->numel() == 16 &&
              codebook->is_contiguous()), "a codebook is 16 contiguous uint8 entries");
  if (two_level) {
    TORCH_CHECK(weight_group % sub_group == 0 && sub_scales->scalar_type() == at::kChar &&
                sub_scales->numel() == n * (k / sub_group), "sub-block scales: int8 [N/16, K/sub_group, 16]");
    TORCH_CHECK(has_min == sub_mins.has_value() && (!has_min || (sub_mins->scalar_type() == at::kChar &&
                sub_mins->numel() == sub_scales->numel())), "sub-block mins: like the sub-block scales, with mins");
  }
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  const at::Tensor bias32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const QuantizedActivations& xa = quantize_activations(x, has_min ? 1.0f : -static_cast<float>(zero_point));
  Problem p{codes.data_ptr<uint8_t>(), reinterpret_cast<const at::Half*>(scales.data_ptr<int16_t>()),
            has_min ? reinterpret_cast<const at::Half*>(mins->data_ptr<int16_t>()) : nullptr,
            bias32.defined() ? bias32.data_ptr<float>() : nullptr,
            two_level ? sub_scales->data_ptr<int8_t>() : nullptr,
            two_level && has_min ? sub_mins->data_ptr<int8_t>() : nullptr,
            looked_up ? codebook->data_ptr<uint8_t>() : nullptr,
            xa.codes.data(), xa.scales.data(), xa.offsets.data(), xa.sums.data(),
            y.data_ptr<float>(), m, n, k, weight_group, zero_point};
  switch (scheme) {
    case kSub16ZeroPoint: if (bits == 6) run<6, kSub16ZeroPoint>(p); else run<3, kSub16ZeroPoint>(p); break;
    case kSub16Min: run<2, kSub16Min>(p); break;
    case kCodebookZeroPoint: run<4, kCodebookZeroPoint>(p); break;
    case kSubMin: if (bits == 5) run<5, kSubMin>(p); else run<4, kSubMin>(p); break;
    case kMin: if (bits == 8) run<8, kMin>(p); else if (bits == 5) run<5, kMin>(p); else run<4, kMin>(p); break;
    case kZeroPoint:
      if (bits == 8) run<8, kZeroPoint>(p); else if (bits == 5) run<5, kZeroPoint>(p); else run<4, kZeroPoint>(p);
      break;
  }
  if (out_features != n) y = y.narrow(1, 0, out_features).contiguous();
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = out_features;
  return y.to(input.scalar_type()).reshape(shape);
}

}  // namespace

// y[..., out_features] (dtype of x) = x[..., K] @ dequant(W)^T + bias, W tiled as in the file header.
TORCH_LIBRARY(vivace_kernels, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? bias, int bits, "
        "int out_features, int group_size, int zero_point, Tensor? sub_scales=None, Tensor? sub_mins=None, "
        "int sub_group=0, Tensor? codebook=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(vivace_kernels, CPU, m) { m.impl("quant_linear", &quant_linear); }
