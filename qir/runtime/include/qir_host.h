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

namespace qir_host {

class Worker;

// A growable array of default-constructible T: what the launch and a fiber's copies need of
// std::vector, without <vector> (see the includes above).
template <typename T>
class Array {
 public:
  Array() = default;
  Array(Array&& o) noexcept : p_(o.p_), n_(o.n_), cap_(o.cap_) { o.p_ = nullptr, o.n_ = o.cap_ = 0; }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
  ~Array() {
    resize(0);
    ::operator delete(p_, std::align_val_t(alignof(T)));
  }
  void resize(size_t n) {
    reserve(n);
    for (size_t i = n_; i < n; ++i) new (p_ + i) T();
    for (size_t i = n; i < n_; ++i) p_[i].~T();
    n_ = n;
  }
  void push_back(const T& v) {
    if (n_ == cap_) reserve(cap_ ? 2 * cap_ : 8);
    new (p_ + n_++) T(v);
  }
  void clear() { resize(0); }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  T& operator[](size_t i) { return p_[i]; }
  const T& operator[](size_t i) const { return p_[i]; }
  T* data() { return p_; }
  T* begin() { return p_; }
  T* end() { return p_ + n_; }

 private:
  void reserve(size_t n) {
    if (n <= cap_) return;
    T* q = static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(alignof(T))));
    for (size_t i = 0; i < n_; ++i) {
      new (q + i) T(std::move(p_[i]));
      p_[i].~T();
    }
    ::operator delete(p_, std::align_val_t(alignof(T)));
    p_ = q;
    cap_ = n;
  }
  T* p_ = nullptr;
  size_t n_ = 0, cap_ = 0;
};

// Launch errors are short messages in fixed buffers (no <string>).
constexpr size_t kErrorBytes = 512;

// The block an OS thread is running, and each fiber's own CUDA thread: what threadIdx, blockIdx,
// blockDim and gridDim read (macros below).
struct BlockState {
  uint3 idx;
  dim3 dim, grid;
  Worker* worker;
};
struct FiberSelf {
  BlockState* block;
  uint3 tid;
};

#if defined(__SANITIZE_ADDRESS__) || !defined(__x86_64__)
// Where a fiber cannot read its own stack pointer (ASan runs frames on fake stacks; other CPUs
// lack the asm below): the OS thread's current fiber, rewritten on every switch.
static thread_local FiberSelf tls_self;
inline FiberSelf& self() { return tls_self; }
#define QIR_HOST_SELF_TLS 1
#endif

enum class State : uint8_t { runnable, wait_block, wait_warp, done };

// A CUDA thread's scheduling state within its Worker (its stack and context are in `Fibers`).
struct Fiber {
  uint3 tid;
  unsigned warp;
  unsigned lane;
  State state;
  unsigned wait_gen;  // the generation of the barrier it waits at
  unsigned calls;     // its block_call()s in the current block
};

struct Warp {
  unsigned live = 0;     // lanes that have not returned
  unsigned arrived = 0;  // lanes waiting at the current warp barrier
  unsigned gen = 0;      // completed warp barriers; its parity picks the exchange bank
  // Double-buffered exchange slots: a lane writes bank gen&1, waits for the barrier, then reads the
  // same bank. It next writes that bank only after the barrier after that, which every lane reaches
  // only once done reading, so one barrier per exchange is enough (the usual two-phase scheme
  // with the second phase folded into the next exchange's barrier).
  uint64_t slot[2][32];
};

// A cp.async a fiber started and has not waited for (see qir_host::cp_async).
struct AsyncCopy {
  void* dst;
  const void* src;
  unsigned bytes, src_bytes;
  unsigned group;  // the commit that closes it: the fiber's commit count when it was started
};

struct AsyncCopies {
  Array<AsyncCopy> pending;
  unsigned committed = 0;
};

#ifndef QIR_HOST_ABI
// host.py defines it as a hash of this header; 0 (a build without it) never shares a Runtime.
#define QIR_HOST_ABI 0ull
#endif

constexpr unsigned kMaxThreads = 1024;
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kStackBytes = 512 * 1024;  // ASan's stack redzones need room
#else
constexpr size_t kStackBytes = 64 * 1024;
#endif
constexpr uint64_t kCanary = 0x5152484f53544b31ull;
constexpr size_t kSelfBytes = (sizeof(FiberSelf) + 15) / 16 * 16;
static_assert((kStackBytes & (kStackBytes - 1)) == 0, "a fiber finds its stack by masking");

#if !defined(QIR_HOST_SELF_TLS)
// The running fiber's FiberSelf: the bottom of the kStackBytes-aligned stack it runs on. The
// stack pointer comes from asm, not a local's address: a pointer the compiler could trace back
// to a local would let it assume the FiberSelf is that local.
inline FiberSelf& self() {
  uintptr_t sp;
  asm("movq %%rsp, %0" : "=r"(sp));
  return *reinterpret_cast<FiberSelf*>(sp & ~static_cast<uintptr_t>(kStackBytes - 1));
}
#endif
inline Worker* worker() { return self().block->worker; }

