#pragma once
// Horovod-style tensor fusion for small allreduces.
//
// Small async allreduces issued back to back are held and sent as one flat
// allreduce. Which ops travel together must be identical on every rank, so
// the buffer is flushed only at points of the program's own order, never by
// a rank-local clock:
//   - the held bytes would pass the threshold (by size, as in Horovod);
//   - an op that cannot join arrives (another dtype or reduce op, a large
//     tensor, any other collective): everything held goes first, keeping
//     issue order;
//   - the caller needs a result: wait(), synchronize(), getFuture() or
//     isCompleted() on any held op (so DDP hooks, which take the future at
//     once, and synchronous calls are never delayed);
//   - shutdown.
// Horovod's cycle time is a rank-local timer; here it would let ranks fuse
// different sets of ops (a collective mismatch) without a negotiation round,
// so it is replaced by the flush-on-demand points above.
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
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
  void flushBuffer();

  std::weak_ptr<FusionBuffer> buffer_;
  c10::IValue result_;
  std::function<void()> finalize_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class FusionBuffer : public std::enable_shared_from_this<FusionBuffer> {
 public:
  explicit FusionBuffer(size_t thresholdBytes) : thresholdBytes_(thresholdBytes) {}

  size_t thresholdBytes() const { return thresholdBytes_; }

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

  // Sends everything held as one allreduce. Thread-safe; a no-op when empty.
  void flush();

 private:
  struct Held {
    at::Tensor tensor;
    c10::intrusive_ptr<FusedWork> work;
  };
  // Issues what is held (under the lock, so transfers leave in program
  // order); returns what must run after the lock is released: attaching the
  // completion, which may run at once and call back into this buffer.
  std::function<void()> flushLocked();

  const size_t thresholdBytes_;
  std::mutex mutex_;
  std::vector<Held> held_;
  size_t heldBytes_ = 0;
  c10::intrusive_ptr<c10d::Backend> transport_;
  c10d::AllreduceOptions opts_;
};

}  // namespace xcomm
