// qir_host.h: run CUDA C++ kernels on the CPU.
//
// Force-included (`g++ -include qir_host.h`) ahead of a rendered .cu file so the very source that
// runs on a GPU compiles as host C++. Each CUDA thread becomes a fiber; one OS thread runs one
// block at a time, so `__shared__` is `static thread_local`, and a fiber reads its threadIdx
// and its block's blockIdx from the bottom of its own stack (see `self`). A fiber runs until it reaches a
// barrier, a warp collective or its end, then hands over straight to the next runnable fiber of
// the block (a lane loop, cut at the collectives); on x86-64 a switch is a stack-pointer swap of
// a few instructions (`swap_sp`), elsewhere _setjmp/_longjmp on stacks that ucontext made.
// A launch runs on the calling thread plus workers of a persistent pool, on fibers booted once
// per OS thread and reused by every later launch (see `Runtime`): after warm-up a launch creates
// no thread, maps no memory and makes no system call but the pool's futex wake-ups.
//
// Not supported: dynamic shared memory (`extern __shared__`), inline PTX (kernels guard it with
// `#ifdef __CUDA_ARCH__`, which is never defined here; the tensor-core and cp.async helpers of
// qir_mma.cuh run on the emulation below), clusters, cooperative groups.
#pragma once

#define QIR_HOST 1

// glibc's fortified longjmp rejects jumps onto another stack, which is what a fiber switch is.
#undef _FORTIFY_SOURCE

// The toolkit headers go first: they define __host__/__device__ etc. as empty for non-nvcc
// compilers, and their include guards make the kernel's own #includes no-ops afterwards.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <setjmp.h>
#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <tuple>
#include <type_traits>
#include <utility>
// What only the runtime (the pool) and the sanitizer runner use. A kernel library leaves these
// out: with them in the precompiled header, g++ spent a third of a second of every kernel's build
// on their deferred template instantiations, so the code below uses Array and fixed buffers.
#if !defined(QIR_HOST_SHARED_RUNTIME)
#include <condition_variable>
#include <deque>
#include <mutex>
#include <vector>
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#define __global__
#define __device__
#define __host__
#define __constant__ const
#define __shared__ static thread_local
#define __launch_bounds__(...)
#ifndef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#endif

static constexpr int warpSize = 32;

#include "qir_host_fibers.h"
#include "qir_host_launch.h"
#include "qir_host_mma.h"
#include "qir_host_exports.h"
#include "qir_host_device.h"
#include "qir_host_runner.h"
