// Fused LayerNorm and RMSNorm, forward and backward, for fp32/fp16/bf16 inputs
// with fp32 statistics. Weights are the input's type or fp32.
//
// Forward: one block per row; the row is read once from device memory (later
// passes over it hit L1/L2), the mean and 1/std are kept for the backward.
// Backward: each block walks a strided set of rows, writes dx, and accumulates
// its share of dweight/dbias per column in shared memory (every thread owns
// fixed columns, so no atomics); a second kernel sums the per-block partials.
// RMSNorm follows the fp32-compute, cast-back convention:
//   y = w * to(x.dtype)(x * rsqrt(mean(x^2) + eps)).
#include <type_traits>

#include "device_common.cuh"

namespace hybrid {
namespace cuda {
namespace {

constexpr int kMinThreads = 64;
constexpr int kMaxThreads = 1024;
constexpr int kPacksPerThread = 4;  // target work per thread when sizing a block
constexpr int kReduceRows = 8;      // threadIdx.y extent of the partial-sum kernel

template <typename T>
constexpr int vec_width() { return static_cast<int>(16 / sizeof(T)); }

int threads_for(int64_t packs) {
  int64_t t = (packs + kPacksPerThread - 1) / kPacksPerThread;
  t = (t + 31) / 32 * 32;
  if (t < kMinThreads) t = kMinThreads;
  if (t > kMaxThreads) t = kMaxThreads;
  return static_cast<int>(t);
}

// -------------------------------------------------------------- forward ----

template <typename T, typename W, typename Y, int V, bool RMS>
__global__ void norm_forward_kernel(const T* __restrict__ x, const W* __restrict__ weight,
                                    const W* __restrict__ bias, Y* __restrict__ y, float* __restrict__ mean_out,
                                    float* __restrict__ rstd_out, int64_t hidden, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int64_t packs = hidden / V;
  const T* xr = x + row * hidden;
  Y* yr = y + row * hidden;
  const float inv_hidden = 1.0f / static_cast<float>(hidden);

  float mean = 0.0f;
  if (!RMS) {
    float acc[1] = {0.0f};
    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
      const Pack<T, V> xp = load_pack<T, V>(xr, k);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[0] += to_float(xp.v[j]);
    }
    block_sum(acc, scratch);
    mean = acc[0] * inv_hidden;
  }
  // Second pass over the (now cached) row: squared deviations, never E[x^2] - E[x]^2.
  float sq[1] = {0.0f};
  for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
    const Pack<T, V> xp = load_pack<T, V>(xr, k);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = to_float(xp.v[j]) - mean;
      sq[0] += d * d;
    }
  }
  block_sum(sq, scratch);
  const float rstd = rsqrtf(sq[0] * inv_hidden + eps);
  if (threadIdx.x == 0) {
    if (!RMS) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }

  for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
    const Pack<T, V> xp = load_pack<T, V>(xr, k);
    const Pack<W, V> wp = load_pack<W, V>(weight, k);
    Pack<Y, V> out;
    if (RMS) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float n = to_float(from_float<T>(to_float(xp.v[j]) * rstd));
        out.v[j] = from_float<Y>(to_float(wp.v[j]) * n);
      }
    } else if (bias != nullptr) {
      const Pack<W, V> bp = load_pack<W, V>(bias, k);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float n = (to_float(xp.v[j]) - mean) * rstd;
        out.v[j] = from_float<Y>(n * to_float(wp.v[j]) + to_float(bp.v[j]));
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float n = (to_float(xp.v[j]) - mean) * rstd;
        out.v[j] = from_float<Y>(n * to_float(wp.v[j]));
      }
    }
    store_pack<Y, V>(yr, k, out);
  }
}

