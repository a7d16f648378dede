#pragma once
// Runs one function per rank, each rank a thread of this process over one
// in-memory store; rethrows the first rank's failure once all have joined.
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

namespace xcomm::testing {

inline void onRankThreads(
    int size, const std::function<void(int rank, const c10::intrusive_ptr<c10d::Store>&)>& fn) {
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
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

}  // namespace xcomm::testing
