// SPDX-License-Identifier: Apache-2.0
// A team of worker threads that split one call's work with the calling thread, and spin between calls.
//
// Why not OpenMP: a decoding step calls the GEMM a hundred times or more, a few tens of microseconds
// apart, with single-threaded operators in between. libgomp's idle threads spin only briefly when the
// process holds more threads than cores (an engine thread, the main thread, and a pool for each thread
// that opened a parallel region), then sleep in the kernel; each product of the step then paid a
// futex wake-up and a context switch on each side, and smollm2-135m's batch-1 step ran slower on two
// threads than on one although the products alone stream 1.45x faster on two (bench/README.md). This
// team's workers spin for `kSpinNs` after their last piece of work, so within a step they answer in
// well under a microsecond, and sleep (a condition variable) once the caller has gone quiet, so an idle
// server burns no core.
//
// One team per process, whichever of dflash-trt's operators includes this header (its statics are
// unique symbols: the dynamic linker binds every library that defines them to one copy). `width` is
// how many threads a call may use (0: the operator's own default); cpu_gemm.set_threads sets it.
//
// One call at a time: a call that finds the team busy (another thread inside) runs its work alone. After
// fork() the child starts a new team on first use (the parent's workers do not exist there).
#pragma once

#include <pthread.h>
#include <sched.h>
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace dflash {

class SpinTeam {
 public:
  using Part = void (*)(const void *ctx, int part, int parts);

  static std::atomic<int> &width() {
    static std::atomic<int> threads{0};
    return threads;
  }

  // Run part(ctx, i, n) for i in [0, n) on the caller and n - 1 workers; returns when all are done.
  static void run(Part part, const void *ctx, int n) {
    if (n <= 1) return part(ctx, 0, 1);
    SpinTeam *team = instance();
    std::unique_lock<std::mutex> busy(team->call_, std::try_to_lock);
    if (!busy.owns_lock()) return part(ctx, 0, 1);
    team->grow(n - 1);
    team->part_ = part, team->ctx_ = ctx, team->parts_ = n;
    team->remaining_.store(static_cast<int>(team->workers_.size()));  // every worker answers every call
    team->generation_.fetch_add(1);
    if (team->sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(team->sleep_);
      team->wake_.notify_all();
    }
    part(ctx, 0, n);
    for (uint32_t spins = 1; team->remaining_.load(std::memory_order_acquire) != 0; spins++) {
      _mm_pause();
      if (spins % 4096 == 0) std::this_thread::yield();  // a worker was preempted: let it run
    }
  }

 private:
  // Spin this long after the last piece of work: through a step and the engine's host work between steps
  // (a compiled batch-1 step of smollm2-135m makes ~120 calls in ~13 ms).
  static constexpr int64_t kSpinNs = 2'000'000;

  static std::atomic<SpinTeam *> &current() {
    static std::atomic<SpinTeam *> team{nullptr};
    return team;
  }

  // The process's team: one atomic load on every call but the first (and the first after a fork).
  static SpinTeam *instance() {
    if (SpinTeam *team = current().load(std::memory_order_acquire)) return team;
    static std::mutex make;
    static bool at_fork = false;
    std::lock_guard<std::mutex> lock(make);
    if (!at_fork) at_fork = pthread_atfork(nullptr, nullptr, [] { current().store(nullptr); }) == 0;
    if (current().load() == nullptr) current().store(new SpinTeam());  // never freed: workers live until exit
    return current().load();
  }

  // Workers 1..want exist (a team only grows: the caller's count decides how many take part).
  void grow(int want) {
    while (static_cast<int>(workers_.size()) < want) {
      const int index = static_cast<int>(workers_.size()) + 1;
      const uint64_t seen = generation_.load();  // before this call's: the new worker answers it
      workers_.emplace_back([this, index, seen] { serve(index, seen); });
      workers_.back().detach();
    }
  }

  void serve(int index, uint64_t seen) {
    for (;;) {
      seen = await(seen);
      if (index < parts_) part_(ctx_, index, parts_);
      remaining_.fetch_sub(1, std::memory_order_release);
    }
  }

  // Spin until the generation moves past `seen`, sleeping once kSpinNs pass without work.
  uint64_t await(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    for (uint32_t spins = 1;; spins++) {
      const uint64_t now = generation_.load(std::memory_order_acquire);
      if (now != seen) return now;
      _mm_pause();
      if (spins % 64 == 0) sched_yield();  // a thread of this process or another waits for this core: let it run
      if (spins % 256 == 0 && std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(kSpinNs)) break;
    }
    std::unique_lock<std::mutex> lock(sleep_);
    sleepers_.fetch_add(1);
    wake_.wait(lock, [&] { return generation_.load() != seen; });
    sleepers_.fetch_sub(1);
    return generation_.load(std::memory_order_acquire);
  }

  std::mutex call_;   // held by the one call in progress
  std::mutex sleep_;  // with wake_: where idle workers sleep
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  Part part_ = nullptr;
  const void *ctx_ = nullptr;
  int parts_ = 0;  // workers with index >= parts_ have no part in this call (they still answer it)
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int> remaining_{0};
  alignas(64) std::atomic<int> sleepers_{0};
};

}  // namespace dflash
