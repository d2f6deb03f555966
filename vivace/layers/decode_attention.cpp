// Paged decode attention on AVX-512 (and on AVX2: attend_queries_avx2): one new query token per
// sequence, one op per layer.
//
// Registers vivace::paged_decode_attention with the dispatcher, so eager calls and compiled
// graphs (inductor's C++ wrapper included) reach it without Python. The cache is one tensor
// [2, num_blocks, block_size, kv_heads, head_dim] (keys, then values); a token's slot is
// block * block_size + offset. The cache may be narrower than q (float32 queries over a float16
// or bfloat16 cache: half the bytes a step reads); scores and the softmax are float32 whatever
// the dtypes. With a window w > 0 a query attends only the last w tokens of its sequence
// (sliding-window layers). On AVX-512 a row's result is bit for bit the prefill kernel's for the
// same row (attention_math.h), so a position's K/V do not depend on which kernel made the hidden
// states under them (a prefix-cache hit on an earlier answer against a miss).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_math.h"
#include "simd.h"

namespace {

using namespace vivace_simd;

struct Layout {
  int64_t num_slots, block_size, kv_heads, head_dim, group;  // group: query heads per kv head
  int64_t token_stride() const { return kv_heads * head_dim; }
};

// Query heads attended together per kv head: at most 4 (head_dim <= 64), 2 (<= 240) or 1 (256),
// so a group's queries and accumulators stay in registers.
template <int ND>
constexpr int heads_per_pass() { return ND <= 4 ? 4 : (ND < 16 ? 2 : 1); }

// One kv head's rows of one sequence's blocks [first, end) in the cache, walked in table order: a
// paged sequence's blocks lie anywhere in the pool, so each block's rows are asked for ahead.
template <typename C>
struct HeadBlocks {
  const C *keys, *values;
  const int64_t* table;
  int64_t block_size, stride, column, head_dim, seq_len, first, end;  // column: the head's first element in a row

  HeadBlocks(const C* keys, const C* values, const int64_t* table, const Layout& s, int64_t kvh, int64_t seq_len,
             int64_t start)
      : keys(keys), values(values), table(table), block_size(s.block_size), stride(s.token_stride()),
        column(kvh * s.head_dim), head_dim(s.head_dim), seq_len(seq_len), first(start / s.block_size),
        end((seq_len + s.block_size - 1) / s.block_size) {}

