// qir_common.cuh: activation conversions, vector loads, the warp reduction and the packed-pair
// arithmetic shared by every qir kernel. Written beside each dumped .cu so the file compiles on
// its own. Inline PTX appears only in the small helpers below, each with a portable C++ body
// that the host backend (and any arch without the instruction) runs instead.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#if defined(QIR_HOST)
// The host backend (qir_host.h) converts 16-bit floats inline and exactly, with the toolkit's
// results; its own host conversions are out-of-line software, slow on every weight.
template <typename T> inline uint16_t qir_bits16(T v) { uint16_t b; memcpy(&b, &v, 2); return b; }
template <typename T> inline T qir_of_bits16(uint16_t b) { T v; memcpy(&v, &b, 2); return v; }
template <typename T> inline float qir_host_widen(uint16_t b) {
  if constexpr (std::is_same<T, __half>::value) return qir_host::half_bits_to_float(b);
  else return qir_host::bf16_bits_to_float(b);
}
#endif

__device__ __forceinline__ float qir_to_float(float v) { return v; }
#if defined(QIR_HOST)
inline float qir_to_float(__half v) { return qir_host::half_bits_to_float(qir_bits16(v)); }
inline float qir_to_float(__nv_bfloat16 v) { return qir_host::bf16_bits_to_float(qir_bits16(v)); }
#else
__device__ __forceinline__ float qir_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float qir_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
#endif

template <typename T> __device__ __forceinline__ T qir_from_float(float v);
template <> __device__ __forceinline__ float qir_from_float<float>(float v) { return v; }
#if defined(QIR_HOST)
template <> inline __half qir_from_float<__half>(float v) {
  return qir_of_bits16<__half>(qir_host::float_to_half_bits(v));
}
template <> inline __nv_bfloat16 qir_from_float<__nv_bfloat16>(float v) {
  return qir_of_bits16<__nv_bfloat16>(qir_host::float_to_bf16_bits(v));
}
#else
template <> __device__ __forceinline__ __half qir_from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 qir_from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
#endif

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

