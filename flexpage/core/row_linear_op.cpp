// flexpage::row_linear's CPU kernel in C++: row_linear.c's few-row product behind torch's
// dispatcher, so a compiled decode step calls it without entering Python (the op is called once
// per linear layer per step). The op's schema and shape function are defined in linear.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" {
int flexpage_f32_linear(const float *x, const float *weight, const float *bias, int64_t rows, int64_t in,
                        int64_t out, float *y);
int flexpage_bf16_linear(const uint16_t *x, const uint16_t *weight, const uint16_t *bias, int64_t rows, int64_t in,
                         int64_t out, uint16_t *y);
}

namespace {

// F.linear(x, weight, bias) for float32 or bfloat16 CPU tensors of one dtype, weight contiguous.
at::Tensor row_linear(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    const auto dtype = x.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "flexpage::row_linear: float32 or bfloat16, got ",
                dtype);
    TORCH_CHECK(weight.scalar_type() == dtype && weight.dim() == 2 && weight.is_contiguous() &&
                    x.size(-1) == weight.size(1),
                "flexpage::row_linear: a contiguous [out, in] weight of the input's dtype and width");
    TORCH_CHECK(!bias || (bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == weight.size(0)),
                "flexpage::row_linear: a contiguous bias of the weight's outputs");
    const at::Tensor flat = x.reshape({-1, x.size(-1)}).contiguous();
    const int64_t rows = flat.size(0), in = weight.size(1), out = weight.size(0);
    at::Tensor y = at::empty({rows, out}, x.options());
    const int status =
        dtype == at::kFloat
            ? flexpage_f32_linear(static_cast<const float *>(flat.const_data_ptr()),
                                  static_cast<const float *>(weight.const_data_ptr()),
                                  bias ? static_cast<const float *>(bias->const_data_ptr()) : nullptr, rows, in, out,
                                  static_cast<float *>(y.mutable_data_ptr()))
            : flexpage_bf16_linear(static_cast<const uint16_t *>(flat.const_data_ptr()),
                                   static_cast<const uint16_t *>(weight.const_data_ptr()),
                                   bias ? static_cast<const uint16_t *>(bias->const_data_ptr()) : nullptr, rows, in,
                                   out, static_cast<uint16_t *>(y.mutable_data_ptr()));
    TORCH_CHECK(status == 0, "flexpage::row_linear: this CPU's build lacks ", dtype);
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = out;
    return y.view(sizes);
}

}  // namespace

TORCH_LIBRARY_IMPL(flexpage, CPU, m) { m.impl("row_linear", row_linear); }