  // Block j's first row of this head in `cache` (keys or values), and how many rows of the sequence it holds.
  const C* rows(const C* cache, int64_t j) const { return cache + table[j] * block_size * stride + column; }
  int64_t count(int64_t j) const { return std::min(block_size, seq_len - j * block_size); }
  // Asks for the rows that follow block j of `cache`: the next block's, or after the last key
  // block the first value block's.
  void prefetch_after(const C* cache, int64_t j) const {
    if (j + 1 < end)
      prefetch_rows(rows(cache, j + 1), count(j + 1), stride, head_dim);
    else if (cache == keys)
      prefetch_rows(rows(values, first), count(first), stride, head_dim);
  }
};

#ifndef VIVACE_SIMDE
// dot[g] = the lane-wise products of query head g with key row k, chained over its ND vectors
// (16 partial sums, the first product a fmadd onto zero as attention_math.h says), for the first
// gb heads; the key row is loaded once.
template <typename C, int ND, int GB>
inline void head_dots(const __m512 (&query)[GB][ND], const C* k, int gb, __m512 (&dot)[GB]) {
  __m512 key[ND];
  for (int i = 0; i < ND; ++i) key[i] = load16(k + 16 * i);
  for (int g = 0; g < GB; ++g) {
    if (g >= gb) break;
    dot[g] = _mm512_setzero_ps();
    for (int i = 0; i < ND; ++i) dot[g] = _mm512_fmadd_ps(query[g][i], key[i], dot[g]);
  }
}

// Attend gb query vectors (gb <= heads_per_pass), all of one sequence and kv head `kvh`, query g
// (qs[g], [head_dim]) over that sequence's tokens [start, lens[g]) into outs[g]; ND = head_dim / 16.
// The queries are heads of one row, or of consecutive rows (a prompt chunk riding the decode
// step), whose lengths then differ: a query's softmax covers its own tokens only (the rest weigh
// zero), so its result is the same whatever else the pass holds. The prefill kernel's arithmetic
// (attention_math.h), so a query's output is that kernel's bits for the same row, in three passes:
// every score (the blocks walked in table order, each key row read once for all gb queries), the
// online softmax over absolute chunks of BK keys, then the values, each accumulator scaled by its
// chunk's alpha where a chunk starts. Apart, the passes pay no per-chunk latency the others wait on.
template <typename T, typename C, int ND>
void attend_queries(const T* const* qs, T* const* outs, const int64_t* lens, int gb, const C* keys, const C* values,
                    const int64_t* table, int64_t start, int64_t kvh, float scale, const Layout& s,
                    std::vector<float>& buf) {
  using vivace_attention::BK;
  constexpr int GB = heads_per_pass<ND>();
  constexpr int64_t D = 16 * ND;
  const int64_t seq_len = *std::max_element(lens, lens + gb);
  const HeadBlocks<C> blocks(keys, values, table, s, kvh, seq_len, start);
  const int64_t stride = s.token_stride(), bs = s.block_size;
  const int64_t first_chunk = start / BK, chunks = (seq_len - 1) / BK + 1 - first_chunk;
  const int64_t width = (first_chunk + chunks) * BK;  // scores at their key's index, whole chunks
  buf.resize(GB * (width + chunks));
  float* scores[GB];
  float* alpha[GB];  // per chunk from first_chunk
  for (int g = 0; g < GB; ++g) scores[g] = buf.data() + g * width, alpha[g] = buf.data() + GB * width + g * chunks;
  const float qscale = vivace_attention::query_scale(scale);
  __m512 query[GB][ND];
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < ND; ++i)
      query[g][i] = g < gb ? _mm512_mul_ps(load16(qs[g] + 16 * i), _mm512_set1_ps(qscale)) : _mm512_setzero_ps();
  // Scores, 16 tokens at a time where a block allows; a key's score is its own lanes' tree
  // (hsum16), whatever keys share its vector.
  for (int64_t j = blocks.first; j < blocks.end; ++j) {
    const C* base = blocks.rows(keys, j);
    const int64_t n = blocks.count(j), at = j * bs;
    blocks.prefetch_after(keys, j);
    for (int64_t t = std::max<int64_t>(0, start - at); t < n; t += 16) {
      const int64_t rest = n - t;
      __m512 part[GB][16];
      for (int u = 0; u < 16; ++u) {
        __m512 dot[GB] = {};
        if (u < rest) head_dots<C, ND, GB>(query, base + (t + u) * stride, gb, dot);
        for (int g = 0; g < GB; ++g) part[g][u] = dot[g];
      }
      for (int g = 0; g < GB; ++g) {
        if (g >= gb) break;
        _mm512_mask_storeu_ps(scores[g] + at + t, tail_mask(rest), vivace_attention::hsum16(part[g]));
      }
    }
  }
  // Softmax numerators, chunk by chunk; each sum divides its output once at the end.
  float total[GB];
  for (int g = 0; g < GB; ++g) {
    if (g >= gb) break;
    float peak = -std::numeric_limits<float>::infinity();
    total[g] = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k0 = (first_chunk + c) * BK;
      alpha[g][c] = vivace_attention::softmax_chunk(scores[g] + k0, std::max<int64_t>(0, start - k0), lens[g] - k0,
                                                    peak, total[g]);
    }
  }
  // Values weighted by the numerators: each value row loaded once for every head. The first
  // chunk's accumulators are zero (alpha changes nothing).
  __m512 acc[GB][ND];
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < ND; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t j = blocks.first; j < blocks.end; ++j) {
    const C* base = blocks.rows(values, j);
    const int64_t n = blocks.count(j), at = j * bs;
    blocks.prefetch_after(values, j);
    for (int64_t u = std::max<int64_t>(0, start - at); u < n; ++u) {
      const int64_t key = at + u;
      if (key % BK == 0 && key > start)
        for (int g = 0; g < GB; ++g) {
          if (g >= gb) break;
          const __m512 a = _mm512_set1_ps(alpha[g][key / BK - first_chunk]);
          for (int i = 0; i < ND; ++i) acc[g][i] = _mm512_mul_ps(acc[g][i], a);
        }
      const C* v = base + u * stride;
      __m512 value[ND];
      for (int i = 0; i < ND; ++i) value[i] = load16(v + 16 * i);
      for (int g = 0; g < GB; ++g) {
        if (g >= gb) break;
        const __m512 p = _mm512_set1_ps(scores[g][key]);
        for (int i = 0; i < ND; ++i) acc[g][i] = _mm512_fmadd_ps(p, value[i], acc[g][i]);
      }
    }
  }
  for (int g = 0; g < GB; ++g) {
    if (g >= gb) break;
    const __m512 w = _mm512_set1_ps(1.0f / total[g]);
    for (int i = 0; i < ND; ++i) store16(outs[g] + 16 * i, _mm512_mul_ps(acc[g][i], w));
  }
}
#else
// AVX2 (the SIMDe build): attend_queries's __m512 values live in pairs of the 16 ymm registers,
// and its 16-token score passes hold 64 of them: they spill, and the default model's decode
// attention took ~70 us a layer at 128 tokens. Here the same attention in native 256-bit code,
// sized for 16 registers: scores 8 tokens of one head at a time (the queries, scaled, in a float
// buffer; the keys re-read from L1 per head), the values one head and up to 8 vectors at a time.
// Every (query, token) score is the same sum in the same order whatever else the task holds, so
// a verify step's rows equal the one-row steps they stand for, as above.

