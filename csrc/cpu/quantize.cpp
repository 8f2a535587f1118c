// Blockwise quantization for compressed communication on CPU: int8, int4 and 1-bit sign.
//
// The CPU counterpart of csrc/cuda/quantize.cu, bit-identical to the torch path in
// hybrid/kernels/quantize.py (format and arithmetic order in its docstring and in
// docs/compression.md). One pass over the input per block: absmax and the non-finite
// check, then quantize-and-pack while the block is in L1; decoding is one fused loop per
// block, and unpack_sum adds every row's block into the output while it is in L1.
//
// The loops in quantize_kernels.h are compiled three times (AVX-512, AVX2, baseline
// x86-64) through target pragmas and auto-vectorised; the path is chosen at run time
// from the CPU flags, and callers may force one for testing. OpenMP splits the blocks
// into one contiguous range per thread.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "isa.h"

namespace hybrid {
namespace cpu_quantize {

struct Geometry {
  int64_t rows = 0;
  int64_t k = 0;
  int64_t block = 0;
  int64_t nblocks = 0;
  int64_t block_bytes = 0;
  int64_t data_bytes = 0;
  int64_t row_bytes = 0;
  int64_t tree = 1;  // block rounded up to a power of two (the 1-bit sum's tree)
  int bits = 8;
};

#if defined(__x86_64__) || defined(_M_X64)
#define HYBRID_CPU_QUANTIZE_X86 1

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
namespace avx512 {
#include "quantize_kernels.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
namespace avx2 {
#include "quantize_kernels.h"
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace scalar {
#include "quantize_kernels.h"
}  // namespace scalar

namespace {

using cpu_isa::Isa;

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
#ifdef HYBRID_CPU_QUANTIZE_X86
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("bmi2");
    case Isa::kAvx512:
      return isa_supported(Isa::kAvx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
    default:
      return false;
  }
}

Isa best_isa() { return cpu_isa::best_isa(isa_supported); }

Isa parse_isa(const std::string& name) {
  return cpu_isa::parse_isa(name, "cpu_quantize",
                            "", isa_supported);
}

Geometry make_geometry(int64_t rows, int64_t k, int64_t bits, int64_t block) {
  TORCH_CHECK(rows >= 0 && k >= 0, "cpu_quantize: bad shape rows=", rows, ", k=", k);
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 1, "cpu_quantize: bits must be 8, 4 or 1, got ", bits);
  TORCH_CHECK(block > 0 && block <= (int64_t{1} << 30), "cpu_quantize: bad block ", block);
  TORCH_CHECK(!(bits == 4 && block % 2), "cpu_quantize: int4 needs an even block, got ", block);
  TORCH_CHECK(!(bits == 1 && block % 8), "cpu_quantize: 1-bit needs a block that is a multiple of 8, got ", block);
  Geometry g;
  g.rows = rows;
  g.k = k;
  g.block = block;
  g.bits = static_cast<int>(bits);
  g.nblocks = (k + block - 1) / block;
  g.block_bytes = block * bits / 8;
  g.data_bytes = g.nblocks * g.block_bytes;
  g.row_bytes = g.data_bytes + 4 * g.nblocks;
  while (g.tree < block) g.tree <<= 1;
  return g;
}

// Runs fn(begin, end) over [0, n) units of `unit_elems` elements each, one contiguous
// range per thread; small jobs stay on the calling thread.
template <typename Fn>
void run_parallel(int64_t n, int64_t unit_elems, Fn&& fn) {
  constexpr int64_t kMinElemsPerThread = 1 << 16;
  if (n <= 0) return;
  const int64_t max_threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t by_work = std::max<int64_t>(1, n * std::max<int64_t>(1, unit_elems) / kMinElemsPerThread);
  const int64_t threads = std::min<int64_t>({max_threads, by_work, n});
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t t = omp_get_thread_num();
    const int64_t per = (n + nt - 1) / nt;
    const int64_t begin = std::min(n, t * per);
    const int64_t end = std::min(n, begin + per);
    if (begin < end) fn(begin, end);
  }
}

// Calls fn(std::integral_constant<int, BITS>) for the runtime bits.
template <typename Fn>
void with_bits(int bits, Fn&& fn) {
  switch (bits) {
    case 8: fn(std::integral_constant<int, 8>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    default: fn(std::integral_constant<int, 1>{}); break;
  }
}

template <typename T, int BITS>
using PackFn = void (*)(const T*, uint8_t*, const Geometry&, int64_t, int64_t);
template <int BITS>
using DecodeFn = void (*)(const uint8_t*, float*, const Geometry&, int64_t, int64_t);

template <typename T, int BITS>
PackFn<T, BITS> pick_pack(Isa isa) {
#ifdef HYBRID_CPU_QUANTIZE_X86
  if (isa == Isa::kAvx512) return &avx512::pack_range<T, BITS>;
  if (isa == Isa::kAvx2) return &avx2::pack_range<T, BITS>;
#endif
  (void)isa;
  return &scalar::pack_range<T, BITS>;
}

template <int BITS>
DecodeFn<BITS> pick_unpack(Isa isa) {
#ifdef HYBRID_CPU_QUANTIZE_X86
  if (isa == Isa::kAvx512) return &avx512::unpack_range<BITS>;
  if (isa == Isa::kAvx2) return &avx2::unpack_range<BITS>;
#endif
  (void)isa;
  return &scalar::unpack_range<BITS>;
}

template <int BITS>
DecodeFn<BITS> pick_unpack_sum(Isa isa) {
#ifdef HYBRID_CPU_QUANTIZE_X86
  if (isa == Isa::kAvx512) return &avx512::unpack_sum_range<BITS>;
  if (isa == Isa::kAvx2) return &avx2::unpack_sum_range<BITS>;
#endif
  (void)isa;
  return &scalar::unpack_sum_range<BITS>;
}

void check_cpu_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "cpu_quantize: ", what, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "cpu_quantize: ", what, " must be contiguous");
}

void check_wire(const at::Tensor& wire, const Geometry& g) {
  check_cpu_contiguous(wire, "wire");
  TORCH_CHECK(wire.scalar_type() == at::kByte, "cpu_quantize: wire must be uint8, got ", wire.scalar_type());
  TORCH_CHECK(wire.dim() == 2 && wire.size(0) == g.rows && wire.size(1) == g.row_bytes, "cpu_quantize: wire must be [",
              g.rows, ", ", g.row_bytes, "], got ", wire.sizes());
}

template <typename T>
void pack_typed(const at::Tensor& x, const at::Tensor& wire, const Geometry& g, Isa isa) {
  const T* xp = static_cast<const T*>(x.data_ptr());
  uint8_t* wp = wire.data_ptr<uint8_t>();
  with_bits(g.bits, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    const PackFn<T, B> fn = pick_pack<T, B>(isa);
    pybind11::gil_scoped_release no_gil;
    run_parallel(g.rows * g.nblocks, g.block, [&](int64_t b0, int64_t b1) { fn(xp, wp, g, b0, b1); });
  });
}

