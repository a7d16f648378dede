#include "runtime/CompletionPool.hpp"

namespace xcomm {

CompletionPool::~CompletionPool() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stopping = true;
    threads.swap(threads_);
  }
  state_->cv.notify_all();
  for (auto& t : threads) {
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();  // destroyed from one of its own tasks
    } else if (t.joinable()) {
      t.join();
    }
  }
}

void CompletionPool::run(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->tasks.push_back(std::move(task));
    if (state_->tasks.size() > state_->idle && threads_.size() < maxThreads_) {
      threads_.emplace_back([state = state_] { loop(state); });
    }
  }
  state_->cv.notify_one();
}

void CompletionPool::loop(const std::shared_ptr<State>& state) {
  std::unique_lock<std::mutex> lock(state->mutex);
  while (true) {
    ++state->idle;
    state->cv.wait(lock, [&] { return state->stopping || !state->tasks.empty(); });
    --state->idle;
    if (state->tasks.empty()) {
      return;  // stopping, nothing left to run
    }
    auto task = std::move(state->tasks.front());
    state->tasks.pop_front();
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