// Lane u: the sum of v[u]'s 8 lanes, by the same tree for every u.
inline __m256 hsum8(const __m256* v) {
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// The scores of tokens t .. t + rest - 1 (rest <= 8) of `base` (rows `stride` apart) against the
// scaled float query q, into sc[t ..]; missing tokens are zero in the tree and not stored.
template <typename C, int N8, bool FULL>
inline void score8(const float* q, const C* base, int64_t t, int rest, int64_t stride, float* sc) {
  __m256 dot[8];
  for (int u = 0; u < 8; ++u) dot[u] = _mm256_setzero_ps();
  for (int i = 0; i < N8; ++i) {
    const __m256 qi = _mm256_loadu_ps(q + 8 * i);
    for (int u = 0; u < 8; ++u)
      if (FULL || u < rest) dot[u] = _mm256_fmadd_ps(qi, load8(base + (t + u) * stride + 8 * i), dot[u]);
  }
  const __m256 sums = hsum8(dot);
  if (FULL) {
    _mm256_storeu_ps(sc + t, sums);
  } else {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sums);
    std::copy(lanes, lanes + rest, sc + t);
  }
}

// attend_queries on AVX2 (the same arguments and results); ND = head_dim / 16.
template <typename T, typename C, int ND>
void attend_queries_avx2(const T* const* qs, T* const* outs, const int64_t* lens, int gb, const C* keys,
                         const C* values, const int64_t* table, int64_t start, int64_t kvh, float scale,
                         const Layout& s, std::vector<float>& buf) {
  constexpr int N8 = 2 * ND;
  constexpr int64_t D = 16 * ND;
  const int64_t seq_len = *std::max_element(lens, lens + gb);
  const HeadBlocks<C> blocks(keys, values, table, s, kvh, seq_len, start);
  const int64_t stride = s.token_stride(), bs = s.block_size, width = seq_len + 8;
  buf.resize(gb * (width + D));
  float* query = buf.data() + gb * width;  // [gb, D]: the queries times the scale, in float32
  for (int g = 0; g < gb; ++g)
    for (int i = 0; i < N8; ++i)
      _mm256_storeu_ps(query + g * D + 8 * i, _mm256_mul_ps(load8(qs[g] + 8 * i), _mm256_set1_ps(scale)));
  const auto scores = [&](int g) { return buf.data() + g * width; };
  for (int64_t j = blocks.first; j < blocks.end; ++j) {
    const C* base = blocks.rows(keys, j);
    const int64_t n = blocks.count(j), at = j * bs;
    blocks.prefetch_after(keys, j);
    for (int64_t t = std::max<int64_t>(0, start - at); t < n; t += 8) {
      const int rest = static_cast<int>(std::min<int64_t>(8, n - t));
      for (int g = 0; g < gb; ++g) {
        if (rest == 8) score8<C, N8, true>(query + g * D, base, t, rest, stride, scores(g) + at);
        else score8<C, N8, false>(query + g * D, base, t, rest, stride, scores(g) + at);
      }
    }
  }
  // Softmax numerators over each query's own tokens; each sum divides its output once at the end.
  float inv[heads_per_pass<1>()];  // gb is at most that (write_and_attend's tasks)
  for (int g = 0; g < gb; ++g) {
    float* sc = scores(g);
    const int64_t len = lens[g];
    __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = start;
    for (; t + 8 <= len; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(sc + t));
    float peak = hmax8(top8);
    for (; t < len; ++t) peak = std::max(peak, sc[t]);
    std::fill(sc + len, sc + seq_len, 0.0f);
    const __m256 top = _mm256_set1_ps(peak);
    __m256 total8 = _mm256_setzero_ps();
    for (t = start; t + 8 <= len; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), top));
      total8 = _mm256_add_ps(total8, e);
      _mm256_storeu_ps(sc + t, e);
    }
    float total = vivace_simde::hsum(total8);
    for (; t < len; ++t) {
      sc[t] = _mm256_cvtss_f32(exp8(_mm256_set1_ps(sc[t] - peak)));
      total += sc[t];
    }
    inv[g] = 1.0f / total;
  }
  // Values weighted by the numerators, one head and up to 8 vectors of it at a time.
  for (int g = 0; g < gb; ++g) {
    const float* sc = scores(g);
    for (int c = 0; c < N8; c += 8) {
      const int cw = std::min(8, N8 - c);
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t j = blocks.first; j < blocks.end; ++j) {
        const C* base = blocks.rows(values, j) + 8 * c;
        const int64_t n = blocks.count(j), at = j * bs;
        if (g == 0 && c == 0) blocks.prefetch_after(values, j);
        for (int64_t u = std::max<int64_t>(0, start - at); u < n; ++u) {
          const __m256 p = _mm256_set1_ps(sc[at + u]);
          const C* v = base + u * stride;
          for (int i = 0; i < 8; ++i)
            if (i < cw) acc[i] = _mm256_fmadd_ps(p, load8(v + 8 * i), acc[i]);
        }
      }
      const __m256 w = _mm256_set1_ps(inv[g]);
      for (int i = 0; i < cw; ++i) store8(outs[g] + 8 * (c + i), _mm256_mul_ps(acc[i], w));
    }
  }
}
#endif

