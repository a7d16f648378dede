#pragma once
// PREMUL_SUM for inner backends that lack it (Gloo, xcomm's StoreRoute).
//
// PREMUL_SUM(factor) means SUM over `factor * x`: when the inner backend cannot
// apply the factor itself, the inputs are scaled here and the inner backend is
// asked for a SUM. When the op is no PREMUL_SUM, or the inner backend implements
// it (NCCL), every method is the plain staging and the options pass unchanged.
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "backend/TensorStaging.hpp"
#include "collectives/reduce/ReduceKernels.hpp"

namespace xcomm {

class PremulLowering {
 public:
  PremulLowering(const c10d::ReduceOp& op, bool backendHasPremul)
      : lowers_(op.op_ == c10d::ReduceOp::PREMUL_SUM && !backendHasPremul),
        factor_(lowers_ ? premulFactor(op) : 1.0) {}

  // Whether the inputs are scaled here and the inner backend runs a SUM.
  bool lowers() const { return lowers_; }

  // The options for the inner backend: `opts` with SUM for PREMUL_SUM when lowered.
  template <typename Options>
  Options options(const Options& opts) const {
    Options inner = opts;
    if (lowers_) inner.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
    return inner;
  }

  // Tensors the op reads and overwrites (all_reduce): staged, then scaled in
  // place, as the op overwrites them anyway.
  std::vector<at::Tensor> inOut(TensorStaging& staging, const std::vector<at::Tensor>& ts) const {
    auto staged = staging.inOut(ts);
    if (lowers_) {
      for (auto& t : staged) t.mul_(factor_);
    }
    return staged;
  }

  // Tensors the op only reads: contiguous scaled copies when lowered, so the
  // caller's tensors keep their values; else staged.
  at::Tensor in(TensorStaging& staging, const at::Tensor& t) const {
    return lowers_ ? t.contiguous().mul(factor_) : staging.in(t);
  }
  std::vector<at::Tensor> in(TensorStaging& staging, const std::vector<at::Tensor>& ts) const {
    std::vector<at::Tensor> staged;
    staged.reserve(ts.size());
    for (const auto& t : ts) staged.push_back(in(staging, t));
    return staged;
  }

 private:
  bool lowers_;
  double factor_;
};

}  // namespace xcomm
