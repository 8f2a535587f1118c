// Torch binding of the fused LayerNorm/RMSNorm launchers. Inputs arrive as
// contiguous [rows, hidden] tensors with outputs preallocated by the caller (so a
// checker can poison them); the current CUDA stream comes in as an integer.
#include <optional>

#include "binding_utils.h"

namespace hybrid {
namespace cuda {
namespace {

bool aligned(const at::Tensor& t, int64_t width) {
  const auto bytes = static_cast<int64_t>(t.element_size()) * width;
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % static_cast<uintptr_t>(bytes) == 0;
}

NormArgs make_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& y, bool rms,
                   std::initializer_list<const at::Tensor*> arrays) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, hidden], got ", x.sizes());
  NormArgs a;
  a.rows = x.size(0);
  a.hidden = x.size(1);
  a.x_dtype = dtype_code(x.scalar_type());
  a.w_dtype = dtype_code(weight.scalar_type());
  a.y_dtype = dtype_code(y.scalar_type());
  a.rms = rms;
  TORCH_CHECK(a.x_dtype != kNoType, "x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == a.hidden, "weight must be [", a.hidden, "], got ",
              weight.sizes());
  TORCH_CHECK(y.sizes() == x.sizes(), "output must have the input's shape ", x.sizes(), ", got ", y.sizes());
  const int64_t width = norm_vector_width(a.x_dtype);
  bool vec = a.hidden % width == 0;
  for (const at::Tensor* t : arrays) vec = vec && aligned(*t, width);
  a.vectorized = vec;
  return a;
}

void check_stats(const at::Tensor& t, const char* what, int64_t rows, const at::Device& device) {
  check_cuda_tensor(t, what, device);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == rows, what, " must be float32 with ", rows, " elements");
}

void norm_forward(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const at::Tensor& y, const std::optional<at::Tensor>& mean, const at::Tensor& rstd, double eps,
                  bool rms, int64_t stream) {
  const auto dev = x.device();
  check_cuda_tensor(x, "x", dev);
  check_cuda_tensor(weight, "weight", dev);
  check_cuda_tensor(y, "y", dev);
  TORCH_CHECK(!(rms && bias.has_value()), "RMSNorm takes no bias");
  TORCH_CHECK(rms || mean.has_value(), "LayerNorm needs a mean output");
  if (bias) {
    check_cuda_tensor(*bias, "bias", dev);
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type() && bias->numel() == weight.numel(),
                "bias must match weight in dtype and size");
  }
  NormArgs a = bias ? make_args(x, weight, y, rms, {&x, &weight, &y, &*bias})
                    : make_args(x, weight, y, rms, {&x, &weight, &y});
  check_stats(rstd, "rstd", a.rows, dev);
  if (mean) check_stats(*mean, "mean", a.rows, dev);
  if (a.rows == 0) return;
  check_launch(launch_norm_forward(a, x.data_ptr(), weight.data_ptr(), bias ? bias->data_ptr() : nullptr,
                                   y.data_ptr(), mean ? mean->data_ptr<float>() : nullptr, rstd.data_ptr<float>(),
                                   static_cast<float>(eps), stream_ptr(stream)),
               rms ? "rms_norm forward" : "layer_norm forward");
}

void norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& mean, const at::Tensor& rstd, const at::Tensor& dx,
                   const at::Tensor& dweight, const std::optional<at::Tensor>& dbias, bool rms, int64_t stream) {
  const auto dev = x.device();
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&dy, "dy"}, {&x, "x"}, {&weight, "weight"},
                         {&dx, "dx"}, {&dweight, "dweight"}}) {
    check_cuda_tensor(*t, name, dev);
  }
  TORCH_CHECK(!(rms && dbias.has_value()), "RMSNorm has no bias gradient");
  TORCH_CHECK(rms || mean.has_value(), "LayerNorm backward needs the saved mean");
  TORCH_CHECK(dx.sizes() == x.sizes() && dx.scalar_type() == x.scalar_type(), "dx must match x");
  TORCH_CHECK(dweight.sizes() == weight.sizes() && dweight.scalar_type() == weight.scalar_type(),
              "dweight must match weight");
  if (dbias) {
    check_cuda_tensor(*dbias, "dbias", dev);
    TORCH_CHECK(dbias->sizes() == weight.sizes() && dbias->scalar_type() == weight.scalar_type(),
                "dbias must match weight");
  }
  NormArgs a = make_args(x, weight, dy, rms, {&dy, &x, &weight, &dx});
  check_stats(rstd, "rstd", a.rows, dev);
  if (mean) check_stats(*mean, "mean", a.rows, dev);
  const int device = dev.index();
  const int64_t blocks = norm_backward_blocks(a, dbias.has_value(), device);
  check_launch(blocks > 0 ? 0 : static_cast<int>(blocks), "norm backward sizing");
  // Partials: [blocks, hidden] for the weight, then the same for the bias. The
  // caching allocator aligns the base; hidden % width == 0 keeps rows aligned.
  const int64_t planes = dbias ? 2 : 1;
  at::Tensor partial = at::empty({planes * blocks * a.hidden}, x.options().dtype(at::kFloat));
  check_launch(launch_norm_backward(a, dy.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                    mean ? mean->data_ptr<float>() : nullptr, rstd.data_ptr<float>(), dx.data_ptr(),
                                    dweight.data_ptr(), dbias ? dbias->data_ptr() : nullptr,
                                    partial.data_ptr<float>(), blocks, device, stream_ptr(stream)),
               rms ? "rms_norm backward" : "layer_norm backward");
}

int64_t max_hidden(bool rms, bool has_bias, int64_t device) {
  return norm_max_hidden(rms, has_bias, static_cast<int>(device));
}

}  // namespace
}  // namespace cuda
}  // namespace hybrid

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hybrid fused LayerNorm / RMSNorm (CUDA)";
  m.def("norm_forward", &hybrid::cuda::norm_forward, "LayerNorm/RMSNorm forward into preallocated outputs",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("y"), pybind11::arg("mean"),
        pybind11::arg("rstd"), pybind11::arg("eps"), pybind11::arg("rms"), pybind11::arg("stream"));
  m.def("norm_backward", &hybrid::cuda::norm_backward, "LayerNorm/RMSNorm backward into preallocated outputs",
        pybind11::arg("dy"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("mean"), pybind11::arg("rstd"),
        pybind11::arg("dx"), pybind11::arg("dweight"), pybind11::arg("dbias"), pybind11::arg("rms"),
        pybind11::arg("stream"));
  m.def("max_hidden", &hybrid::cuda::max_hidden, "Largest hidden size the fused backward supports on a device",
        pybind11::arg("rms"), pybind11::arg("has_bias"), pybind11::arg("device"));
}
