#pragma once
// What the compressed allreduces of a bucket that run as a chain of
// collectives and codec phases (PowerSgdAllreduce, Int8Allreduce,
// SparseAllreduce) share:
//
// - ChainCollectives: the three collectives a chain issues, on whatever
//   carries them. The DDP hooks chain over their process group; the
//   backend's compression= route chains the same steps over its own
//   transport (collectives/compressed/CompressedAllreduce), so each
//   compressed allreduce has one body;
// - a BucketStep: one bucket's chain, kept alive by the future callbacks that
//   continue it; each phase starts from the previous collective's callback,
//   so nothing blocks and no Python runs between collectives;
// - BucketTurns: the order of the chains across ranks. A chain's later
//   collectives are issued from callbacks, which may race with the next
//   bucket's first collective on another thread. So each bucket takes a turn:
//   its first collective is issued once the previous bucket has issued its
//   last one, and every rank issues them in DDP's bucket order. Transfers
//   still overlap the rest of the backward pass.
//
// Errors: a failed collective or codec phase fails the bucket's future with
// that error (DDP raises it), lets the step clean up (abort), and fails every
// later bucket waiting for its turn, with the same error.
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace xcomm {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// How a chain hands over the averaged buffer. DDP's Python hooks must return
// futures of Python objects, so the Python bindings wrap it in one (the only
// point where a chain takes the GIL); C++ callers keep the tensor.
struct ChainResult {
  c10::TypePtr type = c10::TensorType::get();
  std::function<c10::IValue(const at::Tensor&)> wrap;  // empty: the tensor itself
};

// What starting a bucket's chain returns.
struct StartedBucket {
  // Completes with the bucket's buffer holding the average.
  FuturePtr result;
  // Completes once the bucket issued its last collective (an error if it
  // failed before): the next bucket's turn.
  FuturePtr issued;
};

// The collectives of a chain. Each returns the future of its completion. One
// that waits on its caller's thread returns a completed future (or throws),
// and the chain then runs on inline, on that thread.
class ChainCollectives {
 public:
  virtual ~ChainCollectives() = default;
  virtual int64_t size() const = 0;
  // SUM, in place.
  virtual FuturePtr allreduce(at::Tensor& tensor) = 0;
  // `input` of every rank, in rank order, into the flat `output`.
  virtual FuturePtr allgather(at::Tensor& output, at::Tensor& input) = 0;
  // Row j of `input` to rank j; row i of `output` from rank i (even rows).
  virtual FuturePtr alltoall(at::Tensor& output, at::Tensor& input) = 0;

  // Over a process group (the DDP hooks').
  static std::shared_ptr<ChainCollectives> of(c10::intrusive_ptr<c10d::ProcessGroup> group);
};

class BucketStep : public std::enable_shared_from_this<BucketStep> {
 public:
  // On a GPU the result carries the buffer's device (its callbacks and
  // waiters order their streams after the last phase's kernels), and the
  // first collective goes to the stream current now, where the caller's
  // encode ran.
  BucketStep(std::shared_ptr<ChainCollectives> collectives, at::Tensor buffer,
             const ChainResult& how);
  BucketStep(c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor buffer,
             const ChainResult& how)
      : BucketStep(ChainCollectives::of(std::move(group)), std::move(buffer), how) {}
  virtual ~BucketStep() = default;
  BucketStep(const BucketStep&) = delete;
  BucketStep& operator=(const BucketStep&) = delete;

  StartedBucket futures() const { return {result_, issued_}; }

  // Issues the first collective: runs in the bucket's turn.
  virtual void issueFirst() = 0;

  // Fails the bucket (and its turn) with `error`.
  void fail(const std::exception_ptr& error);

 protected:
  // Undoes what the caller's encode left pending for this bucket; runs once,
  // on failure. The bucket's own error is the one reported.
  virtual void abort() {}

  ChainCollectives& collectives() { return *collectives_; }
  int64_t worldSize() const { return worldSize_; }
  const at::Tensor& buffer() const { return buffer_; }
  const std::optional<c10::Stream>& issueStream() const { return issueStream_; }

  // The collectives (and the group under them) are let go once the last
  // collective is out: a step may end on one of the group's own threads (a
  // Gloo worker runs the last callback), and if it held the last reference
  // there (the caller destroyed the group meanwhile), the group's destructor
  // would join the thread it runs on.
  void markIssued();
  // Completes the result with the buffer.
  void complete();
  // Completes it after the decode into `flat`: the buffer itself, or (`index`
  // defined: a resumed run's parameter order) elements of it, copied back to
  // buffer[index] first.
  void completeFrom(const at::Tensor& flat, const at::Tensor& index);

  // Runs `next(step)` once `done` completed, or fails the step with its error.
  template <typename Step, typename Next>
  void then(const FuturePtr& done, Next next) {
    auto self = std::static_pointer_cast<Step>(shared_from_this());
    done->addCallback([self, next](c10::ivalue::Future& f) {
      if (f.hasError()) {
        self->fail(f.exception_ptr());
        return;
      }
      try {
        next(*self);
      } catch (...) {
        self->fail(std::current_exception());
      }
    });
  }

 private:
  std::shared_ptr<ChainCollectives> collectives_;
  int64_t worldSize_ = 1;
  at::Tensor buffer_;
  std::optional<c10::Stream> issueStream_;  // GPU only
  std::function<c10::IValue(const at::Tensor&)> wrap_;
  FuturePtr result_;
  FuturePtr issued_;
};

// Buckets of one hook state, in the order their chains were started.
class BucketTurns {
 public:
  // Issues the step's first collective once `turn` completes when given (a
  // hook that orders its collectives with other methods' passes its own
  // turn), else once the previous step started here issued its last one.
  StartedBucket start(const std::shared_ptr<BucketStep>& step, FuturePtr turn = {});

 private:
  std::mutex mutex_;
  FuturePtr tail_;  // the last started bucket's `issued`
};

}  // namespace xcomm