// Rows [n, stride] of T into cache rows of C (a plain copy when they match).
template <typename T, typename C>
void store_rows(C* dst, const T* src, int64_t len) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(dst, src, len * sizeof(T));
  } else {
    for (int64_t i = 0; i < len; i += 16) store16(dst + i, load16(src + i));
  }
}

// Rows [b, end) are consecutive positions of one sequence when each is one token longer than
// the row before it and sees the same blocks: a prompt chunk riding the decode step as rows, or
// a verify step's proposals. Rows of other sequences never pass (a sequence's partly filled
// last block is its own, so two sequences never share every block a row sees).
int64_t run_end(const at::Tensor& tables, const int64_t* lens, int64_t b, int64_t num_seqs, int64_t block_size) {
  const int64_t* first = tables.data_ptr<int64_t>() + b * tables.stride(0);
  int64_t e = b + 1;
  for (; e < num_seqs && lens[e] == lens[e - 1] + 1; ++e) {
    const int64_t* table = tables.data_ptr<int64_t>() + e * tables.stride(0);
    if (!std::equal(table, table + (lens[e] + block_size - 1) / block_size, first)) break;
  }
  return e;
}

// Rows in a run from which the prefill kernel attends them. Shorter runs are attended here, every
// K/V row read once per pass of heads_per_pass (row, head) pairs; the prefill kernel reads each
// row once for the whole run but first packs the sequence's K/V into float32 tiles, a cost that
// grows with the sequence, not the run (8 streams beside a run at 3,000 tokens: 4 rows added
// ~35 ms to the step, 16 rows ~49 ms). On AVX-512 both kernels give a row the same bits
// (attention_math.h); on AVX2 they do not, and a verify step's rows must stay under it there (up
// to 15: a prediction's 14 proposals and the next token, vivace/engine/prediction.py): this
// kernel's rows compute what one-row steps do, bit for bit, so greedy speculation is exact.
constexpr int64_t MIN_PREFILL_RUN = 16;

using PrefillFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double);

