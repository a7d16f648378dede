#pragma once
// DeferredRelease: lets go of an object on a thread of its own, once every
// other owner has.
//
// After a shrink, the survivors' new group keeps its predecessor this way:
// torch destroys the predecessor right after shrink() returns, and its
// destructor joins transport threads (each Gloo context's event loop polls
// every 10 ms) for 20-60 ms that the survivors' first collective would
// otherwise wait for. Here the last reference goes on this thread instead,
// off that path.
//
// Destroying this object makes the thread release at once and waits for
// that up to `grace` (kGrace unless told). A release that takes longer (a transport an abort let
// go of, whose destructor waits for an op blocked until its timeout) goes on
// alone: whoever drops the group, often a Python caller holding the GIL,
// must not wait for that timeout.
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include <c10/util/intrusive_ptr.h>

namespace xcomm {

class DeferredRelease {
 public:
  explicit DeferredRelease(c10::intrusive_ptr<c10::intrusive_ptr_target> object,
                           std::chrono::milliseconds grace = kGrace);
  ~DeferredRelease();
  DeferredRelease(const DeferredRelease&) = delete;
  DeferredRelease& operator=(const DeferredRelease&) = delete;

  // Whether the object has been let go of (tests).
  bool released() const;

  // How long the destructor waits for the release before leaving it to its
  // thread: longer than an ordinary group's teardown (20-60 ms).
  static constexpr std::chrono::milliseconds kGrace{250};

 private:
  // How often the thread looks whether the others let go: the release may
  // come that late, at no cost to anyone waiting.
  static constexpr std::chrono::milliseconds kPoll{20};

  // Shared with the thread, which may outlive this object (see above).
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    bool stopping = false;
    bool released = false;  // the object's destructor has returned
    c10::intrusive_ptr<c10::intrusive_ptr_target> object;
  };
  std::chrono::milliseconds grace_;
  std::shared_ptr<State> state_;
  std::thread thread_;  // last: starts once the rest is set
};

}  // namespace xcomm
