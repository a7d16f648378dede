#include "schedule/OnDemandFusion.hpp"

#include <utility>

namespace xcomm {

void OnDemandFusion::hold(Held held) {
  std::function<void()> attach;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool joins = !held_.empty() &&
                       sameFusionKind(held_[0].tensor, held_[0].opts, held.tensor, held.opts) &&
                       held.transport.get() == held_[0].transport.get() &&
                       heldBytes_ + held.tensor.nbytes() <= thresholdBytes_;
    if (!joins) attach = flushLocked();
    holdLocked(std::move(held));
  }
  if (attach) attach();
}

void OnDemandFusion::flush() {
  std::function<void()> attach;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    attach = flushLocked();
  }
  if (attach) attach();
}

void OnDemandFusion::expedite(bool /*resultNeeded*/) {
  flush();
}

void OnDemandFusion::stop() {
  flush();
}

void OnDemandFusion::abort() {
  flush();  // nothing blocks: held ops go to the transport, which aborts them
}

std::function<void()> OnDemandFusion::flushLocked() {
  if (held_.empty()) return {};
  auto group = std::make_shared<std::vector<Held>>(takeLocked(held_.size()));
  // Issued under the lock: fused transfers leave in program order.
  return issue(std::move(group));
}

}  // namespace xcomm