// ---- Runtime: worker threads and fiber stacks, made once and kept --------------------------
//
// Each kernel library carries its own copy of everything below (-fvisibility=hidden), but
// threads and stacks are a per-process resource: host.py hands every library loaded after the
// first the first one's `Runtime` (qir_host_share), so a process has one worker pool and one
// set of fiber stacks per OS thread however many kernels it loads. Only code that carries no
// per-library state crosses libraries: the pool runs the caller's function pointer, and a
// fiber's outermost frame (`fiber_main`, the owner's) calls the current kernel's `entry`; the
// kernel's own scheduler (its threadIdx, its `__shared__`) always runs the kernel library's
// code. A library whose QIR_HOST_ABI or struct sizes differ keeps its own Runtime.

// A saved execution context: a fiber's, or (index kSched) the OS thread's own. On x86-64 a
// switch is a stack-pointer swap (`swap_sp`: the callee-saved registers pushed on the old stack,
// popped from the new); elsewhere _setjmp/_longjmp, which leave the signal mask alone, unlike
// swapcontext's syscall per switch. Sanitizer builds keep swapcontext, which ASan's fiber
// annotations understand.
#if defined(__SANITIZE_ADDRESS__)
#define QIR_HOST_SWITCH_UCONTEXT 1
#elif defined(__x86_64__)
#define QIR_HOST_SWITCH_ASM 1
#endif

struct Ctx {
#if defined(QIR_HOST_SWITCH_UCONTEXT)
  ucontext_t uc;
#elif defined(QIR_HOST_SWITCH_ASM)
  void* sp = nullptr;
#else
  jmp_buf jb;
#endif
};

constexpr unsigned kSched = kMaxThreads;  // the Ctx of the OS thread's own stack

// The fibers of one OS thread. Fiber i's stack is arena + i * kStackBytes, with a canary at its
// lowest 8 bytes (guard pages would cost an mprotect and a VMA per fiber, so overflow is caught
// after the fact). The first `ready` fibers are bootstrapped: resuming one for the first time
// enters `fiber_main`, whose loop calls `entry(ctx)` (one CUDA thread of one block); the thread
// ends by switching to another fiber, and the next resume returns into the loop. So after the
// first launch on a thread no launch makes a context or touches a fresh page.
struct Fibers {
  char* arena = nullptr;  // kStackBytes-aligned: a fiber finds its stack's bottom from any local
  char* mapped = nullptr;
  size_t mapped_bytes = 0;
  unsigned capacity = 0;  // stacks mapped
  unsigned ready = 0;     // fibers bootstrapped
  unsigned boot = 0;      // the fiber being bootstrapped (ucontext/setjmp boots)
  void (*entry)(void*) = nullptr;
  void* ctx = nullptr;
#if defined(QIR_HOST_SWITCH_UCONTEXT)
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
#endif
  Ctx ctxs[kMaxThreads + 1];

  char* stack_bottom(unsigned i) const { return arena + static_cast<size_t>(i) * kStackBytes; }
  // A fiber's FiberSelf sits at its stack's bottom, the overflow canary right above it.
  FiberSelf& self_of(unsigned i) const { return *reinterpret_cast<FiberSelf*>(stack_bottom(i)); }
  char* canary(unsigned i) const { return stack_bottom(i) + kSelfBytes; }
  // Stacks kStackBytes apart would put every fiber's hot frames in the same cache sets (L1 and
  // L2 index by address bits below 64 KiB): each fiber's top is moved down by its own number of
  // cache lines.
  static size_t stack_size(unsigned i) { return kStackBytes - (i * 17 % 128) * 64; }
};

#if defined(QIR_HOST_SWITCH_ASM)
// Saves the callee-saved registers on the current stack and its pointer in *save, then resumes
// the context whose stack pointer is `next` (made by this function, or by `boot_stack`).
// noipa: the compiler must treat the call as reading and writing any memory (it resumes other
// code), not infer from the bare asm body that it touches none.
__attribute__((naked, noinline, noipa)) inline void swap_sp(void** /*save*/, void* /*next*/) {
  asm volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}
#endif

// Switches from context `from` to `to` (fiber indices, or kSched).
inline void swap(Fibers& t, unsigned from, unsigned to) {
#if defined(QIR_HOST_SWITCH_UCONTEXT)
  void* fake = nullptr;
  if (to == kSched)
    __sanitizer_start_switch_fiber(&fake, t.sched_bottom, t.sched_size);
  else
    __sanitizer_start_switch_fiber(&fake, t.stack_bottom(to), kStackBytes);
  swapcontext(&t.ctxs[from].uc, &t.ctxs[to].uc);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#elif defined(QIR_HOST_SWITCH_ASM)
  asm volatile("" ::: "memory");
  swap_sp(&t.ctxs[from].sp, t.ctxs[to].sp);
  asm volatile("" ::: "memory");
#else
  if (_setjmp(t.ctxs[from].jb) == 0) _longjmp(t.ctxs[to].jb, 1);
#endif
}

struct Runtime {
  uint64_t abi;
  size_t runtime_size, fibers_size;
  // Runs fn(arg) on the calling thread and on up to `helpers` pool threads; returns once every
  // call that started has returned (calls no pool thread got to are dropped, so fn must cope
  // with running fewer times: launches hand out blocks from a shared counter).
  void (*run)(unsigned helpers, void (*fn)(void*), void* arg);
  // The calling OS thread's fibers, at least n of them ready; nullptr when stacks cannot be had.
  Fibers* (*fibers)(unsigned n);
};

