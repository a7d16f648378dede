#pragma once
// Threads that complete works (and so run their futures' callbacks) off the
// thread that executes collectives.
//
// A callback may block on another collective of the same group (torch's
// powerSGD_hook waits inside its callbacks), so a fixed number of threads can
// all end up waiting for a completion that none of them is free to run. The
// pool grows instead: whenever more tasks are queued than threads are idle, it
// starts another thread (up to `maxThreads`). Idle threads stay for reuse.
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace xcomm {

class CompletionPool {
 public:
  explicit CompletionPool(size_t maxThreads = 64) : maxThreads_(maxThreads) {}
  ~CompletionPool();
  CompletionPool(const CompletionPool&) = delete;
  CompletionPool& operator=(const CompletionPool&) = delete;

  void run(std::function<void()> task);

 private:
  // What the threads touch, shared with them: a task may drop the last
  // reference to the pool's owner, destroying the pool on one of its own
  // threads, which then detaches and finishes on this state alone.
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::function<void()>> tasks;
    size_t idle = 0;
    bool stopping = false;
  };
  static void loop(const std::shared_ptr<State>& state);

  const size_t maxThreads_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
  std::vector<std::thread> threads_;  // guarded by state_->mutex
};

}  // namespace xcomm
