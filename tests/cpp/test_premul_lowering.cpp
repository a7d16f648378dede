// PremulLowering: PREMUL_SUM as SUM over scaled inputs, for transports that
// lack it; a pass-through for every other op and for transports that have it.
#include "backend/PremulLowering.hpp"
#include "common/TorchCompat.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

using xcomm::PremulLowering;
using xcomm::TensorStaging;
using RedOp = c10d::ReduceOp::RedOpType;

namespace {

// A 3x2 tensor that is not contiguous (the transpose of a 2x3 one).
at::Tensor transposed() {
  return at::arange(6, at::kFloat).reshape({2, 3}).t();
}

}  // namespace

TEST_CASE("PremulLowering passes every op but a lowered PREMUL_SUM through", "[premul]") {
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp(RedOp::MAX);
  const PremulLowering other(opts.reduceOp, /*backendHasPremul=*/false);
  CHECK_FALSE(other.lowers());
  CHECK(other.options(opts).reduceOp.op_ == RedOp::MAX);

  // A transport with PREMUL_SUM (NCCL) gets the op and the tensors as they are.
  opts.reduceOp = xcomm::compat::makePreMulSum(2.0);
  const PremulLowering native(opts.reduceOp, /*backendHasPremul=*/true);
  CHECK_FALSE(native.lowers());
  CHECK(native.options(opts).reduceOp.op_ == RedOp::PREMUL_SUM);
  TensorStaging staging;
  auto x = at::arange(4, at::kFloat);
  CHECK(native.in(staging, x).is_same(x));
  CHECK(native.inOut(staging, {x})[0].is_same(x));
  CHECK(at::equal(x, at::arange(4, at::kFloat)));
  CHECK(staging.empty());

  // Nor does it read the factor: a PREMUL_SUM without one is the transport's to reject.
  c10d::ReduceOp bare;
  bare.op_ = RedOp::PREMUL_SUM;
  CHECK_NOTHROW(PremulLowering(bare, /*backendHasPremul=*/true));
  CHECK_THROWS_WITH(PremulLowering(bare, /*backendHasPremul=*/false),
                    Catch::Contains("PREMUL_SUM needs a factor"));
}

TEST_CASE("PremulLowering scales read-only inputs into contiguous copies", "[premul]") {
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = xcomm::compat::makePreMulSum(at::full({1}, 0.5));
  opts.timeout = std::chrono::milliseconds(1234);
  const PremulLowering premul(opts.reduceOp, /*backendHasPremul=*/false);
  REQUIRE(premul.lowers());
  const auto inner = premul.options(opts);
  CHECK(inner.reduceOp.op_ == RedOp::SUM);
  CHECK(inner.timeout == opts.timeout);  // the rest of the options is kept

  TensorStaging staging;
  const auto x = transposed();
  const auto scaled = premul.in(staging, x);
  CHECK(scaled.is_contiguous());
  CHECK(at::equal(scaled, transposed() * 0.5));
  CHECK(at::equal(x, transposed()));  // the caller's tensor keeps its values
  const auto list = premul.in(staging, std::vector<at::Tensor>{x, at::ones({2})});
  REQUIRE(list.size() == 2);
  CHECK(at::equal(list[0], transposed() * 0.5));
  CHECK(at::equal(list[1], at::full({2}, 0.5)));
  CHECK(staging.empty());  // nothing to copy back
}

TEST_CASE("PremulLowering scales overwritten tensors in place", "[premul]") {
  const auto op = xcomm::compat::makePreMulSum(3.0);
  const PremulLowering premul(op, /*backendHasPremul=*/false);
  TensorStaging staging;
  auto flat = at::arange(4, at::kFloat);
  auto strided = transposed();
  const auto staged = premul.inOut(staging, {flat, strided});
  REQUIRE(staged.size() == 2);
  // A contiguous tensor is handed over itself, scaled: the op overwrites it anyway.
  CHECK(staged[0].is_same(flat));
  CHECK(at::equal(flat, at::arange(4, at::kFloat) * 3));
  // A strided one is staged; the scaled stand-in is what the transport gets,
  // and its result goes back to the caller's tensor.
  CHECK(staged[1].is_contiguous());
  CHECK(at::equal(staged[1], transposed() * 3));
  CHECK(at::equal(strided, transposed()));
  staged[1].fill_(7);
  staging.copyBack()();
  CHECK(at::equal(strided, at::full({3, 2}, 7.0)));
}
