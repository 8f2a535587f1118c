// Host-side entry points of the CUDA kernels.
//
// This header needs no CUDA or torch headers: the kernels live in .cu files built
// against the CUDA runtime alone (so CI can compile them with plain `nvcc -c`), and
// the thin torch bindings call them through these declarations with raw pointers
// and a cudaStream_t passed as void*. Every launcher returns 0 on success, a
// cudaError_t value on a CUDA error, or a negative HybridStatus for bad arguments;
// hybrid_cuda_error_string() turns either into text.
#pragma once

#include <cstdint>

namespace hybrid {
namespace cuda {

// Element types, as passed from the bindings.
enum DType : int { kNoType = -1, kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

enum HybridStatus : int {
  kOk = 0,
  kUnsupportedDType = -1,
  kBadShape = -2,
  kHiddenTooLarge = -3,
  kTooManyChunks = -4,
};

// ---------------------------------------------------------- multi-tensor Adam --

// One row of the device-side tensor table (addresses as integers, 64 bytes).
struct AdamTensorEntry {
  int64_t param;        // float*
  int64_t grad;         // float* / half* / bf16*, per the launch's grad dtype
  int64_t exp_avg;      // float*
  int64_t exp_avg_sq;   // float*
  int64_t lowp_out;     // half* / bf16*, or 0
  int64_t numel;        // > 0
  int64_t first_chunk;  // index of this tensor's first chunk in the launch
  int64_t flags;        // kAdamVectorOK when every pointer is aligned for 4-wide access
};
constexpr int64_t kAdamVectorOK = 1;

// Per-step scalars, derived on the host in double precision.
struct AdamScalars {
  float step_size;        // lr / (1 - beta1^step)
  float bc2_sqrt;         // sqrt(1 - beta2^step)
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float decay;            // AdamW: 1 - lr * wd; Adam: 1
  float l2;               // Adam: wd (used only when use_l2)
  float grad_scale;
  int use_l2;             // Adam with weight decay; skipped otherwise so inf weights stay inf
};

// Elements per chunk; one thread block updates one chunk.
int64_t adam_chunk_size();

// table: device pointer to num_tensors AdamTensorEntry rows, sorted by first_chunk.
int launch_multi_tensor_adam(const AdamTensorEntry* table, int num_tensors, int64_t total_chunks,
                             int grad_dtype, int out_dtype, AdamScalars scalars, void* stream);

// ------------------------------------------------------- LayerNorm / RMSNorm --

struct NormArgs {
  int64_t rows;
  int64_t hidden;
  int x_dtype;     // input (and dx) type
  int w_dtype;     // weight/bias type: x_dtype or kFloat32
  int y_dtype;     // output (and dy) type
  bool rms;        // RMSNorm (no mean, no bias) instead of LayerNorm
  bool vectorized; // every pointer aligned for 16-byte access and hidden % width == 0
};

// Element width of a 16-byte access for x_dtype (the divisor hidden must satisfy).
int norm_vector_width(int x_dtype);

// Forward: y = norm(x) * w (+ b). mean may be null for RMSNorm; bias may be null.
int launch_norm_forward(const NormArgs& args, const void* x, const void* weight, const void* bias,
                        void* y, float* mean, float* rstd, float eps, void* stream);

// Blocks of the first backward stage; the partial-sum workspace is
// [2, blocks, hidden] floats. Returns <= 0 (a status) on error.
int64_t norm_backward_blocks(const NormArgs& args, bool has_bias, int device);

// Largest hidden size whose backward fits the device's shared memory.
int64_t norm_max_hidden(bool rms, bool has_bias, int device);

// Backward: dx, dweight and (if dbias is non-null) dbias, with a two-stage
// reduction of the weight/bias gradients through `partial`.
int launch_norm_backward(const NormArgs& args, const void* dy, const void* x, const void* weight,
                         const float* mean, const float* rstd, void* dx, void* dweight, void* dbias,
                         float* partial, int64_t blocks, int device, void* stream);

const char* error_string(int code);

}  // namespace cuda
}  // namespace hybrid