// The worker pool and fiber stacks. Kernel libraries that host.py builds define
// QIR_HOST_SHARED_RUNTIME and leave them out: host.py builds them once, as the runtime library
// (this header on its own), and shares its Runtime with every kernel library it loads, so each
// kernel's g++ run does not compile the pool again (measured: 0.4 s, half of an empty kernel's
// build).
// Sanitizer executables and any other build of the header keep their own.
#if !defined(QIR_HOST_SHARED_RUNTIME)
namespace own {

struct FibersHolder {
  Fibers* f = nullptr;
  ~FibersHolder() {  // a caller thread exiting; pool threads never do
    if (!f) return;
    if (f->mapped) munmap(f->mapped, f->mapped_bytes);
    delete f;
  }
};
static thread_local FibersHolder fibers_of_thread;

// A fiber's outermost frame. The kernel library's `entry` runs one CUDA thread and returns only
// when the fiber is resumed for its next thread (see Worker::leave).
[[noreturn]] static void fiber_main() {
  Fibers* t = fibers_of_thread.f;
#if !defined(QIR_HOST_SWITCH_ASM)
  // Booted by makecontext: park until the first block resumes this fiber.
#if defined(QIR_HOST_SWITCH_UCONTEXT)
  __sanitizer_finish_switch_fiber(nullptr, &t->sched_bottom, &t->sched_size);
#endif
  swap(*t, t->boot, kSched);
#endif
  for (;;) t->entry(t->ctx);
}

inline Fibers* fibers(unsigned n) {
  FibersHolder& h = fibers_of_thread;
  if (!h.f) h.f = new (std::nothrow) Fibers();
  if (!h.f) return nullptr;
  Fibers& t = *h.f;
  if (t.capacity < n) {  // a bigger block than this thread has run: map (and boot) anew
    if (t.mapped) munmap(t.mapped, t.mapped_bytes);
    t.ready = t.capacity = 0;
    t.arena = t.mapped = nullptr;
    const size_t bytes = static_cast<size_t>(n + 1) * kStackBytes;  // room to align
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) return nullptr;
    t.mapped = static_cast<char*>(p);
    t.mapped_bytes = bytes;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    t.arena = t.mapped + ((kStackBytes - a % kStackBytes) % kStackBytes);
    t.capacity = n;
  }
  for (; t.ready < n; ++t.ready) {
    const unsigned i = t.ready;
    std::memcpy(t.canary(i), &kCanary, sizeof kCanary);
#if defined(QIR_HOST_SWITCH_ASM)
    // A frame swap_sp pops into fiber_main: six zero registers, then fiber_main as the return
    // address, above it a never-used return address for fiber_main itself (so that it starts
    // with the stack alignment of a called function).
    auto top = reinterpret_cast<uintptr_t>(t.stack_bottom(i) + Fibers::stack_size(i)) & ~uintptr_t{15};
    void** frame = reinterpret_cast<void**>(top) - 8;
    for (int r = 0; r < 6; ++r) frame[r] = nullptr;
    frame[6] = reinterpret_cast<void*>(&fiber_main);
    frame[7] = nullptr;
    t.ctxs[i].sp = frame;
#else
    t.boot = i;
#if defined(QIR_HOST_SWITCH_UCONTEXT)
    ucontext_t& uc = t.ctxs[i].uc;
#else
    ucontext_t uc;
#endif
    getcontext(&uc);
    uc.uc_stack.ss_sp = t.stack_bottom(i);
    uc.uc_stack.ss_size = Fibers::stack_size(i);
    uc.uc_link = nullptr;
    makecontext(&uc, &fiber_main, 0);
#if defined(QIR_HOST_SWITCH_UCONTEXT)
    swap(t, kSched, i);
#else
    if (_setjmp(t.ctxs[kSched].jb) == 0) setcontext(&uc);
#endif
#endif
  }
  return &t;
}

// Worker threads, started on demand (never more than a launch asked for), parked on a condition
// variable between launches and never joined: the Pool is deliberately leaked, so no destructor
// runs at exit while a thread might still wait on it, and parked threads do not keep a process
// alive (exit_group ends them). A child of fork() starts with no workers.
class Pool {
 public:
  static Pool& get() {
    static Pool* p = new Pool;
    return *p;
  }

  void run(unsigned helpers, void (*fn)(void*), void* arg) {
    Job job;
    if (helpers > 0) {
      {
        std::lock_guard<std::mutex> lock(m_);
        while (threads_ < helpers && spawn()) ++threads_;
        for (unsigned i = 0; i < helpers; ++i) queue_.push_back({fn, arg, &job});
      }
      if (helpers == 1)
        work_.notify_one();
      else
        work_.notify_all();
    }
    fn(arg);
    if (helpers == 0) return;
    std::unique_lock<std::mutex> lock(m_);
    // Whatever no worker has picked up yet is no longer needed: the blocks are all taken.
    queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                                [&](const Task& t) { return t.job == &job; }),
                 queue_.end());
    done_.wait(lock, [&] { return job.running == 0; });
  }

 private:
  struct Job {
    unsigned running = 0;
  };
  struct Task {
    void (*fn)(void*);
    void* arg;
    Job* job;
  };

  Pool() { pthread_atfork(&Pool::prepare, &Pool::parent, &Pool::child); }

  // pthread_create, not std::thread: kernels build without exceptions, and running out of
  // threads is an error code here (run with fewer), not something to throw.
  bool spawn() {
    pthread_t t;
    if (pthread_create(&t, nullptr, &Pool::thread_main, this) != 0) return false;
    pthread_detach(t);
    return true;
  }

  static void* thread_main(void* self) {
    static_cast<Pool*>(self)->loop();
    return nullptr;
  }

  void loop() {
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      work_.wait(lock, [&] { return !queue_.empty(); });
      Task t = queue_.front();
      queue_.pop_front();
      ++t.job->running;
      lock.unlock();
      t.fn(t.arg);
      lock.lock();
      if (--t.job->running == 0) done_.notify_all();
    }
  }

  static void prepare() { get().m_.lock(); }
  static void parent() { get().m_.unlock(); }
  static void child() {  // only the forking thread lives on, and it is in none of our calls
    Pool& p = get();
    new (&p.m_) std::mutex;
    new (&p.work_) std::condition_variable;
    new (&p.done_) std::condition_variable;
    p.queue_.clear();
    p.threads_ = 0;
  }

  std::mutex m_;
  std::condition_variable work_, done_;
  std::deque<Task> queue_;
  unsigned threads_ = 0;
};

