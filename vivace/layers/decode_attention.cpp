// Paged decode attention on AVX-512: one new query token per sequence, one op per layer.
//
// Registers vivace::paged_decode_attention with the dispatcher, so eager calls and compiled
// graphs (inductor's C++ wrapper included) reach it without Python. The cache is one tensor
// [2, num_blocks, block_size, kv_heads, head_dim] (keys, then values); a token's slot is
// block * block_size + offset. Scores and the softmax are float32 whatever the dtype. With a
// window w > 0 a query attends only the last w tokens of its sequence (sliding-window layers).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using namespace vivace_simd;

struct Layout {
  int64_t num_slots, block_size, kv_heads, head_dim, group;  // group: query heads per kv head
  int64_t token_stride() const { return kv_heads * head_dim; }
};

// The 16 horizontal sums of v[0..15], in order, as one vector (a transpose-and-add tree).
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

// Attend the `group` query heads sharing kv head `kvh` of one sequence over its tokens
// [start, seq_len); ND = head_dim / 16. q and out point at the group's first head
// ([group, head_dim]). Blocks are walked in table order, so no token needs a division; scores
// are kept at their token's index (those below `start` are never written or read).
template <typename T, int ND>
void attend_group(const T* q, T* out, const T* keys, const T* values, const int64_t* table, int64_t start,
                  int64_t seq_len, int64_t kvh, float scale, const Layout& s, std::vector<float>& buf) {
  const int64_t stride = s.token_stride(), bs = s.block_size, num_blocks = (seq_len + bs - 1) / bs;
  const int64_t first_block = start / bs;
  buf.resize(seq_len + 16);
  float* scores = buf.data();
  for (int64_t g = 0; g < s.group; ++g) {
    const T* qg = q + g * ND * 16;
    __m512 query[ND];
    for (int i = 0; i < ND; ++i) query[i] = _mm512_mul_ps(load16(qg + 16 * i), _mm512_set1_ps(scale));
    // Scores, 16 tokens at a time where a block allows.
    __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = first_block; j < num_blocks; ++j) {
      const T* base = keys + table[j] * bs * stride + kvh * ND * 16;
      const int64_t n = std::min(bs, seq_len - j * bs);
      float* sc = scores + j * bs;
      int64_t t = std::max<int64_t>(0, start - j * bs);
      for (; t + 16 <= n; t += 16) {
        __m512 part[16];
        for (int u = 0; u < 16; ++u) {
          const T* k = base + (t + u) * stride;
          __m512 dot = _mm512_mul_ps(query[0], load16(k));
          for (int i = 1; i < ND; ++i) dot = _mm512_fmadd_ps(query[i], load16(k + 16 * i), dot);
          part[u] = dot;
        }
        const __m512 sums = hsum16(part);
        peak = _mm512_max_ps(peak, sums);
        _mm512_storeu_ps(sc + t, sums);
      }
      for (; t < n; ++t) {
        const T* k = base + t * stride;
        __m512 dot = _mm512_mul_ps(query[0], load16(k));
        for (int i = 1; i < ND; ++i) dot = _mm512_fmadd_ps(query[i], load16(k + 16 * i), dot);
        sc[t] = _mm512_reduce_add_ps(dot);
        peak = _mm512_max_ps(peak, _mm512_set1_ps(sc[t]));
      }
    }
    // Softmax numerators; the sum divides the output once at the end.
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
    __m512 total = _mm512_setzero_ps();
    int64_t t = start;
    for (; t + 16 <= seq_len; t += 16) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + t), top));
      total = _mm512_add_ps(total, e);
      _mm512_storeu_ps(scores + t, e);
    }
    if (t < seq_len) {
      const __mmask16 m = static_cast<__mmask16>((1u << (seq_len - t)) - 1);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), top));
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
      _mm512_mask_storeu_ps(scores + t, m, e);
    }
    // Values weighted by the numerators.
    __m512 acc[ND];
    for (int i = 0; i < ND; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = first_block; j < num_blocks; ++j) {
      const T* base = values + table[j] * bs * stride + kvh * ND * 16;
      const int64_t n = std::min(bs, seq_len - j * bs);
      const float* sc = scores + j * bs;
      for (int64_t u = std::max<int64_t>(0, start - j * bs); u < n; ++u) {
        const __m512 p = _mm512_set1_ps(sc[u]);
        const T* v = base + u * stride;
        for (int i = 0; i < ND; ++i) acc[i] = _mm512_fmadd_ps(p, load16(v + 16 * i), acc[i]);
      }
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int i = 0; i < ND; ++i) store16(out + g * ND * 16 + 16 * i, _mm512_mul_ps(acc[i], inv));
  }
}

