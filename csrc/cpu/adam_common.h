// Shared definitions for the CPU Adam/AdamW kernels: the per-step constants,
// the buffer bundle, and the scalar element update that every SIMD path also
// uses for its tail, so all paths agree on the math for every element.
#pragma once

#include <cmath>
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace hybrid {
namespace cpu_adam {

enum class GradKind : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum class OutKind : int { kNone = 0, kBFloat16 = 1, kFloat16 = 2 };

// Per-step scalars. They are derived on the host in double precision and then
// rounded to float, the same way torch.optim.AdamW turns its Python-float
// hyperparameters into float scalars for its tensor ops.
struct AdamConstants {
  float step_size;        // lr / (1 - beta1^step)
  float bc2_sqrt;         // sqrt(1 - beta2^step)
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float decay;            // AdamW: 1 - lr * weight_decay; Adam: 1 (exact no-op)
  float l2;               // Adam: weight_decay (used only when use_l2)
  float grad_scale;       // combined unscale x clip factor applied to the grad
  bool use_l2;            // Adam with weight decay: g += l2 * p (skipped otherwise, so
                          // an inf weight does not turn 0 * inf into a NaN gradient)
};

// Raw pointers of one flat partition; every array holds `numel` elements.
struct AdamBuffers {
  float* param;
  const void* grad;       // float, bf16 or fp16 according to GradKind
  float* exp_avg;
  float* exp_avg_sq;
  void* lowp_out;         // bf16 or fp16 according to OutKind, or null
};

template <GradKind G>
inline float load_grad_scalar(const void* grad, int64_t i) {
  if constexpr (G == GradKind::kFloat32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == GradKind::kBFloat16) {
    return static_cast<float>(static_cast<const c10::BFloat16*>(grad)[i]);
  } else {
    return static_cast<float>(static_cast<const c10::Half*>(grad)[i]);
  }
}

// c10's conversions round to nearest even, which is what Tensor.to() does,
// so the low-precision copy is bit-identical to master.to(dtype).
template <OutKind O>
inline void store_out_scalar(void* out, int64_t i, float value) {
  if constexpr (O == OutKind::kBFloat16) {
    static_cast<c10::BFloat16*>(out)[i] = c10::BFloat16(value);
  } else if constexpr (O == OutKind::kFloat16) {
    static_cast<c10::Half*>(out)[i] = c10::Half(value);
  }
}

// One element of Adam/AdamW, in the operation order of torch.optim.AdamW's
// single-tensor path: decay, lerp of m, v*b2 + (1-b2)*g*g, then
// p - step_size * m / (sqrt(v) / bc2_sqrt + eps).
template <GradKind G, OutKind O>
inline void update_range_scalar(const AdamBuffers& b, const AdamConstants& c,
                                int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float p = b.param[i];
    float g = load_grad_scalar<G>(b.grad, i) * c.grad_scale;
    if (c.use_l2) g = g + c.l2 * p;
    p = p * c.decay;
    float m = b.exp_avg[i];
    m = m + c.one_minus_beta1 * (g - m);
    float v = b.exp_avg_sq[i];
    v = v * c.beta2 + c.one_minus_beta2 * g * g;
    const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
    p = p - c.step_size * (m / denom);
    b.param[i] = p;
    b.exp_avg[i] = m;
    b.exp_avg_sq[i] = v;
    store_out_scalar<O>(b.lowp_out, i, p);
  }
}

}  // namespace cpu_adam
}  // namespace hybrid
