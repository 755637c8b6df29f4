// PackedLinear's matmul (model/linear.py) as a C++ op: the rows padded to a bucket, then
// oneDNN's matmul on the weight `mkldnn::_reorder_linear_weight` packed. A compiled step calls
// it as an opaque op; written as a Python custom op it cost ~43 us a call in wrappers (2.8 ms
// of a 90 ms token of the 1.1B Llama, 65 calls), here a few.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

// model/linear.py's padded_rows (the one for the Python fallback; a test holds the two
// equal): powers of two up to 16, multiples of 16 up to 256, then of 64. oneDNN builds and
// caches a kernel per row count, so unpadded ragged batches churned its cache.
int64_t padded_rows(int64_t t) {
  if (t <= 16) {
    int64_t p = 1;
    while (p < t) p <<= 1;
    return p;
  }
  const int64_t step = t <= 256 ? 16 : 64;
  return (t + step - 1) / step * step;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t out_features) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, c10::string_view,
                                         c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  const int64_t t = x.size(0);
  const int64_t padded = padded_rows(t);
  const at::Tensor rows = padded == t ? x : at::constant_pad_nd(x, {0, 0, 0, padded - t});
  at::Tensor y = op.call(rows, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  TORCH_CHECK(y.size(1) == out_features, "packed_linear: the weight has ", y.size(1),
              " outputs, not out_features=", out_features);
  return padded == t ? y : y.narrow(0, 0, t);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(controlplane_cpu, m) { m.impl("packed_rows", &padded_rows); }

// The weight is an opaque oneDNN tensor, so a call dispatches on MkldnnCPU; x alone, on CPU.
TORCH_LIBRARY_IMPL(controlplane_cpu, CPU, m) { m.impl("packed_linear", &packed_linear); }
TORCH_LIBRARY_IMPL(controlplane_cpu, MkldnnCPU, m) { m.impl("packed_linear", &packed_linear); }
