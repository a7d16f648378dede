#pragma once
// Horovod-style tensor fusion for small allreduces: the interface XcommBackend
// uses, and the mechanics both ways of sending share.
//
// Small async allreduces issued back to back are held and sent as one flat
// allreduce of at most the threshold's bytes. Which ops travel together must
// be identical on every rank, whenever each rank waits: CycleFusion
// (schedule/CycleFusion.hpp) agrees with the other ranks, in rounds on a
// control transport of its own, on how many ops all have issued, and sends
// that prefix cut by a rule of the ops alone. Rounds start on a cycle time
// (Horovod's), or on demand: when a rank needs a result, issues another op
// or fills the threshold.
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <torch/csrc/distributed/c10d/Work.hpp>
#include "runtime/Route.hpp"

namespace xcomm {

class FusionBuffer;

// The Work of one held allreduce; completes when its fused transfer does.
class FusedWork : public c10d::Work {
 public:
  // Under torch.profiler: one async event `profilingTitle` from enqueue to
  // completion, with the op's input shape.
  FusedWork(int rank, std::weak_ptr<FusionBuffer> buffer, c10::IValue result,
            std::function<void()> finalize, const char* profilingTitle = nullptr,
            const std::vector<at::Tensor>& inputs = {});

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

// Whether two ops may travel in one transfer: same dtype (the caller's too,
// where an op was lowered), reduce op and timeout.
bool sameFusionKind(const at::Tensor& a, const c10d::AllreduceOptions& aOpts, const at::Tensor& b,
                    const c10d::AllreduceOptions& bOpts);

class FusionBuffer : public std::enable_shared_from_this<FusionBuffer> {
 public:
  virtual ~FusionBuffer() = default;
  FusionBuffer(const FusionBuffer&) = delete;
  FusionBuffer& operator=(const FusionBuffer&) = delete;

  size_t thresholdBytes() const { return thresholdBytes_; }
  // 0: on demand.
  virtual std::chrono::microseconds cycle() const = 0;

  // Whether an allreduce of `tensor` with `opts` may be held at all: one
  // dense contiguous CPU tensor below the threshold, an elementwise reduce op.
  bool accepts(const at::Tensor& tensor, const c10d::AllreduceOptions& opts) const;

  // Holds the op (flushing first what it cannot join); `finalize` runs after
  // its result is in `tensor` (the caller's copy-back), then its future
  // completes with `result`.
  c10::intrusive_ptr<c10d::Work> enqueue(const std::shared_ptr<Route>& transport, int rank,
                                         at::Tensor tensor, const c10d::AllreduceOptions& opts,
                                         std::function<void()> finalize, c10::IValue result,
                                         const char* profilingTitle = nullptr);

  // Sends everything held so far before returning. Called before any other
  // op is issued, so transfers keep program order. Thread-safe.
  virtual void flush() = 0;
  // A held op's result is wanted (`resultNeeded`: wait()/synchronize(), not
  // only isCompleted()/getFuture()).
  virtual void expedite(bool resultNeeded) = 0;
  // Sends what is held; no op is held after it (shutdown()).
  virtual void stop() = 0;
  // Ends what is held without blocking (abort()).
  virtual void abort() = 0;
  // The group's timeout changed (Backend::setTimeout): later agreement
  // rounds wait this long.
  virtual void setTimeout(std::chrono::milliseconds timeout) = 0;

 protected:
  explicit FusionBuffer(size_t thresholdBytes) : thresholdBytes_(thresholdBytes) {}

  struct Held {
    at::Tensor tensor;
    c10::intrusive_ptr<FusedWork> work;
    std::shared_ptr<Route> transport;
    c10d::AllreduceOptions opts;
    std::chrono::steady_clock::time_point heldAt;
  };
  // Takes the op enqueue() made a work for; the mode decides when it leaves.
  virtual void hold(Held held) = 0;

  // Under mutex_: appends an op to held_, or takes the first `count` out.
  void holdLocked(Held held);
  std::vector<Held> takeLocked(size_t count);

  // Issues one group as one allreduce (packed flat when more than one op)
  // and attaches its completion; returns what must run outside any lock
  // (attaching may complete at once).
  static std::function<void()> issue(std::shared_ptr<std::vector<Held>> group);

  const size_t thresholdBytes_;
  std::mutex mutex_;
  std::vector<Held> held_;  // in issue order; guarded by mutex_
  size_t heldBytes_ = 0;    // guarded by mutex_
};

}  // namespace xcomm