inline void run(unsigned helpers, void (*fn)(void*), void* arg) {
  Pool::get().run(helpers, fn, arg);
}

inline Runtime& runtime() {
  static Runtime r{QIR_HOST_ABI, sizeof(Runtime), sizeof(Fibers), &own::run, &own::fibers};
  return r;
}

}  // namespace own
#endif

inline std::atomic<Runtime*>& shared_runtime() {
  static std::atomic<Runtime*> r{nullptr};
  return r;
}

// nullptr in a kernel library that was loaded without being given the runtime library's.
inline Runtime* runtime() {
  Runtime* r = shared_runtime().load(std::memory_order_acquire);
#if defined(QIR_HOST_SHARED_RUNTIME)
  return r;
#else
  return r ? r : &own::runtime();
#endif
}

// ---- One launch ------------------------------------------------------------------------------

struct Launch {
  dim3 grid, block;
  void (*body)(void*);  // runs the kernel for the current fiber
  void* args;
  std::atomic<unsigned long> next_block{0};
  std::atomic<bool> failed{false};
  char error[kErrorBytes] = "";
  // QIR_HOST_SCHEDULE=reverse: blocks, and a block's threads between barriers, run last to first.
  // A fiber runs until it blocks, so a missing barrier lets a thread read a slot it expects
  // another to have written only when the writer happens to run first: a forward run exposes
  // the races where the writer comes later, a reverse run the others. Race-free kernels give
  // the same bytes either way (tests/runtime/test_host.py, test_every_format.py).
  bool reverse = false;
  // A kernel whose threads never wait for one another (Kernel.collectives in qir/codegen, which
  // host.py passes down): each block runs as a plain loop over its threads on one fiber, a
  // function call per thread and no switch. A collective reached anyway fails the launch.
  bool loops = false;
};

// The calling thread's last launch error: launches from several threads do not share one.
inline char* last_error() {
  static thread_local char s[kErrorBytes];
  return s;
}

// First error wins (the others would only describe the same failure from other workers); the
// launch reads `error` only after every worker has returned.
inline void fail(Launch& launch, const char* msg, const char* more = "") {
  if (!launch.failed.exchange(true)) snprintf(launch.error, kErrorBytes, "%s%s", msg, more);
}

