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
  void loop();

  const size_t maxThreads_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool stopping_ = false;
};

}  // namespace xcomm
