#pragma once
// Collectives over ShmTransport (every rank of the group on one host).
//
// Tensors are contiguous CPU tensors (XcommBackend stages them) and every
// rank passes the same sizes and dtype (checked: a mismatch raises on every
// rank). Every rank computes bitwise the same result: reductions fold the
// ranks' contributions in rank order, each element on one rank or on all
// ranks with the same code.
#include <chrono>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "transport/ShmTransport.hpp"

namespace xcomm::shm {

using Deadline = std::chrono::steady_clock::time_point;
using RedOp = c10d::ReduceOp::RedOpType;

// Messages up to this size take the one-barrier path of allreduce (every
// rank reduces every slot); larger ones the reduce-scatter + allgather path.
constexpr size_t kDefaultSmallAllreduceBytes = 256 << 10;

// Dtypes and ops the shared-memory path implements (PREMUL_SUM is lowered to
// SUM by XcommBackend before it gets here).
bool supports(at::ScalarType dtype);
bool supports(at::ScalarType dtype, RedOp op);

void allreduce(ShmTransport& transport, at::Tensor& tensor, RedOp op, Deadline deadline,
               size_t smallBytes = kDefaultSmallAllreduceBytes);
void broadcast(ShmTransport& transport, at::Tensor& tensor, int root, Deadline deadline);
// outputs[r] receives rank r's input; every output has the input's numel.
void allgather(ShmTransport& transport, const at::Tensor& input, std::vector<at::Tensor>& outputs,
               Deadline deadline);
// output = reduction over ranks of their inputs[this rank].
void reduceScatter(ShmTransport& transport, at::Tensor& output,
                   const std::vector<at::Tensor>& inputs, RedOp op, Deadline deadline);
void barrier(ShmTransport& transport, Deadline deadline);

namespace detail {

enum class OpCode : uint64_t { kAllreduce = 1, kBroadcast, kAllgather, kReduceScatter, kBarrier };

// What every rank must agree on, packed for ShmTransport::publishDescriptor.
inline uint64_t describe(OpCode code, at::ScalarType dtype, int redOp, int root) {
  return (static_cast<uint64_t>(code) << 56) | (static_cast<uint64_t>(dtype) << 48) |
         (static_cast<uint64_t>(redOp & 0xff) << 40) | static_cast<uint32_t>(root);
}

inline uint8_t* bytes(const at::Tensor& t) {
  return static_cast<uint8_t*>(t.data_ptr());
}

}  // namespace detail
}  // namespace xcomm::shm