// One OS thread's share of a launch: takes blocks from the shared counter and runs each block's
// threads as this thread's fibers.
class Worker {
 public:
  explicit Worker(Launch& launch) : launch_(launch) {
    const dim3& b = launch.block;
    n_ = b.x * b.y * b.z;
    fibers_.resize(n_);
    async_.resize(n_);
    warps_.resize((n_ + 31) / 32);
    for (unsigned i = 0; i < n_; ++i) {
      Fiber& f = fibers_[i];
      f.tid = make_uint3(i % b.x, (i / b.x) % b.y, i / (b.x * b.y));
      f.warp = i / 32;
      f.lane = i % 32;
    }
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  static void run_launch(void* launch) {
    Launch& l = *static_cast<Launch*>(launch);
    const dim3& g = l.grid;
    const unsigned long total = static_cast<unsigned long>(g.x) * g.y * g.z;
    if (l.next_block.load(std::memory_order_relaxed) >= total) return;  // a late helper
    Worker(l).run();
  }

  void run() {
    const unsigned used = launch_.loops ? 1 : n_;  // loops run every thread on fiber 0
    t_ = runtime()->fibers(used);
    if (!t_) {
      fail(launch_, "qir_host: cannot allocate fiber stacks");
      return;
    }
    t_->entry = &Worker::fiber_entry;
    t_->ctx = this;
    block_.dim = launch_.block;
    block_.grid = launch_.grid;
    block_.worker = this;
#if !defined(QIR_HOST_SELF_TLS)
    for (unsigned i = 0; i < used; ++i) t_->self_of(i) = FiberSelf{&block_, fibers_[i].tid};
#endif
    const dim3& g = launch_.grid;
    const unsigned long total = static_cast<unsigned long>(g.x) * g.y * g.z;
    while (!launch_.failed.load(std::memory_order_relaxed)) {
      unsigned long b = launch_.next_block.fetch_add(1);
      if (b >= total) break;
      if (launch_.reverse) b = total - 1 - b;
      block_.idx = make_uint3(b % g.x, (b / g.x) % g.y, b / (static_cast<unsigned long>(g.x) * g.y));
      if (!run_block()) {
        // Fibers stuck mid-kernel (deadlock) or with a trampled stack (overflow) must never be
        // resumed: boot them all afresh next time.
        t_->ready = 0;
        break;
      }
    }
  }

  // Called from fibers.
  // The last thread to arrive releases the others and yields too, rather than running on: then
  // the threads leave a barrier in schedule order, so a forward and a reverse run see opposite
  // orders for every pair of threads (see Launch::reverse).
  // A waiting thread is released by its barrier's generation moving on (see runnable), so a
  // release touches no other thread.
  void syncthreads() {
    if (launch_.loops) return misused("__syncthreads");
    Fiber& f = fibers_[cur_];
    if (++block_arrived_ == n_) {
      block_arrived_ = 0;
      ++block_gen_;
    } else {
      f.state = State::wait_block;
      f.wait_gen = block_gen_;
    }
    yield();
  }

  void syncwarp() {
    if (launch_.loops) return misused("a warp barrier (__syncwarp/shuffle/vote)");
    Fiber& f = fibers_[cur_];
    Warp& w = warps_[f.warp];
    if (++w.arrived == w.live) {
      release(f.warp);
    } else {
      f.state = State::wait_warp;
      f.wait_gen = w.gen;
    }
    yield();
  }

  // Publishes this lane's value and returns the warp's 32 slots once every live lane has
  // published. Like on the GPU, lanes that returned or skip the call (divergent shuffles) leave
  // stale slots: that is undefined behaviour in CUDA too.
  const uint64_t* exchange(uint64_t bits) {
    Fiber& f = fibers_[cur_];
    Warp& w = warps_[f.warp];
    uint64_t* bank = w.slot[w.gen & 1];
    bank[f.lane] = bits;
    syncwarp();
    return bank;
  }

  // exchange() for n <= kWords words per lane: lane l's words are at [kWords * l, + n). The
  // banks are made on first use (only the tensor-core emulation needs them).
  static constexpr unsigned kWords = 16;
  const uint32_t* exchange_words(const uint32_t* v, unsigned n) {
    Fiber& f = fibers_[cur_];
    Warp& w = warps_[f.warp];
    if (words_.empty()) words_.resize(warps_.size() * 2 * 32 * kWords);
    uint32_t* bank = &words_[(f.warp * 2 + (w.gen & 1)) * 32 * kWords];
    std::memcpy(bank + f.lane * kWords, v, n * sizeof(uint32_t));
    syncwarp();
    return bank;
  }

  // n <= kMaxRow words of this lane, once every lane of a whole warp has published its own: the
  // warp's rows, lane l's at [n * l, n * l + n). nullptr, with nothing published, when a lane of
  // the warp has returned: the one-exchange host bodies of warp collectives (qir_common.cuh's
  // fast mode) then take their shuffle path, whose stale-slot behaviour stays the reference.
  static constexpr unsigned kMaxRow = 64;
  const uint32_t* exchange_rows(const void* v, unsigned n) {
    Fiber& f = fibers_[cur_];
    Warp& w = warps_[f.warp];
    if (w.live != 32 || n > kMaxRow) return nullptr;
    if (rows_.empty()) rows_.resize(warps_.size() * 2 * 32 * kMaxRow);
    uint32_t* bank = &rows_[(f.warp * 2 + (w.gen & 1)) * 32 * kMaxRow];
    std::memcpy(bank + f.lane * n, v, n * sizeof(uint32_t));
    syncwarp();
    return bank;
  }

  AsyncCopies& async_copies() { return async_[cur_]; }

  // A misuse the GPU would fault on (a misaligned address): the launch fails with `msg`, and the
  // fiber runs on (its results are not used).
  void report(const char* msg) {
    char where[96];
    const uint3 t = fibers_[cur_].tid, b = block_.idx;
    snprintf(where, sizeof where, " (thread (%u,%u,%u) of block (%u,%u,%u))", t.x, t.y, t.z, b.x,
             b.y, b.z);
    fail(launch_, msg, where);
  }

  unsigned lane() const { return fibers_[cur_].lane; }

  // A key for this thread's n-th call in its block, unique on this OS thread across blocks and
  // launches: where every thread of a block computes the same values (a row's norm, a staged
  // row), the first to ask computes them into a memo under this key and the others copy them,
  // with no barrier or warp exchange (each a switch of every fiber of the block). Every thread
  // makes the same calls in the same order, so the n-th calls of a block share a key.
  uint64_t block_call() { return serial_ << 8 | (fibers_[cur_].calls++ & 0xFFu); }

  // A collective in a kernel launched as loops: there is no other thread to wait for.
  void misused(const char* what) {
    char msg[kErrorBytes / 2];
    snprintf(msg, sizeof msg,
             "qir_host: the kernel was generated as having no collectives (it runs as a loop over "
             "its threads) but reached %s",
             what);
    report(msg);
  }

  unsigned active_mask() const {
    const Fiber& f = fibers_[cur_];
    unsigned mask = 0;
    for (unsigned i = f.warp * 32; i < std::min(n_, f.warp * 32 + 32); ++i)
      if (fibers_[i].state != State::done) mask |= 1u << (i % 32);
    return mask;
  }

 private:
  // One block: every fiber runs until it blocks or returns, then hands over to the next runnable
  // one in schedule order (see yield); the scheduler gets control back when no fiber can run.
  // Then any thread still alive is deadlocked.
  bool run_block() {
    block_arrived_ = 0;
    serial_ = ++block_serial();
    for (unsigned i = 0; i < n_; ++i) {
      fibers_[i].state = State::runnable;
      fibers_[i].wait_gen = 0;
      fibers_[i].calls = 0;
      async_[i].pending.clear();  // copies a thread never waited for do not outlive its block
      async_[i].committed = 0;
    }
    for (unsigned w = 0; w < warps_.size(); ++w) {
      warps_[w].live = std::min(32u, n_ - w * 32);
      warps_[w].arrived = 0;
    }
    live_ = n_;
    enter(launch_.loops || !launch_.reverse ? 0 : n_ - 1, kSched);
    if (live_ > 0) {
      report_deadlock(live_);
      return false;
    }
    for (unsigned i = 0; i < (launch_.loops ? 1 : n_); ++i) {
      if (std::memcmp(t_->canary(i), &kCanary, sizeof kCanary) != 0) {
        char buf[160];
        snprintf(buf, sizeof buf, "thread (%u,%u,%u) of block (%u,%u,%u) overflowed its %zu KiB "
                 "fiber stack", fibers_[i].tid.x, fibers_[i].tid.y, fibers_[i].tid.z, block_.idx.x,
                 block_.idx.y, block_.idx.z, kStackBytes / 1024);
        fail(launch_, buf);
        return false;
      }
    }
    return true;
  }

  // Switches from context `from` to fiber `i` (or to the scheduler), making it the current thread.
  void enter(unsigned i, unsigned from) {
    if (i != kSched) {
      cur_ = i;
      fibers_[i].state = State::runnable;
#if defined(QIR_HOST_SELF_TLS)
      tls_self = FiberSelf{&block_, fibers_[i].tid};
#endif
    }
    qir_host::swap(*t_, from, i);
  }

  bool runnable(const Fiber& f) const {
    switch (f.state) {
      case State::runnable:
        return true;
      case State::wait_warp:
        return warps_[f.warp].gen != f.wait_gen;
      case State::wait_block:
        return block_gen_ != f.wait_gen;
      default:
        return false;
    }
  }

  // The current fiber stops running: the next runnable fiber after it in schedule order (itself
  // last) runs, or the scheduler when none can. The scheduler's own pass over the block, without
  // the trip through it. Returns when this fiber is next resumed (for a later block, if it has
  // returned: its Worker is then gone).
  void yield() {
    const unsigned me = cur_;
    unsigned next = kSched;
    for (unsigned step = 1, j = me; step <= n_; ++step) {
      if (launch_.reverse)
        j = j == 0 ? n_ - 1 : j - 1;
      else
        j = j + 1 == n_ ? 0 : j + 1;
      if (runnable(fibers_[j])) {
        next = j;
        break;
      }
    }
    if (next == me) return;
    enter(next, me);
  }

  void release(unsigned warp) {
    Warp& w = warps_[warp];
    w.arrived = 0;
    ++w.gen;
  }

  // What a resumed fiber runs (from fiber_main's loop, on its own stack): one CUDA thread.
  static void fiber_entry(void* self_) {
    Worker* self = static_cast<Worker*>(self_);
    if (self->launch_.loops) return self->run_loops();
    self->launch_.body(self->launch_.args);
    Fiber& f = self->fibers_[self->cur_];
    f.state = State::done;
    --self->live_;
    Warp& w = self->warps_[f.warp];
    // A lane leaving may complete a warp barrier the others are waiting at; a block barrier it
    // leaves incomplete stays so and is reported as a deadlock.
    if (--w.live > 0 && w.arrived == w.live) self->release(f.warp);
    self->yield();  // never returns to this thread: the next resume starts another
  }

  // Every thread of the block in schedule order, on fiber 0's stack: its FiberSelf names each
  // thread in turn (they find their coordinates there).
  void run_loops() {
    for (unsigned j = 0; j < n_; ++j) {
      const unsigned i = launch_.reverse ? n_ - 1 - j : j;
      cur_ = i;
#if defined(QIR_HOST_SELF_TLS)
      tls_self = FiberSelf{&block_, fibers_[i].tid};
#else
      t_->self_of(0).tid = fibers_[i].tid;
#endif
      launch_.body(launch_.args);
      fibers_[i].state = State::done;
    }
    live_ = 0;
    cur_ = 0;
    yield();  // to the scheduler; returns when fiber 0 is next resumed
  }

  void report_deadlock(unsigned live) {
    unsigned at_block = 0, at_warp = 0;
    for (const Fiber& f : fibers_) {
      at_block += f.state == State::wait_block && !runnable(f);
      at_warp += f.state == State::wait_warp && !runnable(f);
    }
    char buf[256];
    snprintf(buf, sizeof buf,
             "deadlock in block (%u,%u,%u): %u of %u threads returned, %u wait at "
             "__syncthreads, %u at a warp barrier (__syncwarp/shuffle/vote)",
             block_.idx.x, block_.idx.y, block_.idx.z, n_ - live, n_, at_block, at_warp);
    fail(launch_, buf);
  }

  Launch& launch_;
  unsigned n_ = 0;
  Fibers* t_ = nullptr;
  Array<Fiber> fibers_;
  Array<Warp> warps_;
  Array<AsyncCopies> async_;
  Array<uint32_t> words_;  // exchange_words' banks: [warp][gen & 1][lane][kWords]
  Array<uint32_t> rows_;   // exchange_rows' banks: [warp][gen & 1][32 * kMaxRow]
  BlockState block_{};
  unsigned cur_ = 0;
  unsigned live_ = 0;  // threads of the block that have not returned
  unsigned block_arrived_ = 0;
  unsigned block_gen_ = 0;  // completed __syncthreads
  uint64_t serial_ = 0;     // the current block's block_serial()

  // Blocks this library has run on this OS thread (from 1): a memo's key names its block.
  static uint64_t& block_serial() {
    static thread_local uint64_t n = 0;
    return n;
  }
};

inline unsigned worker_count(unsigned long blocks) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  unsigned n = cpus > 0 ? static_cast<unsigned>(cpus) : 1;
  if (const char* env = std::getenv("QIR_HOST_THREADS")) n = static_cast<unsigned>(std::atoi(env));
  if (n == 0) n = 1;
  return static_cast<unsigned>(std::min<unsigned long>(n, blocks));
}

