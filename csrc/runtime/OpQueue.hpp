#pragma once
// A FIFO of operations run by one worker thread.
//
// Collectives must run in the order they were issued on every rank, so one
// thread per queue is the point, not a limitation.
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace xcomm {

class OpQueue {
 public:
  using Task = std::function<void()>;

  explicit OpQueue(std::string name);
  ~OpQueue();
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Queues `task`. Throws once the queue was shut down.
  void push(Task task);

  // Runs what is queued, then stops the worker. Idempotent.
  void shutdown();

 private:
  void run();

  const std::string name_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace xcomm
