// Per-block bodies of the CPU blockwise quantization codec (see quantize.cpp).
//
// quantize.cpp includes this file once per instruction set, each time inside its own
// namespace and `#pragma GCC target(...)` region, so the same loops are auto-vectorised
// for AVX-512, AVX2 and the baseline, and the path is chosen at run time. There is
// deliberately no include guard, and nothing here includes a header.
//
// Every fp32 operation is a single correctly rounded IEEE operation, written in the
// order of the torch path in hybrid/kernels/quantize.py (the build passes
// -ffp-contract=off -fno-fast-math: no FMA contraction, no reciprocal division, no
// reassociation), so every path is bit-identical to it:
//   int8/int4: q = rint((x / a) * qmax)   (round half to even), x' = (q / qmax) * a
//   1-bit:     r_i = |x_i| / a, summed by the format's pairwise tree, s = (sum / n) * a,
//              x' = (+-1) * s (a select of +s / -s, NaN kept as the product keeps it)
// The block absmax is found on the bit patterns: |x| as an unsigned integer orders like
// the float, +-inf is 0x7f800000 and every NaN is above it, so one integer max gives the
// absmax (as +0 for an all-zero block) and whether the block holds a non-finite value.

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// max over i < n of the bit pattern of |v[i]| (an integer reduction, so it vectorises).
inline uint32_t abs_max_bits(const float* __restrict__ v, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, v + i, sizeof(u));
    u &= 0x7fffffffu;
    m = u > m ? u : m;
  }
  return m;
}

// q[i] = rint((v[i] / safe) * QMAX) as two's-complement bytes.
template <int QMAX>
inline void quantize_block(const float* __restrict__ v, int64_t n, float safe, int8_t* __restrict__ q) {
  const float qmax = static_cast<float>(QMAX);
  for (int64_t i = 0; i < n; ++i) {
    float t = v[i] / safe;
    t = t * qmax;
    q[i] = static_cast<int8_t>(static_cast<int32_t>(__builtin_rintf(t)));
  }
}

// Two 4-bit two's-complement values per byte, element 2j in the low nibble.
inline void pack_nibbles(const int8_t* __restrict__ q, int64_t n, uint8_t* __restrict__ d) {
  for (int64_t j = 0; j < n / 2; ++j) {
    d[j] = static_cast<uint8_t>((static_cast<uint8_t>(q[2 * j]) & 15u) | (static_cast<uint8_t>(q[2 * j + 1]) << 4));
  }
}

// Bit e of byte j is set when v[8j + e] >= 0 (so -0.0 counts as non-negative).
inline void sign_bits(const float* __restrict__ v, int64_t n, uint8_t* __restrict__ d) {
  for (int64_t j = 0; j < n / 8; ++j) {
    uint32_t byte = 0;
    for (int e = 0; e < 8; ++e) byte |= static_cast<uint32_t>(v[8 * j + e] >= 0.0f) << e;
    d[j] = static_cast<uint8_t>(byte);
  }
}

// The 1-bit scale: (tree_sum(|v| / safe) / count) * absmax, with v zero-padded from
// `block` up to the power of two `tree`. r holds `tree` floats of scratch.
inline float one_bit_scale(const float* __restrict__ v, int64_t block, int64_t tree, int64_t count, float safe,
                           float absmax, float* __restrict__ r) {
  for (int64_t i = 0; i < block; ++i) r[i] = __builtin_fabsf(v[i]) / safe;
  for (int64_t i = block; i < tree; ++i) r[i] = 0.0f;
  for (int64_t h = tree >> 1; h >= 1; h >>= 1) {
    for (int64_t i = 0; i < h; ++i) r[i] = r[i] + r[i + h];
  }
  const float mean = r[0] / static_cast<float>(count);
  return mean * absmax;
}

// Quantize one block `v` (block floats, already zero-padded past `count`) into its data
// bytes `d`; returns the scale to store. scratch: max(block, tree) floats.
template <int BITS>
inline float encode_block(const float* __restrict__ v, int64_t block, int64_t tree, int64_t count,
                          uint8_t* __restrict__ d, float* __restrict__ scratch) {
  const uint32_t m = abs_max_bits(v, block);
  const int64_t nbytes = block * BITS / 8;
  if (m >= 0x7f800000u) {  // an inf or NaN: NaN scale, zero data
    std::memset(d, 0, static_cast<size_t>(nbytes));
    return bits_float(0x7fc00000u);
  }
  const float absmax = bits_float(m);
  const float safe = m != 0 ? absmax : 1.0f;
  if constexpr (BITS == 8) {
    quantize_block<127>(v, block, safe, reinterpret_cast<int8_t*>(d));
    return absmax;
  } else if constexpr (BITS == 4) {
    int8_t* q = reinterpret_cast<int8_t*>(scratch);
    quantize_block<7>(v, block, safe, q);
    pack_nibbles(q, block, d);
    return absmax;
  } else {
    sign_bits(v, block, d);
    return one_bit_scale(v, block, tree, count, safe, absmax, scratch);
  }
}

template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);  // exact for bf16 and fp16
}