inline int launch(const unsigned* grid3, const unsigned* block3, void (*body)(void*), void* args,
                  int loops) {
  Launch l;
  l.loops = loops != 0;
  l.grid = dim3(grid3[0], grid3[1], grid3[2]);
  l.block = dim3(block3[0], block3[1], block3[2]);
  l.body = body;
  l.args = args;
  const unsigned long threads = static_cast<unsigned long>(l.block.x) * l.block.y * l.block.z;
  const unsigned long blocks = static_cast<unsigned long>(l.grid.x) * l.grid.y * l.grid.z;
  const char* schedule = std::getenv("QIR_HOST_SCHEDULE");
  l.reverse = schedule != nullptr && std::strcmp(schedule, "reverse") == 0;
  if (schedule != nullptr && *schedule && !l.reverse && std::strcmp(schedule, "forward") != 0) {
    char msg[kErrorBytes];
    snprintf(msg, sizeof msg,
             "qir_host: QIR_HOST_SCHEDULE=%.64s not supported; expected forward or reverse",
             schedule);
    fail(l, msg);
  } else if (threads == 0 || threads > kMaxThreads || blocks == 0) {
    fail(l, "qir_host: block must hold 1..1024 threads and the grid at least one block");
  } else if (runtime() == nullptr) {
    fail(l, "qir_host: no runtime: load kernel libraries through qir's host backend");
  } else {
    runtime()->run(worker_count(blocks) - 1, &Worker::run_launch, &l);
  }
  snprintf(last_error(), kErrorBytes, "%s", l.error);
  return l.failed.load() ? 1 : 0;
}

