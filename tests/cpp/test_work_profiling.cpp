// A DelegatedWork's profiler event ends before the work says it is done.
// xcomm's own works (FutureWork: shm, int8) count as finished before their
// future's callbacks run, and the event used to end in one of those callbacks:
// a caller that waited and left the profiler freed the event's record while
// the completing thread was still to end it (heap corruption under torch
// 2.14.1: the conformance suite's test_all_reduce_sum_async lost a rank to
// SIGSEGV). Here a callback ahead of the event's end holds the completing
// thread after the inner work finished, so the window is always open.
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "backend/XcommWork.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

namespace {

constexpr const char* kTitle = "xcomm:test_work_profiling";
std::atomic<int> ended{0};  // events named kTitle that ended

// Counts the ends of kTitle events, as the profiler would record them.
struct EndCounter {
  at::CallbackHandle handle;
  EndCounter() {
    handle = at::addGlobalCallback(at::RecordFunctionCallback(
        [](const at::RecordFunction&) -> std::unique_ptr<at::ObserverContext> { return nullptr; },
        [](const at::RecordFunction& fn, at::ObserverContext*) {
          if (std::string(fn.name()) == kTitle) ended++;
        }));
  }
  ~EndCounter() { at::removeCallback(handle); }
};

}  // namespace

TEST_CASE("a delegated work's profiler event has ended when wait() or isCompleted() says done",
          "[work]") {
  EndCounter counter;
  for (const bool viaWait : {true, false}) {
    DYNAMIC_SECTION((viaWait ? "wait()" : "isCompleted()")) {
      ended = 0;
      std::vector<at::Tensor> tensors{at::ones({4})};
      auto inner = c10::make_intrusive<xcomm::FutureWork>(
          0, c10d::OpType::ALLREDUCE, "shm:test", c10::IValue(tensors), xcomm::tensorListType());
      // Runs before the event's end (callbacks run in the order added) and
      // holds the completing thread until the caller has looked.
      std::atomic<bool> looked{false};
      inner->getFuture()->addCallback([&looked](c10::ivalue::Future&) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
        while (!looked && std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      });
      auto work = c10::make_intrusive<xcomm::DelegatedWork>(
          0, c10d::OpType::ALLREDUCE, inner, nullptr, c10::IValue(tensors), xcomm::tensorListType(),
          kTitle, tensors);
      std::thread completer([inner] { inner->markSucceeded(); });
      if (viaWait) {
        work->wait();
      } else {
        while (!work->isCompleted()) std::this_thread::yield();
      }
      const int endedWhenDone = ended.load();
      looked = true;
      completer.join();
      CHECK(endedWhenDone == 1);
      CHECK(ended.load() == 1);  // and only once
    }
  }
}