// 8 floats stored as 8 T (16 bytes for 16-bit T, 16-byte aligned; float: 32-byte aligned),
// each rounded to nearest.
template <typename T>
__device__ __forceinline__ void qir_store8(T* dst, const float* v) {
  uint4 out;
  T* h = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int e = 0; e < 8; ++e) h[e] = qir_from_float<T>(v[e]);
  *reinterpret_cast<uint4*>(dst) = out;
}
template <>
__device__ __forceinline__ void qir_store8<float>(float* dst, const float* v) {
  reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ float qir_warp_sum(float v) {
#if defined(QIR_HOST_FAST)
  if (qir_host::warp_sum(v)) return v;
#endif
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Rounds through the activation type, so fused code keeps the numerics of the separate ops
// that stored T between them.
template <typename T>
__device__ __forceinline__ float qir_round(float v) { return qir_to_float(qir_from_float<T>(v)); }

__device__ __forceinline__ float qir_silu(float v) { return v / (1.0f + expf(-v)); }

// gelu's tanh approximation (torch's approximate="tanh"; Gemma's gelu_pytorch_tanh).
__device__ __forceinline__ float qir_gelu_tanh(float v) {
  return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
}

// gpt-oss's clamped SwiGLU (qir.moe.swiglu_gate / swiglu_up): the gate factor
// min(g, limit) * sigmoid(alpha * min(g, limit)) and the up factor clamp(u, -limit, limit) + 1.
__device__ __forceinline__ float qir_swiglu_gate(float g, float limit, float alpha) {
  const float c = fminf(g, limit);
  return c / (1.0f + expf(-alpha * c));
}
__device__ __forceinline__ float qir_swiglu_up(float u, float limit) {
  return fminf(fmaxf(u, -limit), limit) + 1.0f;
}

// ---- 8 floats at a time ------------------------------------------------------------------------
// A dot product's 8 independent partial sums: fmaf per element (registers on a GPU; one vector
// FMA on a CPU, the host's fast mode, with the same roundings).
#if defined(QIR_HOST_FAST) && defined(__AVX__) && defined(__FMA__)
struct qir_f8 { __m256 v; };
__device__ __forceinline__ qir_f8 qir_f8_zero() { return {_mm256_setzero_ps()}; }
// p + w[e] * x[e] per element, each fused (one rounding).
__device__ __forceinline__ qir_f8 qir_fma8(const float* w, const float* x, qir_f8 p) {
  return {_mm256_fmadd_ps(_mm256_loadu_ps(w), _mm256_loadu_ps(x), p.v)};
}
// ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))
__device__ __forceinline__ float qir_sum8(qir_f8 p) {
  const __m128 lo = _mm256_castps256_ps128(p.v), hi = _mm256_extractf128_ps(p.v, 1);
  // pairs (0+1, 2+3) and (4+5, 6+7), then their pairs
  const __m128 a = _mm_hadd_ps(lo, hi);  // p0+p1, p2+p3, p4+p5, p6+p7
  const __m128 b = _mm_hadd_ps(a, a);    // (p0+p1)+(p2+p3), (p4+p5)+(p6+p7), ...
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#else
struct qir_f8 { float v[8]; };
__device__ __forceinline__ qir_f8 qir_f8_zero() { return {}; }
__device__ __forceinline__ qir_f8 qir_fma8(const float* w, const float* x, qir_f8 p) {
#pragma unroll
  for (int e = 0; e < 8; ++e) p.v[e] = fmaf(w[e], x[e], p.v[e]);
  return p;
}
__device__ __forceinline__ float qir_sum8(const qir_f8& p) {
  return ((p.v[0] + p.v[1]) + (p.v[2] + p.v[3])) + ((p.v[4] + p.v[5]) + (p.v[6] + p.v[7]));
}
#endif

// ---- Bit tricks -------------------------------------------------------------------------------

// Any three-input bitwise function in one instruction; LUT is the function's truth table over
// (a, b, c) = (0xF0, 0xCC, 0xAA), e.g. (a & b) | c is (0xF0 & 0xCC) | 0xAA = 0xEA.
template <uint32_t LUT>
__device__ __forceinline__ uint32_t qir_lop3(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return d;
#else
  uint32_t d = 0;
#pragma unroll
  for (uint32_t i = 0; i < 8; ++i) {
    if (!((LUT >> i) & 1u)) continue;
    d |= ((i & 4u) ? a : ~a) & ((i & 2u) ? b : ~b) & ((i & 1u) ? c : ~c);
  }
  return d;
#endif
}

// (a & mask) | bits: the magic-number step of every integer decode below.
__device__ __forceinline__ uint32_t qir_and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  return qir_lop3<(0xF0 & 0xCC) | 0xAA>(a, mask, bits);
}

// Byte i of the result is byte (sel >> 4i) & 7 of the 8 bytes {b:a} (CUDA's __byte_perm), or,
// where bit 4i + 3 of sel is set, that byte's sign bit copied into all 8 bits (PRMT's default
// mode, which __byte_perm's documentation leaves out).
__device__ __forceinline__ uint32_t qir_prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#else
  const uint64_t bytes = (uint64_t)b << 32 | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t n = sel >> (4 * i), byte = (uint32_t)(bytes >> (8 * (n & 7u))) & 0xFFu;
    d |= ((n & 8u) ? ((byte & 0x80u) ? 0xFFu : 0u) : byte) << (8 * i);
  }
  return d;
#endif
}

// c + the sum of the products of the 4 bytes of a and b (DP4A, sm_61 and later): b's signed,
// a's signed, or unsigned where UA (a table decode's offset-binary bytes).
template <bool UA = false>
__device__ __forceinline__ int qir_dp4a(uint32_t a, uint32_t b, int c) {
#if defined(__CUDA_ARCH__)
  int d;
  if constexpr (UA) asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  else asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  for (int i = 0; i < 4; ++i) {
    const int ai = UA ? (int)(uint8_t)(a >> (8 * i)) : (int)(int8_t)(a >> (8 * i));
    c += ai * (int)(int8_t)(b >> (8 * i));
  }
  return c;
#endif
}

// ---- Packed pairs -----------------------------------------------------------------------------
// A pair is two values of a 16-bit type T (__half or __nv_bfloat16) in one 32-bit word, the
// lower-indexed element in the low half. On a GPU the arithmetic is the packed f16x2/bf16x2
// instructions; the portable bodies compute each half in double and round once to T, which is
// the hardware's correctly rounded result except in double-rounding corner cases that the exact
// operations the decoders rely on (magic-number subtraction, products of small codes) never hit.

template <typename T> struct qir_is_bf16 { static constexpr bool value = false; };
template <> struct qir_is_bf16<__nv_bfloat16> { static constexpr bool value = true; };

template <typename T> struct qir_pair_of;
template <> struct qir_pair_of<__half> { using type = __half2; };
template <> struct qir_pair_of<__nv_bfloat16> { using type = __nv_bfloat162; };