void pack(const at::Tensor& x, const at::Tensor& wire, int64_t bits, int64_t block, const std::string& isa_arg) {
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.dim() == 2, "cpu_quantize: x must be [rows, k], got ", x.sizes());
  const Geometry g = make_geometry(x.size(0), x.size(1), bits, block);
  check_wire(wire, g);
  const Isa isa = parse_isa(isa_arg);
  if (g.rows == 0 || g.nblocks == 0) return;
  switch (x.scalar_type()) {
    case at::kFloat: pack_typed<float>(x, wire, g, isa); break;
    case at::kBFloat16: pack_typed<c10::BFloat16>(x, wire, g, isa); break;
    case at::kHalf: pack_typed<c10::Half>(x, wire, g, isa); break;
    default: TORCH_CHECK(false, "cpu_quantize: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

void unpack(const at::Tensor& wire, const at::Tensor& out, int64_t k, int64_t bits, int64_t block,
            const std::string& isa_arg) {
  TORCH_CHECK(wire.dim() == 2, "cpu_quantize: wire must be [rows, wire_bytes], got ", wire.sizes());
  const Geometry g = make_geometry(wire.size(0), k, bits, block);
  check_wire(wire, g);
  check_cpu_contiguous(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == g.rows && out.size(1) == k,
              "cpu_quantize: out must be float32 [", g.rows, ", ", k, "], got ", out.scalar_type(), " ", out.sizes());
  const Isa isa = parse_isa(isa_arg);
  if (g.rows == 0 || k == 0) return;
  const uint8_t* wp = wire.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_bits(g.bits, [&](auto bits_tag) {
    const DecodeFn<decltype(bits_tag)::value> fn = pick_unpack<decltype(bits_tag)::value>(isa);
    pybind11::gil_scoped_release no_gil;
    run_parallel(g.rows * g.nblocks, g.block, [&](int64_t b0, int64_t b1) { fn(wp, op, g, b0, b1); });
  });
}

void unpack_sum(const at::Tensor& wire, const at::Tensor& out, int64_t k, int64_t bits, int64_t block,
                const std::string& isa_arg) {
  TORCH_CHECK(wire.dim() == 2, "cpu_quantize: wire must be [rows, wire_bytes], got ", wire.sizes());
  const Geometry g = make_geometry(wire.size(0), k, bits, block);
  check_wire(wire, g);
  TORCH_CHECK(g.rows > 0, "cpu_quantize: unpack_sum needs at least one row");
  check_cpu_contiguous(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 1 && out.size(0) == k,
              "cpu_quantize: out must be float32 [", k, "], got ", out.scalar_type(), " ", out.sizes());
  const Isa isa = parse_isa(isa_arg);
  if (k == 0) return;
  const uint8_t* wp = wire.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_bits(g.bits, [&](auto bits_tag) {
    const DecodeFn<decltype(bits_tag)::value> fn = pick_unpack_sum<decltype(bits_tag)::value>(isa);
    pybind11::gil_scoped_release no_gil;
    run_parallel(g.nblocks, g.block * g.rows, [&](int64_t b0, int64_t b1) { fn(wp, op, g, b0, b1); });
  });
}

int64_t wire_bytes(int64_t k, int64_t bits, int64_t block) { return make_geometry(1, k, bits, block).row_bytes; }

std::vector<std::string> supported_isas() { return cpu_isa::supported_names(isa_supported); }

std::string default_isa() { return cpu_isa::isa_name(best_isa()); }

}  // namespace
}  // namespace cpu_quantize
}  // namespace hybrid

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace q = hybrid::cpu_quantize;
  m.doc() = "hybrid blockwise quantization: int8, int4, 1-bit sign (CPU: AVX-512 / AVX2 / scalar, OpenMP)";
  m.def("pack", &q::pack, "Quantize x [rows, k] (fp32/bf16/fp16, contiguous) into a preallocated uint8 wire",
        pybind11::arg("x"), pybind11::arg("wire"), pybind11::arg("bits"), pybind11::arg("block"),
        pybind11::arg("isa") = "");
  m.def("unpack", &q::unpack, "Dequantize a wire [rows, wire_bytes] into contiguous fp32 out [rows, k]",
        pybind11::arg("wire"), pybind11::arg("out"), pybind11::arg("k"), pybind11::arg("bits"),
        pybind11::arg("block"), pybind11::arg("isa") = "");
  m.def("unpack_sum", &q::unpack_sum, "Dequantize every row and add them in row order into contiguous fp32 out [k]",
        pybind11::arg("wire"), pybind11::arg("out"), pybind11::arg("k"), pybind11::arg("bits"),
        pybind11::arg("block"), pybind11::arg("isa") = "");
  m.def("wire_bytes", &q::wire_bytes, "Bytes of one packed row", pybind11::arg("k"), pybind11::arg("bits"),
        pybind11::arg("block"));
  m.def("supported_isas", &q::supported_isas, "SIMD paths this CPU can run, slowest first");
  m.def("default_isa", &q::default_isa, "The path chosen when none is forced");
}
