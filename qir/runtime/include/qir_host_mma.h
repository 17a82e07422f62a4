// qir_host_mma.h: 16-bit float conversions and the emulated tensor cores and
// asynchronous copies behind qir_mma.cuh.
// Part of qir_host.h, which includes the parts in order after the toolkit headers; not
// usable on its own.
#pragma once

namespace qir_host {

// ---- 16-bit floats, exactly and inline ------------------------------------------------------
// The toolkit's host conversions are out-of-line software; kernels convert on every weight, so
// qir_common.cuh's host paths come here. Results equal the toolkit's (round to nearest even);
// F16C does f16 in one instruction where the build targets it. NaNs go to the toolkit, so
// their bit patterns stay its own.

inline float half_bits_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0) {  // zero and subnormals: m * 2^-24 is exact in float
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  uint32_t bits = sign | (e == 0x1F ? 0x7F800000u : (e + 112) << 23) | m << 13;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float bf16_bits_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_half_bits(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN
    const __half h = __float2half_rn(f);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // rounds to inf (65520 and up)
  if (a < 0x38800000u) {                        // below 2^-14: a subnormal half (or zero)
    // The value in units of 2^-24 (exact: a power-of-two scale), rounded to nearest even;
    // 1024 units come out as the smallest normal's bits, as they should.
    float mag;
    std::memcpy(&mag, &a, 4);
    const uint32_t r = static_cast<uint32_t>(std::nearbyint(mag * 16777216.0f));
    return sign | static_cast<uint16_t>(r);
  }
  // Normal: drop 13 mantissa bits with round to nearest even.
  const uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
#endif
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN
    const __nv_bfloat16 h = __float2bfloat16_rn(f);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// A double rounded to float toward zero with the last bit set when inexact ("round to odd"):
// rounding that to a format of 22 bits or fewer to nearest even gives the double's own correct
// rounding (24 >= 11 + 2 and 8 + 2 bits), so one double rounding path serves f16 and bf16.
inline float round_to_odd(double d) {
  float f = static_cast<float>(d);
  if (static_cast<double>(f) != d) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    if (std::fabs(static_cast<double>(f)) > std::fabs(d)) b -= 1;  // rounded up in magnitude
    b |= 1u;
    std::memcpy(&f, &b, 4);
  }
  return f;
}

inline uint16_t double_to_half_bits(double d) {
  if (d != d) {
    const __half h = __double2half(d);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  return float_to_half_bits(round_to_odd(d));
}

inline uint16_t double_to_bf16_bits(double d) {
  if (d != d) {
    const __nv_bfloat16 h = __double2bfloat16(d);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  return float_to_bf16_bits(round_to_odd(d));
}

// Packed pair arithmetic (qir_common.cuh's qir_fma2 & co): each half computed in double and
// rounded once to its 16-bit type, both halves at once in SSE registers where the build has
// F16C and SSE4.1 (the same values as the scalar path: double's exact product, round to odd,
// then to nearest even). NaNs take the scalar path, for the toolkit's NaN bits.
enum class PairOp { fma, mul, add };

template <bool Bf16>
inline double pair_half(uint32_t v, int i) {
  const uint16_t h = static_cast<uint16_t>(v >> (16 * i));
  return Bf16 ? bf16_bits_to_float(h) : half_bits_to_float(h);
}

template <bool Bf16, PairOp Op>
inline uint32_t pair_scalar(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t out = 0;
  for (int i = 0; i < 2; ++i) {
    const double x = pair_half<Bf16>(a, i), y = pair_half<Bf16>(b, i);
    const double r = Op == PairOp::fma ? x * y + pair_half<Bf16>(c, i) : Op == PairOp::mul ? x * y : x + y;
    out |= static_cast<uint32_t>(Bf16 ? double_to_bf16_bits(r) : double_to_half_bits(r)) << (16 * i);
  }
  return out;
}

#if defined(__F16C__) && defined(__SSE4_1__)
template <bool Bf16>
inline __m128d pair_widen(uint32_t v) {
  const __m128i x = _mm_cvtsi32_si128(static_cast<int>(v));
  if constexpr (Bf16) return _mm_cvtps_pd(_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), x)));
  else return _mm_cvtps_pd(_mm_cvtph_ps(x));
}