// vivace's native prefill kernel, found through the dispatcher under the name only its library
// registers; none while that library is not loaded.
std::optional<c10::TypedOperatorHandle<PrefillFn>> native_prefill() {
  static std::mutex mutex;
  static std::optional<c10::TypedOperatorHandle<PrefillFn>> op;  // kept once found; looked up again until then
  std::lock_guard<std::mutex> lock(mutex);
  if (!op)
    if (const auto handle = c10::Dispatcher::singleton().findOp({"vivace::paged_prefill_attention_native", ""}))
      op = handle->typed<PrefillFn>();
  return op;
}

// Attends rows [b, e), a run, with the native prefill kernel into out; false when that library
// is not loaded or the dtypes or shape are not ones it takes.
bool attend_run(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables, const int64_t* lens,
                int64_t b, int64_t e, double scale, at::Tensor& out) {
  // The dtype pairs the prefill kernel is built for: one dtype, or float32 over a 16-bit cache.
  const auto qt = q.scalar_type(), ct = cache.scalar_type();
  const bool pair = qt == ct || (qt == at::kFloat && (ct == at::kHalf || ct == at::kBFloat16));
  const auto prefill = pair && (q.size(2) <= 128 || q.size(2) == 256) ? native_prefill() : std::nullopt;
  if (!prefill) return false;
  out.narrow(0, b, e - b).copy_(prefill->call(q.narrow(0, b, e - b), cache, tables.select(0, b), lens[e - 1], scale));
  return true;
}

template <typename T, typename C>
void write_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& cache,
                      const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& seq_lens,
                      double scale, int64_t window, const int64_t* prompt, at::Tensor& out, const Layout& s) {
  const int64_t num_seqs = q.size(0), row = s.token_stride();
  C* keys = cache.data_ptr<C>();
  C* values = keys + s.num_slots * row;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < s.num_slots, "slot ", slot[b], " is outside the cache");
    store_rows(keys + slot[b] * row, k.data_ptr<T>() + b * k.stride(0), row);
    store_rows(values + slot[b] * row, v.data_ptr<T>() + b * v.stride(0), row);
  }
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t width = tables.size(1), num_blocks = s.num_slots / s.block_size;
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * s.block_size, "seq_len ", lens[b], " does not fit the block table");
    const int64_t* table = tables.data_ptr<int64_t>() + b * tables.stride(0);
    for (int64_t j = 0; j < (lens[b] + s.block_size - 1) / s.block_size; ++j)
      TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, "block ", table[j], " is outside the cache");
  }
  using Attend = void (*)(const T* const*, T* const*, const int64_t*, int, const C*, const C*, const int64_t*, int64_t,
                         int64_t, float, const Layout&, std::vector<float>&);
  Attend attend = nullptr;
  int per_pass = 0;
  switch (s.head_dim / 16) {
#ifdef VIVACE_SIMDE
#define VIVACE_CASE(ND) case ND: attend = attend_queries_avx2<T, C, ND>; per_pass = heads_per_pass<1>(); break;
#else
#define VIVACE_CASE(ND) case ND: attend = attend_queries<T, C, ND>; per_pass = heads_per_pass<ND>(); break;
#endif
    VIVACE_CASE(1) VIVACE_CASE(2) VIVACE_CASE(3) VIVACE_CASE(4) VIVACE_CASE(5) VIVACE_CASE(6) VIVACE_CASE(7)
    VIVACE_CASE(8) VIVACE_CASE(16)
#undef VIVACE_CASE
    default: TORCH_CHECK(false, "paged_decode_attention: head_dim ", s.head_dim, " is not a multiple of 16 up to 128, or 256");
  }
  // Tasks: a kv head of a group of rows (one row, or a run of one sequence's consecutive rows)
  // and up to per_pass of the (row, query head) pairs that share it. With `prompt` (a flag per
  // row: a position of the request's prompt), a run's prompt rows go to the prefill kernel
  // whatever their number, as a step on the prefill path attends them, and its other rows (the
  // next token, proposals to verify, generated tokens recomputed after a preemption) stay here,
  // as a one-row step attends them: each position then gets the same bits whatever step carries
  // it. Without flags, long runs go to the prefill kernel whole. A run whose last row's window
  // hides some key is attended here a row at a time (each row its own first key).
  struct Task { int64_t row, kvh, first_pair, pairs; };
  std::vector<Task> tasks;
  for (int64_t b = 0; b < num_seqs;) {
    int64_t e = run_end(tables, lens, b, num_seqs, s.block_size);
    if (prompt != nullptr) {
      int64_t p = b;
      while (p < e && prompt[p] != 0) ++p;
      if (p > b) {
        // As the prefill path: its kernel for the rows whose window hides no key, this one for those
        // past the window (a row at a time, below).
        int64_t w = p;
        if (window > 0)
          for (w = b; w < p && lens[w] <= window;) ++w;
        if (w > b && attend_run(q, cache, tables, lens, b, w, scale, out)) {
          b = w;
          continue;
        }
        e = w > b ? w : p;
      } else {
        while (p < e && prompt[p] == 0) ++p;
        e = p;
      }
    } else if (window == 0 && e - b >= MIN_PREFILL_RUN && attend_run(q, cache, tables, lens, b, e, scale, out)) {
      b = e;
      continue;
    }
    if (window > 0 && lens[e - 1] > window) e = b + 1;
    const int64_t pairs = (e - b) * s.group;
    for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh)
      for (int64_t first = 0; first < pairs; first += per_pass)
        tasks.push_back({b, kvh, first, std::min<int64_t>(per_pass, pairs - first)});
    b = e;
  }
  const int64_t heads = s.kv_heads * s.group, row_stride = q.stride(0);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    constexpr int kMaxPerPass = heads_per_pass<1>();  // the most of any head size
    const T* qs[kMaxPerPass];
    T* outs[kMaxPerPass];
    int64_t query_lens[kMaxPerPass];
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      for (int64_t g = 0; g < task.pairs; ++g) {
        const int64_t pair = task.first_pair + g, row = task.row + pair / s.group;
        const int64_t head = task.kvh * s.group + pair % s.group;
        qs[g] = q.data_ptr<T>() + row * row_stride + head * s.head_dim;
        outs[g] = out.data_ptr<T>() + (row * heads + head) * s.head_dim;
        query_lens[g] = lens[row];
      }
      const int64_t start = window > 0 ? std::max<int64_t>(0, lens[task.row] - window) : 0;
      attend(qs, outs, query_lens, static_cast<int>(task.pairs), keys, values,
             tables.data_ptr<int64_t>() + task.row * tables.stride(0), start, task.kvh, static_cast<float>(scale), s,
             buf);
    }
  });
}

