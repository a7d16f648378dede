#include "runtime/DeferredRelease.hpp"

#include <utility>

namespace xcomm {

DeferredRelease::DeferredRelease(c10::intrusive_ptr<c10::intrusive_ptr_target> object)
    : object_(std::move(object)), thread_([this] {
        std::unique_lock<std::mutex> lock(mutex_);
        while (!stopping_ && object_ && object_.use_count() > 1) cv_.wait_for(lock, kPoll);
        // The destructor may run for a while (it joins threads): not under the lock.
        auto last = std::move(object_);
        lock.unlock();
        last.reset();
      }) {}

DeferredRelease::~DeferredRelease() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool DeferredRelease::released() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !object_;
}

}  // namespace xcomm
