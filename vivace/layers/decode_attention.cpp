// Paged decode attention on AVX-512: one new query token per sequence, one op per layer.
//
// Registers vivace::paged_decode_attention with the dispatcher, so eager calls and compiled
// graphs (inductor's C++ wrapper included) reach it without Python. The cache is one tensor
// [2, num_blocks, block_size, kv_heads, head_dim] (keys, then values); a token's slot is
// block * block_size + offset. Scores and the softmax are float32 whatever the dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(at::BFloat16* p, __m512 x) {
  // Round to nearest even, as c10::BFloat16's conversion does for finite values.
  __m512i bits = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
inline void store16(at::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

struct Layout {
  int64_t num_slots, block_size, kv_heads, head_dim, group;  // group: query heads per kv head
  int64_t token_stride() const { return kv_heads * head_dim; }
};

// Attend the `group` query heads sharing kv head `kvh` of one sequence over its first
// `seq_len` tokens. q and out point at the group's first head ([group, head_dim]).
template <typename T>
void attend_group(const T* q, T* out, const T* keys, const T* values, const int64_t* table,
                  int64_t seq_len, int64_t kvh, float scale, const Layout& s, std::vector<float>& buf) {
  const int64_t d = s.head_dim, g_count = s.group;
  buf.assign(g_count * (seq_len + 2 * d), 0.0f);
  float* scores = buf.data();                   // [group, seq_len]
  float* query = scores + g_count * seq_len;    // [group, head_dim], pre-scaled
  float* acc = query + g_count * d;             // [group, head_dim]
  for (int64_t i = 0; i < g_count * d; i += 16)
    _mm512_storeu_ps(query + i, _mm512_mul_ps(load16(q + i), _mm512_set1_ps(scale)));
  auto row = [&](const T* base, int64_t t) {
    return base + (table[t / s.block_size] * s.block_size + t % s.block_size) * s.token_stride() + kvh * d;
  };
  for (int64_t t = 0; t < seq_len; ++t) {
    const T* k = row(keys, t);
    for (int64_t g = 0; g < g_count; ++g) {
      __m512 dot = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) dot = _mm512_fmadd_ps(_mm512_loadu_ps(query + g * d + i), load16(k + i), dot);
      scores[g * seq_len + t] = _mm512_reduce_add_ps(dot);
    }
  }
  for (int64_t g = 0; g < g_count; ++g) {
    float* sc = scores + g * seq_len;
    float peak = -std::numeric_limits<float>::infinity(), total = 0.0f;
    for (int64_t t = 0; t < seq_len; ++t) peak = std::max(peak, sc[t]);
    for (int64_t t = 0; t < seq_len; ++t) total += (sc[t] = std::exp(sc[t] - peak));
    for (int64_t t = 0; t < seq_len; ++t) sc[t] /= total;
  }
  for (int64_t t = 0; t < seq_len; ++t) {
    const T* v = row(values, t);
    for (int64_t g = 0; g < g_count; ++g) {
      __m512 p = _mm512_set1_ps(scores[g * seq_len + t]);
      for (int64_t i = 0; i < d; i += 16)
        _mm512_storeu_ps(acc + g * d + i, _mm512_fmadd_ps(p, load16(v + i), _mm512_loadu_ps(acc + g * d + i)));
    }
  }
  for (int64_t i = 0; i < g_count * d; i += 16) store16(out + i, _mm512_loadu_ps(acc + i));
}

template <typename T>
void write_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& cache,
                      const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& seq_lens,
                      double scale, at::Tensor& out, const Layout& s) {
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
  at::parallel_for(0, num_seqs * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / s.kv_heads, kvh = task % s.kv_heads, head = kvh * s.group;
      attend_group<T>(q.data_ptr<T>() + b * q.stride(0) + head * s.head_dim,
                      out.data_ptr<T>() + (b * s.kv_heads * s.group + head) * s.head_dim, keys, values,
                      tables.data_ptr<int64_t>() + b * tables.stride(0), lens[b], kvh,
                      static_cast<float>(scale), s, buf);
    }
  });
}

// Rows must be dense in their last two dims; a sliced batch dimension is fine.
bool rows_dense(const at::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2); }

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
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
    case at::kFloat: write_and_attend<float>(qd, kd, vd, kv_cache, slots, tables, lens, scale, out, s); break;
    case at::kBFloat16: write_and_attend<at::BFloat16>(qd, kd, vd, kv_cache, slots, tables, lens, scale, out, s); break;
    case at::kHalf: write_and_attend<at::Half>(qd, kd, vd, kv_cache, slots, tables, lens, scale, out, s); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vivace, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(vivace, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
