// CPU Adam/AdamW over one flat fp32 partition, exposed to Python.
//
// One pass per element: read the gradient (fp32/bf16/fp16) times the combined
// unscale x clip factor, update the fp32 master weight and both moments, and
// optionally write a bf16/fp16 copy of the new weight. The SIMD path is chosen
// at run time from the host's CPU flags; callers may force one for testing.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <string>
#include <vector>

#include "adam_common.h"
#include "adam_simd.h"
#include "isa.h"

namespace hybrid {
namespace cpu_adam {
namespace {

using cpu_isa::Isa;

using RangeFn = void (*)(const AdamBuffers&, const AdamConstants&, int64_t, int64_t);

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
#ifdef HYBRID_CPU_ADAM_X86
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f");
#endif
    default:
      return false;
  }
}

Isa best_isa() { return cpu_isa::best_isa(isa_supported); }

Isa parse_isa(const std::string& name) {
  return cpu_isa::parse_isa(name, "cpu_adam",
                            "; unset HYBRID_CPU_ADAM_ISA or pick one of the supported paths reported by "
                            "`python -m hybrid.kernels report`",
                            isa_supported);
}

template <GradKind G, OutKind O>
RangeFn pick_for_isa(Isa isa) {
#ifdef HYBRID_CPU_ADAM_X86
  if (isa == Isa::kAvx512) return &avx512::update_range<G, O>;
  if (isa == Isa::kAvx2) return &avx2::update_range<G, O>;
#endif
  (void)isa;
  return &update_range_scalar<G, O>;
}

template <GradKind G>
RangeFn pick_for_out(Isa isa, OutKind out) {
  switch (out) {
    case OutKind::kBFloat16: return pick_for_isa<G, OutKind::kBFloat16>(isa);
    case OutKind::kFloat16: return pick_for_isa<G, OutKind::kFloat16>(isa);
    default: return pick_for_isa<G, OutKind::kNone>(isa);
  }
}

RangeFn pick_kernel(Isa isa, GradKind grad, OutKind out) {
  switch (grad) {
    case GradKind::kBFloat16: return pick_for_out<GradKind::kBFloat16>(isa, out);
    case GradKind::kFloat16: return pick_for_out<GradKind::kFloat16>(isa, out);
    default: return pick_for_out<GradKind::kFloat32>(isa, out);
  }
}

// Splits [0, n) into one contiguous range per thread. Ranges start on
// 64-element boundaries so no two threads write the same cache line of any
// array (fp32 or 16-bit). Small inputs stay on the calling thread because a
// parallel region costs more than the work.
void run_parallel(RangeFn fn, const AdamBuffers& b, const AdamConstants& c, int64_t n) {
  constexpr int64_t kMinPerThread = 1 << 15;
  constexpr int64_t kAlign = 64;
  const int64_t max_threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t threads = std::min<int64_t>(max_threads, std::max<int64_t>(1, n / kMinPerThread));
  if (threads <= 1) {
    fn(b, c, 0, n);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t t = omp_get_thread_num();
    const int64_t per = ((n + nt - 1) / nt + kAlign - 1) / kAlign * kAlign;
    const int64_t begin = std::min(n, t * per);
    const int64_t end = std::min(n, begin + per);
    if (begin < end) fn(b, c, begin, end);
  }
}

GradKind grad_kind(const at::Tensor& grad) {
  switch (grad.scalar_type()) {
    case at::kFloat: return GradKind::kFloat32;
    case at::kBFloat16: return GradKind::kBFloat16;
    case at::kHalf: return GradKind::kFloat16;
    default:
      TORCH_CHECK(false, "cpu_adam: grad must be float32, bfloat16 or float16, got ",
                  grad.scalar_type());
  }
}

void check_state(const at::Tensor& t, const char* what, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), "cpu_adam: ", what, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "cpu_adam: ", what, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "cpu_adam: ", what, " has ", t.numel(),
              " elements but param has ", numel);
}

void adam_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
               std::optional<at::Tensor> lowp_out, double lr, double beta1, double beta2,
               double eps, double weight_decay, int64_t step, bool adamw, double grad_scale,
               const std::string& isa_name_arg) {
  const int64_t n = param.numel();
  TORCH_CHECK(param.scalar_type() == at::kFloat, "cpu_adam: param must be float32");
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat, "cpu_adam: exp_avg must be float32");
  TORCH_CHECK(exp_avg_sq.scalar_type() == at::kFloat, "cpu_adam: exp_avg_sq must be float32");
  TORCH_CHECK(step >= 1, "cpu_adam: step must be >= 1 (1 on the first update), got ", step);
  check_state(param, "param", n);
  check_state(grad, "grad", n);
  check_state(exp_avg, "exp_avg", n);
  check_state(exp_avg_sq, "exp_avg_sq", n);
  OutKind out = OutKind::kNone;
  void* out_ptr = nullptr;
  if (lowp_out.has_value()) {
    check_state(*lowp_out, "lowp_out", n);
    const auto dt = lowp_out->scalar_type();
    TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf,
                "cpu_adam: lowp_out must be bfloat16 or float16, got ", dt);
    out = dt == at::kBFloat16 ? OutKind::kBFloat16 : OutKind::kFloat16;
    out_ptr = lowp_out->data_ptr();
  }
  const Isa isa = parse_isa(isa_name_arg);

  // Same double-precision derivation as torch.optim.AdamW (Python floats).
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamConstants c;
  c.step_size = static_cast<float>(lr / bias_correction1);
  c.bc2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.decay = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;  // p * 1 is exact
  c.l2 = static_cast<float>(weight_decay);
  c.use_l2 = !adamw && weight_decay != 0.0;
  c.grad_scale = static_cast<float>(grad_scale);

  AdamBuffers b;
  b.param = param.data_ptr<float>();
  b.grad = grad.data_ptr();
  b.exp_avg = exp_avg.data_ptr<float>();
  b.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  b.lowp_out = out_ptr;

  const RangeFn fn = pick_kernel(isa, grad_kind(grad), out);
  if (n == 0) return;
  pybind11::gil_scoped_release no_gil;
  run_parallel(fn, b, c, n);
}

std::vector<std::string> supported_isas() { return cpu_isa::supported_names(isa_supported); }

std::string default_isa() { return cpu_isa::isa_name(best_isa()); }

}  // namespace
}  // namespace cpu_adam
}  // namespace hybrid

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hybrid CPU Adam/AdamW (AVX-512 / AVX2 / scalar, OpenMP)";
  m.def("adam_step", &hybrid::cpu_adam::adam_step,
        "In-place Adam/AdamW step on flat CPU tensors", pybind11::arg("param"),
        pybind11::arg("grad"), pybind11::arg("exp_avg"), pybind11::arg("exp_avg_sq"),
        pybind11::arg("lowp_out"), pybind11::arg("lr"), pybind11::arg("beta1"),
        pybind11::arg("beta2"), pybind11::arg("eps"), pybind11::arg("weight_decay"),
        pybind11::arg("step"), pybind11::arg("adamw"), pybind11::arg("grad_scale"),
        pybind11::arg("isa"));
  m.def("supported_isas", &hybrid::cpu_adam::supported_isas,
        "SIMD paths this CPU can run, slowest first");
  m.def("default_isa", &hybrid::cpu_adam::default_isa, "The path chosen when none is forced");
}
