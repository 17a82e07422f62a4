// qir_host.h: run CUDA C++ kernels on the CPU.
//
// Force-included (`g++ -include qir_host.h`) ahead of a rendered .cu file so the very source that
// runs on a GPU compiles as host C++. Each CUDA thread becomes a fiber (glibc ucontext); one OS
// thread runs one block at a time, so `__shared__` is `static thread_local`, and threadIdx/blockIdx
// are per-OS-thread globals that the scheduler rewrites before every switch into a fiber.
// Boost.Context is not used (and not required): ucontext is everywhere glibc is, and switching
// with _setjmp/_longjmp once ucontext has built the stacks (see `switch_to`) avoids
// swapcontext's per-switch syscall, which is what Boost.Context would have bought.
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
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

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

// Per-OS-thread view of "which CUDA thread is running": rewritten by the scheduler on each switch.
static thread_local uint3 threadIdx;
static thread_local uint3 blockIdx;
static thread_local dim3 blockDim;
static thread_local dim3 gridDim;

namespace qir_host {

enum class State : uint8_t { runnable, wait_block, wait_warp, done };

// A CUDA thread's scheduling state within its Worker (its stack and context are in `Fibers`).
struct Fiber {
  uint3 tid;
  unsigned warp;
  unsigned lane;
  State state;
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
  std::vector<AsyncCopy> pending;
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

// ---- Runtime: worker threads and fiber stacks, made once and kept --------------------------
//
// Each kernel library carries its own copy of everything below (-fvisibility=hidden), but
// threads and stacks are a per-process resource: host.py hands every library loaded after the
// first the first one's `Runtime` (qir_host_share), so a process has one worker pool and one
// set of fiber stacks per OS thread however many kernels it loads. Only code that carries no
// per-library state crosses libraries: the pool runs the caller's function pointer, and a
// fiber's outermost frame (`fiber_boot`, the owner's) calls the current kernel's `entry`; the
// kernel's own scheduler (its threadIdx, its `__shared__`) always runs the kernel library's
// code. A library whose QIR_HOST_ABI or struct sizes differ keeps its own Runtime.

// One fiber stack's saved context.
struct Slot {
#if defined(__SANITIZE_ADDRESS__)
  ucontext_t uc;
#else
  jmp_buf jb;
#endif
};

// The fibers of one OS thread. Fiber i's stack is arena + i * kStackBytes, with a canary at its
// lowest 8 bytes (guard pages would cost an mprotect and a VMA per fiber, so overflow is caught
// after the fact). The first `ready` fibers are bootstrapped: each sits in `fiber_boot`'s loop,
// and resuming it makes it call `entry(ctx)` once (one CUDA thread of one block) and park again,
// so after the first launch on a thread no launch makes a context or touches a fresh page.
struct Fibers {
  char* arena = nullptr;
  unsigned capacity = 0;  // stacks mapped
  unsigned ready = 0;     // fibers parked at the top of fiber_boot's loop
  unsigned boot = 0;      // the fiber being bootstrapped
  void (*entry)(void*) = nullptr;
  void* ctx = nullptr;
#if defined(__SANITIZE_ADDRESS__)
  ucontext_t sched;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
#else
  jmp_buf sched;
#endif
  Slot slots[kMaxThreads];

