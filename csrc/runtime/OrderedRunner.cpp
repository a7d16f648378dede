#include "runtime/OrderedRunner.hpp"

#include <utility>

#include <c10/util/Exception.h>

namespace xcomm {

OrderedRunner::OrderedRunner(std::string name, CallerThread callerThread)
    : name_(name), callerThread_(callerThread), queue_(std::move(name)) {}

OrderedRunner::~OrderedRunner() {
  queue_.shutdown();
}

void OrderedRunner::submit(Step step, bool synchronous) {
  std::lock_guard<std::mutex> lock(submitMutex_);
  // Checked here, not only by the queue: a step would otherwise still run on
  // the caller's thread after shutdown.
  TORCH_CHECK(!stopped_, "xcomm: ", name_, " was shut down; no new operations can be issued");
  if (synchronous && callerThread_ == CallerThread::kWhenIdle && pending_.load() == 0) {
    // Nothing queued or running, and no later step can be queued before this
    // one returns (the lock): the order is kept on the caller's thread.
    if (auto complete = step()) complete();
    return;
  }
  queue_.push([this, step = std::move(step)] {
    auto complete = step();
    if (complete) completions_.run(std::move(complete));
    pending_--;
  });
  // After the push (which throws once shut down); under the lock, so the
  // next submit sees it even if the worker already finished the step.
  pending_++;
}

void OrderedRunner::stop() {
  stopped_ = true;  // as in shutdown()
  queue_.stop();
}

void OrderedRunner::shutdown() {
  stopped_ = true;  // not under submitMutex_: a step running inline holds it
  queue_.shutdown();
}

}  // namespace xcomm