template <typename T>
__device__ __forceinline__ typename qir_pair_of<T>::type qir_as_pair(uint32_t v) {
  return *reinterpret_cast<const typename qir_pair_of<T>::type*>(&v);
}
template <typename P>
__device__ __forceinline__ uint32_t qir_pair_bits(P v) {
  return *reinterpret_cast<const uint32_t*>(&v);
}

#if defined(QIR_HOST)
template <typename T> inline float qir_lo(uint32_t v) { return qir_host_widen<T>((uint16_t)v); }
template <typename T> inline float qir_hi(uint32_t v) { return qir_host_widen<T>((uint16_t)(v >> 16)); }
#else
template <typename T> __device__ __forceinline__ float qir_lo(uint32_t v) { return __low2float(qir_as_pair<T>(v)); }
template <typename T> __device__ __forceinline__ float qir_hi(uint32_t v) { return __high2float(qir_as_pair<T>(v)); }
#endif

// The pair (lo, hi), each rounded to T.
template <typename T> __device__ __forceinline__ uint32_t qir_pack(float lo, float hi);
#if defined(QIR_HOST)
template <> inline uint32_t qir_pack<__half>(float lo, float hi) {
  return (uint32_t)qir_host::float_to_half_bits(hi) << 16 | qir_host::float_to_half_bits(lo);
}
template <> inline uint32_t qir_pack<__nv_bfloat16>(float lo, float hi) {
  return (uint32_t)qir_host::float_to_bf16_bits(hi) << 16 | qir_host::float_to_bf16_bits(lo);
}
#else
template <> __device__ __forceinline__ uint32_t qir_pack<__half>(float lo, float hi) {
  return qir_pair_bits(__floats2half2_rn(lo, hi));
}
template <> __device__ __forceinline__ uint32_t qir_pack<__nv_bfloat16>(float lo, float hi) {
  return qir_pair_bits(__floats2bfloat162_rn(lo, hi));
}
#endif

#if !defined(__CUDA_ARCH__)
// Each half's exact result (in double) rounded once to T.
template <typename T> inline uint16_t qir_host_round_bits(double v) {
#if defined(QIR_HOST)
  if constexpr (qir_is_bf16<T>::value) return qir_host::double_to_bf16_bits(v);
  else return qir_host::double_to_half_bits(v);
#else
  T r;
  if constexpr (qir_is_bf16<T>::value) r = __double2bfloat16(v);
  else r = __double2half(v);
  uint16_t b;
  memcpy(&b, &r, 2);
  return b;
#endif
}
template <typename T> inline T qir_host_round(double v) {
  const uint16_t b = qir_host_round_bits<T>(v);
  T r;
  memcpy(&r, &b, 2);
  return r;
}
template <typename T> inline uint32_t qir_host_pair(double lo, double hi) {
  return (uint32_t)qir_host_round_bits<T>(hi) << 16 | qir_host_round_bits<T>(lo);
}
#endif

// a * b + c, per half.
template <typename T>
__device__ __forceinline__ uint32_t qir_fma2(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  return qir_pair_bits(__hfma2(qir_as_pair<T>(a), qir_as_pair<T>(b), qir_as_pair<T>(c)));
#elif defined(QIR_HOST)
  return qir_host::pair_op<qir_is_bf16<T>::value, qir_host::PairOp::fma>(a, b, c);
#else
  return qir_host_pair<T>((double)qir_lo<T>(a) * qir_lo<T>(b) + qir_lo<T>(c),
                          (double)qir_hi<T>(a) * qir_hi<T>(b) + qir_hi<T>(c));
#endif
}

template <typename T>
__device__ __forceinline__ uint32_t qir_mul2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return qir_pair_bits(__hmul2(qir_as_pair<T>(a), qir_as_pair<T>(b)));
#elif defined(QIR_HOST)
  return qir_host::pair_op<qir_is_bf16<T>::value, qir_host::PairOp::mul>(a, b, 0u);
#else
  return qir_host_pair<T>((double)qir_lo<T>(a) * qir_lo<T>(b), (double)qir_hi<T>(a) * qir_hi<T>(b));
#endif
}

