#include "runtime/OpQueue.hpp"

#include <c10/util/Exception.h>

namespace xcomm {

OpQueue::OpQueue(std::string name)
    : name_(std::move(name)), worker_([state = state_] { run(state); }) {}

OpQueue::~OpQueue() {
  shutdown();
}

void OpQueue::push(Task task) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    TORCH_CHECK(!state_->stopping, "xcomm: ", name_,
                " was shut down; no new operations can be issued");
    state_->tasks.push_back(std::move(task));
  }
  state_->cv.notify_one();
}

void OpQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stopping = true;
  }
  state_->cv.notify_all();
}

void OpQueue::shutdown() {
  stop();
  if (!worker_.joinable()) {
    return;
  }
  if (worker_.get_id() == std::this_thread::get_id()) {
    worker_.detach();  // called from a task: the worker drains and exits on its own
  } else {
    worker_.join();
  }
}

void OpQueue::run(const std::shared_ptr<State>& state) {
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(state->mutex);
      state->cv.wait(lock, [&] { return state->stopping || !state->tasks.empty(); });
      if (state->tasks.empty()) {
        return;  // stopping and drained
      }
      task = std::move(state->tasks.front());
      state->tasks.pop_front();
    }
    task();  // tasks report their own errors through their Work
  }
}

}  // namespace xcomm
