// PowerSgdCodec: the math of one rank (world size 1, so the "allreduces" are
// the identity), checked against linear algebra.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "compress/PowerSgdCodec.hpp"

namespace {

using xcomm::PowerSgdCodec;
using xcomm::PowerSgdOptions;

struct Bucket {
  at::Tensor buffer;
  std::vector<at::Tensor> grads;
  std::vector<int64_t> keys;
};

// A bucket holding a rows x cols matrix and a bias of `bias` elements.
Bucket makeBucket(const at::Tensor& matrix, int64_t bias) {
  Bucket b;
  b.buffer = at::zeros({matrix.numel() + bias});
  b.grads = {b.buffer.narrow(0, 0, matrix.numel()).view(matrix.sizes()),
             b.buffer.narrow(0, matrix.numel(), bias)};
  b.grads[0].copy_(matrix);
  b.grads[1].copy_(at::arange(bias, at::kFloat));
  b.keys = {0, 1};
  return b;
}

// One step at world size 1: every allreduce returns its input.
void step(PowerSgdCodec& codec, Bucket& b, uint64_t seed = 1) {
  codec.setLayout(0, b.buffer, b.grads, b.keys);
  auto info =
      codec.prepare(0, b.buffer, codec.needsSeed(0) ? std::optional<uint64_t>(seed) : std::nullopt);
  at::Tensor q = codec.reduceP(0, info.wire.clone(), 1);
  codec.finish(0, q.clone(), 1);
}

at::Tensor lowRank(int64_t rows, int64_t cols, int64_t rank, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::matmul(at::randn({rows, rank}, gen), at::randn({rank, cols}, gen));
}

}  // namespace

TEST_CASE("PowerSGD reconstructs a matrix of rank <= r exactly", "[powersgd]") {
  PowerSgdOptions opts;
  opts.matrixApproximationRank = 2;
  PowerSgdCodec codec(opts);
  const at::Tensor m = lowRank(64, 48, 2, 3);
  Bucket b = makeBucket(m, 5);
  step(codec, b);
  // P spans the column space of M, so P (P^T M) = M.
  REQUIRE(at::allclose(b.grads[0], m, 1e-4, 1e-4));
  // The bias (1-D) is sent uncompressed and comes back unchanged.
  REQUIRE(at::equal(b.grads[1], at::arange(5, at::kFloat)));
  REQUIRE(codec.compressionRanks(0) == std::vector<int64_t>{2, 0});
}

TEST_CASE("PowerSGD error feedback: sent plus residual equals the input", "[powersgd]") {
  PowerSgdOptions opts;
  opts.matrixApproximationRank = 1;
  PowerSgdCodec codec(opts);
  const at::Tensor m = at::randn({40, 30}, at::make_generator<at::CPUGeneratorImpl>(7));
  Bucket b = makeBucket(m, 3);
  step(codec, b);
  const at::Tensor error = codec.paramState(0).error.view({40, 30});
  REQUIRE(at::allclose(b.grads[0] + error, m, 1e-5, 1e-5));
  // A rank-1 approximation of a random matrix loses something.
  REQUIRE(error.abs().max().item<float>() > 1e-3);
  // The next step adds the residual back: with a zero gradient it sends
  // (an approximation of) the residual.
  b.grads[0].zero_();
  step(codec, b);
  const at::Tensor error2 = codec.paramState(0).error.view({40, 30});
  REQUIRE(at::allclose(b.grads[0] + error2, error, 1e-5, 1e-5));
}

TEST_CASE("PowerSGD rank-1 result is the best rank-1 direction after warm-started steps",
          "[powersgd]") {
  // Power iteration with warm start converges to the top singular pair.
  PowerSgdOptions opts;
  opts.matrixApproximationRank = 1;
  opts.useErrorFeedback = false;
  PowerSgdCodec codec(opts);
  const at::Tensor m = lowRank(30, 20, 3, 11);
  at::Tensor u, s, v;
  std::tie(u, s, v) = at::linalg_svd(m, false);
  const at::Tensor best = s[0] * at::outer(u.select(1, 0), v.select(0, 0));
  Bucket b = makeBucket(m, 1);
  for (int i = 0; i < 30; ++i) {
    b.grads[0].copy_(m);
    step(codec, b);
  }
  REQUIRE(at::allclose(b.grads[0], best, 1e-3, 1e-3));
}

TEST_CASE("PowerSGD is deterministic for a seed", "[powersgd]") {
  const at::Tensor m = at::randn({33, 17}, at::make_generator<at::CPUGeneratorImpl>(5));
  at::Tensor results[2];
  for (auto& r : results) {
    PowerSgdCodec codec(PowerSgdOptions{});
    Bucket b = makeBucket(m, 2);
    step(codec, b, 42);
    r = b.buffer.clone();
  }
  REQUIRE(at::equal(results[0], results[1]));
}

TEST_CASE("PowerSGD leaves matrices that would not shrink uncompressed", "[powersgd]") {
  PowerSgdOptions opts;
  opts.matrixApproximationRank = 4;
  PowerSgdCodec codec(opts);
  // (4 + 4) * 4 * 2 >= 16: not worth compressing.
  const at::Tensor m = at::randn({4, 4}, at::make_generator<at::CPUGeneratorImpl>(1));
  Bucket b = makeBucket(m, 1);
  step(codec, b);
  REQUIRE(codec.compressionRanks(0) == std::vector<int64_t>{0, 0});
  REQUIRE(at::equal(b.grads[0], m));
}

TEST_CASE("PowerSGD rejects bad options by name", "[powersgd]") {
  PowerSgdOptions rank0;
  rank0.matrixApproximationRank = 0;
  REQUIRE_THROWS_WITH(PowerSgdCodec(rank0), Catch::Contains("matrix_approximation_rank"));
  PowerSgdOptions negative;
  negative.minCompressionRate = -1;
  REQUIRE_THROWS_WITH(PowerSgdCodec(negative), Catch::Contains("min_compression_rate"));
}

TEST_CASE("PowerSGD steps out of order are refused, naming the step", "[powersgd]") {
  PowerSgdOptions opts;
  opts.matrixApproximationRank = 2;
  PowerSgdCodec codec(opts);
  Bucket b = makeBucket(lowRank(16, 8, 2, 5), 3);
  using Catch::Contains;
  CHECK_THROWS_WITH(codec.reduceP(7, b.buffer, 1), Contains("reduceP for bucket 7, whose layout"));
  codec.setLayout(0, b.buffer, b.grads, b.keys);
  CHECK_THROWS_WITH(codec.reduceP(0, b.buffer, 1),
                    Contains("reduceP for bucket 0 without a prepare before it"));
  CHECK_THROWS_WITH(codec.finish(0, b.buffer, 1),
                    Contains("finish for bucket 0 without a reduceP before it"));
  auto info =
      codec.prepare(0, b.buffer, codec.needsSeed(0) ? std::optional<uint64_t>(1) : std::nullopt);
  CHECK_THROWS_WITH(codec.finish(0, b.buffer, 1),
                    Contains("finish for bucket 0 without a reduceP before it"));
  at::Tensor q = codec.reduceP(0, info.wire.clone(), 1);
  codec.finish(0, q.clone(), 1);  // the refusals left the step intact
}
