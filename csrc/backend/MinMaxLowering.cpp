#include "backend/MinMaxLowering.hpp"

#include <limits>

namespace xcomm {
namespace {

// The floating type a tensor travels as, and its keys' integer type.
at::ScalarType wideType(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

at::ScalarType keyType(at::ScalarType t) {
  return wideType(t) == at::kDouble ? at::kLong : at::kInt;
}

// Flips the magnitude bits of negative values: an involution that maps the
// IEEE bit patterns' order onto the signed integers' order.
at::Tensor flipNegatives(const at::Tensor& bits) {
  const int64_t shift = bits.scalar_type() == at::kLong ? 63 : 31;
  const int64_t magnitude = bits.scalar_type() == at::kLong ? std::numeric_limits<int64_t>::max()
                                                            : std::numeric_limits<int32_t>::max();
  return at::bitwise_xor(bits, at::bitwise_and(at::bitwise_right_shift(bits, shift), magnitude));
}

// The key every NaN becomes: the one that wins the op. No number's key is
// it (the extreme keys belong to NaN bit patterns only).
int64_t nanKey(at::ScalarType keys, c10d::ReduceOp::RedOpType op) {
  if (keys == at::kLong) {
    return op == c10d::ReduceOp::MIN ? std::numeric_limits<int64_t>::min()
                                     : std::numeric_limits<int64_t>::max();
  }
  return op == c10d::ReduceOp::MIN ? std::numeric_limits<int32_t>::min()
                                   : std::numeric_limits<int32_t>::max();
}

}  // namespace

MinMaxLowering::MinMaxLowering(const c10d::ReduceOp& op, const at::Tensor& sample)
    : lowers_((op.op_ == c10d::ReduceOp::MIN || op.op_ == c10d::ReduceOp::MAX) &&
              sample.defined() && sample.device().is_cpu() && sample.layout() == at::kStrided &&
              at::isFloatingType(sample.scalar_type())),
      op_(op.op_),
      dtype_(sample.defined() ? sample.scalar_type() : at::ScalarType::Undefined) {}

at::Tensor MinMaxLowering::encode(const at::Tensor& t, c10d::ReduceOp::RedOpType op) {
  const at::Tensor wide = t.to(wideType(t.scalar_type())).contiguous();
  at::Tensor keys = flipNegatives(wide.view(keyType(t.scalar_type())));
  keys.masked_fill_(at::isnan(wide), nanKey(keys.scalar_type(), op));
  return keys;
}

void MinMaxLowering::decodeInto(const at::Tensor& keys, c10d::ReduceOp::RedOpType op,
                                const at::Tensor& out) {
  const at::Tensor nan = keys.eq(nanKey(keys.scalar_type(), op));
  at::Tensor values =
      flipNegatives(keys).view(keys.scalar_type() == at::kLong ? at::kDouble : at::kFloat);
  values.masked_fill_(nan, std::numeric_limits<double>::quiet_NaN());
  out.copy_(values.view(out.sizes()));
}

std::vector<at::Tensor> MinMaxLowering::inOut(TensorStaging& staging,
                                              const std::vector<at::Tensor>& ts) const {
  std::vector<at::Tensor> keys;
  keys.reserve(ts.size());
  for (const auto& t : ts) {
    keys.push_back(encode(t, op_));
    staging.afterwards([k = keys.back(), t, op = op_] { decodeInto(k, op, t); });
  }
  return keys;
}

at::Tensor MinMaxLowering::in(const at::Tensor& t) const {
  return encode(t, op_);
}

std::vector<at::Tensor> MinMaxLowering::in(const std::vector<at::Tensor>& ts) const {
  std::vector<at::Tensor> keys;
  keys.reserve(ts.size());
  for (const auto& t : ts) keys.push_back(in(t));
  return keys;
}

at::Tensor MinMaxLowering::out(TensorStaging& staging, const at::Tensor& t) const {
  at::Tensor keys = at::empty(
      t.sizes(),
      t.options().dtype(keyType(t.scalar_type())).memory_format(at::MemoryFormat::Contiguous));
  staging.afterwards([keys, t, op = op_] { decodeInto(keys, op, t); });
  return keys;
}

std::vector<at::Tensor> MinMaxLowering::out(TensorStaging& staging,
                                            const std::vector<at::Tensor>& ts) const {
  std::vector<at::Tensor> keys;
  keys.reserve(ts.size());
  for (const auto& t : ts) keys.push_back(out(staging, t));
  return keys;
}

}  // namespace xcomm