  char* stack_bottom(unsigned i) const { return arena + static_cast<size_t>(i) * kStackBytes; }
};

// ucontext makes the fiber stacks, but swapcontext costs a sigprocmask syscall per switch, so
// switches go through _setjmp/_longjmp, which leave the signal mask alone. Sanitizer builds keep
// swapcontext throughout, which ASan's fiber annotations understand.
inline void switch_to(Fibers& t, unsigned i) {  // scheduler -> fiber i
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, t.stack_bottom(i), kStackBytes);
  swapcontext(&t.sched, &t.slots[i].uc);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  if (_setjmp(t.sched) == 0) _longjmp(t.slots[i].jb, 1);
#endif
}

inline void switch_back(Fibers& t, unsigned i) {  // fiber i -> scheduler
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, t.sched_bottom, t.sched_size);
  swapcontext(&t.slots[i].uc, &t.sched);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  if (_setjmp(t.slots[i].jb) == 0) _longjmp(t.sched, 1);
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

namespace own {  // this library's Runtime: used unless host.py shares another library's

struct FibersHolder {
  Fibers* f = nullptr;
  ~FibersHolder() {  // a caller thread exiting; pool threads never do
    if (!f) return;
    if (f->arena) munmap(f->arena, static_cast<size_t>(f->capacity) * kStackBytes);
    delete f;
  }
};
static thread_local FibersHolder fibers_of_thread;

[[noreturn]] static void fiber_boot() {
  Fibers* t = fibers_of_thread.f;
  const unsigned me = t->boot;
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &t->sched_bottom, &t->sched_size);
#endif
  for (;;) {
    switch_back(*t, me);
    t->entry(t->ctx);
  }
}

inline Fibers* fibers(unsigned n) {
  FibersHolder& h = fibers_of_thread;
  if (!h.f) h.f = new (std::nothrow) Fibers();
  if (!h.f) return nullptr;
  Fibers& t = *h.f;
  if (t.capacity < n) {  // a bigger block than this thread has run: map (and boot) anew
    if (t.arena) munmap(t.arena, static_cast<size_t>(t.capacity) * kStackBytes);
    t.ready = t.capacity = 0;
    void* p = mmap(nullptr, static_cast<size_t>(n) * kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    t.arena = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
    if (!t.arena) return nullptr;
    t.capacity = n;
  }
  for (; t.ready < n; ++t.ready) {
    const unsigned i = t.ready;
    std::memcpy(t.stack_bottom(i), &kCanary, sizeof kCanary);
    t.boot = i;
#if defined(__SANITIZE_ADDRESS__)
    ucontext_t& uc = t.slots[i].uc;
#else
    ucontext_t uc;
#endif
    getcontext(&uc);
    uc.uc_stack.ss_sp = t.stack_bottom(i);
    uc.uc_stack.ss_size = kStackBytes;
    uc.uc_link = nullptr;
    makecontext(&uc, &fiber_boot, 0);
#if defined(__SANITIZE_ADDRESS__)
    switch_to(t, i);
#else
    if (_setjmp(t.sched) == 0) setcontext(&uc);
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

  bool spawn() {
    try {
      std::thread([this] { loop(); }).detach();
      return true;
    } catch (...) {  // out of threads: run with fewer
      return false;
    }
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

inline std::atomic<Runtime*>& shared_runtime() {
  static std::atomic<Runtime*> r{nullptr};
  return r;
}

inline Runtime& runtime() {
  Runtime* r = shared_runtime().load(std::memory_order_acquire);
  return r ? *r : own::runtime();
}

// ---- One launch ------------------------------------------------------------------------------

struct Launch {
  dim3 grid, block;
  void (*body)(void*);  // runs the kernel for the current fiber
  void* args;
  std::atomic<unsigned long> next_block{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::string error;
  // QIR_HOST_SCHEDULE=reverse: blocks, and a block's threads between barriers, run last to first.
  // A fiber runs until it blocks, so a missing barrier lets a thread read a slot it expects
  // another to have written only when the writer happens to run first: a forward run exposes
  // the races where the writer comes later, a reverse run the others. Race-free kernels give
  // the same bytes either way (tests/runtime/test_host.py, test_every_format.py).
  bool reverse = false;
};

// The calling thread's last launch error: launches from several threads do not share one.
inline std::string& last_error() {
  static thread_local std::string s;
  return s;
}

// First error wins; the others would only describe the same failure from other workers.
inline void fail(Launch& launch, const std::string& msg) {
  std::lock_guard<std::mutex> lock(launch.error_mutex);
  if (!launch.failed.exchange(true)) launch.error = msg;
}

class Worker;
static thread_local Worker* current_worker = nullptr;

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
    t_ = runtime().fibers(n_);
    if (!t_) {
      fail(launch_, "qir_host: cannot allocate fiber stacks");
      return;
    }
    t_->entry = &Worker::fiber_entry;
    t_->ctx = this;
    current_worker = this;
    blockDim = launch_.block;
    gridDim = launch_.grid;
    const dim3& g = launch_.grid;
    const unsigned long total = static_cast<unsigned long>(g.x) * g.y * g.z;
    while (!launch_.failed.load(std::memory_order_relaxed)) {
      unsigned long b = launch_.next_block.fetch_add(1);
      if (b >= total) break;
      if (launch_.reverse) b = total - 1 - b;
      blockIdx = make_uint3(b % g.x, (b / g.x) % g.y, b / (static_cast<unsigned long>(g.x) * g.y));
      if (!run_block()) {
        // Fibers stuck mid-kernel (deadlock) or with a trampled stack (overflow) must never be
        // resumed: boot them all afresh next time.
        t_->ready = 0;
        break;
      }
    }
    current_worker = nullptr;
  }

  // Called from fibers.
  // The last thread to arrive releases the others and yields too, rather than running on: then
  // the threads leave a barrier in schedule order, so a forward and a reverse run see opposite
  // orders for every pair of threads (see Launch::reverse).
  void syncthreads() {
    Fiber& f = fibers_[cur_];
    if (++block_arrived_ == n_) {
      block_arrived_ = 0;
      for (Fiber& o : fibers_)
        if (o.state == State::wait_block) o.state = State::runnable;
    } else {
      f.state = State::wait_block;
    }
    switch_back(*t_, cur_);
  }

  void syncwarp() {
    Fiber& f = fibers_[cur_];
    Warp& w = warps_[f.warp];
    if (++w.arrived == w.live) {
      release(f.warp);
    } else {
      f.state = State::wait_warp;
    }
    switch_back(*t_, cur_);
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

  AsyncCopies& async_copies() { return async_[cur_]; }

  // A misuse the GPU would fault on (a misaligned address): the launch fails with `msg`, and the
  // fiber runs on (its results are not used).
  void report(const std::string& msg) {
    char where[96];
    snprintf(where, sizeof where, " (thread (%u,%u,%u) of block (%u,%u,%u))", threadIdx.x,
             threadIdx.y, threadIdx.z, blockIdx.x, blockIdx.y, blockIdx.z);
    fail(launch_, msg + where);
  }

  unsigned lane() const { return fibers_[cur_].lane; }

  unsigned active_mask() const {
    const Fiber& f = fibers_[cur_];
    unsigned mask = 0;
    for (unsigned i = f.warp * 32; i < std::min(n_, f.warp * 32 + 32); ++i)
      if (fibers_[i].state != State::done) mask |= 1u << (i % 32);
    return mask;
  }

 private:
  // One block: every fiber runs until it blocks or returns; a full pass in which no fiber could
  // run while some are still alive is a deadlock.
  bool run_block() {
    block_arrived_ = 0;
    for (unsigned i = 0; i < n_; ++i) {
      fibers_[i].state = State::runnable;
      async_[i].pending.clear();  // copies a thread never waited for do not outlive its block
      async_[i].committed = 0;
    }
    for (unsigned w = 0; w < warps_.size(); ++w) {
      warps_[w].live = std::min(32u, n_ - w * 32);
      warps_[w].arrived = 0;
    }
    unsigned live = n_;
    while (live > 0) {
      bool progressed = false;
      for (unsigned j = 0; j < n_; ++j) {
        const unsigned i = launch_.reverse ? n_ - 1 - j : j;
        if (fibers_[i].state != State::runnable) continue;
        progressed = true;
        cur_ = i;
        threadIdx = fibers_[i].tid;
        switch_to(*t_, i);
        if (fibers_[i].state == State::done) --live;
      }
      if (!progressed) {
        report_deadlock(live);
        return false;
      }
    }
    for (unsigned i = 0; i < n_; ++i) {
      if (std::memcmp(t_->stack_bottom(i), &kCanary, sizeof kCanary) != 0) {
        char buf[160];
        snprintf(buf, sizeof buf, "thread (%u,%u,%u) of block (%u,%u,%u) overflowed its %zu KiB "
                 "fiber stack", fibers_[i].tid.x, fibers_[i].tid.y, fibers_[i].tid.z, blockIdx.x,
                 blockIdx.y, blockIdx.z, kStackBytes / 1024);
        fail(launch_, buf);
        return false;
      }
    }
    return true;
  }

  void release(unsigned warp) {
    Warp& w = warps_[warp];
    w.arrived = 0;
    ++w.gen;
    for (unsigned i = warp * 32; i < std::min(n_, warp * 32 + 32); ++i)
      if (fibers_[i].state == State::wait_warp) fibers_[i].state = State::runnable;
  }

  // What a resumed fiber runs (from fiber_boot's loop, on its own stack): one CUDA thread.
  static void fiber_entry(void* self_) {
    Worker* self = static_cast<Worker*>(self_);
    self->launch_.body(self->launch_.args);
    Fiber& f = self->fibers_[self->cur_];
    f.state = State::done;
    Warp& w = self->warps_[f.warp];
    // A lane leaving may complete a warp barrier the others are waiting at; a block barrier it
    // leaves incomplete stays so and is reported as a deadlock.
    if (--w.live > 0 && w.arrived == w.live) self->release(f.warp);
  }

  void report_deadlock(unsigned live) {
    unsigned at_block = 0, at_warp = 0;
    for (const Fiber& f : fibers_) {
      at_block += f.state == State::wait_block;
      at_warp += f.state == State::wait_warp;
    }
    char buf[256];
    snprintf(buf, sizeof buf,
             "deadlock in block (%u,%u,%u): %u of %u threads returned, %u wait at "
             "__syncthreads, %u at a warp barrier (__syncwarp/shuffle/vote)",
             blockIdx.x, blockIdx.y, blockIdx.z, n_ - live, n_, at_block, at_warp);
    fail(launch_, buf);
  }

  Launch& launch_;
  unsigned n_ = 0;
  Fibers* t_ = nullptr;
  std::vector<Fiber> fibers_;
  std::vector<Warp> warps_;
  std::vector<AsyncCopies> async_;
  std::vector<uint32_t> words_;  // exchange_words' banks: [warp][gen & 1][lane][kWords]
  unsigned cur_ = 0;
  unsigned block_arrived_ = 0;
};

inline unsigned worker_count(unsigned long blocks) {
  unsigned n = std::thread::hardware_concurrency();
  if (const char* env = std::getenv("QIR_HOST_THREADS")) n = static_cast<unsigned>(std::atoi(env));
  if (n == 0) n = 1;
  return static_cast<unsigned>(std::min<unsigned long>(n, blocks));
}

inline int launch(const unsigned* grid3, const unsigned* block3, void (*body)(void*), void* args) {
  Launch l;
  l.grid = dim3(grid3[0], grid3[1], grid3[2]);
  l.block = dim3(block3[0], block3[1], block3[2]);
  l.body = body;
  l.args = args;
  const unsigned long threads = static_cast<unsigned long>(l.block.x) * l.block.y * l.block.z;
  const unsigned long blocks = static_cast<unsigned long>(l.grid.x) * l.grid.y * l.grid.z;
  const char* schedule = std::getenv("QIR_HOST_SCHEDULE");
  l.reverse = schedule != nullptr && std::strcmp(schedule, "reverse") == 0;
  if (schedule != nullptr && *schedule && !l.reverse && std::strcmp(schedule, "forward") != 0) {
    fail(l, std::string("qir_host: QIR_HOST_SCHEDULE=") + schedule +
                " not supported; expected forward or reverse");
  } else if (threads == 0 || threads > kMaxThreads || blocks == 0) {
    fail(l, "qir_host: block must hold 1..1024 threads and the grid at least one block");
  } else {
    runtime().run(worker_count(blocks) - 1, &Worker::run_launch, &l);
  }
  last_error() = l.error;
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
                  std::index_sequence<I...>) {
  Call<A...> call{fn, {*static_cast<std::decay_t<A>*>(params[I])...}};
  return launch(grid3, block3, &Call<A...>::run, &call);
}

template <typename... A>
int launch_kernel(void (*fn)(A...), const unsigned* grid3, const unsigned* block3, void** params) {
  return launch_kernel(fn, grid3, block3, params, std::index_sequence_for<A...>{});
}

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
  const unsigned lane = current_worker->lane();
  const uint64_t* bank = current_worker->exchange(to_bits(v));
  return from_bits<T>(bank[src(lane) % 32]);
}

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
  const float* bank = reinterpret_cast<const float*>(current_worker->exchange_words(words, 12));
  constexpr unsigned W = Worker::kWords;
  const unsigned lane = current_worker->lane();
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
  const uint32_t* bank = current_worker->exchange_words(mine, 8);
  constexpr unsigned W = Worker::kWords;
  const unsigned lane = current_worker->lane();
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
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0 && current_worker->lane() < 8 * N)
    current_worker->report("ldmatrix: a row address is not 16-byte aligned");
  const uint64_t* bank = current_worker->exchange(to_bits(row));
  const unsigned lane = current_worker->lane();
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
    current_worker->report("cp.async: an address is not aligned to the copy size");
  if (src_bytes < 0 || static_cast<unsigned>(src_bytes) > bytes)
    current_worker->report("cp.async: src-size must be in [0, copy size]");
  AsyncCopies& q = current_worker->async_copies();
  const unsigned n = std::min<unsigned>(static_cast<unsigned>(std::max(src_bytes, 0)), bytes);
  q.pending.push_back({dst, src, bytes, n, q.committed});
}

inline void cp_async_commit() { ++current_worker->async_copies().committed; }

inline void cp_async_wait(unsigned n) {
  AsyncCopies& q = current_worker->async_copies();
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
  return qir_host::last_error().c_str();
}

// Sharing one Runtime between kernel libraries (host.py calls these right after loading one):
// qir_host_abi() says which libraries can share, qir_host_runtime() is the Runtime this library
// uses, and qir_host_share(r) makes it use r instead, when r is of the same build (returns 1).
extern "C" __attribute__((visibility("default"))) unsigned long long qir_host_abi() {
  return QIR_HOST_ABI;
}
extern "C" __attribute__((visibility("default"))) void* qir_host_runtime() {
  return &qir_host::runtime();
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
      const unsigned* grid3, const unsigned* block3, void** params) {                        \
    return qir_host::launch_kernel(&name, grid3, block3, params);                            \
  }

// ---- CUDA device API -------------------------------------------------------------------------
// Masks are ignored: every live lane of the warp takes part, so shuffles must be reached
// convergently (as CUDA requires for a full mask).

inline void __syncthreads() { qir_host::current_worker->syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { qir_host::current_worker->syncwarp(); }
inline unsigned __activemask() { return qir_host::current_worker->active_mask(); }
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
  const uint64_t* bank = qir_host::current_worker->exchange(pred != 0);
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
//   argv[1] (input): u32 grid[3], u32 block[3], u32 nparams, then per param u32 kind
//     (0 = buffer, 1 = int) and u64 nbytes followed by the bytes;
//   argv[2] (output): the buffers' final bytes, concatenated in parameter order.
extern "C" int QIR_HOST_RUNNER(const unsigned*, const unsigned*, void**);

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 2;
  unsigned dims[6], n = 0;
  if (std::fread(dims, sizeof(unsigned), 6, in) != 6 || std::fread(&n, 4, 1, in) != 1) return 2;
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
  if (QIR_HOST_RUNNER(dims, dims + 3, values.data()) != 0) {
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
