#include "collectives/reduce/ReduceKernels.hpp"

#include <c10/util/Exception.h>

namespace xcomm {

using RedOp = c10d::ReduceOp::RedOpType;

void reduceInto(at::Tensor& acc, const at::Tensor& x, RedOp op) {
  const bool isBool = acc.scalar_type() == at::kBool;
  switch (op) {
    case RedOp::SUM:
    case RedOp::AVG:
    case RedOp::PREMUL_SUM:
      // Gloo's SUM over bool is a logical or; keep the same meaning.
      isBool ? acc.logical_or_(x) : acc.add_(x);
      return;
    case RedOp::PRODUCT:
      isBool ? acc.logical_and_(x) : acc.mul_(x);
      return;
    case RedOp::MIN:
      at::minimum_out(acc, acc, x);
      return;
    case RedOp::MAX:
      at::maximum_out(acc, acc, x);
      return;
    case RedOp::BAND:
      acc.bitwise_and_(x);
      return;
    case RedOp::BOR:
      acc.bitwise_or_(x);
      return;
    case RedOp::BXOR:
      acc.bitwise_xor_(x);
      return;
    default:
      TORCH_CHECK(false, "xcomm: reduce op ", reduceOpName(op), " is not supported");
  }
}

void finishReduction(at::Tensor& acc, RedOp op, int worldSize) {
  if (op == RedOp::AVG) {
    acc.div_(worldSize);
  }
}

double premulFactor(const c10d::ReduceOp& op) {
  auto supplement =
      c10::dynamic_intrusive_pointer_cast<compat::PreMulSumSupplement>(op.supplement_);
  TORCH_CHECK(supplement,
              "xcomm: PREMUL_SUM needs a factor; build the op with "
              "torch.distributed._make_nccl_premul_sum(factor)");
  if (supplement->tensor_factor.defined()) {
    return supplement->tensor_factor.item<double>();
  }
  return supplement->double_factor;
}

bool reduceOpSupports(RedOp op, at::ScalarType dtype) {
  const bool integral = at::isIntegralType(dtype, /*includeBool=*/true);
  switch (op) {
    case RedOp::BAND:
    case RedOp::BOR:
    case RedOp::BXOR:
      return integral;
    case RedOp::AVG:
    case RedOp::PREMUL_SUM:
      return at::isFloatingType(dtype) || at::isComplexType(dtype);
    case RedOp::MIN:
    case RedOp::MAX:
      return !at::isComplexType(dtype);
    case RedOp::SUM:
    case RedOp::PRODUCT:
      return true;
    default:
      return false;
  }
}

const char* reduceOpName(RedOp op) {
  switch (op) {
    case RedOp::SUM:
      return "SUM";
    case RedOp::AVG:
      return "AVG";
    case RedOp::PRODUCT:
      return "PRODUCT";
    case RedOp::MIN:
      return "MIN";
    case RedOp::MAX:
      return "MAX";
    case RedOp::BAND:
      return "BAND";
    case RedOp::BOR:
      return "BOR";
    case RedOp::BXOR:
      return "BXOR";
    case RedOp::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return "UNUSED";
  }
}

}  // namespace xcomm
