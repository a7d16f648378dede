#pragma once
// Horovod-style tensor fusion for small allreduces.
//
// Small async allreduces issued back to back are held and sent as one flat
// allreduce of at most the threshold's bytes. Which ops travel together must
// be identical on every rank. Two ways to decide when held ops leave:
//
// On demand (no cycle time): only at points of the program's own order, never
// by a rank-local clock:
//   - the held bytes would pass the threshold;
//   - an op that cannot join arrives (another dtype or reduce op, a large
//     tensor, any other collective): everything held goes first, keeping
//     issue order;
//   - the caller needs a result: wait(), synchronize(), getFuture() or
//     isCompleted() on any held op (so DDP hooks, which take the future at
//     once, and synchronous calls are never delayed);
//   - shutdown.
// Held ops wait for one of these, so nothing is sent while the caller computes.
//
// Negotiated cycle (a cycle time > 0, as Horovod's HOROVOD_CYCLE_TIME): a
// background thread sends held ops at most one cycle after the first of them
// arrived, or at once when the threshold fills or a result or another op
// needs them. A rank-local timer alone would let ranks cut different sets,
// so each round first agrees, over a control transport of its own, on how
// many ops every rank has issued (an allreduce-MIN of one counter) and sends
// exactly that prefix, grouped by a rule that depends only on the ops
// (FusionPlan). Ranks issue the same ops in the same order, so a rank that
// enters a round early only waits for its peers to reach the same count.
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace xcomm {

class FusionBuffer;

// The Work of one held allreduce; completes when its fused transfer does.
class FusedWork : public c10d::Work {
 public:
  FusedWork(int rank, std::weak_ptr<FusionBuffer> buffer, c10::IValue result,
            std::function<void()> finalize);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Called by the buffer once the fused transfer landed (on its thread).
  void complete(std::exception_ptr error);

 private:
  void expedite(bool resultNeeded);

  std::weak_ptr<FusionBuffer> buffer_;
  c10::IValue result_;
  std::function<void()> finalize_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// How held ops are cut into transfers: consecutive ops with the same dtype,
// reduce op and timeout, up to the threshold's bytes each. It depends only on
// the ops, so every rank cuts the same groups from the same ops.
struct FusionPlan {
  // [begin, end) indices into the ops given to groups().
  std::vector<std::pair<size_t, size_t>> groups(
      const std::vector<std::pair<const at::Tensor*, const c10d::AllreduceOptions*>>& ops,
      size_t thresholdBytes) const;
};

class FusionBuffer : public std::enable_shared_from_this<FusionBuffer> {
 public:
  // On-demand fusion.
  explicit FusionBuffer(size_t thresholdBytes) : thresholdBytes_(thresholdBytes) {}
  // Negotiated cycle: `control` carries only the rounds' counters (a transport
  // no other op uses, so its order never mixes with theirs).
  FusionBuffer(size_t thresholdBytes, std::chrono::microseconds cycle,
               c10::intrusive_ptr<c10d::Backend> control, std::chrono::milliseconds timeout);
  ~FusionBuffer();
  FusionBuffer(const FusionBuffer&) = delete;
  FusionBuffer& operator=(const FusionBuffer&) = delete;

  size_t thresholdBytes() const { return thresholdBytes_; }
  // 0: on demand.
  std::chrono::microseconds cycle() const { return cycle_; }

  // Whether an allreduce of `tensor` with `opts` may be held at all: one
  // dense contiguous CPU tensor below the threshold, an elementwise reduce op.
  bool accepts(const at::Tensor& tensor, const c10d::AllreduceOptions& opts) const;

  // Holds the op (flushing first what it cannot join); `finalize` runs after
  // its result is in `tensor` (the caller's copy-back), then its future
  // completes with `result`.
  c10::intrusive_ptr<c10d::Work> enqueue(const c10::intrusive_ptr<c10d::Backend>& transport,
                                         int rank, at::Tensor tensor,
                                         const c10d::AllreduceOptions& opts,
                                         std::function<void()> finalize, c10::IValue result);

  // Sends everything held so far before returning (on demand: one
  // allreduce; cycle: after the rounds that agree on it). Called before any
  // other op is issued, so transfers keep program order. Thread-safe.
  void flush();
  // A held op's result is wanted: on demand, flush(); in cycle mode, start a
  // round now without blocking (the next round sends it anyway).
  void expedite(bool resultNeeded);
  // Cycle mode: sends what is held, then stops the thread (shutdown()).
  void stop();
  // Fails what is held without sending it, and aborts the control transport
  // (a round waiting for a dead peer returns); later ops fail at once.
  void abort();

 private:
  struct Held {
    at::Tensor tensor;
    c10::intrusive_ptr<FusedWork> work;
    c10::intrusive_ptr<c10d::Backend> transport;
    c10d::AllreduceOptions opts;
    std::chrono::steady_clock::time_point heldAt;
  };
  // Issues one group as one allreduce and attaches its completion; returns
  // what must run outside any lock (attaching may complete at once).
  static std::function<void()> issue(std::shared_ptr<std::vector<Held>> group);
  // On demand: issues what is held (under the lock, so transfers leave in
  // program order).
  std::function<void()> flushLocked();
  // Cycle mode: the background thread's loop, one agreement round at a time.
  void cycleLoop();
  int64_t negotiate(int64_t issued);
  void failHeldLocked(std::exception_ptr error, std::vector<Held>& out);
  // Whether the next round should start now rather than when its cycle comes.
  bool hurryLocked() const { return urgent_ || stopping_ || wantedCount_ > sentCount_; }

  const size_t thresholdBytes_;
  std::mutex mutex_;
  std::vector<Held> held_;  // in issue order
  size_t heldBytes_ = 0;

  // Cycle mode only.
  const std::chrono::microseconds cycle_{0};
  c10::intrusive_ptr<c10d::Backend> control_;
  std::chrono::milliseconds timeout_{0};
  std::condition_variable wake_;  // the thread: something to send
  std::condition_variable sent_;  // flush(): a round sent ops
  int64_t issuedCount_ = 0;       // ops ever held
  int64_t sentCount_ = 0;         // ops ever issued as transfers (or failed)
  int64_t wantedCount_ = 0;       // flush()/wait() need this many sent
  bool urgent_ = false;           // the threshold filled
  bool stopping_ = false;
  std::exception_ptr broken_;  // a failed round: later ops fail at once
  std::thread thread_;
};

}  // namespace xcomm
