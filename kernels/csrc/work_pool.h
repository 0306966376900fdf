#pragma once

// The kernels' own parallel loop: a process-wide pool of worker threads that claim chunks of a
// range from one shared counter, in place of at::parallel_for (OpenMP).
//
// Why not OpenMP: a decode step is some three hundred short parallel regions (30 layers x a dozen
// kernels, each tens of microseconds), and two properties of libgomp cost a large part of such a
// step. (1) Its static partition gives every thread one fixed range, and the region ends at a
// barrier: a thread that the OS preempts (the HTTP proxy, the ingress and the load generator share
// these cores) stalls the whole region for its time slice. (2) Once the process holds more OpenMP
// threads than it has CPUs (any second thread that ever ran a parallel torch op keeps its own
// team: the main thread that loaded the model, a second engine, the overlap thread), libgomp
// throttles its spin-wait to ~100 iterations, and every region pays a futex sleep and wake-up per
// worker: measured here, a batch-1 decode step of the default model went from 8 to 16 ms from one
// such idle thread.
//
// Here: the caller and the workers take chunks from an atomic counter until none is left, so a
// worker that has not woken yet claims nothing and delays nothing; the caller waits only for
// chunks that were claimed and are being computed. Idle workers spin on the job counter for a
// short while (RADIXSERVE_POOL_SPIN_US, default 50 us, so consecutive kernels find them awake),
// then sleep on a futex. The number of threads that take part follows at::get_num_threads() of the
// caller; nested calls (from inside a chunk) run inline. Results do not depend on which thread
// runs a chunk: every kernel computes each chunk's outputs by itself.

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#define RADIXSERVE_WORK_POOL 1
#endif

namespace radixserve {

#if defined(RADIXSERVE_WORK_POOL)

namespace pool_detail {

inline void futex_wait(std::atomic<uint32_t>* addr, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
inline void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

inline int64_t spin_ns() {
  static const int64_t ns = [] {
    const char* v = std::getenv("RADIXSERVE_POOL_SPIN_US");
    return (v != nullptr ? std::max<int64_t>(0, std::atoll(v)) : 50) * 1000;
  }();
  return ns;
}

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

inline thread_local bool in_pool = false;  // a worker, or a caller inside its own job

// The claim word: (number of chunks << 32) | next chunk. A CAS that moves `next` up claims that
// chunk of whichever job is current; a claimed chunk keeps its job from completing, so the job's
// description stays put while the chunk runs (an old word read before a new job was published
// either fails the CAS or, being equal, is a claim on the new job, which is just as correct).
struct Pool {
  alignas(64) std::atomic<uint64_t> claim{0};
  alignas(64) std::atomic<int64_t> done{0};
  alignas(64) std::atomic<uint32_t> epoch{0};  // bumped per job; workers sleep on it
  std::atomic<int32_t> sleepers{0};
  // The current job (written by the caller before it publishes the claim word).
  void (*invoke)(const void*, int64_t, int64_t) = nullptr;
  const void* fn = nullptr;
  int64_t begin = 0, end = 0, chunk = 1;
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex job;  // one caller's job at a time
  std::mutex grow;
  std::atomic<int> workers{0};

  static constexpr uint64_t kCount = 0xFFFFFFFFull;

  // Claims and runs chunks of the current job until none is left; returns how many it ran.
  int64_t work() {
    int64_t ran = 0;
    uint64_t c = claim.load(std::memory_order_acquire);
    while ((c & kCount) < (c >> 32)) {
      if (!claim.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      const int64_t lo = begin + static_cast<int64_t>(c & kCount) * chunk;
      const int64_t hi = std::min(end, lo + chunk);
      try {
        invoke(fn, lo, hi);
      } catch (...) {
        if (!failed.exchange(true)) error = std::current_exception();
      }
      done.fetch_add(1, std::memory_order_acq_rel);
      ++ran;
      c = claim.load(std::memory_order_acquire);
    }
    return ran;
  }

  void worker_loop() {
    in_pool = true;
    uint32_t seen = epoch.load(std::memory_order_acquire);
    for (;;) {
      const int64_t until = now_ns() + spin_ns();
      int polls = 0;
      while (epoch.load(std::memory_order_acquire) == seen) {
        _mm_pause();
        if (++polls % 64 == 0 && now_ns() > until) {
          sleepers.fetch_add(1, std::memory_order_seq_cst);
          futex_wait(&epoch, seen);
          sleepers.fetch_sub(1, std::memory_order_seq_cst);
          polls = 0;
        }
      }
      seen = epoch.load(std::memory_order_acquire);
      work();
    }
  }

  void ensure_workers(int wanted) {
    if (workers.load(std::memory_order_acquire) >= wanted) return;
    std::lock_guard<std::mutex> lock(grow);
    while (workers.load(std::memory_order_relaxed) < wanted) {
      std::thread([this] { worker_loop(); }).detach();
      workers.fetch_add(1, std::memory_order_release);
    }
  }

  template <typename F>
  void run(int64_t b, int64_t e, int64_t chunk_len, int64_t chunks, const F& f, int threads) {
    std::lock_guard<std::mutex> lock(job);
    ensure_workers(threads - 1);
    invoke = [](const void* p, int64_t lo, int64_t hi) { (*static_cast<const F*>(p))(lo, hi); };
    fn = &f;
    begin = b;
    end = e;
    chunk = chunk_len;
    failed.store(false, std::memory_order_relaxed);
    error = nullptr;
    done.store(0, std::memory_order_relaxed);
    claim.store(static_cast<uint64_t>(chunks) << 32, std::memory_order_release);
    epoch.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&epoch);
    in_pool = true;
    work();
    in_pool = false;
    // Only chunks that a worker claimed and is computing are left. If that takes long (the worker
    // was preempted), give the core away rather than spin against it.
    int polls = 0;
    while (done.load(std::memory_order_acquire) < chunks) {
      if (++polls < 2048)
        _mm_pause();
      else
        sched_yield();
    }
    if (failed.load(std::memory_order_acquire)) std::rethrow_exception(error);
  }
};

inline Pool*& pool_slot() {
  static Pool* p = nullptr;
  return p;
}

inline Pool& pool() {
  static std::once_flag once;
  std::call_once(once, [] {
    pool_slot() = new Pool();  // never destroyed: workers sleep in it until the process ends
    // A forked child has none of the parent's threads: it starts a pool of its own.
    pthread_atfork(nullptr, nullptr, [] { pool_slot() = new Pool(); });
  });
  return *pool_slot();
}

}  // namespace pool_detail

// f(lo, hi) over [begin, end) in chunks of at least `grain`, as at::parallel_for.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t range = end - begin;
  if (range <= 0) return;
  const int threads = at::get_num_threads();
  grain = std::max<int64_t>(grain, 1);
  if (threads <= 1 || range <= grain || pool_detail::in_pool) {
    f(begin, end);
    return;
  }
  // Several chunks a thread so that a slow or late thread's share is taken over by the others.
  const int64_t chunk_len = std::max(grain, (range + 4 * threads - 1) / (4 * threads));
  const int64_t chunks = (range + chunk_len - 1) / chunk_len;
  pool_detail::pool().run(begin, end, chunk_len, chunks, f, threads);
}

#else

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}

#endif

}  // namespace radixserve
