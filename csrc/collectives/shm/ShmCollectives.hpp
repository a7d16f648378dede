#pragma once
// Collectives over ShmTransport (every rank of the group on one host).
//
// Tensors are contiguous CPU tensors (XcommBackend stages them) and every
// rank passes the same sizes and dtype (checked: a mismatch raises on every
// rank). Every rank computes bitwise the same result: reductions fold the
// ranks' contributions in rank order, each element on one rank or on all
// ranks with the same code.
#include <chrono>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "common/AgreedCall.hpp"
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

// The reductions take the reduce op itself: it may record the caller's dtype
// (common/AgreedCall.hpp), which the ranks agree on.
void allreduce(ShmTransport& transport, at::Tensor& tensor, const c10d::ReduceOp& op,
               Deadline deadline, size_t smallBytes = kDefaultSmallAllreduceBytes);
void broadcast(ShmTransport& transport, at::Tensor& tensor, int root, Deadline deadline);
// What a broadcast's root hands its readers instead of the data when it
// could not produce it (a hierarchical allreduce's leader whose step between
// hosts failed): every rank, the root too, then raises this error (a
// ValueError when `invalidInput`, else a DistBackendError) at the
// broadcast's first barrier, so the ranks stay in step.
struct RootError {
  std::string message;
  bool invalidInput = false;
};
// `rootError` (root only; null: the root has the data) as above.
void broadcast(ShmTransport& transport, at::Tensor& tensor, int root, Deadline deadline,
               const RootError* rootError);
// outputs[r] receives rank r's input; every output has the input's numel.
void allgather(ShmTransport& transport, const at::Tensor& input, std::vector<at::Tensor>& outputs,
               Deadline deadline);
// output = reduction over ranks of their inputs[this rank].
void reduceScatter(ShmTransport& transport, at::Tensor& output,
                   const std::vector<at::Tensor>& inputs, const c10d::ReduceOp& op,
                   Deadline deadline);
// sends[d] goes to rank d, recvs[s] comes from rank s; each pair's sizes may
// differ from the other pairs' (uneven splits) but must agree between the two
// ranks of the pair, or every rank raises. Any dtype: the bytes are moved.
// `op` names the collective in errors.
void alltoall(ShmTransport& transport, const std::vector<at::Tensor>& sends,
              std::vector<at::Tensor>& recvs, Deadline deadline, const char* op);
// Whether the transport's slots hold alltoall's per-rank header (the same on
// every rank: the slot size is agreed).
bool alltoallFits(const ShmTransport& transport);
void barrier(ShmTransport& transport, Deadline deadline);
// For a collective that runs elsewhere (the fallback backend): a barrier at
// which every rank checks that all ranks are issuing `call`, so a rank whose
// op runs here and one whose op runs there fail at once instead of waiting
// for each other until the timeout.
void agree(ShmTransport& transport, ShmTransport::Descriptor call, Deadline deadline,
           const char* op);

namespace detail {

enum class OpCode : uint64_t {
  kAllreduce = 1,
  kBroadcast,
  kAllgather,
  kReduceScatter,
  kBarrier,
  kFallback,  // run by the fallback backend; `fallbackOp` says which
  kAlltoall,
  kRootError,  // a broadcast's root failed: its slot holds the message
};

// What every rank must agree on, packed for ShmTransport::publishDescriptor:
// the op, dtype, reduce op, root, and for kFallback the c10d::OpType.
inline uint64_t describe(OpCode code, at::ScalarType dtype, int redOp, int root,
                         int fallbackOp = 0) {
  return (static_cast<uint64_t>(code) << 56) | (static_cast<uint64_t>(dtype) << 48) |
         (static_cast<uint64_t>(redOp & 0xff) << 40) |
         (static_cast<uint64_t>(fallbackOp & 0xff) << 32) | static_cast<uint32_t>(root);
}

// A reduction's descriptor (`t` its output): the caller's dtype and bytes,
// also where the op runs on MinMaxLowering's keys.
inline ShmTransport::Descriptor describeReduction(OpCode code, const at::Tensor& t,
                                                  const c10d::ReduceOp& op) {
  return {describe(code, agreedDtype(t.scalar_type(), op), static_cast<int>(op.op_), 0),
          agreedBytes(t, op)};
}

// After a barrier: raises a ValueError, with the same message on every rank,
// unless every rank published the same descriptor for it. The message names
// what rank 0 and the first rank that differs from it called.
void checkAgreement(const ShmTransport& transport, const char* op);

inline uint8_t* bytes(const at::Tensor& t) {
  return static_cast<uint8_t*>(t.data_ptr());
}

}  // namespace detail
}  // namespace xcomm::shm
