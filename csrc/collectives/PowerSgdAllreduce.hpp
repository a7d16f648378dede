#pragma once
// PowerSGD's compressed allreduce of one DDP bucket, driven in C++:
//
//   allreduce the wire (P factors and uncompressed gradients) -> reduceP
//   -> allreduce Q -> finish -> the returned future holds the bucket
//
// Each step starts from the previous one's future callback, so nothing
// blocks; the codec (compress/PowerSgdCodec) does the arithmetic, the
// process group's allreduce the transfers. Driving the chain here, not from
// Python callbacks, takes the interpreter off the path: each bucket used to
// cost four Python callbacks (each taking the GIL from the training thread
// on a CPU group), two `dist.all_reduce` wrappers and three Python futures.
// On a GPU, where NCCL's futures complete at launch and the whole chain runs
// on the training thread while it queues kernels, that host time is step
// time.
//
// Order across ranks: the second allreduce is issued from a callback, which
// may race with the next bucket's first allreduce on another thread. Each
// bucket therefore takes a turn: its first allreduce is issued once the
// previous bucket (of this object) has issued its last one, so every rank
// issues P0, Q0, P1, Q1, ... in DDP's bucket order. Transfers still overlap
// the rest of the backward pass.
//
// Errors: a failed collective or codec phase fails the bucket's future with
// that error (DDP raises it), aborts the bucket's step in the codec, and
// fails every later bucket waiting for its turn, with the same error.
#include <functional>
#include <memory>
#include <mutex>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "compress/PowerSgdCodec.hpp"

namespace xcomm {

class PowerSgdAllreduce {
 public:
  // How the averaged buffer is handed over: DDP's Python hooks must return
  // futures of Python objects, so the Python binding wraps it in one (the
  // only point where the chain takes the GIL); C++ callers keep the tensor.
  using WrapResult = std::function<c10::IValue(const at::Tensor&)>;
  PowerSgdAllreduce() = default;
  PowerSgdAllreduce(c10::TypePtr resultType, WrapResult wrapResult)
      : resultType_(std::move(resultType)), wrapResult_(std::move(wrapResult)) {}

  struct Started {
    // Completes with `buffer` holding the average.
    c10::intrusive_ptr<c10::ivalue::Future> result;
    // Completes once the bucket issued its last collective (an error if it
    // failed before): the next bucket's turn.
    c10::intrusive_ptr<c10::ivalue::Future> issued;
  };

  // Starts the collectives of a bucket whose `codec.prepare(bucket, buffer)`
  // returned `wire`. The first allreduce waits for `turn` when given (a hook
  // that orders its collectives with other methods' passes its own turn),
  // else for the previous bucket started here. On a GPU the result carries
  // the buffer's device (its callbacks and waiters order their streams after
  // finish's kernels) and the first allreduce is issued on the stream
  // current now, where prepare ran.
  Started start(std::shared_ptr<PowerSgdCodec> codec, c10::intrusive_ptr<c10d::ProcessGroup> group,
                int64_t bucket, at::Tensor buffer, at::Tensor wire,
                c10::intrusive_ptr<c10::ivalue::Future> turn = {});

 private:
  c10::TypePtr resultType_ = c10::TensorType::get();
  WrapResult wrapResult_;
  std::mutex mutex_;
  // Completes when the last started bucket has issued its last collective.
  c10::intrusive_ptr<c10::ivalue::Future> tail_;
};

}  // namespace xcomm