// max(m, |a|) in each half of two f16 pairs, m's halves not negative; a NaN wins.
__device__ __forceinline__ uint32_t qir_absmax2(uint32_t m, uint32_t a) {
#if defined(__CUDA_ARCH__)
  return qir_pair_bits(__hmax2_nan(qir_as_pair<__half>(m), __habs2(qir_as_pair<__half>(a))));
#else
  // Magnitudes order as their bits, and a NaN's are above infinity's.
  uint32_t out = 0;
  for (int h = 0; h < 2; ++h) {
    const uint32_t x = (m >> (16 * h)) & 0xFFFFu, y = (a >> (16 * h)) & 0x7FFFu;
    out |= (x > y ? x : y) << (16 * h);
  }
  return out;
#endif
}

template <typename T>
__device__ __forceinline__ uint32_t qir_add2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return qir_pair_bits(__hadd2(qir_as_pair<T>(a), qir_as_pair<T>(b)));
#elif defined(QIR_HOST)
  return qir_host::pair_op<qir_is_bf16<T>::value, qir_host::PairOp::add>(a, b, 0u);
#else
  return qir_host_pair<T>((double)qir_lo<T>(a) + qir_lo<T>(b), (double)qir_hi<T>(a) + qir_hi<T>(b));
#endif
}

// lo + hi in float: how a run summed in pairs joins the float accumulator.
template <typename T>
__device__ __forceinline__ float qir_sum2(uint32_t v) { return qir_lo<T>(v) + qir_hi<T>(v); }

// lo + hi added in T (one rounding, where a run's pair accumulator is folded), as float.
template <typename T>
__device__ __forceinline__ float qir_hsum(uint32_t v) {
#if defined(__CUDA_ARCH__)
  const typename qir_pair_of<T>::type p = qir_as_pair<T>(v);
  return qir_to_float(__hadd(p.x, p.y));
#else
  return qir_to_float(qir_host_round<T>((double)qir_lo<T>(v) + qir_hi<T>(v)));
#endif
}

// The same two values as the other 16-bit type (exact for the small decoded codes that pass
// through here: they fit both types).
__device__ __forceinline__ uint32_t qir_f16x2_to_bf16x2(uint32_t v) {
  return qir_pair_bits(__floats2bfloat162_rn(qir_lo<__half>(v), qir_hi<__half>(v)));
}

// Magic-number constants of T: a code field at bit `pos` of a half reads 2^W + q * 2^pos,
// W = the mantissa bits below the exponent whose unit is 1.
template <typename T> __host__ __device__ constexpr int qir_magic_w() { return qir_is_bf16<T>::value ? 7 : 10; }
template <typename T> __host__ __device__ constexpr int qir_exp_bias() { return qir_magic_w<T>() == 10 ? 15 : 127; }
// Bits of +-2^e in T (e may fall below the normal range of f16: then a subnormal, still exact).
template <typename T>
__host__ __device__ constexpr uint32_t qir_pow2_bits(int e, bool negative) {
  const int biased = e + qir_exp_bias<T>();
  const uint32_t mag = biased >= 1 ? (uint32_t)biased << qir_magic_w<T>()
                                   : 1u << (qir_magic_w<T>() - 1 + biased);
  return (negative ? 0x8000u : 0u) | mag;
}
// Pair bits with both halves equal to v (a 16-bit pattern).
__host__ __device__ constexpr uint32_t qir_splat(uint32_t v16) { return v16 * 0x10001u; }

// n pairs of activations, read with 16-byte loads from x (16-byte aligned) and permuted so that
// pair e of each unit of 2S consecutive elements holds elements (e, e + S): the order in which
// a decoder with pair stride S produces its codes. S = 1 is plain k order.
template <int S, int N, typename T>
__device__ __forceinline__ void qir_act_pairs(const T* __restrict__ x, uint32_t (&p)[N]) {
  static_assert(sizeof(T) == 2 && N % 4 == 0 && (2 * N) % (2 * S) == 0, "16-byte loads of whole units");
  uint32_t k[N];  // k order: pair i = elements (2i, 2i + 1)
#pragma unroll
  for (int i = 0; i < N; i += 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(x + 2 * i);
    k[i] = v.x; k[i + 1] = v.y; k[i + 2] = v.z; k[i + 3] = v.w;
  }
  if constexpr (S == 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = k[i];
  } else {
    // Unit u, pair e: element u*2S + e sits in k[(u*2S + e) / 2], element u*2S + e + S in
    // k[(u*2S + e + S) / 2]; e even takes the low halves, e odd the high ones.
#pragma unroll
    for (int u = 0; u < 2 * N / (2 * S); ++u)
#pragma unroll
      for (int e = 0; e < S; ++e) {
        const uint32_t a = k[(u * 2 * S + e) / 2], b = k[(u * 2 * S + e + S) / 2];
        p[u * S + e] = qir_prmt(a, b, (e & 1) ? 0x7632u : 0x5410u);
      }
  }
}

