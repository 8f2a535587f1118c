// Blockwise quantization for compressed communication: int8, int4 and 1-bit sign.
//
// Bit-identical to the torch path in hybrid/kernels/quantize.py: every fp32 operation
// is the same correctly rounded operation in the same order (the __f*_rn intrinsics
// keep nvcc from contracting into FMAs or using approximate division), rintf rounds
// half to even like torch.round, and the 1-bit scale's sum uses the format's fixed
// pairwise tree. Format (per row: the blocks' data bytes, then one little-endian fp32
// scale per block) in docs/compression.md.
//
// pack:       one thread block per quantization block (grid-stride over rows * nblocks):
//             absmax and the non-finite flag by a block reduction, then each thread
//             writes whole bytes (1, 2 or 8 elements).
// unpack:     one thread per output element.
// unpack_sum: one thread per output element, rows added in order in fp32, cast once.
#include <type_traits>

#include "device_common.cuh"
#include "quantize_launchers.h"

namespace hybrid {
namespace cuda {
namespace {

constexpr int kMaxThreads = 256;
constexpr int64_t kMaxGrid = int64_t{1} << 20;  // grid-stride beyond this
constexpr int64_t kMax1BitTree = 8192;          // 32 KiB of fp32 shared memory

__device__ __forceinline__ float quiet_nan() { return __uint_as_float(0x7fc00000u); }

// Scales sit at arbitrary byte offsets: moved byte by byte, little endian.
__device__ __forceinline__ void store_scale(uint8_t* p, float s) {
  const unsigned int bits = __float_as_uint(s);
  p[0] = static_cast<uint8_t>(bits & 0xffu);
  p[1] = static_cast<uint8_t>((bits >> 8) & 0xffu);
  p[2] = static_cast<uint8_t>((bits >> 16) & 0xffu);
  p[3] = static_cast<uint8_t>(bits >> 24);
}

__device__ __forceinline__ float load_scale(const uint8_t* p) {
  const unsigned int bits = static_cast<unsigned int>(p[0]) | (static_cast<unsigned int>(p[1]) << 8) |
                            (static_cast<unsigned int>(p[2]) << 16) | (static_cast<unsigned int>(p[3]) << 24);
  return __uint_as_float(bits);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Max over the block, returned to every thread. blockDim.x % 32 == 0; scratch holds 32 floats.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_max(lane < warps ? scratch[lane] : 0.0f);
}

// q = round_half_even(x / a * qmax), in fp32, as the torch path computes it.
template <int QMAX>
__device__ __forceinline__ int quantize(float v, float safe) {
  return static_cast<int>(rintf(__fmul_rn(__fdiv_rn(v, safe), static_cast<float>(QMAX))));
}

template <typename T>
__device__ __forceinline__ float element(const T* xr, int64_t i, int64_t count) {
  return i < count ? to_float(xr[i]) : 0.0f;  // the last block is zero-padded
}

template <typename T, int BITS>
__global__ void __launch_bounds__(kMaxThreads) pack_kernel(const T* __restrict__ x, uint8_t* __restrict__ wire,
                                                           QuantArgs a) {
  extern __shared__ float tree[];  // 1-bit: a.tree floats
  __shared__ float scratch[32];
  const int64_t total = a.rows * a.nblocks;
  for (int64_t qb = blockIdx.x; qb < total; qb += gridDim.x) {
    const int64_t row = qb / a.nblocks;
    const int64_t b = qb - row * a.nblocks;
    const int64_t start = b * a.block;
    const int64_t count = a.k - start < a.block ? a.k - start : a.block;
    const T* xr = x + row * a.k + start;
    uint8_t* wr = wire + row * a.row_bytes;
    uint8_t* dr = wr + b * a.block_bytes;

    float m = 0.0f;
    int finite = 1;
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
      const float v = fabsf(to_float(xr[i]));
      finite &= isfinite(v) ? 1 : 0;
      m = fmaxf(m, v);
    }
    const bool bad = __syncthreads_or(!finite) != 0;
    const float absmax = block_max(m, scratch);
    const float safe = (!bad && absmax > 0.0f) ? absmax : 1.0f;
    float scale = bad ? quiet_nan() : absmax;

    if constexpr (BITS == 8) {
      for (int64_t i = threadIdx.x; i < a.block; i += blockDim.x) {
        const int q = bad ? 0 : quantize<127>(element(xr, i, count), safe);
        dr[i] = static_cast<uint8_t>(q & 0xff);
      }
    } else if constexpr (BITS == 4) {
      for (int64_t j = threadIdx.x; j < a.block / 2; j += blockDim.x) {
        const int q0 = bad ? 0 : quantize<7>(element(xr, 2 * j, count), safe);
        const int q1 = bad ? 0 : quantize<7>(element(xr, 2 * j + 1, count), safe);
        dr[j] = static_cast<uint8_t>((q0 & 15) | ((q1 & 15) << 4));
      }
    } else {
      // mean(|x|) = (sum(|x| / a) / n) * a, the sum by the format's pairwise tree.
      for (int64_t i = threadIdx.x; i < a.tree; i += blockDim.x) {
        tree[i] = i < count ? __fdiv_rn(fabsf(to_float(xr[i])), safe) : 0.0f;
      }
      __syncthreads();
      for (int64_t h = a.tree >> 1; h > 0; h >>= 1) {
        for (int64_t i = threadIdx.x; i < h; i += blockDim.x) tree[i] = __fadd_rn(tree[i], tree[i + h]);
        __syncthreads();
      }
      if (!bad) scale = __fmul_rn(__fdiv_rn(tree[0], static_cast<float>(count)), absmax);
      for (int64_t j = threadIdx.x; j < a.block / 8; j += blockDim.x) {
        unsigned int byte = 0;
        if (!bad) {
#pragma unroll
          for (int e = 0; e < 8; ++e) byte |= (element(xr, 8 * j + e, count) >= 0.0f ? 1u : 0u) << e;
        }
        dr[j] = static_cast<uint8_t>(byte);
      }
    }
    if (threadIdx.x == 0) store_scale(wr + a.data_bytes + 4 * b, scale);
    __syncthreads();  // tree and scratch are reused by the next block
  }
}

// Element i of one packed row, dequantized: (q / qmax) * scale, or +-scale for 1-bit.
template <int BITS>
__device__ __forceinline__ float dequant(const uint8_t* __restrict__ row, int64_t i, const QuantArgs& a) {
  const int64_t b = i / a.block;
  const int64_t j = i - b * a.block;
  const float scale = load_scale(row + a.data_bytes + 4 * b);
  const uint8_t* d = row + b * a.block_bytes;
  if constexpr (BITS == 1) {
    return ((d[j >> 3] >> (j & 7)) & 1) ? scale : -scale;
  } else if constexpr (BITS == 8) {
    const int q = static_cast<int>(static_cast<int8_t>(d[j]));
    return __fmul_rn(__fdiv_rn(static_cast<float>(q), 127.0f), scale);
  } else {
    const unsigned int byte = d[j >> 1];
    const int nibble = static_cast<int>((j & 1) ? (byte >> 4) : (byte & 15u));
    const int q = (nibble ^ 8) - 8;  // 4-bit two's complement
    return __fmul_rn(__fdiv_rn(static_cast<float>(q), 7.0f), scale);
  }
}

template <int BITS>
__global__ void unpack_kernel(const uint8_t* __restrict__ wire, float* __restrict__ out, QuantArgs a) {
  const int64_t total = a.rows * a.k;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const int64_t row = idx / a.k;
    out[idx] = dequant<BITS>(wire + row * a.row_bytes, idx - row * a.k, a);
  }
}

template <int BITS, typename O>
__global__ void unpack_sum_kernel(const uint8_t* __restrict__ wire, O* __restrict__ out, QuantArgs a) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.k; i += stride) {
    float acc = dequant<BITS>(wire, i, a);
    for (int64_t r = 1; r < a.rows; ++r) acc = __fadd_rn(acc, dequant<BITS>(wire + r * a.row_bytes, i, a));
    out[i] = from_float<O>(acc);
  }
}

