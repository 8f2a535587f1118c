// AVX2 and AVX-512 bodies of the CPU Adam/AdamW update.
//
// Each function is compiled for its instruction set through a target pragma,
// so one object file holds every path and the choice is made at run time.
// The arithmetic is written as separate multiplies and adds in the same order
// as update_range_scalar (the build passes -ffp-contract=off), and division and
// square root are IEEE-exact in both, so every path gives bit-identical results;
// the tests rely on that.
#pragma once

#include "adam_common.h"

#if defined(__x86_64__) || defined(_M_X64)
#define HYBRID_CPU_ADAM_X86 1
#include <immintrin.h>

namespace hybrid {
namespace cpu_adam {

// Software prefetch this many elements ahead. The update streams four arrays at
// once, more than the hardware prefetcher tracks well on the machines measured
// (see docs/kernels.md); prefetching about 4 KiB ahead of each stream gave
// 10-20% more bandwidth there.
#ifndef HYBRID_CPU_ADAM_PREFETCH
#define HYBRID_CPU_ADAM_PREFETCH 1024  // elements; 0 disables (for measurements)
#endif
constexpr int64_t kPrefetchAhead = HYBRID_CPU_ADAM_PREFETCH;

// Addresses are formed as integers: they may lie past the end of the arrays, which
// a prefetch tolerates but pointer arithmetic would not.
inline void prefetch_address(const void* base, int64_t byte_offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(byte_offset)),
               _MM_HINT_T0);
}

template <GradKind G>
inline void prefetch_ahead(const AdamBuffers& b, int64_t i) {
  if (kPrefetchAhead == 0) return;
  const int64_t j = i + kPrefetchAhead;
  prefetch_address(b.param, j * 4);
  prefetch_address(b.exp_avg, j * 4);
  prefetch_address(b.exp_avg_sq, j * 4);
  prefetch_address(b.grad, j * (G == GradKind::kFloat32 ? 4 : 2));
}

// ---------------------------------------------------------------- AVX-512 --
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace avx512 {

constexpr int64_t kWidth = 16;

template <GradKind G>
inline __m512 load_grad(const void* grad, int64_t i) {
  if constexpr (G == GradKind::kFloat32) {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m256i half = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (G == GradKind::kBFloat16) {
      // bf16 is the top half of an fp32: widening and shifting is exact.
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    } else {
      return _mm512_cvtph_ps(half);
    }
  }
}

// Round to nearest even on the bit pattern; NaN becomes the canonical 0x7FC0,
// matching the scalar conversion.
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}

template <OutKind O>
inline void store_out(void* out, int64_t i, __m512 value) {
  if constexpr (O != OutKind::kNone) {
    __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i);
    if constexpr (O == OutKind::kBFloat16) {
      _mm256_storeu_si256(dst, to_bf16(value));
    } else {
      _mm256_storeu_si256(dst, _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
}

template <GradKind G, OutKind O>
void update_range(const AdamBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  const __m512 step_size = _mm512_set1_ps(c.step_size);
  const __m512 bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt);
  const __m512 beta2 = _mm512_set1_ps(c.beta2);
  const __m512 omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 eps = _mm512_set1_ps(c.eps);
  const __m512 decay = _mm512_set1_ps(c.decay);
  const __m512 l2 = _mm512_set1_ps(c.l2);
  const __m512 grad_scale = _mm512_set1_ps(c.grad_scale);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    prefetch_ahead<G>(b, i);
    __m512 p = _mm512_loadu_ps(b.param + i);
    __m512 g = _mm512_mul_ps(load_grad<G>(b.grad, i), grad_scale);
    if (c.use_l2) g = _mm512_add_ps(g, _mm512_mul_ps(l2, p));
    p = _mm512_mul_ps(p, decay);
    __m512 m = _mm512_loadu_ps(b.exp_avg + i);
    m = _mm512_add_ps(m, _mm512_mul_ps(omb1, _mm512_sub_ps(g, m)));
    __m512 v = _mm512_loadu_ps(b.exp_avg_sq + i);
    v = _mm512_add_ps(_mm512_mul_ps(v, beta2), _mm512_mul_ps(_mm512_mul_ps(omb2, g), g));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2_sqrt), eps);
    p = _mm512_sub_ps(p, _mm512_mul_ps(step_size, _mm512_div_ps(m, denom)));
    _mm512_storeu_ps(b.param + i, p);
    _mm512_storeu_ps(b.exp_avg + i, m);
    _mm512_storeu_ps(b.exp_avg_sq + i, v);
    store_out<O>(b.lowp_out, i, p);
  }
  update_range_scalar<G, O>(b, c, i, end);
}

}  // namespace avx512
#pragma GCC pop_options

// ------------------------------------------------------------------- AVX2 --
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

constexpr int64_t kWidth = 8;

template <GradKind G>
inline __m256 load_grad(const void* grad, int64_t i) {
  if constexpr (G == GradKind::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i half = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (G == GradKind::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    } else {
      return _mm256_cvtph_ps(half);
    }
  }
}

inline __m128i to_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // packus works per 128-bit lane; the permute gathers the two useful halves.
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xD8));
}

template <OutKind O>
inline void store_out(void* out, int64_t i, __m256 value) {
  if constexpr (O != OutKind::kNone) {
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
    if constexpr (O == OutKind::kBFloat16) {
      _mm_storeu_si128(dst, to_bf16(value));
    } else {
      _mm_storeu_si128(dst, _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
}

template <GradKind G, OutKind O>
void update_range(const AdamBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  const __m256 step_size = _mm256_set1_ps(c.step_size);
  const __m256 bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt);
  const __m256 beta2 = _mm256_set1_ps(c.beta2);
  const __m256 omb1 = _mm256_set1_ps(c.one_minus_beta1);
  const __m256 omb2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 eps = _mm256_set1_ps(c.eps);
  const __m256 decay = _mm256_set1_ps(c.decay);
  const __m256 l2 = _mm256_set1_ps(c.l2);
  const __m256 grad_scale = _mm256_set1_ps(c.grad_scale);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    if ((i & 15) == 0) prefetch_ahead<G>(b, i);  // once per 64-byte line of the fp32 arrays
    __m256 p = _mm256_loadu_ps(b.param + i);
    __m256 g = _mm256_mul_ps(load_grad<G>(b.grad, i), grad_scale);
    if (c.use_l2) g = _mm256_add_ps(g, _mm256_mul_ps(l2, p));
    p = _mm256_mul_ps(p, decay);
    __m256 m = _mm256_loadu_ps(b.exp_avg + i);
    m = _mm256_add_ps(m, _mm256_mul_ps(omb1, _mm256_sub_ps(g, m)));
    __m256 v = _mm256_loadu_ps(b.exp_avg_sq + i);
    v = _mm256_add_ps(_mm256_mul_ps(v, beta2), _mm256_mul_ps(_mm256_mul_ps(omb2, g), g));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2_sqrt), eps);
    p = _mm256_sub_ps(p, _mm256_mul_ps(step_size, _mm256_div_ps(m, denom)));
    _mm256_storeu_ps(b.param + i, p);
    _mm256_storeu_ps(b.exp_avg + i, m);
    _mm256_storeu_ps(b.exp_avg_sq + i, v);
    store_out<O>(b.lowp_out, i, p);
  }
  update_range_scalar<G, O>(b, c, i, end);
}

}  // namespace avx2
#pragma GCC pop_options

}  // namespace cpu_adam
}  // namespace hybrid

#endif  // x86-64
