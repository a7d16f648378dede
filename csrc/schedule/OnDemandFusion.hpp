#pragma once
// Tensor fusion on demand (no cycle time): held ops leave only at points of
// the program's own order, never by a rank-local clock:
//   - the held bytes would pass the threshold;
//   - an op that cannot join arrives (another dtype or reduce op, a large
//     tensor, any other collective): everything held goes first, keeping
//     issue order;
//   - the caller needs a result: wait(), synchronize(), getFuture() or
//     isCompleted() on any held op (so DDP hooks, which take the future at
//     once, and synchronous calls are never delayed);
//   - shutdown.
// Held ops wait for one of these, so nothing is sent while the caller computes.
#include "schedule/FusionBuffer.hpp"

namespace xcomm {

class OnDemandFusion final : public FusionBuffer {
 public:
  explicit OnDemandFusion(size_t thresholdBytes) : FusionBuffer(thresholdBytes) {}

  std::chrono::microseconds cycle() const override { return std::chrono::microseconds{0}; }
  // One allreduce of everything held.
  void flush() override;
  // Any interest in a held result sends everything held: flush().
  void expedite(bool resultNeeded) override;
  void stop() override;
  // Nothing blocks: held ops go to the transport, which aborts them.
  void abort() override;

 private:
  void hold(Held held) override;
  // Issues what is held (under the lock, so transfers leave in program order).
  std::function<void()> flushLocked();
};

}  // namespace xcomm
