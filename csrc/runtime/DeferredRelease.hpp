#pragma once
// DeferredRelease: lets go of an object on a thread of its own, once every
// other owner has.
//
// After a shrink, the survivors' new group keeps its predecessor this way:
// torch destroys the predecessor right after shrink() returns, and its
// destructor joins transport threads (each Gloo context's event loop polls
// every 10 ms) for 20-60 ms that the survivors' first collective would
// otherwise wait for. Here the last reference goes on this thread instead,
// off that path. Destroying this object releases at once and joins.
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <c10/util/intrusive_ptr.h>

namespace xcomm {

class DeferredRelease {
 public:
  explicit DeferredRelease(c10::intrusive_ptr<c10::intrusive_ptr_target> object);
  ~DeferredRelease();
  DeferredRelease(const DeferredRelease&) = delete;
  DeferredRelease& operator=(const DeferredRelease&) = delete;

  // Whether the object has been let go of (tests).
  bool released() const;

 private:
  // How often the thread looks whether the others let go: the release may
  // come that late, at no cost to anyone waiting.
  static constexpr std::chrono::milliseconds kPoll{20};

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
  c10::intrusive_ptr<c10::intrusive_ptr_target> object_;
  std::thread thread_;  // last: starts once the rest is set
};

}  // namespace xcomm