// ---- Small float codes as packed pairs -------------------------------------------------------

// Two E4M3FN codes (bytes 2h and 2h+1 of w) as their exact values times 2^LOG2 in an f16 pair.
// sm_89 and later convert in hardware (then multiply by 2^LOG2 if it is not 0); the portable
// body moves the byte into the f16's high byte (sign at bit 15, exponent and mantissa one bit
// right of where f16 keeps them, which is e4m3 * 2^-8 for normal and subnormal codes alike) and
// scales by 2^(8 + LOG2) in one multiply, exactly (f16 keeps its subnormals) while the result
// stays in f16's range.
template <int H, int LOG2 = 0>
__device__ __forceinline__ uint32_t qir_e4m3x2_to_f16x2(uint32_t w) {
  static_assert(8 + LOG2 >= -14 && 8 + LOG2 <= 15, "2^(8 + LOG2) must be a normal f16");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t d;
  if constexpr (H == 1)
    asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;}" : "=r"(d) : "r"(w));
  else
    asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;}" : "=r"(d) : "r"(w));
  if constexpr (LOG2 != 0) d = qir_mul2<__half>(d, qir_splat(qir_pow2_bits<__half>(LOG2, false)));
  return d;
#else
  const uint32_t v = qir_prmt(w, 0u, H ? 0x3424u : 0x1404u);  // bytes {0, b[2H], 0, b[2H+1]}
  const uint32_t f = (v & 0x80008000u) | ((v >> 1) & 0x3F803F80u);
  return qir_mul2<__half>(f, qir_splat(qir_pow2_bits<__half>(8 + LOG2, false)));
#endif
}

// E2M1 (FP4) codes. Where the target converts a byte (two codes) to an f16 pair in hardware
// (arch-specific sm_100a, sm_120a, ...), the lowering defines QIR_FP4_CVT 1 in the kernel before
// this header: codes then decode in k order. Elsewhere each code goes through an E4M3 byte
// (s 0 0 e1 e0 m 0 0: the same value * 2^-6, normal and subnormal codes alike) and the E4M3
// conversion, which pairs codes two apart. QIR_FP4_STRIDE is that pair stride. The host (and
// a QIR_FP4_CVT kernel built for an arch without the instruction) runs a table lookup instead.
#ifndef QIR_FP4_CVT
#define QIR_FP4_CVT 0
#endif
#if QIR_FP4_CVT
constexpr int QIR_FP4_STRIDE = 1;
#else
constexpr int QIR_FP4_STRIDE = 2;
#endif

// The 8 E2M1 codes of w (element j in nibble j, element 2k low in byte k) as 4 f16 pairs of
// value * 2^LOG2 (exact), pair e of each unit of 2 * QIR_FP4_STRIDE codes holding codes
// (e, e + QIR_FP4_STRIDE). Through E4M3 the 2^-6 and LOG2 are one multiply.
template <int LOG2 = 0>
__device__ __forceinline__ void qir_e2m1x8_to_f16x2(uint32_t w, uint32_t (&p)[4]) {
#if QIR_FP4_CVT && defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && \
    __CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000 && __CUDA_ARCH_FAMILY_SPECIFIC__ < 1300
  asm("{.reg .b8 b0, b1, b2, b3;\n mov.b32 {b0, b1, b2, b3}, %4;\n"
      " cvt.rn.f16x2.e2m1x2 %0, b0;\n cvt.rn.f16x2.e2m1x2 %1, b1;\n"
      " cvt.rn.f16x2.e2m1x2 %2, b2;\n cvt.rn.f16x2.e2m1x2 %3, b3;}"
      : "=r"(p[0]), "=r"(p[1]), "=r"(p[2]), "=r"(p[3]) : "r"(w));
  if constexpr (LOG2 != 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = qir_mul2<__half>(p[i], qir_splat(qir_pow2_bits<__half>(LOG2, false)));
  }
#elif QIR_FP4_CVT
  // The conversion's result: each code's f16 bits (0, 0.5, 1, 1.5, 2, 3, 4, 6, signed), the
  // low nibble in the low half.
  constexpr uint16_t f16[8] = {0x0000, 0x3800, 0x3C00, 0x3E00, 0x4000, 0x4200, 0x4400, 0x4600};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = (w >> (8 * i)) & 0xFu, hi = (w >> (8 * i + 4)) & 0xFu;
    p[i] = ((uint32_t)f16[lo & 7] | (lo & 8u) << 12) | ((uint32_t)f16[hi & 7] | (hi & 8u) << 12) << 16;
    if constexpr (LOG2 != 0) p[i] = qir_mul2<__half>(p[i], qir_splat(qir_pow2_bits<__half>(LOG2, false)));
  }