// Unpacks cuLaunchKernel-style `void** params` (params[i] points at argument i) into the
// kernel's typed parameters, once per launch; every fiber then calls the kernel with the tuple.
template <typename... A>
struct Call {
  void (*fn)(A...);
  std::tuple<std::decay_t<A>...> args;

  static void run(void* self) {
    auto* c = static_cast<Call*>(self);
    std::apply(c->fn, c->args);
  }
};

template <typename... A, size_t... I>
int launch_kernel(void (*fn)(A...), const unsigned* grid3, const unsigned* block3, void** params,
                  int loops, std::index_sequence<I...>) {
  Call<A...> call{fn, {*static_cast<std::decay_t<A>*>(params[I])...}};
  return launch(grid3, block3, &Call<A...>::run, &call, loops);
}

template <typename... A>
int launch_kernel(void (*fn)(A...), const unsigned* grid3, const unsigned* block3, void** params,
                  int loops) {
  return launch_kernel(fn, grid3, block3, params, loops, std::index_sequence_for<A...>{});
}

// See Worker::block_call.
inline uint64_t block_call() { return worker()->block_call(); }

template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                "warp exchange supports trivially copyable types up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <typename T>
inline T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

// Shuffles take the source lane from `src` (already resolved within the width segment).
template <typename T, typename Src>
inline T shuffle(T v, Src src) {
  const unsigned lane = worker()->lane();
  const uint64_t* bank = worker()->exchange(to_bits(v));
  return from_bits<T>(bank[src(lane) % 32]);
}

// ---- Warp collectives in one exchange (qir_common.cuh's fast mode) ----------------------------
// Shuffle trees reproduced from the warp's published values, operand for operand as each lane
// would form them, so the results are the shuffles' own; one warp barrier instead of one per
// shuffle. All return false (nothing done) unless the whole warp is live.

// v = op(v, v of lane ^ o) for o = 16, 8, 4, 2, 1: every lane's values at every step (for an
// op that may not commute: fmaxf on signed zeros).
template <typename Op>
inline bool warp_butterfly(float& v, Op op) {
  const uint32_t* bank = worker()->exchange_rows(&v, 1);
  if (!bank) return false;
  float all[32];
  std::memcpy(all, bank, sizeof all);
  for (unsigned o = 16; o > 0; o >>= 1) {
    float next[32];
    for (unsigned j = 0; j < 32; ++j) next[j] = op(all[j], all[j ^ o]);
    std::memcpy(all, next, sizeof all);
  }
  v = all[worker()->lane()];
  return true;
}

// The butterfly sum: every lane ends with the same total, pairs of lanes 16 apart added first,
// then 8, ... (addition commutes: each lane's own-plus-partner is its partner's too).
inline bool warp_sum(float& v) {
  const uint32_t* bank = worker()->exchange_rows(&v, 1);
  if (!bank) return false;
  float t[32];
  std::memcpy(t, bank, sizeof t);
  for (unsigned half = 16; half > 0; half >>= 1)
    for (unsigned i = 0; i < half; ++i) t[i] = t[i] + t[i + half];
  v = t[0];
  return true;
}