template <bool Bf16, PairOp Op>
inline uint32_t pair_op(uint32_t a, uint32_t b, uint32_t c) {
  const __m128d x = pair_widen<Bf16>(a), y = pair_widen<Bf16>(b);
  const __m128d r = Op == PairOp::fma ? _mm_add_pd(_mm_mul_pd(x, y), pair_widen<Bf16>(c))
                    : Op == PairOp::mul ? _mm_mul_pd(x, y)
                                        : _mm_add_pd(x, y);
  if (_mm_movemask_pd(_mm_cmpunord_pd(r, r))) return pair_scalar<Bf16, Op>(a, b, c);
  // Round to odd: where float's nearest is not r, the float below it in magnitude, last bit set.
  const __m128 f = _mm_cvtpd_ps(r);
  const __m128d back = _mm_cvtps_pd(f), abs_mask = _mm_castsi128_pd(_mm_set1_epi64x(0x7FFFFFFFFFFFFFFFll));
  const __m128d inexact = _mm_cmpneq_pd(back, r);
  const __m128d above = _mm_and_pd(inexact, _mm_cmpgt_pd(_mm_and_pd(back, abs_mask), _mm_and_pd(r, abs_mask)));
  // 64-bit lane masks to 32-bit lanes 0 and 1.
  const __m128i inexact32 = _mm_shuffle_epi32(_mm_castpd_si128(inexact), 0x08);
  const __m128i above32 = _mm_shuffle_epi32(_mm_castpd_si128(above), 0x08);
  __m128i bits = _mm_add_epi32(_mm_castps_si128(f), above32);  // -1 where rounded up
  bits = _mm_or_si128(bits, _mm_and_si128(inexact32, _mm_set1_epi32(1)));
  if constexpr (Bf16) {
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
    const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(bits, _mm_set1_epi32(0x7FFF)), lsb), 16);
    return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_packus_epi32(rounded, rounded)));
  } else {
    return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_cvtps_ph(_mm_castsi128_ps(bits), _MM_FROUND_TO_NEAREST_INT)));
  }
}
#else
template <bool Bf16, PairOp Op>
inline uint32_t pair_op(uint32_t a, uint32_t b, uint32_t c) {
  return pair_scalar<Bf16, Op>(a, b, c);
}
#endif

// ---- Tensor cores and asynchronous copies: the portable bodies of qir_mma.cuh ---------------
// The GEMM family's mma.sync, ldmatrix and cp.async. mma and ldmatrix are warp-collective: every
// lane publishes its operands (registers, or a row address) in one warp exchange, then computes
// what the PTX ISA says its own registers receive. cp.async copies are queued per thread and
// performed at the cp.async.wait_group that covers them, so a kernel that reads the destination
// before waiting (or, after its wait, before a barrier orders another thread's wait) reads stale
// bytes here, as it might on a GPU.

// 16-bit operand bits widened to float, exactly (the toolkit's host conversions are slower).
inline float widen(uint16_t h, __half) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0) {  // zero and subnormals: m * 2^-24 is exact in float
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (e == 0x1F ? 0x7F800000u : (e + 112) << 23) | m << 13;
  return from_bits<float>(bits);
}
inline float widen(uint16_t h, __nv_bfloat16) { return from_bits<float>(uint32_t{h} << 16); }

template <typename T>
inline float operand(uint32_t reg, unsigned half) {
  static_assert(sizeof(T) == 2, "16-bit operands");
  return widen(static_cast<uint16_t>(reg >> (16 * half)), T{});
}

// The value an m16n8k16 mma with fp32 accumulation gives: each of the 16 products of two 16-bit
// floats is exact in double, and their sum with c is rounded to fp32 once. (A tensor core adds in
// its own order and precision; the results agree to fp32 rounding, and exactly where every
// partial sum is representable, which scripts/gpu_check.sh checks on a GPU.) Lanes publish
// their operands widened to float (A's 8, then B's 4), so each is converted once.
template <typename T>
__attribute__((noinline)) void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2], const float (&c)[4]) {
  float mine[12];
  for (unsigned i = 0; i < 4; ++i)
    for (unsigned h = 0; h < 2; ++h) mine[2 * i + h] = operand<T>(a[i], h);
  for (unsigned i = 0; i < 2; ++i)
    for (unsigned h = 0; h < 2; ++h) mine[8 + 2 * i + h] = operand<T>(b[i], h);
  uint32_t words[12];
  std::memcpy(words, mine, sizeof words);
  const float* bank = reinterpret_cast<const float*>(worker()->exchange_words(words, 12));
  constexpr unsigned W = Worker::kWords;
  const unsigned lane = worker()->lane();
  const unsigned g = lane >> 2, t = lane & 3;
  // This lane's rows g, g + 8 of A and columns 2t, 2t + 1 of B. A[row][k] is element k & 1 of
  // register (row >= 8) + 2 (k >= 8) of lane 4 (row % 8) + (k % 8) / 2; B[k][col] element k & 1
  // of register k >= 8 of lane 4 col + (k % 8) / 2.
  float arow[2][16], bcol[2][16];
  for (unsigned k = 0; k < 16; ++k) {
    const unsigned kk = (k & 7) >> 1, e = k & 1, hi = k >> 3;
    for (unsigned r = 0; r < 2; ++r) arow[r][k] = bank[W * (4 * g + kk) + 2 * (r + 2 * hi) + e];
    for (unsigned j = 0; j < 2; ++j) bcol[j][k] = bank[W * (4 * (2 * t + j) + kk) + 8 + 2 * hi + e];
  }
  // The four outputs' sums advance together (independent chains), each over k in order.
  double sum[4] = {0.0, 0.0, 0.0, 0.0};
  for (unsigned k = 0; k < 16; ++k) {
    const double a0 = arow[0][k], a1 = arow[1][k], b0 = bcol[0][k], b1 = bcol[1][k];
    sum[0] += a0 * b0;
    sum[1] += a0 * b1;
    sum[2] += a1 * b0;
    sum[3] += a1 * b1;
  }
  for (unsigned i = 0; i < 4; ++i) d[i] = static_cast<float>(sum[i] + c[i]);
}

