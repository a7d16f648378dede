#include "runtime/CompletionPool.hpp"

namespace xcomm {

CompletionPool::~CompletionPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable() && t.get_id() != std::this_thread::get_id()) {
      t.join();
    } else if (t.joinable()) {
      t.detach();  // destroyed from one of its own callbacks
    }
  }
}

void CompletionPool::run(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
    if (tasks_.size() > idle_ && threads_.size() < maxThreads_) {
      threads_.emplace_back([this] { loop(); });
    }
  }
  cv_.notify_one();
}

void CompletionPool::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    ++idle_;
    cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
    --idle_;
    if (tasks_.empty()) {
      return;  // stopping, nothing left to run
    }
    auto task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();  // a work's completion reports its own errors
    // Destroyed before the lock is taken again: what the task holds (the
    // last reference to a work and its tensors) may take the GIL when it
    // goes, and a thread holding the GIL may be waiting for this lock
    // (~CompletionPool, run()).
    task = nullptr;
    lock.lock();
  }
}

}  // namespace xcomm
