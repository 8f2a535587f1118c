// Multi-tensor fused Adam/AdamW: one launch updates every tensor of a dtype
// group. Each thread block owns one chunk of one tensor, found by binary search
// in a device-side table, and makes a single pass over it: read the gradient
// (times the unscale x clip factor), update the fp32 master weight and both
// moments, and optionally write a bf16/fp16 copy of the new weight.
#include <type_traits>

#include "device_common.cuh"

namespace hybrid {
namespace cuda {
namespace {

constexpr int kAdamThreads = 256;
constexpr int64_t kAdamChunk = 16384;  // multiple of 4 * kAdamThreads
constexpr int kWidth = 4;              // elements per vector access

struct NoOut {};

// The element update, in the same operation order as torch.optim.AdamW.
__device__ __forceinline__ void adam_element(float& p, float g, float& m, float& v, const AdamScalars& s) {
  g = g * s.grad_scale;
  if (s.use_l2) g = g + s.l2 * p;
  p = p * s.decay;
  m = m + s.one_minus_beta1 * (g - m);
  v = v * s.beta2 + s.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / s.bc2_sqrt + s.eps;
  p = p - s.step_size * (m / denom);
}

__device__ __forceinline__ int find_tensor(const AdamTensorEntry* table, int num_tensors, int64_t chunk) {
  int lo = 0;
  int hi = num_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (table[mid].first_chunk <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename G, typename O>
__global__ void __launch_bounds__(kAdamThreads)
multi_tensor_adam_kernel(const AdamTensorEntry* __restrict__ table, int num_tensors, AdamScalars s) {
  constexpr bool kHasOut = !std::is_same<O, NoOut>::value;
  using OutT = typename std::conditional<kHasOut, O, __half>::type;

  const int64_t chunk = blockIdx.x;
  const AdamTensorEntry e = table[find_tensor(table, num_tensors, chunk)];
  const int64_t begin = (chunk - e.first_chunk) * kAdamChunk;
  const int64_t end = min(e.numel, begin + kAdamChunk);

  float* __restrict__ param = reinterpret_cast<float*>(e.param);
  const G* __restrict__ grad = reinterpret_cast<const G*>(e.grad);
  float* __restrict__ exp_avg = reinterpret_cast<float*>(e.exp_avg);
  float* __restrict__ exp_avg_sq = reinterpret_cast<float*>(e.exp_avg_sq);
  OutT* __restrict__ out = reinterpret_cast<OutT*>(e.lowp_out);

  int64_t scalar_begin = begin;
  if (e.flags & kAdamVectorOK) {
    // begin is a multiple of kWidth, so pack indices are exact.
    const int64_t packs_end = begin / kWidth + (end - begin) / kWidth;
    for (int64_t k = begin / kWidth + threadIdx.x; k < packs_end; k += kAdamThreads) {
      Pack<float, kWidth> p = load_pack<float, kWidth>(param, k);
      const Pack<G, kWidth> g = load_pack<G, kWidth>(grad, k);
      Pack<float, kWidth> m = load_pack<float, kWidth>(exp_avg, k);
      Pack<float, kWidth> v = load_pack<float, kWidth>(exp_avg_sq, k);
      Pack<OutT, kWidth> o;
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        adam_element(p.v[j], to_float(g.v[j]), m.v[j], v.v[j], s);
        if (kHasOut) o.v[j] = from_float<OutT>(p.v[j]);
      }
      store_pack<float, kWidth>(param, k, p);
      store_pack<float, kWidth>(exp_avg, k, m);
      store_pack<float, kWidth>(exp_avg_sq, k, v);
      if (kHasOut) store_pack<OutT, kWidth>(out, k, o);
    }
    scalar_begin = packs_end * kWidth;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < end; i += kAdamThreads) {
    float p = param[i];
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    adam_element(p, to_float(grad[i]), m, v, s);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (kHasOut) out[i] = from_float<OutT>(p);
  }
}

template <typename G, typename O>
int launch_typed(const AdamTensorEntry* table, int num_tensors, int64_t total_chunks, const AdamScalars& s,
                 cudaStream_t stream) {
  multi_tensor_adam_kernel<G, O><<<static_cast<unsigned int>(total_chunks), kAdamThreads, 0, stream>>>(
      table, num_tensors, s);
  return last_launch_status();
}

template <typename G>
int launch_for_grad(int out_dtype, const AdamTensorEntry* table, int num_tensors, int64_t total_chunks,
                    const AdamScalars& s, cudaStream_t stream) {
  switch (out_dtype) {
    case kNoType: return launch_typed<G, NoOut>(table, num_tensors, total_chunks, s, stream);
    case kFloat16: return launch_typed<G, __half>(table, num_tensors, total_chunks, s, stream);
    case kBFloat16: return launch_typed<G, __nv_bfloat16>(table, num_tensors, total_chunks, s, stream);
    default: return kUnsupportedDType;
  }
}

}  // namespace

int64_t adam_chunk_size() { return kAdamChunk; }

int launch_multi_tensor_adam(const AdamTensorEntry* table, int num_tensors, int64_t total_chunks,
                             int grad_dtype, int out_dtype, AdamScalars scalars, void* stream) {
  if (num_tensors <= 0 || total_chunks <= 0) return kBadShape;
  if (total_chunks > 0x7fffffffLL) return kTooManyChunks;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (grad_dtype) {
    case kFloat32: return launch_for_grad<float>(out_dtype, table, num_tensors, total_chunks, scalars, st);
    case kFloat16: return launch_for_grad<__half>(out_dtype, table, num_tensors, total_chunks, scalars, st);
    case kBFloat16:
      return launch_for_grad<__nv_bfloat16>(out_dtype, table, num_tensors, total_chunks, scalars, st);
    default: return kUnsupportedDType;
  }
}

}  // namespace cuda
}  // namespace hybrid
