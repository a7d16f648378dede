#include "runtime/OpQueue.hpp"

#include <c10/util/Exception.h>

namespace xcomm {

OpQueue::OpQueue(std::string name) : name_(std::move(name)), worker_([this] { run(); }) {}

OpQueue::~OpQueue() {
  shutdown();
}

void OpQueue::push(Task task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stopping_, "xcomm: ", name_, " was shut down; no new operations can be issued");
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void OpQueue::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) {
    worker_.join();
  }
}

void OpQueue::run() {
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) {
        return;  // stopping and drained
      }
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();  // tasks report their own errors through their Work
  }
}

}  // namespace xcomm
