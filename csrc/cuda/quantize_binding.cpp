// Torch binding of the blockwise quantization launchers (quantize.cu). Tensors arrive
// contiguous with outputs preallocated by the caller; the current CUDA stream comes in
// as an integer. hybrid/kernels/quantize.py chooses between this op and the torch path.
#include "binding_utils.h"
#include "quantize_launchers.h"

namespace hybrid {
namespace cuda {
namespace {

QuantArgs make_args(int64_t rows, int64_t k, int64_t bits, int64_t block) {
  QuantArgs a;
  TORCH_CHECK(quant_args(rows, k, static_cast<int>(bits), block, &a) == kOk, "bad quantization format: rows=", rows,
              ", k=", k, ", bits=", bits, ", block=", block, " (bits 8, 4 or 1; int4 needs an even block, 1-bit a ",
              "multiple of 8 up to ", quant_max_1bit_block(), ")");
  return a;
}

void check_wire(const at::Tensor& wire, const QuantArgs& a, const at::Device& device) {
  check_cuda_tensor(wire, "wire", device);
  TORCH_CHECK(wire.scalar_type() == at::kByte, "wire must be uint8, got ", wire.scalar_type());
  TORCH_CHECK(wire.dim() == 2 && wire.size(0) == a.rows && wire.size(1) == a.row_bytes, "wire must be [", a.rows,
              ", ", a.row_bytes, "], got ", wire.sizes());
}

void pack(const at::Tensor& x, const at::Tensor& wire, int64_t bits, int64_t block, int64_t stream) {
  const auto dev = x.device();
  check_cuda_tensor(x, "x", dev);
  TORCH_CHECK(x.dim() == 2, "x must be [rows, k], got ", x.sizes());
  const int dtype = dtype_code(x.scalar_type());
  TORCH_CHECK(dtype != kNoType, "x must be float32, float16 or bfloat16, got ", x.scalar_type());
  const QuantArgs a = make_args(x.size(0), x.size(1), bits, block);
  check_wire(wire, a, dev);
  check_launch(launch_quant_pack(a, x.data_ptr(), dtype, wire.data_ptr<uint8_t>(), stream_ptr(stream)),
               "quantize pack");
}

void unpack(const at::Tensor& wire, const at::Tensor& out, int64_t k, int64_t bits, int64_t block, int64_t stream) {
  const auto dev = wire.device();
  TORCH_CHECK(wire.dim() == 2, "wire must be [rows, wire_bytes], got ", wire.sizes());
  const QuantArgs a = make_args(wire.size(0), k, bits, block);
  check_wire(wire, a, dev);
  check_cuda_tensor(out, "out", dev);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == a.rows && out.size(1) == k,
              "out must be float32 [", a.rows, ", ", k, "], got ", out.scalar_type(), " ", out.sizes());
  check_launch(launch_quant_unpack(a, wire.data_ptr<uint8_t>(), out.data_ptr<float>(), stream_ptr(stream)),
               "quantize unpack");
}

void unpack_sum(const at::Tensor& wire, const at::Tensor& out, int64_t k, int64_t bits, int64_t block,
                int64_t stream) {
  const auto dev = wire.device();
  TORCH_CHECK(wire.dim() == 2, "wire must be [rows, wire_bytes], got ", wire.sizes());
  const QuantArgs a = make_args(wire.size(0), k, bits, block);
  check_wire(wire, a, dev);
  TORCH_CHECK(a.rows > 0, "unpack_sum needs at least one row");
  check_cuda_tensor(out, "out", dev);
  const int dtype = dtype_code(out.scalar_type());
  TORCH_CHECK(dtype != kNoType && out.dim() == 1 && out.size(0) == k, "out must be float32, float16 or bfloat16 [",
              k, "], got ", out.scalar_type(), " ", out.sizes());
  check_launch(launch_quant_unpack_sum(a, wire.data_ptr<uint8_t>(), out.data_ptr(), dtype, stream_ptr(stream)),
               "quantize unpack_sum");
}

int64_t wire_bytes(int64_t k, int64_t bits, int64_t block) { return make_args(1, k, bits, block).row_bytes; }

}  // namespace
}  // namespace cuda
}  // namespace hybrid

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hybrid blockwise quantization: int8, int4, 1-bit sign (CUDA)";
  m.def("pack", &hybrid::cuda::pack, "Quantize x [rows, k] into a preallocated uint8 wire [rows, wire_bytes]",
        pybind11::arg("x"), pybind11::arg("wire"), pybind11::arg("bits"), pybind11::arg("block"),
        pybind11::arg("stream"));
  m.def("unpack", &hybrid::cuda::unpack, "Dequantize a wire [rows, wire_bytes] into fp32 out [rows, k]",
        pybind11::arg("wire"), pybind11::arg("out"), pybind11::arg("k"), pybind11::arg("bits"), pybind11::arg("block"),
        pybind11::arg("stream"));
  m.def("unpack_sum", &hybrid::cuda::unpack_sum, "Dequantize every row and sum them in row order into out [k]",
        pybind11::arg("wire"), pybind11::arg("out"), pybind11::arg("k"), pybind11::arg("bits"), pybind11::arg("block"),
        pybind11::arg("stream"));
  m.def("wire_bytes", &hybrid::cuda::wire_bytes, "Bytes of one packed row (the kernels' geometry)",
        pybind11::arg("k"), pybind11::arg("bits"), pybind11::arg("block"));
  m.def("max_1bit_block", &hybrid::cuda::quant_max_1bit_block, "Largest power-of-two 1-bit block the kernel takes");
}
