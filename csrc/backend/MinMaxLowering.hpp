#pragma once
// MIN and MAX of floating CPU tensors, one answer on every route.
//
// Routes disagreed on NaN: xcomm's own kernels propagate it (as torch's ops
// and NCCL do), while Gloo's std::min/std::max keep the first rank's operand,
// so a group's answer depended on the op's size and route; signed zeros
// depended on rank order everywhere. Lowered here, the op runs on integer
// keys whose order is the floats' total order (-0 < +0), with every NaN
// mapped to the key that wins (the smallest for MIN, the largest for MAX):
// integer MIN/MAX is exact on every route, and decoding gives NaN wherever
// any rank had one, and -0 against +0 by the op (MIN -0, MAX +0), as IEEE
// 754-2019's minimum/maximum. Half and bfloat16 travel as float32 keys
// (exactly representable; Gloo has no 16-bit integer reductions), float32
// as int32, float64 as int64. CUDA tensors are left to NCCL, which
// propagates NaN itself.
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "backend/TensorStaging.hpp"
#include "common/AgreedCall.hpp"

namespace xcomm {

class MinMaxLowering {
 public:
  MinMaxLowering(const c10d::ReduceOp& op, const at::Tensor& sample);

  // Whether the op runs on keys (MIN or MAX of a floating CPU tensor).
  bool lowers() const { return lowers_; }

  // The options for the inner backend: lowered, `opts` whose reduce op
  // records the caller's dtype (common/AgreedCall.hpp), so the ranks'
  // agreement compares and names the caller's call, not its keys'.
  template <typename Options>
  Options options(const Options& opts) const {
    Options inner = opts;
    if (lowers_) inner.reduceOp = standingFor(opts.reduceOp, dtype_);
    return inner;
  }

  // Tensors the op reads and overwrites: their keys, decoded back into
  // them (whatever their strides) by the staging's copy-back.
  std::vector<at::Tensor> inOut(TensorStaging& staging, const std::vector<at::Tensor>& ts) const;
  // A tensor the op only reads: its keys.
  at::Tensor in(const at::Tensor& t) const;
  std::vector<at::Tensor> in(const std::vector<at::Tensor>& ts) const;
  // A tensor the op only writes: a key buffer decoded into it afterwards.
  at::Tensor out(TensorStaging& staging, const at::Tensor& t) const;
  std::vector<at::Tensor> out(TensorStaging& staging, const std::vector<at::Tensor>& ts) const;

  // The keys of `t` for `op` (MIN or MAX), and back; exposed for tests.
  static at::Tensor encode(const at::Tensor& t, c10d::ReduceOp::RedOpType op);
  static void decodeInto(const at::Tensor& keys, c10d::ReduceOp::RedOpType op,
                         const at::Tensor& out);

 private:
  bool lowers_;
  c10d::ReduceOp::RedOpType op_;
  at::ScalarType dtype_;  // the caller's
};

}  // namespace xcomm