// Rows must be dense in their last two dims; a sliced batch dimension is fine.
bool rows_dense(const at::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2); }

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window, const c10::optional<at::Tensor>& prompt_rows) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && kv_cache.dim() == 5, "bad ranks");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.size(0) == 2, "kv_cache must be contiguous [2, N, bs, h, d]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k and v must share a dtype");
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
  at::Tensor prompt;
  if (prompt_rows.has_value()) {
    TORCH_CHECK(prompt_rows->scalar_type() == at::kLong && prompt_rows->numel() == q.size(0),
                "prompt_rows must be int64, one flag per row");
    prompt = prompt_rows->contiguous();
  }
  const int64_t* flags = prompt.defined() ? prompt.data_ptr<int64_t>() : nullptr;
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const auto qt = q.scalar_type(), ct = kv_cache.scalar_type();
  if (qt == at::kFloat && ct == at::kFloat) write_and_attend<float, float>(qd, kd, vd, kv_cache, slots, tables, lens, scale, window, flags, out, s);
  else if (qt == at::kFloat && ct == at::kHalf) write_and_attend<float, at::Half>(qd, kd, vd, kv_cache, slots, tables, lens, scale, window, flags, out, s);
  else if (qt == at::kFloat && ct == at::kBFloat16) write_and_attend<float, at::BFloat16>(qd, kd, vd, kv_cache, slots, tables, lens, scale, window, flags, out, s);
  else if (qt == at::kBFloat16 && ct == at::kBFloat16) write_and_attend<at::BFloat16, at::BFloat16>(qd, kd, vd, kv_cache, slots, tables, lens, scale, window, flags, out, s);
  else if (qt == at::kHalf && ct == at::kHalf) write_and_attend<at::Half, at::Half>(qd, kd, vd, kv_cache, slots, tables, lens, scale, window, flags, out, s);
  else TORCH_CHECK(false, "paged_decode_attention: unsupported dtypes ", qt, " (q) and ", ct, " (kv_cache)");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vivace, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window=0, Tensor? prompt_rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(vivace, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
