// Text for the status codes the launchers return (shared by every CUDA op).
#include <cuda_runtime.h>

#include "launchers.h"

namespace hybrid {
namespace cuda {

const char* error_string(int code) {
  switch (code) {
    case kOk: return "success";
    case kUnsupportedDType: return "unsupported dtype combination";
    case kBadShape: return "empty or malformed shape";
    case kHiddenTooLarge: return "hidden size too large for the fused backward's shared memory";
    case kTooManyChunks: return "too many chunks for one launch";
    default: return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown error";
  }
}

}  // namespace cuda
}  // namespace hybrid
