// Device helpers shared by the kernels: dtype conversions, packed 16-byte
// accesses, block reductions and status/error plumbing. CUDA runtime only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launchers.h"

namespace hybrid {
namespace cuda {

template <typename T>
struct TypeTag {
  using type = T;
};

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// Round to nearest even, as Tensor.to(dtype) does.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// V consecutive elements moved as one aligned access (16 bytes for V * sizeof(T) == 16).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* base, int64_t pack_index) {
  return reinterpret_cast<const Pack<T, V>*>(base)[pack_index];
}

template <typename T, int V>
__device__ __forceinline__ void store_pack(T* base, int64_t pack_index, const Pack<T, V>& p) {
  reinterpret_cast<Pack<T, V>*>(base)[pack_index] = p;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sums N values over the block and returns the totals to every thread.
// blockDim.x must be a multiple of 32; scratch holds 32 * N floats.
template <int N>
__device__ __forceinline__ void block_sum(float (&vals)[N], float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
#pragma unroll
  for (int k = 0; k < N; ++k) vals[k] = warp_sum(vals[k]);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) scratch[k * 32 + warp] = vals[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) vals[k] = warp_sum(lane < warps ? scratch[k * 32 + lane] : 0.0f);
}

inline int last_launch_status() { return static_cast<int>(cudaGetLastError()); }

}  // namespace cuda
}  // namespace hybrid
