// qir_host_launch.h: one launch (blocks over the pool, threads on fibers, barriers) and the
// warp collectives.
// Part of qir_host.h, which includes the parts in order after the toolkit headers; not
// usable on its own.
#pragma once

namespace qir_host {

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

// A launch run by this library's own scheduler (see `launch` below).
inline int launch_here(const unsigned* grid3, const unsigned* block3, void (*body)(void*),
                       void* args, int loops) {
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

#if !defined(QIR_HOST_SHARED_RUNTIME)
namespace own {
inline int launch(const unsigned* grid3, const unsigned* block3, void (*body)(void*), void* args,
                  int loops, char* error) {
  const int failed = launch_here(grid3, block3, body, args, loops);
  snprintf(error, kErrorBytes, "%s", last_error());
  return failed;
}
}  // namespace own
#endif

// A kernel library's launches run on the runtime library's scheduler, which every kernel's
// build would otherwise compile again (Worker's run, run_block, fiber_entry: 0.13 s of g++ per
// library at -O1). Where a fiber finds itself through a
// thread-local (QIR_HOST_SELF_TLS), that thread-local is the library's own, so the library
// schedules its own threads.
inline int launch(const unsigned* grid3, const unsigned* block3, void (*body)(void*), void* args,
                  int loops) {
#if defined(QIR_HOST_SHARED_RUNTIME) && !defined(QIR_HOST_SELF_TLS)
  Runtime* r = runtime();
  if (r == nullptr) {
    snprintf(last_error(), kErrorBytes, "%s",
             "qir_host: no runtime: load kernel libraries through qir's host backend");
    return 1;
  }
  return r->launch(grid3, block3, body, args, loops, last_error());
#else
  return launch_here(grid3, block3, body, args, loops);
#endif
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

}  // namespace qir_host
