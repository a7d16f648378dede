#include "runtime/DeferredRelease.hpp"

#include <utility>

namespace xcomm {

DeferredRelease::DeferredRelease(c10::intrusive_ptr<c10::intrusive_ptr_target> object,
                                 std::chrono::milliseconds grace)
    : grace_(grace), state_(std::make_shared<State>()) {
  state_->object = std::move(object);
  thread_ = std::thread([state = state_] {
    std::unique_lock<std::mutex> lock(state->mutex);
    while (!state->stopping && state->object.use_count() > 1) {
      state->cv.wait_for(lock, kPoll);
    }
    // The destructor may run for a while (it joins threads): not under the lock.
    auto last = std::move(state->object);
    lock.unlock();
    last.reset();
    lock.lock();
    state->released = true;
    state->cv.notify_all();
  });
}

DeferredRelease::~DeferredRelease() {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->stopping = true;
  state_->cv.notify_all();
  const bool released = state_->cv.wait_for(lock, grace_, [this] { return state_->released; });
  lock.unlock();
  if (released) {
    thread_.join();
  } else {
    thread_.detach();  // it owns what it still touches (State)
  }
}

bool DeferredRelease::released() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->released;
}

}  // namespace xcomm
