// Small-float codes -> float, portable bit assembly shared by the FP fragments (mirrors
// qir/formats/fp_codes.py). No tables, so nothing lands in local memory. NaN codes never reach a
// kernel: the formats reject them when the weights are loaded.

// E2M1 code (low 4 bits): exponent field e > 0 gives 2^(e-1) * (1 + m/2), e == 0 gives m * 0.5.
__device__ __forceinline__ float qir_e2m1_to_float(uint32_t c) {
  const uint32_t e = (c >> 1) & 3u, m = c & 1u;
  const uint32_t mag = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3F000000u : 0u);
  return __uint_as_float(mag | ((c & 8u) << 28));
}

// E4M3FN byte: its exponent/mantissa bits placed at the bottom of a float's exponent field are
// the same value times 2^-120 (subnormals land on float subnormals), so one multiply by 2^120
// rescales exactly.
__device__ __forceinline__ float qir_e4m3_to_float(uint32_t b) {
  const float mag = __uint_as_float((b & 0x7Fu) << 20) * 1.329227995784916e36f;  // 2^120
  return (b & 0x80u) ? -mag : mag;
}

// E8M0 byte e: 2^(e-127) is e in a float's exponent field; e == 0 is the float subnormal 2^-127.
__device__ __forceinline__ float qir_e8m0_to_float(uint32_t e) {
  return __uint_as_float(e ? (e << 23) : 0x00400000u);
}
