// qir_layer.cuh: what the layer kernels (RMSNorm, RoPE, KV cache, attention, embedding) share.
// Written beside each dumped .cu so the file compiles on its own; includes qir_common.cuh.
#pragma once
#include "qir_common.cuh"

// +infinity without <math.h> (NVRTC has none): an empty softmax starts at -QIR_INF.
#define QIR_INF __int_as_float(0x7f800000)

// Sum of v over a block of THREADS threads (a multiple of 32); every thread gets the sum.
template <int THREADS>
__device__ __forceinline__ float qir_block_sum(float v) {
  __shared__ float partial[THREADS / 32];
  v = qir_warp_sum(v);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.0f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) s += partial[w];
  __syncthreads();  // partial may be written again by the next call
  return s;
}

// RMSNorm's divisor of a row whose squares sum to sum_sq: sqrt(mean(x^2) + eps), as the
// interpreter forms it (x / divisor * w, not x * rsqrt(...)).
__device__ __forceinline__ float qir_rms_divisor(float sum_sq, int n, float eps) {
  return sqrtf(sum_sq / (float)n + eps);
}

// Rotates the pair (a, b) = (x[i], x[i + head_dim/2]) of one head by `angle` (the
// rotate-half convention of Llama's RoPE).
__device__ __forceinline__ void qir_rotate_cs(float& a, float& b, float c, float s) {
  const float ra = a * c - b * s;
  b = b * c + a * s;
  a = ra;
}
// `s` scales cos and sin (yarn's and LongRoPE's attention_factor; 1 is exact for the other
// RoPE types).
__device__ __forceinline__ void qir_rotate(float& a, float& b, float angle, float s = 1.0f) {
  qir_rotate_cs(a, b, cosf(angle) * s, sinf(angle) * s);
}

// The cache row of position p (>= 0) of a sequence whose block table is `table`: page
// table[p / PAGE] of a pool of PAGES pages, row p % PAGE in it. A page id outside the pool reads
// its nearest page instead of memory past the pool (the interpreter refuses such a table).
template <int PAGE, int PAGES>
__device__ __forceinline__ int qir_page_row(const int32_t* table, int p) {
  return min(max(table[p / PAGE], 0), PAGES - 1) * PAGE + p % PAGE;
}

__device__ __forceinline__ float qir_warp_reduce_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Attention's soft-cap tanh(s / cap) * cap as cap - 2 cap / (2^(s * k) + 1), k = 2 log2(e) / cap
// (times the attention scale, folded by the caller): one exp2 and one fast division (the
// divisor is >= 1; past 2^126 the quotient is 0 and the score the cap). tanhf's longer code in
// the split kernel's key loop made ptxas spill (sm_80, sm_100a).
__device__ __forceinline__ float qir_softcap(float scaled_k, float cap) {
  return cap - __fdividef(2.0f * cap, exp2f(scaled_k) + 1.0f);
}
