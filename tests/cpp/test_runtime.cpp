// The runtime's threads: a queue or pool whose owner goes inside one of its
// own tasks (the last reference to a backend dropped by a completing op) must
// not crash the process (std::terminate on a joinable std::thread) nor touch
// freed memory afterwards.
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "runtime/CompletionPool.hpp"
#include "runtime/DeferredRelease.hpp"
#include "runtime/OpQueue.hpp"
#include "runtime/OrderedRunner.hpp"

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

TEST_CASE("an OrderedRunner runs steps in submission order and completes them off its worker",
          "[runtime]") {
  using xcomm::OrderedRunner;
  for (auto policy :
       {OrderedRunner::CallerThread::kNever, OrderedRunner::CallerThread::kWhenIdle}) {
    OrderedRunner runner("test runner", policy);
    std::mutex mutex;
    std::vector<int> ran;
    std::vector<std::thread::id> stepThreads(6), completionThreads(6);
    std::atomic<int> completed{0};
    std::promise<void> release;
    auto released = release.get_future().share();
    for (int i = 0; i < 6; ++i) {
      // Step 0 blocks until released, so steps 1-5 queue behind it even
      // when synchronous: the caller's thread may run a step only when idle.
      runner.submit(
          [&, i]() -> OrderedRunner::Completion {
            if (i == 0) released.wait();
            {
              std::lock_guard<std::mutex> lock(mutex);
              ran.push_back(i);
            }
            stepThreads[i] = std::this_thread::get_id();
            return [&, i] {
              completionThreads[i] = std::this_thread::get_id();
              completed++;
            };
          },
          /*synchronous=*/i % 2 == 1);
    }
    release.set_value();
    for (int i = 0; i < 500 && completed < 6; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    REQUIRE(completed == 6);
    REQUIRE(ran == std::vector<int>{0, 1, 2, 3, 4, 5});
    for (int i = 0; i < 6; ++i) {
      CHECK(stepThreads[i] != std::this_thread::get_id());
      CHECK(completionThreads[i] != stepThreads[i]);  // the worker stays free
    }
  }
}

TEST_CASE("an idle OrderedRunner runs a synchronous step on the caller's thread only if allowed",
          "[runtime]") {
  using xcomm::OrderedRunner;
  const auto caller = std::this_thread::get_id();
  for (auto policy :
       {OrderedRunner::CallerThread::kNever, OrderedRunner::CallerThread::kWhenIdle}) {
    OrderedRunner runner("test runner", policy);
    std::thread::id stepThread, completionThread;
    std::atomic<bool> done{false};
    runner.submit(
        [&]() -> OrderedRunner::Completion {
          stepThread = std::this_thread::get_id();
          return [&] {
            completionThread = std::this_thread::get_id();
            done = true;
          };
        },
        /*synchronous=*/true);
    REQUIRE(waitFor(done));
    const bool inline_ = policy == OrderedRunner::CallerThread::kWhenIdle;
    CHECK((stepThread == caller) == inline_);
    CHECK((completionThread == caller) == inline_);
  }
}

TEST_CASE("an OrderedRunner refuses steps once shut down and still finishes the queued ones",
          "[runtime]") {
  using xcomm::OrderedRunner;
  OrderedRunner runner("test runner", OrderedRunner::CallerThread::kWhenIdle);
  std::atomic<bool> done{false};
  runner.submit([&]() -> OrderedRunner::Completion {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return [&] { done = true; };
  });
  runner.shutdown();
  REQUIRE(waitFor(done));
  CHECK_THROWS_WITH(runner.submit([]() -> OrderedRunner::Completion { return {}; }, true),
                    Catch::Contains("was shut down"));
  // An empty completion: the step's op is finished elsewhere; nothing runs.
  OrderedRunner other("other runner", OrderedRunner::CallerThread::kNever);
  std::atomic<bool> stepRan{false};
  other.submit([&]() -> OrderedRunner::Completion {
    stepRan = true;
    return {};
  });
  REQUIRE(waitFor(stepRan));
}

namespace {

// Records the thread its destructor ran on.
struct Tracked : c10::intrusive_ptr_target {
  explicit Tracked(std::promise<std::thread::id>& died) : died_(died) {}
  ~Tracked() override { died_.set_value(std::this_thread::get_id()); }
  std::promise<std::thread::id>& died_;
};

}  // namespace

TEST_CASE("a DeferredRelease lets go once the other owners did, on its own thread", "[runtime]") {
  std::promise<std::thread::id> died;
  auto diedAt = died.get_future();
  auto object = c10::make_intrusive<Tracked>(died);
  xcomm::DeferredRelease deferred(object);
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  CHECK_FALSE(deferred.released());  // another owner still holds it
  object.reset();                    // the last other owner: no destruction on this thread
  REQUIRE(diedAt.wait_for(std::chrono::seconds(5)) == std::future_status::ready);
  CHECK(diedAt.get() != std::this_thread::get_id());
  // released() says so once the destructor has returned: just after the promise.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!deferred.released() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(deferred.released());
}

TEST_CASE("a DeferredRelease destroyed first releases at once", "[runtime]") {
  std::promise<std::thread::id> died;
  auto diedAt = died.get_future();
  {
    xcomm::DeferredRelease deferred(c10::make_intrusive<Tracked>(died));
    // Its thread may release at once (no other owner), or the destructor makes it.
  }
  CHECK(diedAt.wait_for(std::chrono::seconds(0)) == std::future_status::ready);
}

namespace {

// An object whose destructor blocks until it is let go (a transport waiting
// for an op blocked until its timeout).
struct SlowToDie : c10::intrusive_ptr_target {
  explicit SlowToDie(std::shared_future<void> letGo) : letGo_(std::move(letGo)) {}
  ~SlowToDie() override { letGo_.wait(); }
  std::shared_future<void> letGo_;
};

}  // namespace

TEST_CASE("a DeferredRelease destroyed while its release blocks returns after its grace",
          "[runtime]") {
  std::promise<void> letGo;
  const auto start = std::chrono::steady_clock::now();
  { xcomm::DeferredRelease deferred(c10::make_intrusive<SlowToDie>(letGo.get_future().share())); }
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(waited >= xcomm::DeferredRelease::kGrace);
  CHECK(waited < xcomm::DeferredRelease::kGrace + std::chrono::seconds(2));
  letGo.set_value();  // the detached thread finishes the release on its own
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}
