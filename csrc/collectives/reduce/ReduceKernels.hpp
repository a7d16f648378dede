#pragma once
// Elementwise reductions used by xcomm's own collective algorithms.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "common/TorchCompat.hpp"

namespace xcomm {

// Folds `x` into `acc` (acc = acc (op) x). Both tensors are contiguous and of
// the same dtype and size. AVG and PREMUL_SUM accumulate as SUM; callers apply
// the division or the factor (see finishReduction / applyPremul).
void reduceInto(at::Tensor& acc, const at::Tensor& x, c10d::ReduceOp::RedOpType op);

// Applies the final step of a reduction over `worldSize` contributions
// (AVG divides by worldSize; every other op leaves `acc` as it is).
void finishReduction(at::Tensor& acc, c10d::ReduceOp::RedOpType op, int worldSize);

// The PREMUL_SUM factor of `op` as a double (scalar or one-element tensor).
double premulFactor(const c10d::ReduceOp& op);

// True when `op` is defined for `dtype` (bitwise ops need integers or bool;
// AVG and PREMUL_SUM need floating point).
bool reduceOpSupports(c10d::ReduceOp::RedOpType op, at::ScalarType dtype);

// A short name such as "BAND" for error messages.
const char* reduceOpName(c10d::ReduceOp::RedOpType op);

}  // namespace xcomm