// Pack quantization blocks [qb0, qb1) (row-major over rows x nblocks) of x [rows, k].
template <typename T, int BITS>
void pack_range(const T* __restrict__ x, uint8_t* __restrict__ wire, const Geometry& g, int64_t qb0, int64_t qb1) {
  std::vector<float> buf(static_cast<size_t>(g.block + (g.tree > g.block ? g.tree : g.block)));
  float* padded = buf.data();             // block floats: a converted or zero-padded block
  float* scratch = buf.data() + g.block;  // the 1-bit tree / the int4 codes
  for (int64_t qb = qb0; qb < qb1; ++qb) {
    const int64_t row = qb / g.nblocks;
    const int64_t b = qb - row * g.nblocks;
    const int64_t start = b * g.block;
    const int64_t count = g.k - start < g.block ? g.k - start : g.block;
    const T* xr = x + row * g.k + start;
    uint8_t* wr = wire + row * g.row_bytes;
    const float* v = padded;
    bool direct = false;
    if constexpr (std::is_same<T, float>::value) direct = count == g.block;
    if (direct) {
      v = reinterpret_cast<const float*>(xr);
    } else {
      for (int64_t i = 0; i < count; ++i) padded[i] = widen(xr[i]);
      for (int64_t i = count; i < g.block; ++i) padded[i] = 0.0f;
    }
    const float scale = encode_block<BITS>(v, g.block, g.tree, count, wr + b * g.block_bytes, scratch);
    std::memcpy(wr + g.data_bytes + 4 * b, &scale, sizeof(scale));  // little-endian host
  }
}

// out[i] (or out[i] + ...) for the first `count` elements of one block.
template <int BITS, bool ADD>
inline void decode_block(const uint8_t* __restrict__ d, float scale, int64_t count, float* __restrict__ out) {
  if constexpr (BITS == 8) {
    for (int64_t i = 0; i < count; ++i) {
      float t = static_cast<float>(static_cast<int8_t>(d[i])) / 127.0f;
      t = t * scale;
      out[i] = ADD ? out[i] + t : t;
    }
  } else if constexpr (BITS == 4) {
    const int64_t pairs = count / 2;
    for (int64_t j = 0; j < pairs; ++j) {
      const int8_t byte = static_cast<int8_t>(d[j]);
      float lo = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(d[j] << 4)) >> 4) / 7.0f;
      float hi = static_cast<float>(byte >> 4) / 7.0f;
      lo = lo * scale;
      hi = hi * scale;
      out[2 * j] = ADD ? out[2 * j] + lo : lo;
      out[2 * j + 1] = ADD ? out[2 * j + 1] + hi : hi;
    }
    if (count % 2) {
      float lo = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(d[pairs] << 4)) >> 4) / 7.0f;
      lo = lo * scale;
      out[count - 1] = ADD ? out[count - 1] + lo : lo;
    }
  } else {
    // x' = (+-1) * s, which is +s or -s exactly; for a NaN s the product is s itself,
    // quieted (what the torch path's multiplication gives; the compiler would turn a
    // multiplication by -1 into a sign flip, which would flip the NaN's sign too).
    const uint32_t sb = float_bits(scale);
    const bool nan = (sb & 0x7fffffffu) > 0x7f800000u;
    const float pos = nan ? bits_float(sb | 0x00400000u) : scale;
    const float neg = nan ? pos : -scale;
    const int64_t whole = count / 8;
    for (int64_t j = 0; j < whole; ++j) {
      const uint32_t byte = d[j];
      for (int e = 0; e < 8; ++e) {
        const float t = ((byte >> e) & 1u) ? pos : neg;
        out[8 * j + e] = ADD ? out[8 * j + e] + t : t;
      }
    }
    for (int64_t i = 8 * whole; i < count; ++i) {
      const float t = ((d[i >> 3] >> (i & 7)) & 1u) ? pos : neg;
      out[i] = ADD ? out[i] + t : t;
    }
  }
}

inline float load_scale(const uint8_t* p) {
  float s;
  std::memcpy(&s, p, sizeof(s));
  return s;
}

// Dequantize quantization blocks [qb0, qb1) of wire into out [rows, k].
template <int BITS>
void unpack_range(const uint8_t* __restrict__ wire, float* __restrict__ out, const Geometry& g, int64_t qb0,
                  int64_t qb1) {
  for (int64_t qb = qb0; qb < qb1; ++qb) {
    const int64_t row = qb / g.nblocks;
    const int64_t b = qb - row * g.nblocks;
    const int64_t start = b * g.block;
    const int64_t count = g.k - start < g.block ? g.k - start : g.block;
    const uint8_t* wr = wire + row * g.row_bytes;
    decode_block<BITS, false>(wr + b * g.block_bytes, load_scale(wr + g.data_bytes + 4 * b), count,
                              out + row * g.k + start);
  }
}

// out[cols of blocks b0..b1) = ((row 0 + row 1) + ...) + row rows-1, in fp32.
template <int BITS>
void unpack_sum_range(const uint8_t* __restrict__ wire, float* __restrict__ out, const Geometry& g, int64_t b0,
                      int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * g.block;
    const int64_t count = g.k - start < g.block ? g.k - start : g.block;
    decode_block<BITS, false>(wire + b * g.block_bytes, load_scale(wire + g.data_bytes + 4 * b), count, out + start);
    for (int64_t r = 1; r < g.rows; ++r) {
      const uint8_t* wr = wire + r * g.row_bytes;
      decode_block<BITS, true>(wr + b * g.block_bytes, load_scale(wr + g.data_bytes + 4 * b), count, out + start);
    }
  }
}
