// Host-side entry points of the blockwise quantization kernels (quantize.cu).
//
// Like launchers.h this needs no CUDA or torch headers; the binding passes raw
// pointers and the cudaStream_t as void*. Launchers return 0, a cudaError_t value,
// or a negative HybridStatus (launchers.h); error_string() turns either into text.
// Format: docs/compression.md and hybrid/kernels/quantize.py.
#pragma once

#include <cstdint>

#include "launchers.h"

namespace hybrid {
namespace cuda {

// Geometry of one pack/unpack call, filled in by quant_args().
struct QuantArgs {
  int64_t rows;
  int64_t k;            // elements per row
  int64_t block;        // elements per block
  int64_t nblocks;      // ceil(k / block)
  int64_t block_bytes;  // data bytes per block: block * bits / 8
  int64_t data_bytes;   // nblocks * block_bytes: offset of the first scale in a row
  int64_t row_bytes;    // data_bytes + 4 * nblocks (= wire_bytes in Python)
  int64_t tree;         // 1-bit: block rounded up to a power of two (the pairwise sum's width)
  int bits;             // 8, 4 or 1
};

// Validates bits/block (int4: even block; 1-bit: block % 8 == 0 and tree <=
// quant_max_1bit_block()) and fills *args. Returns kOk or kBadShape.
int quant_args(int64_t rows, int64_t k, int bits, int64_t block, QuantArgs* args);

// Largest power-of-two block the 1-bit pack kernel's shared-memory tree holds.
int64_t quant_max_1bit_block();

// x: [rows, k] contiguous, x_dtype one of kFloat32/kFloat16/kBFloat16.
// wire: [rows, row_bytes] bytes, every byte written.
int launch_quant_pack(const QuantArgs& args, const void* x, int x_dtype, uint8_t* wire, void* stream);

// out: [rows, k] contiguous fp32.
int launch_quant_unpack(const QuantArgs& args, const uint8_t* wire, float* out, void* stream);

// out: [k] contiguous, out_dtype one of kFloat32/kFloat16/kBFloat16; rows >= 1.
// out[i] = cast(((deq(0, i) + deq(1, i)) + ...) + deq(rows-1, i)), summed in fp32.
int launch_quant_unpack_sum(const QuantArgs& args, const uint8_t* wire, void* out, int out_dtype, void* stream);

}  // namespace cuda
}  // namespace hybrid
