// NVFP4 activation quantization, portable (mirrors qir.formats.nvfp4.quantize_activation_nvfp4,
// bit for bit): per block of 16 a dequant factor from the block amax and the global scale, then
// each element rounded to the nearest E2M1 value, ties to even, saturating at +-6.

// Round to the nearest E4M3FN value, ties to even; inputs are in [0, 448].
__device__ __forceinline__ float qir_round_e4m3(float x) {
  if (x < 0.015625f) return rintf(x * 512.0f) * 0.001953125f;  // subnormals: multiples of 2^-9
  uint32_t b = __float_as_uint(x);
  b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;  // keep 3 mantissa bits, ties to even
  return fminf(__uint_as_float(b), 448.0f);
}

// Nearest E2M1 value of v, ties to the even code, saturating at +-6.
__device__ __forceinline__ float qir_round_e2m1(float v) {
  const float a = fabsf(v);
  const float r = a <= 0.25f ? 0.0f : a < 0.75f ? 0.5f : a <= 1.25f ? 1.0f : a < 1.75f ? 1.5f
                : a <= 2.5f ? 2.0f : a < 3.5f ? 3.0f : a <= 5.0f ? 4.0f : 6.0f;
  return v < 0.0f ? -r : r;
}

// E2M1 code of a value qir_round_e2m1 returned.
__device__ __forceinline__ uint32_t qir_e2m1_code(float q) {
  const float a = fabsf(q);
  const uint32_t c = a < 2.0f ? (uint32_t)(a * 2.0f) : a < 4.0f ? 4u + (uint32_t)(a - 2.0f) : a < 6.0f ? 6u : 7u;
  return c | (q < 0.0f ? 8u : 0u);
}

// The factor x_q * factor dequantizes with. mode: 0 = per-row or calibrated encode factor gs
// (CT order: e4m3(min(amax/6*gs, 448)) / gs), 1 = calibrated decode factor is (ModelOpt order:
// e4m3(clamp(amax/(6*is), 2^-9, 448)) * is).
__device__ __forceinline__ float qir_nvfp4_factor(float amax, int mode, float scale) {
  if (mode == 1) {
    const float raw = fminf(fmaxf(amax / (6.0f * scale), 0.001953125f), 448.0f);
    return qir_round_e4m3(raw) * scale;
  }
  const float s = qir_round_e4m3(fminf(amax / 6.0f * scale, 448.0f));
  return (s == 0.0f ? 1.0f : s) / scale;  // an all-zero block codes as zeros with any factor
}

// Encode factor of a row whose amax is row_amax (no calibrated scale): 2688 / amax.
__device__ __forceinline__ float qir_nvfp4_row_scale(float row_amax) {
  return 2688.0f / (row_amax > 0.0f ? row_amax : 1.0f);
}

__device__ __forceinline__ float qir_warp_max(float v) {
#if defined(QIR_HOST_FAST)
  if (qir_host::warp_butterfly(v, [](float a, float b) { return fmaxf(a, b); })) return v;
#endif
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
