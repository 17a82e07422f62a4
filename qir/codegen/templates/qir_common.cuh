// qir_common.cuh: activation conversions, vector loads and the warp reduction shared by every
// qir kernel. Written beside each dumped .cu so the file compiles on its own.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ float qir_to_float(float v) { return v; }
__device__ __forceinline__ float qir_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float qir_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T qir_from_float(float v);
template <> __device__ __forceinline__ float qir_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half qir_from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 qir_from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// 8 consecutive activations as floats. Callers guarantee 16-byte alignment of p for 16-bit
// types (8 x 2 bytes = one 128-bit load) and 32-byte alignment for float (two loads).
template <typename T>
__device__ __forceinline__ void qir_load_act8(const T* __restrict__ p, float (&out)[8]) {
  static_assert(sizeof(T) == 2, "16-bit activations");
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = qir_to_float(h[i]);
}
template <>
__device__ __forceinline__ void qir_load_act8<float>(const float* __restrict__ p, float (&out)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__device__ __forceinline__ float qir_warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Rounds through the activation type, so fused code keeps the numerics of the separate ops
// that stored T between them.
template <typename T>
__device__ __forceinline__ float qir_round(float v) { return qir_to_float(qir_from_float<T>(v)); }

__device__ __forceinline__ float qir_silu(float v) { return v / (1.0f + expf(-v)); }