unsigned int grid_for(int64_t work, int threads) {
  int64_t blocks = (work + threads - 1) / threads;
  if (blocks > kMaxGrid) blocks = kMaxGrid;
  return static_cast<unsigned int>(blocks < 1 ? 1 : blocks);
}

template <typename Fn>
int with_bits(int bits, Fn&& fn) {
  switch (bits) {
    case 8: return fn(std::integral_constant<int, 8>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 1: return fn(std::integral_constant<int, 1>{});
    default: return kBadShape;
  }
}

template <typename Fn>
int with_float_type(int dtype, Fn&& fn) {
  switch (dtype) {
    case kFloat32: return fn(TypeTag<float>{});
    case kFloat16: return fn(TypeTag<__half>{});
    case kBFloat16: return fn(TypeTag<__nv_bfloat16>{});
    default: return kUnsupportedDType;
  }
}

}  // namespace

int64_t quant_max_1bit_block() { return kMax1BitTree; }

int quant_args(int64_t rows, int64_t k, int bits, int64_t block, QuantArgs* args) {
  if (rows < 0 || k < 0 || block <= 0 || (bits != 8 && bits != 4 && bits != 1)) return kBadShape;
  if ((bits == 4 && block % 2 != 0) || (bits == 1 && block % 8 != 0)) return kBadShape;
  int64_t tree = 1;
  while (tree < block) tree <<= 1;
  if (bits == 1 && tree > kMax1BitTree) return kBadShape;
  QuantArgs a;
  a.rows = rows;
  a.k = k;
  a.block = block;
  a.nblocks = (k + block - 1) / block;
  a.block_bytes = block * bits / 8;
  a.data_bytes = a.nblocks * a.block_bytes;
  a.row_bytes = a.data_bytes + 4 * a.nblocks;
  a.tree = tree;
  a.bits = bits;
  *args = a;
  return kOk;
}

