// qir_mma.cuh: the tensor-core and asynchronous-copy instructions of the GEMM family, one tiny
// helper each: inline PTX on a GPU (sm_80 and later), and on the host backend the portable bodies
// in qir_host.h, where the warp-collective fragment exchange of mma and ldmatrix is emulated and
// cp.async is a copy performed at its wait. Written beside each dumped .cu so it compiles alone.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

// Blackwell's warp-level block-scaled FP4 MMA (kind::mxf4nvf4) exists on sm_120a and sm_121a;
// ptxas refuses it for sm_100a, whose block-scaled MMA is tcgen05's (tensor memory, one thread
// issues; see docs/gpu-checks.md).
#if defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL)
#define QIR_NATIVE_FP4 1
#else
#define QIR_NATIVE_FP4 0
#endif

#if defined(__CUDA_ARCH__)
// The .shared address of a generic pointer into shared memory, as PTX's shared operands take it.
__device__ __forceinline__ uint32_t qir_smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#elif !defined(QIR_HOST)
#error "qir_mma.cuh: compile with NVRTC/nvcc for a GPU, or for the host backend (qir_host.h)"
#endif

// D = A * B + C over one 16x8x16 tile with fp32 accumulation, T = __half or __nv_bfloat16. The
// fragments are the PTX ISA's m16n8k16 layouts (groupID = lane / 4, t = lane % 4): a[0..3] hold
// A rows g and g + 8 at columns 2t, 2t + 1 (a[0], a[1]) and 2t + 8, 2t + 9 (a[2], a[3]), row g
// in a[0] and a[2]; b[0..1] hold B column g at rows 2t, 2t + 1 and 2t + 8, 2t + 9; d and c hold
// rows g and g + 8 at columns 2t and 2t + 1. Every pair packs its lower column (or row) in the
// low 16 bits. All 32 lanes must call it together.
template <typename T>
__device__ void qir_mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                 const float (&c)[4]);

template <>
__device__ __forceinline__ void qir_mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                         const uint32_t (&b)[2],
                                                         const float (&c)[4]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
#else
  qir_host::mma_m16n8k16<__half>(d, a, b, c);
#endif
}

template <>
__device__ __forceinline__ void qir_mma_m16n8k16<__nv_bfloat16>(float (&d)[4],
                                                                const uint32_t (&a)[4],
                                                                const uint32_t (&b)[2],
                                                                const float (&c)[4]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
#else
  qir_host::mma_m16n8k16<__nv_bfloat16>(d, a, b, c);
#endif
}

// D = (A * scale_A) (B * scale_B) + C over one 16x8x64 tile of E2M1 codes, fp32 accumulation,
// one UE4M3 scale per 16 elements of K (mma ... kind::mxf4nvf4.block_scale.scale_vec::4X, both
// selectors 0). The PTX ISA's m16n8k64 layouts (g = lane / 4, t = lane % 4): a[i] holds 8 codes
// (element j in nibble j) of A row g + 8 (i & 1), columns 8t + 32 (i >> 1) + j; b[i] holds B
// column g, rows 8t + 32 i + j; d and c as for m16n8k16. sfa carries, byte b for k block b, the
// scales of A row g + 8 (t & 1); sfb those of B column g. (This scale placement is how public
// sm_120a kernels feed the instruction; the ISA's figure was not at hand.) On sm_120a/sm_121a
// this is the instruction, compile-checked only: no machine here runs it; the host backend
// runs the emulation in qir_host.h; other GPUs trap (callers guard with QIR_NATIVE_FP4).
__device__ __forceinline__ void qir_mma_m16n8k64_nvf4(float (&d)[4], const uint32_t (&a)[4],
                                                      const uint32_t (&b)[2],
                                                      const float (&c)[4], uint32_t sfa,
                                                      uint32_t sfb) {
#if QIR_NATIVE_FP4
  const uint16_t zero = 0;
  asm volatile(
      "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1"
      ".f32.ue4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13}, %14, "
      "{%15, %16}, %17, {%18, %19};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]), "r"(sfa), "h"(zero), "h"(zero), "r"(sfb), "h"(zero), "h"(zero));
#elif defined(__CUDA_ARCH__)
  __trap();
#else
  qir_host::mma_m16n8k64_nvf4(d, a, b, c, sfa, sfb);
#endif
}

// N (1, 2 or 4) 8x8 matrices of 16-bit elements from shared memory: lane 8i + r passes the address
// of row r of matrix i (16-byte aligned; lanes past 8N pass any address). Register i of lane l
// receives matrix i's row l / 4, columns 2(l % 4) and 2(l % 4) + 1 (the lower in the low half);
// with Trans the matrix is read column-major: column l / 4, rows 2(l % 4) and 2(l % 4) + 1.
template <int N, bool Trans>
__device__ __forceinline__ void qir_ldmatrix(uint32_t (&r)[N], const void* row) {
  static_assert(N == 1 || N == 2 || N == 4, "ldmatrix loads 1, 2 or 4 matrices");
#if defined(__CUDA_ARCH__)
  const uint32_t s = qir_smem_addr(row);
  if constexpr (N == 1 && !Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(s));
  } else if constexpr (N == 1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(s));
  } else if constexpr (N == 2 && !Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(s));
  } else if constexpr (N == 2) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(s));
  } else if constexpr (!Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
  }
#else
  qir_host::ldmatrix<N, Trans>(r, row);
#endif
}

// Starts copying 16 bytes from global src to shared dst (both 16-byte aligned), bypassing L1
// (.cg: data read once per block, such as an activation tile). Only the first src_bytes (0..16)
// are read, the rest of dst is zero-filled: 0 reads nothing, for rows past a ragged edge.
__device__ __forceinline__ void qir_cp_async_cg16(void* dst, const void* src, int src_bytes) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(qir_smem_addr(dst)), "l"(src), "r"(src_bytes) : "memory");
#else
  qir_host::cp_async(dst, src, 16, src_bytes);
#endif
}

// The same through L1 (.ca) for Bytes = 4, 8 or 16, both pointers Bytes-aligned.
template <int Bytes>
__device__ __forceinline__ void qir_cp_async_ca(void* dst, const void* src, int src_bytes) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
               :: "r"(qir_smem_addr(dst)), "l"(src), "n"(Bytes), "r"(src_bytes) : "memory");
#else
  qir_host::cp_async(dst, src, Bytes, src_bytes);
#endif
}

// Closes the group of this thread's cp.asyncs started since the last commit.
__device__ __forceinline__ void qir_cp_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#else
  qir_host::cp_async_commit();
#endif
}

// Waits until at most N of this thread's committed groups are still in flight. Other threads see
// the data only after a barrier that follows their writers' waits.
template <int N>
__device__ __forceinline__ void qir_cp_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
#else
  qir_host::cp_async_wait(N);
#endif
}
