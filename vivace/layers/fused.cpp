// Fused elementwise ops for the eager forward (prefill): each is one pass over its rows instead
// of PyTorch's chain of elementwise kernels and temporaries.
//
//   silu_mul(x [N, 2I]) -> [N, I]                 silu(x[:, :I]) * x[:, I:]
//   gelu_tanh_mul(x [N, 2I]) -> [N, I]            gelu(x[:, :I], approximate="tanh") * x[:, I:]
//   rms_norm(x [N, H], w [H], eps) -> [N, H]      as Hugging Face Llama: statistics in float32,
//                                                  the normalized row rounded to x's dtype, then w *
//   add_rms_norm(x, residual, w, eps) -> [N, H]   residual += x (in place), then rms_norm(residual)
//   rotary_(x [N, heads, D], cos [N, .., D/2], sin [N, .., D/2])
//                                                  neox rotation of (i, i + D/2) pairs, in place,
//                                                  by each token's own cos/sin row
//
// Rows may be strided (a slice of a fused projection); the last dimension must be dense.
// float32 and bfloat16; arithmetic in float32 registers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>

#include "simd.h"

namespace {

using namespace vivace_simd;

constexpr int64_t kGrain = 64;  // rows per parallel task: fewer stay on one thread

void check_rows(const at::Tensor& x, int64_t dim, const char* name) {
  TORCH_CHECK(x.dim() == dim && x.stride(-1) == 1, name, " must have ", dim, " dims and a dense last one");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16 only");
}

// The gate's activation g * sigmoid(z(g)), z given by Z: SiLU's z = g, and the tanh GELU's
// z = 2 sqrt(2 / pi) (g + 0.044715 g^3) (0.5 (1 + tanh(y)) = sigmoid(2y)).
struct Silu {
  static __m512 z(__m512 g) { return g; }
};
struct GeluTanh {
  static __m512 z(__m512 g) {
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    return _mm512_mul_ps(_mm512_set1_ps(1.5957691216057308f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
  }
};

template <typename T, typename Z>
void gated_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t n = out.size(1);
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = x.data_ptr<T>() + r * x.stride(0);
      const T* up = gate + n;
      T* y = out.data_ptr<T>() + r * n;
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 g = maskload16(gate + i, m);
        // The activation rounded to T, then the product rounded: PyTorch's two kernels do the same.
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), Z::z(g)));
        const __m512 a = round_to(y, _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        maskstore16(y + i, m, _mm512_mul_ps(a, maskload16(up + i, m)));
      }
    }
  });
}

template <typename Z>
at::Tensor gated(const at::Tensor& x, const char* name) {
  check_rows(x, 2, name);
  TORCH_CHECK(x.size(1) % 2 == 0, name, ": odd width");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) gated_rows<float, Z>(x, out); else gated_rows<at::BFloat16, Z>(x, out);
  return out;
}

at::Tensor silu_mul(const at::Tensor& x) { return gated<Silu>(x, "silu_mul input"); }
at::Tensor gelu_tanh_mul(const at::Tensor& x) { return gated<GeluTanh>(x, "gelu_tanh_mul input"); }

// out = w * rounded(row * rsqrt(mean(row^2) + eps)); with `residual`, row = residual += x first.
template <typename T>
void norm_rows(const at::Tensor& x, at::Tensor* residual, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t h = x.size(1);
  const T* weight = w.data_ptr<T>();
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x.data_ptr<T>() + r * x.stride(0);
      T* row = const_cast<T*>(xr);
      if (residual != nullptr) {
        row = residual->data_ptr<T>() + r * residual->stride(0);
        for (int64_t i = 0; i < h; i += 16) {
          const __mmask16 m = tail_mask(h - i);
          maskstore16(row + i, m, _mm512_add_ps(maskload16(row + i, m), maskload16(xr + i, m)));
        }
      }
      __m512 sq = _mm512_setzero_ps();
      for (int64_t i = 0; i < h; i += 16) {
        const __m512 v = maskload16(row + i, tail_mask(h - i));
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(h) +
                                                            static_cast<float>(eps)));
      T* y = out.data_ptr<T>() + r * h;
      for (int64_t i = 0; i < h; i += 16) {
        const __mmask16 m = tail_mask(h - i);
        const __m512 normed = round_to(y, _mm512_mul_ps(maskload16(row + i, m), scale));
        maskstore16(y + i, m, _mm512_mul_ps(maskload16(weight + i, m), normed));
      }
    }
  });
}

at::Tensor norm(const at::Tensor& x, at::Tensor* residual, const at::Tensor& w, double eps) {
  check_rows(x, 2, "rms_norm input");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a dense [hidden] of the input's dtype");
  if (residual != nullptr) {
    check_rows(*residual, 2, "rms_norm residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must match the input");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) norm_rows<float>(x, residual, w, eps, out);
  else norm_rows<at::BFloat16>(x, residual, w, eps, out);
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return norm(x, nullptr, w, eps); }

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  return norm(x, &residual, w, eps);
}

template <typename T>
void rotate_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t heads = x.size(1), half = x.size(2) / 2;
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* c = cos.data_ptr<T>() + r * cos.stride(0);
      const T* s = sin.data_ptr<T>() + r * sin.stride(0);
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* a = x.data_ptr<T>() + r * x.stride(0) + hd * x.stride(1);
        T* b = a + half;
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = tail_mask(half - i);
          const __m512 x1 = maskload16(a + i, m), x2 = maskload16(b + i, m);
          const __m512 cv = maskload16(c + i, m), sv = maskload16(s + i, m);
          // As apply_rotary rounds: each product to T, then the sum.
          const __m512 x1c = round_to(a, _mm512_mul_ps(x1, cv)), x2s = round_to(a, _mm512_mul_ps(x2, sv));
          const __m512 x2c = round_to(a, _mm512_mul_ps(x2, cv)), x1s = round_to(a, _mm512_mul_ps(x1, sv));
          maskstore16(a + i, m, _mm512_sub_ps(x1c, x2s));
          maskstore16(b + i, m, _mm512_add_ps(x2c, x1s));
        }
      }
    }
  });
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, 3, "rotary input");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary: odd head_dim");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->size(0) == x.size(0) && t->size(-1) == x.size(2) / 2 && t->stride(-1) == 1 &&
                t->numel() == x.size(0) * (x.size(2) / 2) && t->scalar_type() == x.scalar_type(),
                "rotary: cos and sin must hold one dense [head_dim / 2] row per token, of the input's dtype");
  if (x.scalar_type() == at::kFloat) rotate_rows<float>(x, cos, sin);
  else rotate_rows<at::BFloat16>(x, cos, sin);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vivace, m) {
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_mul(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(vivace, CPU, m) {
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
}
