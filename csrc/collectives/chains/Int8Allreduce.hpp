#pragma once
// The int8 compressed allreduce, driven in C++: the one body behind the int8
// DDP hook (a bucket at a time; python/xcomm/hooks/int8.py states the
// arithmetic) and the backend's Options(compression="int8") on the CPU:
//
//   the caller quantized the bucket into `world` shards (packShards, with or
//   without error feedback) -> alltoall: shard j to rank j -> reduceAndPack:
//   the mean of this rank's shard, quantized again -> allgather of the means
//   -> unpackAll into the bucket -> the returned future holds the bucket
//
// As PowerSgdAllreduce, it takes the interpreter off the path between the
// collectives (three Python callbacks, two collective wrappers and four
// Python futures per bucket before); BucketChain does the chaining, turns and
// errors.
#include <memory>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "collectives/chains/BucketChain.hpp"
#include "compress/Int8Codec.hpp"

namespace xcomm {

class Int8Allreduce {
 public:
  Int8Allreduce() = default;
  explicit Int8Allreduce(ChainResult how) : how_(std::move(how)) {}

  // Starts the collectives of a bucket, in its turn (see BucketTurns::start).
  // `flat` is what the codec packed: the bucket's buffer itself, or (`index`
  // defined) its elements in another order, which are written back to
  // buffer[index] at the end. `packed` is codec.packShards(flat, world). The
  // result is the mean (the DDP hooks').
  StartedBucket start(std::shared_ptr<const Int8Codec> codec,
                      c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor buffer,
                      at::Tensor flat, at::Tensor index, at::Tensor packed, FuturePtr turn = {});
  // The same over any collectives; the reduced shard is divided by `divisor`
  // (1: the sum; the world size: the mean).
  StartedBucket start(std::shared_ptr<const Int8Codec> codec,
                      std::shared_ptr<ChainCollectives> collectives, at::Tensor buffer,
                      at::Tensor flat, at::Tensor index, at::Tensor packed, double divisor,
                      FuturePtr turn = {});

 private:
  ChainResult how_;
  BucketTurns turns_;
};

}  // namespace xcomm
