#pragma once
// Tensor fusion on a negotiated cycle (a cycle time > 0, as Horovod's
// HOROVOD_CYCLE_TIME): a background thread sends held ops at most one cycle
// after the first of them arrived, or at once when the threshold fills or a
// result or another op needs them. A rank-local timer alone would let ranks
// cut different sets, so each round first agrees, over a control transport of
// its own, on how many ops every rank has issued (an allreduce-MIN of one
// counter) and sends exactly that prefix, grouped by a rule that depends only
// on the ops (FusionPlan). Ranks issue the same ops in the same order, so a
// rank that enters a round early only waits for its peers to reach the same
// count.
//
// On demand (fusion_cycle_ms=0) is the same machinery with a different
// trigger: a round starts as soon as a rank needs a result, issues another
// op or fills the threshold, and every rank's thread joins a round at the
// latest kOnDemandJoin after it holds ops. That bound is what lets a rank
// whose program is waiting elsewhere (on another group, or at a later wait
// point) take part, so a legal program never waits for a peer's wait() and
// what travels together never depends on when each rank waits.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <thread>
#include <utility>

#include "schedule/FusionBuffer.hpp"

namespace xcomm {

// How held ops are cut into transfers: consecutive ops with the same dtype,
// reduce op and timeout, up to the threshold's bytes each. It depends only on
// the ops, so every rank cuts the same groups from the same ops.
struct FusionPlan {
  // [begin, end) indices into the ops given to groups().
  std::vector<std::pair<size_t, size_t>> groups(
      const std::vector<std::pair<const at::Tensor*, const c10d::AllreduceOptions*>>& ops,
      size_t thresholdBytes) const;
};

class CycleFusion final : public FusionBuffer {
 public:
  // On demand: how long a rank's thread may hold ops before it joins a round
  // unasked (rounds asked for by any rank start at once).
  static constexpr std::chrono::microseconds kOnDemandJoin{2000};

  // `control` carries only the rounds' counters (a transport no other op
  // uses, so its order never mixes with theirs).
  // `cycle` 0: on demand (see above).
  CycleFusion(size_t thresholdBytes, std::chrono::microseconds cycle,
              std::shared_ptr<Route> control, std::chrono::milliseconds timeout);
  ~CycleFusion() override;

  std::chrono::microseconds cycle() const override {
    return onDemand_ ? std::chrono::microseconds{0} : cycle_;
  }
  // Returns after the rounds that agree on everything held so far sent it.
  void flush() override;
  // A result is needed: start a round now without blocking (the next round
  // sends it anyway, so a mere poll or getFuture() changes nothing).
  void expedite(bool resultNeeded) override;
  // Sends what is held, then stops the thread.
  void stop() override;
  // Fails what is held without sending it, and aborts the control transport
  // (a round waiting for a dead peer returns); later ops fail at once.
  void abort() override;
  void setTimeout(std::chrono::milliseconds timeout) override;

 private:
  void hold(Held held) override;
  // The background thread's loop, one agreement round at a time.
  void cycleLoop();
  int64_t negotiate(int64_t issued);
  // Fails every held op from now on; returns those held, to complete outside
  // the lock.
  std::vector<Held> failHeldLocked(std::exception_ptr error);
  // Whether the next round should start now rather than when its cycle comes.
  bool hurryLocked() const { return urgent_ || stopping_ || wantedCount_ > sentCount_; }

  const bool onDemand_;
  const std::chrono::microseconds cycle_;  // the join bound when on demand
  std::shared_ptr<Route> control_;
  std::atomic<int64_t> timeoutMs_;  // set by the user's thread, read by the rounds'
  std::condition_variable wake_;    // the thread: something to send
  std::condition_variable sent_;    // flush(): a round sent ops
  int64_t issuedCount_ = 0;         // ops ever held
  int64_t sentCount_ = 0;           // ops ever issued as transfers (or failed)
  int64_t wantedCount_ = 0;         // flush()/wait() need this many sent
  bool urgent_ = false;             // the threshold filled
  bool stopping_ = false;
  std::exception_ptr broken_;  // a failed round: later ops fail at once
  std::thread thread_;
};

// The group's fusion: null when `thresholdBytes` is 0 (fusion off); else rounds over `control`
// that wait up to `timeout`, on demand when `cycle` is 0.
std::shared_ptr<FusionBuffer> makeFusionBuffer(size_t thresholdBytes,
                                               std::chrono::microseconds cycle,
                                               std::shared_ptr<Route> control,
                                               std::chrono::milliseconds timeout);

}  // namespace xcomm