template <typename T>
void write_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& cache,
                      const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& seq_lens,
                      double scale, int64_t window, at::Tensor& out, const Layout& s) {
  const int64_t num_seqs = q.size(0), row_bytes = s.token_stride() * sizeof(T);
  T* keys = cache.data_ptr<T>();
  T* values = keys + s.num_slots * s.token_stride();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < s.num_slots, "slot ", slot[b], " is outside the cache");
    std::memcpy(keys + slot[b] * s.token_stride(), k.data_ptr<T>() + b * k.stride(0), row_bytes);
    std::memcpy(values + slot[b] * s.token_stride(), v.data_ptr<T>() + b * v.stride(0), row_bytes);
  }
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t width = tables.size(1), num_blocks = s.num_slots / s.block_size;
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * s.block_size, "seq_len ", lens[b], " does not fit the block table");
    const int64_t* table = tables.data_ptr<int64_t>() + b * tables.stride(0);
    for (int64_t j = 0; j < (lens[b] + s.block_size - 1) / s.block_size; ++j)
      TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, "block ", table[j], " is outside the cache");
  }
  using Attend = void (*)(const T*, T*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, float,
                         const Layout&, std::vector<float>&);
  Attend attend = nullptr;
  switch (s.head_dim / 16) {
    case 1: attend = attend_group<T, 1>; break;
    case 2: attend = attend_group<T, 2>; break;
    case 3: attend = attend_group<T, 3>; break;
    case 4: attend = attend_group<T, 4>; break;
    case 5: attend = attend_group<T, 5>; break;
    case 6: attend = attend_group<T, 6>; break;
    case 7: attend = attend_group<T, 7>; break;
    case 8: attend = attend_group<T, 8>; break;
    case 16: attend = attend_group<T, 16>; break;
    default: TORCH_CHECK(false, "paged_decode_attention: head_dim ", s.head_dim, " is not a multiple of 16 up to 128, or 256");
  }
  at::parallel_for(0, num_seqs * s.kv_heads, num_seqs == 1 ? s.kv_heads : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / s.kv_heads, kvh = task % s.kv_heads, head = kvh * s.group;
      const int64_t start = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      attend(q.data_ptr<T>() + b * q.stride(0) + head * s.head_dim,
             out.data_ptr<T>() + (b * s.kv_heads * s.group + head) * s.head_dim, keys, values,
             tables.data_ptr<int64_t>() + b * tables.stride(0), start, lens[b], kvh, static_cast<float>(scale), s,
             buf);
    }
  });
}

// Rows must be dense in their last two dims; a sliced batch dimension is fine.
bool rows_dense(const at::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2); }

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && kv_cache.dim() == 5, "bad ranks");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.size(0) == 2, "kv_cache must be contiguous [2, N, bs, h, d]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && k.scalar_type() == kv_cache.scalar_type() &&
              v.scalar_type() == kv_cache.scalar_type(), "q, k, v and kv_cache must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && block_tables.scalar_type() == at::kLong &&
              seq_lens.scalar_type() == at::kLong, "slot_mapping, block_tables and seq_lens must be int64");
  const Layout s{kv_cache.size(1) * kv_cache.size(2), kv_cache.size(2), kv_cache.size(3), kv_cache.size(4),
                 q.size(1) / kv_cache.size(3)};
  TORCH_CHECK(s.head_dim % 16 == 0 && q.size(2) == s.head_dim && q.size(1) == s.group * s.kv_heads,
              "head_dim must be a multiple of 16 and heads a multiple of kv heads");
  const at::Tensor qd = rows_dense(q) ? q : q.contiguous();
  const at::Tensor kd = rows_dense(k) ? k : k.contiguous();
  const at::Tensor vd = rows_dense(v) ? v : v.contiguous();
  const at::Tensor slots = slot_mapping.contiguous(), lens = seq_lens.contiguous();
  const at::Tensor tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  switch (q.scalar_type()) {
    case at::kFloat: write_and_attend<float>(qd, kd, vd, kv_cache, slots, tables, lens, scale, window, out, s); break;
    case at::kBFloat16: write_and_attend<at::BFloat16>(qd, kd, vd, kv_cache, slots, tables, lens, scale, window, out, s); break;
    case at::kHalf: write_and_attend<at::Half>(qd, kd, vd, kv_cache, slots, tables, lens, scale, window, out, s); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vivace, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(vivace, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
