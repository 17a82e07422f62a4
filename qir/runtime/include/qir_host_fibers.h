// qir_host_fibers.h: a CUDA thread's state, the fibers that run CUDA threads, and the
// worker pool that runs blocks (left out of kernel libraries: QIR_HOST_SHARED_RUNTIME).
// Part of qir_host.h, which includes the parts in order after the toolkit headers; not
// usable on its own.
#pragma once

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
// per-library state crosses libraries: the pool runs the caller's function pointer, a fiber's
// outermost frame (`fiber_main`, the owner's) calls the current kernel's `entry`, and on x86-64
// the owner's scheduler (`Runtime::launch`: blocks, fibers, barriers' bookkeeping) runs a
// kernel library's launches, whose threads find their coordinates on their own stacks and keep
// their `__shared__` in their library's thread-locals. A library whose QIR_HOST_ABI or struct
// sizes differ keeps its own Runtime.

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
  // One launch of `body` (qir_host::launch), its error, if any, copied to `error`.
  int (*launch)(const unsigned* grid3, const unsigned* block3, void (*body)(void*), void* args,
                int loops, char* error);
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

inline int launch(const unsigned* grid3, const unsigned* block3, void (*body)(void*), void* args,
                  int loops, char* error);  // defined in qir_host_launch.h

inline Runtime& runtime() {
  static Runtime r{QIR_HOST_ABI, sizeof(Runtime), sizeof(Fibers), &own::run, &own::fibers,
                   &own::launch};
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

}  // namespace qir_host
