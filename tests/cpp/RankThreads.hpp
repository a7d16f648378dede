#pragma once
// Runs one function per rank, each rank a thread of this process over one
// in-memory store; rethrows the first rank's failure once all have joined.
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

namespace xcomm::testing {

using RankBody = std::function<void(int rank, const c10::intrusive_ptr<c10d::Store>&)>;

// Over `store` (a test's own, e.g. one that fails on purpose).
inline void onRankThreads(int size, const c10::intrusive_ptr<c10d::Store>& store,
                          const RankBody& fn) {
  std::vector<std::exception_ptr> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, store);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

inline void onRankThreads(int size, const RankBody& fn) {
  onRankThreads(size, c10::make_intrusive<c10d::HashStore>(), fn);
}

}  // namespace xcomm::testing
