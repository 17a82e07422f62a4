// qir_host_device.h: the CUDA device API kernels call (threadIdx and friends, shuffles,
// atomics, intrinsics), on the fibers and the launch.
// Part of qir_host.h, which includes the parts in order after the toolkit headers; not
// usable on its own.
#pragma once

// The running CUDA thread's coordinates (see qir_host::self).
#define threadIdx (qir_host::self().tid)
#define blockIdx (qir_host::self().block->idx)
#define blockDim (qir_host::self().block->dim)
#define gridDim (qir_host::self().block->grid)

// ---- CUDA device API -------------------------------------------------------------------------
// Masks are ignored: every live lane of the warp takes part, so shuffles must be reached
// convergently (as CUDA requires for a full mask).

inline void __syncthreads() { qir_host::worker()->syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { qir_host::worker()->syncwarp(); }
inline unsigned __activemask() { return qir_host::worker()->active_mask(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int width = warpSize) {
  return qir_host::shuffle(v, [=](unsigned lane) {
    return (lane / width) * width + static_cast<unsigned>(src) % width;
  });
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = warpSize) {
  return qir_host::shuffle(v, [=](unsigned lane) {
    const unsigned s = lane ^ static_cast<unsigned>(mask);
    return s / width == lane / width ? s : lane;
  });
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = warpSize) {
  return qir_host::shuffle(v, [=](unsigned lane) {
    return lane % width + delta < static_cast<unsigned>(width) ? lane + delta : lane;
  });
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = warpSize) {
  return qir_host::shuffle(v, [=](unsigned lane) { return lane % width >= delta ? lane - delta : lane; });
}

inline unsigned __ballot_sync(unsigned, int pred) {
  const unsigned live = __activemask();
  const uint64_t* bank = qir_host::worker()->exchange(pred != 0);
  unsigned r = 0;
  for (unsigned i = 0; i < 32; ++i)
    if ((live >> i & 1u) && bank[i]) r |= 1u << i;
  return r;
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __all_sync(unsigned m, int pred) {
  const unsigned live = __activemask();
  return __ballot_sync(m, pred) == live;
}

template <typename T>
inline T __ldg(const T* p) { return *p; }

// Blocks run concurrently on OS threads, so atomics must be real ones.
template <typename T>
inline T atomicAdd(T* p, T v) {
  if constexpr (std::is_integral<T>::value) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
  } else {
    using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
    U* q = reinterpret_cast<U*>(p);
    U old = __atomic_load_n(q, __ATOMIC_RELAXED);
    for (;;) {
      T updated = qir_host::from_bits<T>(old) + v;
      U want;
      std::memcpy(&want, &updated, sizeof(U));
      if (__atomic_compare_exchange_n(q, &old, want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        return qir_host::from_bits<T>(old);
    }
  }
}
template <typename T>
inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
template <typename T>
inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
template <typename T>
inline T atomicCAS(T* p, T expected, T desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;
}
template <typename T>
inline T atomicMax(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,
                                                 __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
inline T atomicMin(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,
                                                 __ATOMIC_RELAXED)) {
  }
  return old;
}

// CUDA's min/max overloads mix integer types by the usual arithmetic conversions.
template <typename A, typename B>
inline auto max(A a, B b) -> decltype(a + b) { return a > b ? a : b; }
template <typename A, typename B>
inline auto min(A a, B b) -> decltype(a + b) { return a < b ? a : b; }

inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanhf(float x) { return tanhf(x); }
// Rounded float operations that the device compiler never fuses into an FMA: plain operations
// here (host builds target baseline x86-64, which has no FMA to contract into).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
// Rounded double operations: plain ones here (ISO C++ mode does not contract them into FMAs).
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }

inline int __float_as_int(float x) { return qir_host::from_bits<int>(qir_host::to_bits(x)); }
inline unsigned __float_as_uint(float x) { return qir_host::from_bits<unsigned>(qir_host::to_bits(x)); }
inline float __int_as_float(int x) { return qir_host::from_bits<float>(qir_host::to_bits(x)); }
inline float __uint_as_float(unsigned x) { return qir_host::from_bits<float>(qir_host::to_bits(x)); }
inline long long __double_as_longlong(double x) { return qir_host::from_bits<long long>(qir_host::to_bits(x)); }
inline double __longlong_as_double(long long x) { return qir_host::from_bits<double>(qir_host::to_bits(x)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
  x = (x >> 1 & 0x55555555u) | (x & 0x55555555u) << 1;
  x = (x >> 2 & 0x33333333u) | (x & 0x33333333u) << 2;
  x = (x >> 4 & 0x0f0f0f0fu) | (x & 0x0f0f0f0fu) << 4;
  return __builtin_bswap32(x);
}
