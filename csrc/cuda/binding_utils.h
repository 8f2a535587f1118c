// Helpers shared by the thin torch bindings of the CUDA ops. Only torch's CPU
// headers are needed here: CUDA specifics stay behind launchers.h.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

#include "launchers.h"

namespace hybrid {
namespace cuda {

inline int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kFloat32;
    case at::kHalf: return kFloat16;
    case at::kBFloat16: return kBFloat16;
    default: return kNoType;
  }
}

inline void check_launch(int code, const char* what) {
  TORCH_CHECK(code == 0, what, " failed: ", error_string(code), " (code ", code, ")");
}

inline void check_cuda_tensor(const at::Tensor& t, const char* what, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), what, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == device, what, " is on ", t.device(), " but the op runs on ", device);
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

inline void* stream_ptr(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

}  // namespace cuda
}  // namespace hybrid