// qir_reduce_scatter<V, W, L>: lane l's values after the halving steps (offsets L/2, L/4, ...
// while it holds more than W) and the butterfly on what is left. Its value k is then the sum of
// value k + base of every lane of its group of L, added in pairs of lanes that differ in bit
// L/2 first, then L/4, ... (each add a lane's own value plus its partner's: commutative, so
// the pair's order is immaterial); base is the offset of the halves lane l kept.
// Lane `lane`'s values from all 32 lanes' (`all`: V a lane, lane-major).
template <int V, int W, int L>
inline void reduce_scatter_lane(const float* all, unsigned lane, float (&v)[V]) {
  const unsigned group = lane / L * L;
  int n = V, o = L / 2, base = 0;
  for (; n > W && o > 0; n /= 2, o /= 2)
    if (lane & o) base += n / 2;
  for (int k = 0; k < n; ++k) {
    float t[L];
    for (int i = 0; i < L; ++i) t[i] = all[(group + i) * V + base + k];
    for (int half = L / 2; half > 0; half /= 2)
      for (int i = 0; i < half; ++i) t[i] = t[i] + t[i + half];
    v[k] = t[0];
  }
}

template <int V, int W, int L>
inline bool reduce_scatter(float (&v)[V]) {
  const uint32_t* bank = worker()->exchange_rows(v, V);
  if (!bank) return false;
  reduce_scatter_lane<V, W, L>(reinterpret_cast<const float*>(bank), worker()->lane(), v);
  return true;
}

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

// The calling thread's last launch error ("" after a launch that succeeded).
extern "C" __attribute__((visibility("default"))) const char* qir_host_error() {
  return qir_host::last_error();
}

// Sharing one Runtime between kernel libraries (host.py calls these right after loading one):
// qir_host_abi() says which libraries can share, qir_host_runtime() is the Runtime this library
// uses, and qir_host_share(r) makes it use r instead, when r is of the same build (returns 1).
extern "C" __attribute__((visibility("default"))) unsigned long long qir_host_abi() {
  return QIR_HOST_ABI;
}
extern "C" __attribute__((visibility("default"))) void* qir_host_runtime() {
  return qir_host::runtime();
}
extern "C" __attribute__((visibility("default"))) int qir_host_share(void* other) {
  auto* r = static_cast<qir_host::Runtime*>(other);
  if (QIR_HOST_ABI == 0 || r == nullptr || r->abi != QIR_HOST_ABI ||
      r->runtime_size != sizeof(qir_host::Runtime) || r->fibers_size != sizeof(qir_host::Fibers))
    return 0;
  qir_host::shared_runtime().store(r, std::memory_order_release);
  return 1;
}

#define QIR_HOST_EXPORT(name)                                                                \
  extern "C" __attribute__((visibility("default"))) int qir_launch_##name(                   \
      const unsigned* grid3, const unsigned* block3, void** params, int loops) {             \
    return qir_host::launch_kernel(&name, grid3, block3, params, loops);                     \
  }

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

#if defined(QIR_HOST_RUNNER)
// Standalone-executable mode (sanitizer builds): an ASan runtime cannot be loaded into an
// uninstrumented Python, so the kernel runs in its own process on buffers malloc'd to their exact
// size, where ASan's redzones catch out-of-bounds indexing.
//   argv[1] (input): u32 grid[3], u32 block[3], u32 loops (Launch::loops), u32 nparams, then
//     per param u32 kind
//     (0 = buffer, 1 = int) and u64 nbytes followed by the bytes;
//   argv[2] (output): the buffers' final bytes, concatenated in parameter order.
extern "C" int QIR_HOST_RUNNER(const unsigned*, const unsigned*, void**, int);

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 2;
  unsigned dims[6], loops = 0, n = 0;
  if (std::fread(dims, sizeof(unsigned), 6, in) != 6 || std::fread(&loops, 4, 1, in) != 1 ||
      std::fread(&n, 4, 1, in) != 1)
    return 2;
  std::vector<void*> values(n);
  std::vector<void*> buffers(n, nullptr);
  std::vector<uint64_t> sizes(n, 0);
  for (unsigned i = 0; i < n; ++i) {
    unsigned kind = 0;
    if (std::fread(&kind, 4, 1, in) != 1 || std::fread(&sizes[i], 8, 1, in) != 1) return 2;
    void* data = std::malloc(sizes[i] ? sizes[i] : 1);
    if (sizes[i] && std::fread(data, 1, sizes[i], in) != sizes[i]) return 2;
    if (kind == 0) {
      buffers[i] = data;
      values[i] = &buffers[i];
    } else {
      values[i] = data;
    }
  }
  std::fclose(in);
  if (QIR_HOST_RUNNER(dims, dims + 3, values.data(), static_cast<int>(loops)) != 0) {
    std::fprintf(stderr, "%s\n", qir_host_error());
    return 3;
  }
  FILE* out = std::fopen(argv[2], "wb");
  if (!out) return 2;
  for (unsigned i = 0; i < n; ++i)
    if (buffers[i]) std::fwrite(buffers[i], 1, sizes[i], out);
  std::fclose(out);
  return 0;
}
#endif
