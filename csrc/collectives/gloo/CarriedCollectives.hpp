#pragma once
// Small collectives carried by the rank-agreement exchange itself.
//
// On a group whose CPU ops run on Gloo, every collective first sends a
// descriptor to every other rank and receives theirs (backend/
// CheckedRoute). A small op can put its data in that same message: an
// all_reduce is then one exchange plus a local reduction, in rank order, so
// every rank computes the same bits; a broadcast or an all_gather is one
// exchange plus copies; an all_to_all sends each peer its own piece, a
// gather or a reduce sends bytes to the root only. Gloo's own algorithms
// take several dependent round
// trips for a few bytes (~2 ms for an 8-byte all_reduce between two ranks on
// a busy 2-core machine), the exchange one.
// (On a plain group a reduce-scatter runs as an all_to_all_single plus a
// local reduction, collectives/gloo/AlltoallReduceScatter: carried with it.)
//
// Each function here says whether this rank can carry the op (a dense CPU
// tensor of a dtype and reduce op Gloo takes, up to `capacityBytes`, outputs
// shaped as Gloo requires), what bytes it contributes, and how the outputs
// are written from every rank's bytes. The op is carried only when every
// rank can carry it; otherwise it runs on Gloo as before, where Gloo reports
// whatever made a rank decline.
#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace xcomm {

struct CarriedOp {
  bool capable = false;
  // A barrier: the group's earlier ops complete before the exchange, as
  // Gloo's barrier waits for them.
  bool drainFirst = false;
  // The bytes this rank sends `peer` (a contiguous uint8 tensor; for
  // peer == this rank, the part it keeps), read when the op runs; null, or
  // an undefined result, for none. Returning the same tensor for several
  // peers lets one row serve them all.
  std::function<at::Tensor(int peer)> payload;
  // Writes the outputs from the bytes every rank sent this one, in rank order.
  std::function<void(const std::vector<at::Tensor>&)> finish;
};

// The most bytes a rank carries to one peer per op in a group of `size`
// ranks: 128 KiB up to 3 ranks, then 256 KiB spread over the other ranks
// (each rank may send its bytes to every other one), 0 for one rank.
int64_t carryCapacityBytes(int size);

CarriedOp carriedAllreduce(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op,
                           int size, int64_t capacityBytes);
CarriedOp carriedBroadcast(const std::vector<at::Tensor>& tensors, int root, int rank,
                           int64_t capacityBytes);
CarriedOp carriedAllgather(const std::vector<std::vector<at::Tensor>>& outputs,
                           const std::vector<at::Tensor>& inputs, int size, int64_t capacityBytes);
CarriedOp carriedAllgatherBase(const at::Tensor& output, const at::Tensor& input, int size,
                               int64_t capacityBytes);
CarriedOp carriedReduce(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op, int root,
                        int rank, int size, int64_t capacityBytes);
CarriedOp carriedReduceScatter(const std::vector<at::Tensor>& outputs,
                               const std::vector<std::vector<at::Tensor>>& inputs,
                               const c10d::ReduceOp& op, int size, int64_t capacityBytes);
CarriedOp carriedGather(const std::vector<std::vector<at::Tensor>>& outputs,
                        const std::vector<at::Tensor>& inputs, int root, int rank, int size,
                        int64_t capacityBytes);
CarriedOp carriedScatter(const std::vector<at::Tensor>& outputs,
                         const std::vector<std::vector<at::Tensor>>& inputs, int root, int rank,
                         int size, int64_t capacityBytes);
// Empty splits: even pieces along dim 0.
CarriedOp carriedAlltoallBase(const at::Tensor& output, const at::Tensor& input,
                              const std::vector<int64_t>& outputSplits,
                              const std::vector<int64_t>& inputSplits, int size,
                              int64_t capacityBytes);
CarriedOp carriedAlltoall(const std::vector<at::Tensor>& outputs,
                          const std::vector<at::Tensor>& inputs, int size, int64_t capacityBytes);
CarriedOp carriedBarrier();

}  // namespace xcomm
