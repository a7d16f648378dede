#pragma once
// A FIFO of operations run by one worker thread.
//
// Collectives must run in the order they were issued on every rank, so one
// thread per queue is the point, not a limitation.
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
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
  // shutdown() without waiting for the worker: for an abort, whose caller
  // must not wait for a task blocked in a transport (until its timeout).
  // The worker still runs what is queued; shutdown() or destruction joins it.
  void stop();

 private:
  // What the worker touches, shared with it: the last reference to the
  // queue's owner may go inside a task, so the queue can be destroyed on its
  // own worker, which then detaches and finishes on this state alone.
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Task> tasks;
    bool stopping = false;
  };
  static void run(const std::shared_ptr<State>& state);

  const std::string name_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
  std::thread worker_;
};

}  // namespace xcomm