// E2M1 code (low 4 bits) and UE4M3 byte (sign ignored) as floats, exactly.
inline float e2m1(uint32_t c) {
  static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return (c & 8u) ? -mag[c & 7u] : mag[c & 7u];
}
inline float ue4m3(uint32_t b) {
  const uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
  return e ? std::ldexp(1.0f + m / 8.0f, static_cast<int>(e) - 7) : m * 0.001953125f;
}

// mma ... m16n8k64 kind::mxf4nvf4 scale_vec::4X (qir_mma_m16n8k64_nvf4 says where each lane's
// operands and scales sit): each k16 block's E2M1 products sum exactly; the four block sums,
// scaled by their two UE4M3 factors, and c are added in double and rounded once.
__attribute__((noinline)) inline void mma_m16n8k64_nvf4(float (&d)[4], const uint32_t (&a)[4],
                                                        const uint32_t (&b)[2],
                                                        const float (&c)[4], uint32_t sfa,
                                                        uint32_t sfb) {
  const uint32_t mine[8] = {a[0], a[1], a[2], a[3], b[0], b[1], sfa, sfb};
  const uint32_t* bank = worker()->exchange_words(mine, 8);
  constexpr unsigned W = Worker::kWords;
  const unsigned lane = worker()->lane();
  const unsigned g = lane >> 2, t = lane & 3;
  for (unsigned i = 0; i < 4; ++i) {
    const unsigned row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    double sum = c[i];
    for (unsigned blk = 0; blk < 4; ++blk) {
      float dot = 0.0f;  // at most 16 products of multiples of 1/4 below 36: exact
      for (unsigned kk = 0; kk < 16; ++kk) {
        const unsigned k = 16 * blk + kk, q = (k & 31) >> 3, j = k & 7, hi = k >> 5;
        const uint32_t ra = bank[W * (4 * (row & 7) + q) + (row >> 3) + 2 * hi];
        const uint32_t rb = bank[W * (4 * col + q) + 4 + hi];
        dot += e2m1(ra >> (4 * j)) * e2m1(rb >> (4 * j));
      }
      const uint32_t sa = bank[W * (4 * (row & 7) + (row >> 3)) + 6] >> (8 * blk);
      const uint32_t sb = bank[W * (4 * col) + 7] >> (8 * blk);
      sum += static_cast<double>(dot) * ue4m3(sa & 0xFFu) * ue4m3(sb & 0xFFu);
    }
    d[i] = static_cast<float>(sum);
  }
}

template <int N, bool Trans>
__attribute__((noinline)) void ldmatrix(uint32_t (&r)[N], const void* row) {
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0 && worker()->lane() < 8 * N)
    worker()->report("ldmatrix: a row address is not 16-byte aligned");
  const uint64_t* bank = worker()->exchange(to_bits(row));
  const unsigned lane = worker()->lane();
  auto at = [&](unsigned matrix, unsigned rr, unsigned cc) -> uint32_t {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(bank[8 * matrix + rr]);
    return p[cc];
  };
  for (int i = 0; i < N; ++i) {
    const unsigned q = lane >> 2, e = 2 * (lane & 3);
    const uint32_t lo = Trans ? at(i, e, q) : at(i, q, e);
    const uint32_t hi = Trans ? at(i, e + 1, q) : at(i, q, e + 1);
    r[i] = lo | hi << 16;
  }
}

inline void cp_async(void* dst, const void* src, unsigned bytes, int src_bytes) {
  if (reinterpret_cast<uintptr_t>(dst) % bytes != 0 || reinterpret_cast<uintptr_t>(src) % bytes)
    worker()->report("cp.async: an address is not aligned to the copy size");
  if (src_bytes < 0 || static_cast<unsigned>(src_bytes) > bytes)
    worker()->report("cp.async: src-size must be in [0, copy size]");
  AsyncCopies& q = worker()->async_copies();
  const unsigned n = std::min<unsigned>(static_cast<unsigned>(std::max(src_bytes, 0)), bytes);
  q.pending.push_back({dst, src, bytes, n, q.committed});
}

inline void cp_async_commit() { ++worker()->async_copies().committed; }

inline void cp_async_wait(unsigned n) {
  AsyncCopies& q = worker()->async_copies();
  // Groups older than the newest n committed ones complete, in the order they were started.
  size_t kept = 0;
  for (AsyncCopy& c : q.pending) {
    if (c.group + n < q.committed) {
      std::memcpy(c.dst, c.src, c.src_bytes);
      std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
    } else {
      q.pending[kept++] = c;
    }
  }
  q.pending.resize(kept);
}

}  // namespace qir_host
