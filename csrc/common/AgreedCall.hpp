#pragma once
// What the ranks agree on about a reduction's tensors: the caller's dtype and
// bytes, also where the op travels as other tensors.
//
// MinMaxLowering (backend/) runs MIN/MAX of floats as MIN/MAX of integer
// keys. The agreement between ranks (CheckedRoute's descriptor rows,
// shared memory's descriptors, fusion's groups) must still compare, and name
// in its errors, the caller's call: described by its keys, a float32 MIN on
// one rank and an int32 MIN of the same size on another would agree. So the
// lowering records the caller's dtype in the reduce op it hands on, as a
// c10d supplement (the slot torch gives a reduce op for data of its own;
// PREMUL_SUM's factor travels there), which reaches every inner backend with
// the options, and every descriptor reads the dtype and bytes here.
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace xcomm {
namespace detail {

struct CallerDtype final : c10d::_SupplementBase {
  explicit CallerDtype(at::ScalarType d) : dtype(d) {}
  const at::ScalarType dtype;
};

}  // namespace detail

// `op`, recording that the tensors it reduces stand for the caller's of `dtype`.
inline c10d::ReduceOp standingFor(c10d::ReduceOp op, at::ScalarType dtype) {
  op.supplement_ = c10::make_intrusive<detail::CallerDtype>(dtype);
  return op;
}

// The dtype the ranks agree on for tensors of `travelling` dtype reduced by
// `op`: the caller's where `op` records one (standingFor), else `travelling`.
inline at::ScalarType agreedDtype(at::ScalarType travelling, const c10d::ReduceOp& op) {
  const auto* caller = dynamic_cast<const detail::CallerDtype*>(op.supplement_.get());
  return caller ? caller->dtype : travelling;
}

// `t`'s bytes as the caller's tensor has them (its elements at the agreed
// dtype's size); 0 for a sparse tensor, whose size legitimately differs
// between ranks.
inline uint64_t agreedBytes(const at::Tensor& t, const c10d::ReduceOp& op) {
  if (t.layout() != at::kStrided) return 0;
  return static_cast<uint64_t>(t.numel()) * c10::elementSize(agreedDtype(t.scalar_type(), op));
}

}  // namespace xcomm
