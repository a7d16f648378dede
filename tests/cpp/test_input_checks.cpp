// Input checks: each bad input raises an error that names the problem.
#include "backend/InputChecks.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

namespace checks = xcomm::checks;
using Catch::Contains;

TEST_CASE("empty tensor lists are rejected", "[checks]") {
  CHECK_THROWS_WITH(checks::tensorList("all_reduce", {}), Contains("empty"));
}

TEST_CASE("mixed dtypes in one list are rejected with both dtype names", "[checks]") {
  std::vector<at::Tensor> ts{at::zeros({2}), at::zeros({2}, at::kDouble)};
  CHECK_THROWS_WITH(checks::tensorList("all_reduce", ts),
                    Contains("torch.float64") && Contains("torch.float32"));
}

TEST_CASE("unsupported devices are named", "[checks]") {
  std::vector<at::Tensor> ts{at::empty({2}, at::TensorOptions().device(at::kMeta))};
  CHECK_THROWS_WITH(checks::tensorList("broadcast", ts), Contains("meta"));
}

TEST_CASE("ranks outside the group are rejected", "[checks]") {
  CHECK_NOTHROW(checks::rank("broadcast", 1, 2, "root"));
  CHECK_THROWS_WITH(checks::rank("broadcast", 2, 2, "root"),
                    Contains("root rank 2") && Contains("size 2"));
  CHECK_THROWS_WITH(checks::rank("send", -1, 4, "destination"), Contains("destination rank -1"));
}

TEST_CASE("bitwise ops on floating point name the op and the dtype", "[checks]") {
  c10d::ReduceOp band(c10d::ReduceOp::BAND);
  CHECK_THROWS_WITH(checks::reduceOp("all_reduce", band, at::kFloat),
                    Contains("BAND") && Contains("torch.float32"));
  CHECK_NOTHROW(checks::reduceOp("all_reduce", band, at::kInt));
  c10d::ReduceOp avg(c10d::ReduceOp::AVG);
  CHECK_THROWS_WITH(checks::reduceOp("all_reduce", avg, at::kLong), Contains("AVG"));
}

TEST_CASE("all_gather_into_tensor and reduce_scatter_tensor sizes", "[checks]") {
  CHECK_NOTHROW(checks::allgatherBase(at::zeros({6}), at::zeros({3}), 2));
  CHECK_THROWS_WITH(checks::allgatherBase(at::zeros({5}), at::zeros({3}), 2),
                    Contains("3 x 2 = 6"));
  CHECK_NOTHROW(checks::reduceScatterBase(at::zeros({2}), at::zeros({4}), 2));
  CHECK_THROWS_WITH(checks::reduceScatterBase(at::zeros({2}), at::zeros({5}), 2),
                    Contains("2 x 2 = 4"));
}

TEST_CASE("split sizes must cover dim 0 exactly", "[checks]") {
  const auto t = at::zeros({5, 2});
  CHECK_NOTHROW(checks::splits("all_to_all_single", {2, 3}, t, 2, "input"));
  CHECK_THROWS_WITH(checks::splits("all_to_all_single", {2, 2}, t, 2, "input"),
                    Contains("sum to 4") && Contains("5 rows"));
  CHECK_THROWS_WITH(checks::splits("all_to_all_single", {5}, t, 2, "input"), Contains("1 entries"));
  CHECK_THROWS_WITH(checks::splits("all_to_all_single", {}, t, 2, "input"), Contains("evenly"));
}

TEST_CASE("lists need one tensor per rank of the input's size", "[checks]") {
  std::vector<at::Tensor> two{at::zeros({3}), at::zeros({3})};
  CHECK_NOTHROW(checks::listForEveryRank("all_gather", two, 2, 3, "output"));
  CHECK_THROWS_WITH(checks::listForEveryRank("all_gather", two, 3, 3, "output"),
                    Contains("3 ranks"));
  CHECK_THROWS_WITH(checks::listForEveryRank("all_gather", two, 2, 4, "output"),
                    Contains("4 per rank"));
}