// ------------------------------------------------------------- backward ----

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w; RMSNorm drops mean(g).
template <typename T, typename W, typename Y, int V, bool RMS>
__global__ void norm_backward_kernel(const Y* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                                     const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                                     T* __restrict__ dx, float* __restrict__ partial_w, float* __restrict__ partial_b,
                                     int64_t rows, int64_t hidden) {
  extern __shared__ float column_acc[];  // [hidden] dweight, then [hidden] dbias if partial_b
  __shared__ float scratch[64];
  float* acc_w = column_acc;
  float* acc_b = column_acc + hidden;
  const bool with_bias = partial_b != nullptr;
  const int64_t packs = hidden / V;
  const float inv_hidden = 1.0f / static_cast<float>(hidden);

  // Accumulators are stored element-major (index j * packs + k) so that a warp's
  // threads, which own consecutive packs k, hit consecutive banks.
  for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      acc_w[j * packs + k] = 0.0f;
      if (with_bias) acc_b[j * packs + k] = 0.0f;
    }
  }

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const Y* dyr = dy + row * hidden;
    const T* xr = x + row * hidden;
    T* dxr = dx + row * hidden;
    const float mean = RMS ? 0.0f : mean_in[row];
    const float rstd = rstd_in[row];

    float sums[2] = {0.0f, 0.0f};  // sum(g * xhat), sum(g)
    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
      const Pack<Y, V> gp = load_pack<Y, V>(dyr, k);
      const Pack<T, V> xp = load_pack<T, V>(xr, k);
      const Pack<W, V> wp = load_pack<W, V>(weight, k);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float g = to_float(gp.v[j]) * to_float(wp.v[j]);
        const float xhat = (to_float(xp.v[j]) - mean) * rstd;
        sums[0] += g * xhat;
        sums[1] += g;
      }
    }
    block_sum(sums, scratch);
    const float mean_gx = sums[0] * inv_hidden;
    const float mean_g = RMS ? 0.0f : sums[1] * inv_hidden;

    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
      const Pack<Y, V> gp = load_pack<Y, V>(dyr, k);
      const Pack<T, V> xp = load_pack<T, V>(xr, k);
      const Pack<W, V> wp = load_pack<W, V>(weight, k);
      Pack<T, V> out;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = to_float(gp.v[j]);
        const float xhat = (to_float(xp.v[j]) - mean) * rstd;
        const float g = d * to_float(wp.v[j]);
        out.v[j] = from_float<T>(rstd * (g - mean_g - xhat * mean_gx));
        // RMSNorm's weight multiplies the normalized value after its cast to x's type.
        const float factor = RMS ? to_float(from_float<T>(xhat)) : xhat;
        acc_w[j * packs + k] += d * factor;
        if (with_bias) acc_b[j * packs + k] += d;
      }
      store_pack<T, V>(dxr, k, out);
    }
  }

  // Each thread wrote only its own columns above, so its partials are ready without a barrier.
  float* pw = partial_w + static_cast<int64_t>(blockIdx.x) * hidden;
  float* pb = with_bias ? partial_b + static_cast<int64_t>(blockIdx.x) * hidden : nullptr;
  for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
    Pack<float, V> w_sum;
    Pack<float, V> b_sum;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      w_sum.v[j] = acc_w[j * packs + k];
      b_sum.v[j] = with_bias ? acc_b[j * packs + k] : 0.0f;
    }
    store_pack<float, V>(pw, k, w_sum);
    if (with_bias) store_pack<float, V>(pb, k, b_sum);
  }
}

