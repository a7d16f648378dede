// MinMaxLowering: MIN/MAX of floating CPU tensors as MIN/MAX of integer keys,
// and the caller's dtype its options record for the ranks' agreement
// (common/AgreedCall.hpp).
#include <cmath>
#include <limits>
#include <vector>

#include "backend/MinMaxLowering.hpp"
#include "backend/TensorLists.hpp"
#include "common/TorchCompat.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

using xcomm::MinMaxLowering;
using xcomm::TensorStaging;
using RedOp = c10d::ReduceOp::RedOpType;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

// Ascending in IEEE 754-2019's total order of numbers (-0 before +0).
std::vector<double> ascending(at::ScalarType dtype) {
  const double tiny = dtype == at::kDouble ? 1e-310 : dtype == at::kFloat ? 1e-40 : 1e-7;
  return {-kInf, -6e4, -1.0, -tiny, -0.0, 0.0, tiny, 1.0, 6e4, kInf};
}

bool sameBits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

}  // namespace

TEST_CASE("MinMaxLowering's keys order floats totally, NaN winning the op", "[minmax]") {
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    INFO("dtype " << c10::toString(dtype));
    const auto values = at::tensor(ascending(dtype), at::kDouble).to(dtype);
    for (auto op : {RedOp::MIN, RedOp::MAX}) {
      const auto keys = MinMaxLowering::encode(values, op);
      CHECK(keys.scalar_type() == (dtype == at::kDouble ? at::kLong : at::kInt));
      // Strictly ascending: integer MIN/MAX picks what the floats' order picks.
      CHECK(at::all(keys.slice(0, 1).gt(keys.slice(0, 0, -1))).item<bool>());
      // Back to the same bits (16-bit floats travel as float32, exactly).
      auto back = at::empty_like(values);
      MinMaxLowering::decodeInto(keys, op, back);
      CHECK(sameBits(back, values));

      // Every NaN (either sign) is the key that wins: below every number for
      // MIN, above for MAX, and decodes to NaN.
      const auto nans = at::tensor({kNan, -kNan}, at::kDouble).to(dtype);
      const auto nanKeys = MinMaxLowering::encode(nans, op);
      CHECK(at::equal(nanKeys[0], nanKeys[1]));
      const auto extreme = op == RedOp::MIN ? keys.min() : keys.max();
      CHECK((op == RedOp::MIN ? nanKeys[0].lt(extreme) : nanKeys[0].gt(extreme)).item<bool>());
      auto nanBack = at::empty_like(nans);
      MinMaxLowering::decodeInto(nanKeys, op, nanBack);
      CHECK(at::all(at::isnan(nanBack)).item<bool>());
    }
  }
}

TEST_CASE("MinMaxLowering reduces like IEEE 754-2019's minimum and maximum", "[minmax]") {
  const auto a = at::tensor({kNan, 1.0, -0.0, 0.0, kInf, 2.0}, at::kFloat);
  const auto b = at::tensor({1.0, kNan, 0.0, -0.0, -kInf, 3.0}, at::kFloat);
  for (auto op : {RedOp::MIN, RedOp::MAX}) {
    const auto ka = MinMaxLowering::encode(a, op);
    const auto kb = MinMaxLowering::encode(b, op);
    auto got = at::empty_like(a);
    MinMaxLowering::decodeInto(op == RedOp::MIN ? at::minimum(ka, kb) : at::maximum(ka, kb), op,
                               got);
    const auto want = op == RedOp::MIN
                          ? at::tensor({kNan, kNan, -0.0, -0.0, -kInf, 2.0}, at::kFloat)
                          : at::tensor({kNan, kNan, 0.0, 0.0, kInf, 3.0}, at::kFloat);
    CHECK(at::equal(at::isnan(got), at::isnan(want)));
    const auto numbers = at::logical_not(at::isnan(want));
    CHECK(sameBits(got.masked_select(numbers), want.masked_select(numbers)));
  }
}

TEST_CASE("MinMaxLowering lowers MIN/MAX of floating CPU tensors only", "[minmax]") {
  const auto x = at::ones({4}, at::kFloat);
  CHECK(MinMaxLowering(c10d::ReduceOp(RedOp::MIN), x).lowers());
  CHECK(MinMaxLowering(c10d::ReduceOp(RedOp::MAX), x.to(at::kBFloat16)).lowers());
  CHECK_FALSE(MinMaxLowering(c10d::ReduceOp(RedOp::SUM), x).lowers());
  CHECK_FALSE(MinMaxLowering(c10d::ReduceOp(RedOp::MIN), x.to(at::kInt)).lowers());
  CHECK_FALSE(MinMaxLowering(c10d::ReduceOp(RedOp::MIN), x.to_sparse()).lowers());
}

TEST_CASE("A lowered op's options record the caller's dtype and bytes for the agreement",
          "[minmax][agreement]") {
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(RedOp::MIN);
  opts.timeout = std::chrono::milliseconds(1234);
  const auto caller = at::ones({6}, at::kBFloat16);
  const MinMaxLowering minmax(opts.reduceOp, caller);
  const auto inner = minmax.options(opts);
  CHECK(inner.reduceOp.op_ == RedOp::MIN);
  CHECK(inner.timeout == opts.timeout);
  TensorStaging staging;
  const auto keys = minmax.inOut(staging, {caller});
  REQUIRE(keys[0].scalar_type() == at::kInt);
  // Described as the caller's call: bfloat16, 12 bytes, not int32 and 24.
  CHECK(xcomm::dtypeOf(keys, inner.reduceOp) == at::kBFloat16);
  CHECK(xcomm::denseBytes(keys, inner.reduceOp) == 12);
  // A real int32 MIN of the keys' size is another call.
  const std::vector<at::Tensor> ints{at::ones({6}, at::kInt)};
  CHECK(xcomm::dtypeOf(ints, opts.reduceOp) == at::kInt);
  CHECK(xcomm::denseBytes(ints, opts.reduceOp) == 24);

  // Not lowered: the options pass unchanged, and the tensors describe the call.
  const MinMaxLowering sum(c10d::ReduceOp(RedOp::SUM), caller);
  c10d::AllreduceOptions sumOpts;
  CHECK_FALSE(sum.options(sumOpts).reduceOp.supplement_);
  CHECK(xcomm::dtypeOf({caller}, sumOpts.reduceOp) == at::kBFloat16);
  // PREMUL_SUM's supplement is no caller's dtype.
  CHECK(xcomm::agreedDtype(at::kFloat, xcomm::compat::makePreMulSum(2.0)) == at::kFloat);
}

TEST_CASE("MinMaxLowering decodes results through the caller's strided views", "[minmax]") {
  auto base = at::arange(12, at::kFloat).reshape({3, 4});
  auto column = base.select(1, 1);  // strided: 1, 5, 9
  const MinMaxLowering minmax(c10d::ReduceOp(RedOp::MAX), column);
  TensorStaging staging;
  auto keys = minmax.inOut(staging, {column});
  REQUIRE(keys[0].is_contiguous());
  // What a peer's MAX would leave in the keys: NaN in the middle.
  keys[0].copy_(at::maximum(
      keys[0], MinMaxLowering::encode(at::tensor({0.0, kNan, 10.0}, at::kFloat), RedOp::MAX)));
  staging.copyBack()();
  CHECK(base[0][1].item<float>() == 1.0F);
  CHECK(std::isnan(base[1][1].item<float>()));
  CHECK(base[2][1].item<float>() == 10.0F);
  CHECK(at::equal(base.select(1, 0), at::tensor({0.0, 4.0, 8.0}, at::kFloat)));  // untouched
}
