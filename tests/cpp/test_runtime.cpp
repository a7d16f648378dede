// The runtime's threads: a queue or pool whose owner goes inside one of its
// own tasks (the last reference to a backend dropped by a completing op) must
// not crash the process (std::terminate on a joinable std::thread) nor touch
// freed memory afterwards.
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include "runtime/CompletionPool.hpp"
#include "runtime/OpQueue.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

namespace {

// Waits until `done` is set, at most a few seconds.
bool waitFor(const std::atomic<bool>& done) {
  for (int i = 0; i < 500 && !done; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done;
}

}  // namespace

TEST_CASE("an OpQueue destroyed by its own task finishes its queue and exits", "[runtime]") {
  auto queue = std::make_shared<xcomm::OpQueue>("test queue");
  std::atomic<bool> later{false};
  std::atomic<bool> released{false};
  std::promise<void> go;
  auto started = go.get_future().share();
  // The task holds the last reference: the queue dies when the task does, on the worker.
  queue->push([keep = queue, started, &released]() mutable {
    started.wait();
    keep.reset();
    released = true;
  });
  queue->push([&later] { later = true; });
  queue.reset();
  go.set_value();
  CHECK(waitFor(released));
  CHECK(waitFor(later));  // the queue drained after its owner went
}

TEST_CASE("a CompletionPool destroyed by its own task lets its threads finish", "[runtime]") {
  auto pool = std::make_shared<xcomm::CompletionPool>(4);
  std::atomic<bool> released{false};
  std::promise<void> go;
  auto started = go.get_future().share();
  pool->run([keep = pool, started, &released]() mutable {
    started.wait();
    keep.reset();
    released = true;
  });
  pool.reset();
  go.set_value();
  CHECK(waitFor(released));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the detached thread exits
}
