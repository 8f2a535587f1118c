// Torch binding of the multi-tensor Adam launcher. The Python wrapper builds the
// device-side tensor table (addresses, sizes, chunk offsets) and passes the
// current CUDA stream as an integer.
#include <cmath>

#include "binding_utils.h"

namespace hybrid {
namespace cuda {
namespace {

void multi_tensor_adam(const at::Tensor& table, int64_t num_tensors, int64_t total_chunks, int64_t grad_dtype,
                       int64_t out_dtype, double lr, double beta1, double beta2, double eps, double weight_decay,
                       int64_t step, bool adamw, double grad_scale, int64_t stream) {
  check_cuda_tensor(table, "tensor table", table.device());
  TORCH_CHECK(table.scalar_type() == at::kLong, "tensor table must be int64");
  constexpr int64_t kColumns = sizeof(AdamTensorEntry) / sizeof(int64_t);
  TORCH_CHECK(table.numel() == num_tensors * kColumns, "tensor table must hold ", num_tensors, " x ", kColumns,
              " int64 values, got ", table.numel());
  TORCH_CHECK(step >= 1, "step must be >= 1 (1 on the first update), got ", step);
  if (num_tensors == 0) return;

  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamScalars s;
  s.step_size = static_cast<float>(lr / bias_correction1);
  s.bc2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.decay = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  s.l2 = static_cast<float>(weight_decay);
  s.use_l2 = (!adamw && weight_decay != 0.0) ? 1 : 0;
  s.grad_scale = static_cast<float>(grad_scale);

  const auto* rows = reinterpret_cast<const AdamTensorEntry*>(table.data_ptr<int64_t>());
  check_launch(launch_multi_tensor_adam(rows, static_cast<int>(num_tensors), total_chunks, static_cast<int>(grad_dtype),
                                        static_cast<int>(out_dtype), s, stream_ptr(stream)),
               "multi_tensor_adam");
}

}  // namespace
}  // namespace cuda
}  // namespace hybrid

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hybrid multi-tensor Adam/AdamW (CUDA)";
  m.def("multi_tensor_adam", &hybrid::cuda::multi_tensor_adam, "One fused Adam/AdamW launch over a tensor table",
        pybind11::arg("table"), pybind11::arg("num_tensors"), pybind11::arg("total_chunks"),
        pybind11::arg("grad_dtype"), pybind11::arg("out_dtype"), pybind11::arg("lr"), pybind11::arg("beta1"),
        pybind11::arg("beta2"), pybind11::arg("eps"), pybind11::arg("weight_decay"), pybind11::arg("step"),
        pybind11::arg("adamw"), pybind11::arg("grad_scale"), pybind11::arg("stream"));
  m.def("chunk_size", &hybrid::cuda::adam_chunk_size, "Elements per thread block");
  m.attr("table_columns") = static_cast<int64_t>(sizeof(hybrid::cuda::AdamTensorEntry) / sizeof(int64_t));
}
