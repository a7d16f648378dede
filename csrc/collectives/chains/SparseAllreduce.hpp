#pragma once
// The top-k and random-k hooks' exchanges of one DDP bucket, driven in C++
// (see python/xcomm/hooks/sparse.py for the arithmetic). Each is one
// collective, then a decode into the bucket:
//
//   top-k:    allgather every rank's (index, value) payload -> decode: the
//             payloads scattered and summed in rank order, / world
//   random-k: allreduce the values at the shared positions -> decode: the
//             sums / world at the positions, the rest of the bucket zero
//
// The caller encoded (with or without error feedback). Driving the rest here
// takes the Python callback, its future and the collective's Python wrapper
// off each bucket; BucketChain does the chaining, turns and errors.
#include <memory>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "collectives/chains/BucketChain.hpp"
#include "compress/RandomKCodec.hpp"
#include "compress/TopKCodec.hpp"

namespace xcomm {

class TopKAllreduce {
 public:
  TopKAllreduce() = default;
  explicit TopKAllreduce(ChainResult how) : how_(std::move(how)) {}

  // `packed` is codec.encode(key, flat, k): this rank's payload. `flat` and
  // `index` as in Int8Allreduce::start.
  StartedBucket start(std::shared_ptr<const TopKCodec> codec,
                      c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor buffer,
                      at::Tensor flat, at::Tensor index, at::Tensor packed, int64_t k,
                      FuturePtr turn = {});

 private:
  ChainResult how_;
  BucketTurns turns_;
};

class RandomKAllreduce {
 public:
  RandomKAllreduce() = default;
  explicit RandomKAllreduce(ChainResult how) : how_(std::move(how)) {}

  // `values` is codec.encode(key, flat, positions).
  StartedBucket start(std::shared_ptr<const RandomKCodec> codec,
                      c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor buffer,
                      at::Tensor flat, at::Tensor index, at::Tensor values, at::Tensor positions,
                      FuturePtr turn = {});

 private:
  ChainResult how_;
  BucketTurns turns_;
};

}  // namespace xcomm