// Second stage: column sums of the [blocks, hidden] partials. Block (32, kReduceRows).
template <typename W>
__global__ void column_sum_kernel(const float* __restrict__ partial_w, const float* __restrict__ partial_b,
                                  int64_t blocks, int64_t hidden, W* __restrict__ dweight, W* __restrict__ dbias) {
  __shared__ float tile_w[kReduceRows][33];
  __shared__ float tile_b[kReduceRows][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float sw = 0.0f;
  float sb = 0.0f;
  if (col < hidden) {
    for (int64_t r = threadIdx.y; r < blocks; r += kReduceRows) {
      sw += partial_w[r * hidden + col];
      if (partial_b != nullptr) sb += partial_b[r * hidden + col];
    }
  }
  tile_w[threadIdx.y][threadIdx.x] = sw;
  tile_b[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
    float tw = 0.0f;
    float tb = 0.0f;
#pragma unroll
    for (int r = 0; r < kReduceRows; ++r) {
      tw += tile_w[r][threadIdx.x];
      tb += tile_b[r][threadIdx.x];
    }
    dweight[col] = from_float<W>(tw);
    if (dbias != nullptr) dbias[col] = from_float<W>(tb);
  }
}

// ------------------------------------------------------------- dispatch ----

// Calls fn(TypeTag<T>, TypeTag<W>, TypeTag<Y>) for the supported combinations:
// W is T or float; Y is T for LayerNorm and promote(T, W) for RMSNorm.
template <typename Fn>
int dispatch_types(const NormArgs& a, Fn&& fn) {
  const bool w_same = a.w_dtype == a.x_dtype;
  const bool w_float = a.w_dtype == kFloat32;
  if (!w_same && !w_float) return kUnsupportedDType;
  const int expected_y = (a.rms && w_float) ? kFloat32 : a.x_dtype;
  if (a.y_dtype != expected_y) return kUnsupportedDType;
  switch (a.x_dtype) {
    case kFloat32:
      return fn(TypeTag<float>{}, TypeTag<float>{}, TypeTag<float>{});
    case kFloat16:
      if (w_same) return fn(TypeTag<__half>{}, TypeTag<__half>{}, TypeTag<__half>{});
      if (a.rms) return fn(TypeTag<__half>{}, TypeTag<float>{}, TypeTag<float>{});
      return fn(TypeTag<__half>{}, TypeTag<float>{}, TypeTag<__half>{});
    case kBFloat16:
      if (w_same) return fn(TypeTag<__nv_bfloat16>{}, TypeTag<__nv_bfloat16>{}, TypeTag<__nv_bfloat16>{});
      if (a.rms) return fn(TypeTag<__nv_bfloat16>{}, TypeTag<float>{}, TypeTag<float>{});
      return fn(TypeTag<__nv_bfloat16>{}, TypeTag<float>{}, TypeTag<__nv_bfloat16>{});
    default:
      return kUnsupportedDType;
  }
}

int64_t backward_smem_bytes(int64_t hidden, bool two_accumulators) {
  return hidden * static_cast<int64_t>(sizeof(float)) * (two_accumulators ? 2 : 1);
}

int max_optin_smem(int device) {
  int bytes = 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    cudaGetLastError();
    return 48 * 1024;
  }
  return bytes;
}

constexpr int64_t kStaticSmemReserve = 1024;  // scratch arrays of the backward kernel

template <typename T, typename W, typename Y, int V, bool RMS>
int forward_typed(const NormArgs& a, const void* x, const void* w, const void* b, void* y, float* mean,
                  float* rstd, float eps, cudaStream_t stream) {
  const int threads = threads_for(a.hidden / V);
  norm_forward_kernel<T, W, Y, V, RMS><<<static_cast<unsigned int>(a.rows), threads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const W*>(w), static_cast<const W*>(b), static_cast<Y*>(y), mean, rstd,
      a.hidden, eps);
  return last_launch_status();
}

template <typename T, typename W, typename Y, int V, bool RMS>
int backward_typed(const NormArgs& a, const void* dy, const void* x, const void* w, const float* mean,
                   const float* rstd, void* dx, void* dw, void* db, float* partial, int64_t blocks,
                   cudaStream_t stream) {
  const int threads = threads_for(a.hidden / V);
  const bool with_bias = db != nullptr;
  const int64_t smem = backward_smem_bytes(a.hidden, with_bias);
  auto kernel = norm_backward_kernel<T, W, Y, V, RMS>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return static_cast<int>(err);
  float* partial_w = partial;
  float* partial_b = with_bias ? partial + blocks * a.hidden : nullptr;
  kernel<<<static_cast<unsigned int>(blocks), threads, static_cast<size_t>(smem), stream>>>(
      static_cast<const Y*>(dy), static_cast<const T*>(x), static_cast<const W*>(w), mean, rstd, static_cast<T*>(dx),
      partial_w, partial_b, a.rows, a.hidden);
  int status = last_launch_status();
  if (status != 0) return status;
  const dim3 reduce_block(32, kReduceRows);
  const unsigned int reduce_grid = static_cast<unsigned int>((a.hidden + 31) / 32);
  column_sum_kernel<W><<<reduce_grid, reduce_block, 0, stream>>>(partial_w, partial_b, blocks, a.hidden,
                                                                 static_cast<W*>(dw), static_cast<W*>(db));
  return last_launch_status();
}

int check_args(const NormArgs& a) {
  if (a.rows <= 0 || a.hidden <= 0) return kBadShape;
  if (a.rows > 0x7fffffffLL) return kBadShape;
  if (a.vectorized && a.hidden % norm_vector_width(a.x_dtype) != 0) return kBadShape;
  return kOk;
}

}  // namespace

