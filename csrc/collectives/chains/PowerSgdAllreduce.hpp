#pragma once
// PowerSGD's compressed allreduce of one DDP bucket, driven in C++:
//
//   allreduce the wire (P factors and uncompressed gradients) -> reduceP
//   -> allreduce Q -> finish -> the returned future holds the bucket
//
// The codec (compress/PowerSgdCodec) does the arithmetic, the process group's
// allreduce the transfers, BucketChain the chaining, turns and errors. Driving
// the chain here, not from Python callbacks, takes the interpreter off the
// path: each bucket used to cost four Python callbacks (each taking the GIL
// from the training thread on a CPU group), two `dist.all_reduce` wrappers and
// three Python futures. On a GPU, where NCCL's futures complete at launch and
// the whole chain runs on the training thread while it queues kernels, that
// host time is step time.
//
// On failure the codec's step of the bucket is aborted (abortStep).
#include <memory>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "collectives/chains/BucketChain.hpp"
#include "compress/PowerSgdCodec.hpp"

namespace xcomm {

class PowerSgdAllreduce {
 public:
  PowerSgdAllreduce() = default;
  explicit PowerSgdAllreduce(ChainResult how) : how_(std::move(how)) {}

  // Starts the collectives of a bucket whose `codec.prepare(bucket, buffer)`
  // returned `wire`, in the bucket's turn (see BucketTurns::start).
  StartedBucket start(std::shared_ptr<PowerSgdCodec> codec,
                      c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t bucket,
                      at::Tensor buffer, at::Tensor wire, FuturePtr turn = {});

 private:
  ChainResult how_;
  BucketTurns turns_;
};

}  // namespace xcomm
