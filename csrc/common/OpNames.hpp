#pragma once
// The names torch.distributed gives collectives, for error messages.
#include <cstdint>

#include <torch/csrc/distributed/c10d/Types.hpp>

namespace xcomm {

// The name torch.distributed gives each op (c10d's OpType has one COALESCED
// for several, and upper-case names users never type). `redOp` (-1: none)
// tells the coalesced reduce-scatter from the coalesced all-gather.
inline const char* opName(c10d::OpType type, int64_t redOp) {
  switch (type) {
    case c10d::OpType::BROADCAST:
      return "broadcast";
    case c10d::OpType::ALLREDUCE:
      return "all_reduce";
    case c10d::OpType::ALLREDUCE_COALESCED:
      return "all_reduce_coalesced";
    case c10d::OpType::REDUCE:
      return "reduce";
    case c10d::OpType::ALLGATHER:
      return "all_gather";
    case c10d::OpType::_ALLGATHER_BASE:
      return "all_gather_into_tensor";
    case c10d::OpType::ALLGATHER_COALESCED:
      return "all_gather_coalesced";
    case c10d::OpType::GATHER:
      return "gather";
    case c10d::OpType::SCATTER:
      return "scatter";
    case c10d::OpType::REDUCE_SCATTER:
      return "reduce_scatter";
    case c10d::OpType::_REDUCE_SCATTER_BASE:
      return "reduce_scatter_tensor";
    case c10d::OpType::ALLTOALL_BASE:
      return "all_to_all_single";
    case c10d::OpType::ALLTOALL:
      return "all_to_all";
    case c10d::OpType::BARRIER:
      return "barrier";
    case c10d::OpType::COALESCED:
      return redOp >= 0 ? "reduce_scatter_tensor_coalesced" : "all_gather_into_tensor_coalesced";
    default:
      return "an unknown op";
  }
}

// The ops whose root rank is part of what every rank must agree on.
inline bool isRooted(c10d::OpType type) {
  return type == c10d::OpType::BROADCAST || type == c10d::OpType::REDUCE ||
         type == c10d::OpType::GATHER || type == c10d::OpType::SCATTER;
}

}  // namespace xcomm
