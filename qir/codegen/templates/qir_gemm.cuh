// qir_gemm.cuh: what the GEMM family's kernels share besides the tensor-core helpers
// (qir_mma.cuh): staging stores into shared memory. Written beside each dumped .cu.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include "qir_common.cuh"

// n (a multiple of 8) zero T at dst (16-byte aligned): a tile's rows and columns past an edge.
template <typename T>
__device__ __forceinline__ void qir_zero(T* dst, int n) {
  for (int e = 0; e < n; e += 8) *reinterpret_cast<uint4*>(dst + e) = make_uint4(0u, 0u, 0u, 0u);
}
