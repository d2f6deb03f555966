// vivace::packed_linear: y = x W^T + b with W prepacked by mkldnn::_reorder_linear_weight.
//
// A thin, opaque wrapper over mkldnn::_linear_pointwise: inductor lowers that op only when the
// weight is a graph constant (freezing, which packs a copy per compiled graph), while this op
// takes the packed weight as an ordinary input, so eager steps and every compiled graph share
// one packed copy.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_weight, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  TORCH_CHECK(x.dim() == 2, "packed_linear: x must be [M, in_features]");
  return op.call(x.contiguous(), packed_weight, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vivace, m) { m.def("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(vivace, CompositeExplicitAutograd, m) { m.impl("packed_linear", &packed_linear); }
