// Small-float codes -> float, portable bit assembly shared by the FP fragments (mirrors
// qir/formats/fp_codes.py). No tables, so nothing lands in local memory. NaN codes never reach a
// kernel: the formats reject them when the weights are loaded.

// E2M1 code (low 4 bits): exponent field e > 0 gives 2^(e-1) * (1 + m/2), e == 0 gives m * 0.5.
__device__ __forceinline__ float qir_e2m1_to_float(uint32_t c) {
  const uint32_t e = (c >> 1) & 3u, m = c & 1u;
  const uint32_t mag = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3F000000u : 0u);
  return __uint_as_float(mag | ((c & 8u) << 28));
}

// E4M3FN byte: a normal code (exponent e > 0) is a normal float with the exponent rebiased
// (7 -> 127) and the 3 mantissa bits on top; a subnormal one is m * 2^-9. Built without float
// subnormals, so flush-to-zero compilation (-ftz=true) decodes it the same.
__device__ __forceinline__ float qir_e4m3_to_float(uint32_t b) {
  const uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
  const float mag = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
  return (b & 0x80u) ? -mag : mag;
}

// E8M0 byte e: 2^(e-127) is e in a float's exponent field; e == 0 is the float subnormal 2^-127,
// whose bits 0x00400000 are below every e << 23 of e >= 1 (one max, no select).
__device__ __forceinline__ float qir_e8m0_to_float(uint32_t e) {
  return __uint_as_float(max(e << 23, 0x00400000u));
}
