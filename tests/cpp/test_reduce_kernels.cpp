// Reduction kernels against the arithmetic they stand for.
#include "collectives/reduce/ReduceKernels.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

using xcomm::reduceInto;
using RedOp = c10d::ReduceOp::RedOpType;

namespace {

at::Tensor ints(std::initializer_list<int64_t> v, at::ScalarType t = at::kInt) {
  return at::tensor(std::vector<int64_t>(v)).to(t);
}

}  // namespace

TEST_CASE("reduceInto matches the arithmetic of every op on integers", "[reduce]") {
  const auto a = ints({6, 3, -2, 0});
  const auto b = ints({5, 1, 4, 7});
  struct Case {
    RedOp op;
    at::Tensor expected;
  };
  const std::vector<Case> cases = {
      {RedOp::SUM, ints({11, 4, 2, 7})},
      {RedOp::PRODUCT, ints({30, 3, -8, 0})},
      {RedOp::MIN, ints({5, 1, -2, 0})},
      {RedOp::MAX, ints({6, 3, 4, 7})},
      {RedOp::BAND, ints({6 & 5, 3 & 1, -2 & 4, 0})},
      {RedOp::BOR, ints({6 | 5, 3 | 1, -2 | 4, 7})},
      {RedOp::BXOR, ints({6 ^ 5, 3 ^ 1, -2 ^ 4, 7})},
  };
  for (const auto& c : cases) {
    INFO("op " << xcomm::reduceOpName(c.op));
    auto acc = a.clone();
    reduceInto(acc, b, c.op);
    CHECK(at::equal(acc, c.expected));
  }
}

TEST_CASE("bool SUM is logical or and PRODUCT logical and, as in Gloo", "[reduce]") {
  auto a = at::tensor(std::vector<int64_t>{1, 0, 0}).to(at::kBool);
  auto b = at::tensor(std::vector<int64_t>{1, 1, 0}).to(at::kBool);
  auto sum = a.clone();
  reduceInto(sum, b, RedOp::SUM);
  CHECK(at::equal(sum, at::tensor(std::vector<int64_t>{1, 1, 0}).to(at::kBool)));
  auto prod = a.clone();
  reduceInto(prod, b, RedOp::PRODUCT);
  CHECK(at::equal(prod, at::tensor(std::vector<int64_t>{1, 0, 0}).to(at::kBool)));
}

TEST_CASE("AVG accumulates as SUM and finishReduction divides", "[reduce]") {
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    auto acc = at::full({4}, 1.0, at::TensorOptions().dtype(dtype));
    reduceInto(acc, at::full({4}, 2.0, acc.options()), RedOp::AVG);
    reduceInto(acc, at::full({4}, 3.0, acc.options()), RedOp::AVG);
    xcomm::finishReduction(acc, RedOp::AVG, 3);
    CHECK(at::allclose(acc.to(at::kFloat), at::full({4}, 2.0)));
  }
}

TEST_CASE("MIN and MAX propagate NaN like torch.minimum/maximum", "[reduce]") {
  auto acc = at::tensor(std::vector<float>{1.0f, std::nanf("")});
  reduceInto(acc, at::tensor(std::vector<float>{std::nanf(""), 0.0f}), RedOp::MIN);
  CHECK(std::isnan(acc[0].item<float>()));
  CHECK(std::isnan(acc[1].item<float>()));
}

TEST_CASE("reduceOpSupports follows the dtype rules", "[reduce]") {
  CHECK_FALSE(xcomm::reduceOpSupports(RedOp::BAND, at::kFloat));
  CHECK(xcomm::reduceOpSupports(RedOp::BAND, at::kBool));
  CHECK(xcomm::reduceOpSupports(RedOp::BXOR, at::kByte));
  CHECK_FALSE(xcomm::reduceOpSupports(RedOp::AVG, at::kLong));
  CHECK(xcomm::reduceOpSupports(RedOp::AVG, at::kBFloat16));
  CHECK(xcomm::reduceOpSupports(RedOp::PREMUL_SUM, at::kHalf));
  CHECK(xcomm::reduceOpSupports(RedOp::SUM, at::kChar));
}

TEST_CASE("premulFactor reads scalar and tensor factors", "[reduce]") {
  CHECK(xcomm::premulFactor(xcomm::compat::makePreMulSum(2.5)) == Approx(2.5));
  CHECK(xcomm::premulFactor(xcomm::compat::makePreMulSum(at::full({1}, 0.25))) == Approx(0.25));
  c10d::ReduceOp bare;  // PREMUL_SUM without its factor
  bare.op_ = RedOp::PREMUL_SUM;
  CHECK_THROWS_WITH(xcomm::premulFactor(bare), Catch::Contains("factor"));
}