int norm_vector_width(int x_dtype) { return x_dtype == kFloat32 ? vec_width<float>() : vec_width<__half>(); }

int launch_norm_forward(const NormArgs& a, const void* x, const void* weight, const void* bias, void* y, float* mean,
                        float* rstd, float eps, void* stream) {
  const int status = check_args(a);
  if (status != kOk) return status;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dispatch_types(a, [&](auto t_tag, auto w_tag, auto y_tag) -> int {
    using T = typename decltype(t_tag)::type;
    using W = typename decltype(w_tag)::type;
    using Y = typename decltype(y_tag)::type;
    constexpr int V = vec_width<T>();
    if (a.rms) {
      return a.vectorized ? forward_typed<T, W, Y, V, true>(a, x, weight, bias, y, mean, rstd, eps, st)
                          : forward_typed<T, W, Y, 1, true>(a, x, weight, bias, y, mean, rstd, eps, st);
    }
    return a.vectorized ? forward_typed<T, W, Y, V, false>(a, x, weight, bias, y, mean, rstd, eps, st)
                        : forward_typed<T, W, Y, 1, false>(a, x, weight, bias, y, mean, rstd, eps, st);
  });
}

int64_t norm_max_hidden(bool rms, bool has_bias, int device) {
  const bool two = !rms && has_bias;
  return (max_optin_smem(device) - kStaticSmemReserve) / backward_smem_bytes(1, two);
}

int64_t norm_backward_blocks(const NormArgs& a, bool has_bias, int device) {
  const int status = check_args(a);
  if (status != kOk) return status;
  if (a.hidden > norm_max_hidden(a.rms, has_bias, device)) return kHiddenTooLarge;
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return static_cast<int>(cudaGetLastError());
  }
  int per_sm_smem = 0;
  if (cudaDeviceGetAttribute(&per_sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess) {
    return static_cast<int>(cudaGetLastError());
  }
  // Enough blocks to fill the device, bounded by what fits in shared memory at once,
  // so that the partial buffer (blocks x hidden) stays small.
  const int64_t smem = backward_smem_bytes(a.hidden, !a.rms && has_bias) + kStaticSmemReserve;
  const int threads = threads_for(a.hidden / (a.vectorized ? norm_vector_width(a.x_dtype) : 1));
  int64_t by_smem = per_sm_smem / smem;
  int64_t by_threads = 2048 / threads;
  int64_t per_sm = by_smem < by_threads ? by_smem : by_threads;
  if (per_sm < 1) per_sm = 1;
  if (per_sm > 8) per_sm = 8;
  int64_t blocks = per_sm * sms;
  if (blocks > a.rows) blocks = a.rows;
  return blocks;
}

int launch_norm_backward(const NormArgs& a, const void* dy, const void* x, const void* weight, const float* mean,
                         const float* rstd, void* dx, void* dweight, void* dbias, float* partial, int64_t blocks,
                         int device, void* stream) {
  const int status = check_args(a);
  if (status != kOk) return status;
  if (blocks <= 0 || blocks > a.rows) return kBadShape;
  if (a.hidden > norm_max_hidden(a.rms, dbias != nullptr, device)) return kHiddenTooLarge;
  if (a.rms && dbias != nullptr) return kBadShape;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dispatch_types(a, [&](auto t_tag, auto w_tag, auto y_tag) -> int {
    using T = typename decltype(t_tag)::type;
    using W = typename decltype(w_tag)::type;
    using Y = typename decltype(y_tag)::type;
    constexpr int V = vec_width<T>();
    if (a.rms) {
      return a.vectorized
                 ? backward_typed<T, W, Y, V, true>(a, dy, x, weight, mean, rstd, dx, dweight, dbias, partial, blocks, st)
                 : backward_typed<T, W, Y, 1, true>(a, dy, x, weight, mean, rstd, dx, dweight, dbias, partial, blocks, st);
    }
    return a.vectorized
               ? backward_typed<T, W, Y, V, false>(a, dy, x, weight, mean, rstd, dx, dweight, dbias, partial, blocks, st)
               : backward_typed<T, W, Y, 1, false>(a, dy, x, weight, mean, rstd, dx, dweight, dbias, partial, blocks, st);
  });
}

}  // namespace cuda
}  // namespace hybrid