#else
  // Each byte takes its magnitude field (bits 4..2, M) from w shifted, two bits down for the
  // odd codes (high nibbles), two up for the even ones, and its other bits from the signs s
  // (s << 4 for the even ones): those are zero but at bit 7, the sign, and at bit 3, which M
  // selects away. One select each: 6 integer ops a word. (Written as masks, or with s as a
  // plain w & ..., the compiler masks w << 4 afresh and takes 7.)
  constexpr uint32_t M = 0x1C1C1C1Cu, SELECT = (0xF0 & 0xAA) | (0xCC & ~0xAA);  // c ? a : b
  const uint32_t s = qir_lop3<0xF0 & 0xCC>(w, 0x88888888u, 0u);
  const uint32_t odd = qir_lop3<SELECT>(w >> 2, s, M);
  const uint32_t even = qir_lop3<SELECT>(w << 2, s << 4, M);
  p[0] = qir_e4m3x2_to_f16x2<0, LOG2 + 6>(even);  // codes (0, 2)
  p[1] = qir_e4m3x2_to_f16x2<0, LOG2 + 6>(odd);   // (1, 3)
  p[2] = qir_e4m3x2_to_f16x2<1, LOG2 + 6>(even);  // (4, 6)
  p[3] = qir_e4m3x2_to_f16x2<1, LOG2 + 6>(odd);   // (5, 7)
#endif
}

// E2M1 values times 2 are the integers 0, 1, 2, 3, 4, 6, 8, 12 and their negatives: products of
// two sum exactly in int32 (DP4A, four a step). PRMT looks a code's magnitude up in an 8-byte
// table; a code whose sign bit is set selects its table byte's sign instead, 0 (every entry is
// positive). So one lookup yields the positive codes, and one with the sign bits flipped the
// negative ones.
constexpr uint32_t QIR_E2M1_X2_LO = 0x03020100u, QIR_E2M1_X2_HI = 0x0C080604u;

// v, in a per-thread register: ptxas keeps a constant (or any warp-uniform value) in a uniform
// register and copies it into a fresh one before every PRMT that reads it as its table, a
// move per lookup. threadIdx.x >> 16 is 0 (a block has at most 1024 threads), but ptxas does
// not fold it, and it varies by thread as far as ptxas knows.
__device__ __forceinline__ uint32_t qir_per_thread(uint32_t v) {
#if defined(__CUDA_ARCH__)
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  v |= tid >> 16;
#endif
  return v;
}

// The 8 E2M1 codes of w (element j in nibble j) as bytes 2|v| for codes v >= 0 (pos) and v < 0
// (neg), 0 in the other's bytes: codes 4h .. 4h + 3 in word h, in k order. `lo` holds
// QIR_E2M1_X2_LO (see qir_per_thread).
__device__ __forceinline__ void qir_e2m1x8_split(uint32_t w, uint32_t (&pos)[2], uint32_t (&neg)[2],
                                                 uint32_t lo = QIR_E2M1_X2_LO) {
  const uint32_t f = w ^ 0x88888888u;
  pos[0] = qir_prmt(lo, QIR_E2M1_X2_HI, w);
  neg[0] = qir_prmt(lo, QIR_E2M1_X2_HI, f);
  pos[1] = qir_prmt(lo, QIR_E2M1_X2_HI, w >> 16);
  neg[1] = qir_prmt(lo, QIR_E2M1_X2_HI, f >> 16);
}

// The same codes as signed bytes 2v. pos - neg byte by byte: (pos | 0x80) - neg stays within
// [116, 140] in every byte, so no byte borrows from the next.
__device__ __forceinline__ void qir_e2m1x8_s8(uint32_t w, uint32_t (&v)[2]) {
  uint32_t pos[2], neg[2];
  qir_e2m1x8_split(w, pos, neg);
#pragma unroll
  for (int h = 0; h < 2; ++h) v[h] = ((pos[h] | 0x80808080u) - neg[h]) ^ 0x80808080u;
}