int launch_quant_pack(const QuantArgs& args, const void* x, int x_dtype, uint8_t* wire, void* stream) {
  if (args.rows == 0 || args.nblocks == 0) return kOk;
  int64_t threads = (args.block + 31) / 32 * 32;
  if (threads > kMaxThreads) threads = kMaxThreads;
  const unsigned int grid = grid_for(args.rows * args.nblocks, 1);
  const size_t shared = args.bits == 1 ? static_cast<size_t>(args.tree) * sizeof(float) : 0;
  auto s = static_cast<cudaStream_t>(stream);
  return with_float_type(x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return with_bits(args.bits, [&](auto bits) {
      pack_kernel<T, decltype(bits)::value><<<grid, static_cast<unsigned int>(threads), shared, s>>>(
          static_cast<const T*>(x), wire, args);
      return last_launch_status();
    });
  });
}

int launch_quant_unpack(const QuantArgs& args, const uint8_t* wire, float* out, void* stream) {
  if (args.rows == 0 || args.k == 0) return kOk;
  auto s = static_cast<cudaStream_t>(stream);
  return with_bits(args.bits, [&](auto bits) {
    unpack_kernel<decltype(bits)::value><<<grid_for(args.rows * args.k, kMaxThreads), kMaxThreads, 0, s>>>(
        wire, out, args);
    return last_launch_status();
  });
}

int launch_quant_unpack_sum(const QuantArgs& args, const uint8_t* wire, void* out, int out_dtype, void* stream) {
  if (args.rows == 0) return kBadShape;
  if (args.k == 0) return kOk;
  auto s = static_cast<cudaStream_t>(stream);
  return with_float_type(out_dtype, [&](auto tag) {
    using O = typename decltype(tag)::type;
    return with_bits(args.bits, [&](auto bits) {
      unpack_sum_kernel<decltype(bits)::value, O><<<grid_for(args.k, kMaxThreads), kMaxThreads, 0, s>>>(
          wire, static_cast<O*>(out), args);
      return last_launch_status();
    });
  });
}

}  // namespace cuda
}  // namespace hybrid
