// Codecs: round-trip error bounds, error-feedback conservation, determinism
// and edge cases, against the arithmetic each codec promises.
#include <cmath>

#include <ATen/CPUGeneratorImpl.h>

#include "compress/ErrorFeedback.hpp"
#include "compress/Int8Codec.hpp"
#include "compress/RandomKCodec.hpp"
#include "compress/TopKCodec.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

using Catch::Contains;

namespace {

at::Tensor randn(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({n}, gen, at::TensorOptions().dtype(at::kFloat));
}

// The largest error int8 rounding may make on each element: half a step of
// its chunk's scale (max |x| / 127).
at::Tensor int8Bound(const at::Tensor& x, int64_t chunk) {
  const int64_t n = x.numel();
  const int64_t padded = (n + chunk - 1) / chunk * chunk;
  auto p = at::zeros({padded});
  p.narrow(0, 0, n).copy_(x);
  auto absmax = std::get<0>(p.abs().view({-1, chunk}).max(1));
  return (absmax / 127.0 / 2.0).repeat_interleave(chunk).narrow(0, 0, n) + 1e-7;
}

}  // namespace

TEST_CASE("int8 round trip stays within half a quantization step", "[int8]") {
  xcomm::Int8Codec codec(64);
  for (int64_t n : {1, 63, 64, 65, 1000, 4097}) {
    auto x = randn(n, n) * 3.0;
    auto err = (codec.roundTrip(x) - x).abs();
    INFO("n = " << n);
    CHECK(at::all(err <= int8Bound(x, 64)).item<bool>());
  }
}

TEST_CASE("int8 reduce-scatter + allgather gives the mean on every rank", "[int8]") {
  xcomm::Int8Codec codec(32);
  const int world = 3;
  const int64_t n = 1000;
  std::vector<at::Tensor> inputs;
  for (int r = 0; r < world; ++r) inputs.push_back(randn(n, 100 + r));
  const int64_t shard = codec.shardElems(n, world);
  std::vector<at::Tensor> packed;
  for (const auto& x : inputs) packed.push_back(codec.packShards(x, world));
  // Rank j receives row j of every rank's packing, reduces, re-packs.
  std::vector<at::Tensor> mine;
  for (int j = 0; j < world; ++j) {
    std::vector<at::Tensor> rows;
    for (int r = 0; r < world; ++r) rows.push_back(packed[r][j]);
    mine.push_back(codec.pack(codec.reduceShards(at::stack(rows), shard).div_(world)));
  }
  auto gathered = at::cat(mine);
  auto out = at::empty({n});
  codec.unpackAll(gathered, shard, out);
  auto mean = (inputs[0] + inputs[1] + inputs[2]) / 3.0;
  // Two roundings: each input's (averaged) and the mean's.
  auto bound =
      int8Bound(mean, 32) +
      (int8Bound(inputs[0], 32) + int8Bound(inputs[1], 32) + int8Bound(inputs[2], 32)) / 3.0;
  CHECK(at::all((out - mean).abs() <= bound + 1e-6).item<bool>());
}

TEST_CASE("int8 rows: a reduce-scatter whose shard boundaries the caller fixes", "[int8]") {
  // FSDP2's rows are numel / world elements, rarely whole chunks: each row is
  // padded, never shifted, and rank j's sum holds exactly its row's elements.
  xcomm::Int8Codec codec(32);
  const int world = 3;
  const int64_t row = 100;  // 3 chunks + 4
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> packed;
  for (int r = 0; r < world; ++r) {
    inputs.push_back(randn(world * row, 200 + r));
    packed.push_back(codec.packRows(inputs.back(), world, nullptr, 0));
  }
  const int64_t padded = codec.rowElems(world * row, world);
  CHECK(padded == 128);
  CHECK(packed[0].size(1) == codec.packedBytes(padded));
  for (int j = 0; j < world; ++j) {
    std::vector<at::Tensor> rows;
    at::Tensor want = at::zeros({row});
    at::Tensor bound = at::zeros({row});
    for (int r = 0; r < world; ++r) {
      rows.push_back(packed[r][j]);
      at::Tensor mine = inputs[r].narrow(0, j * row, row);
      want += mine;
      bound += int8Bound(mine, 32);
    }
    at::Tensor sum = codec.reduceShards(at::stack(rows), padded);
    INFO("row " << j);
    CHECK(at::all((sum.narrow(0, 0, row) - want).abs() <= bound + 1e-6).item<bool>());
    CHECK(at::all(sum.narrow(0, row, padded - row) == 0).item<bool>());
  }
  // With feedback: what the rows carry + the residual = the input, per element.
  xcomm::ErrorFeedback feedback;
  at::Tensor rows = codec.packRows(inputs[0], world, &feedback, 5);
  at::Tensor sent = at::empty({world * row});
  for (int j = 0; j < world; ++j) {
    at::Tensor part = sent.narrow(0, j * row, row);
    codec.unpackAll(rows[j].view({1, -1}), padded, part);
  }
  CHECK(at::allclose(sent + feedback.find(5), inputs[0], 1e-6, 1e-6));
  CHECK_THROWS_WITH(codec.packRows(randn(10, 1), 3, nullptr, 0), Contains("splits evenly"));
}

TEST_CASE("int8 edge cases: empty, zeros, non-finite", "[int8]") {
  xcomm::Int8Codec codec(4);
  CHECK(codec.roundTrip(at::empty({0})).numel() == 0);
  CHECK(at::equal(codec.roundTrip(at::zeros({9})), at::zeros({9})));
  auto x = at::tensor(std::vector<float>{1, 2, 3, 4, 1, INFINITY, 3, 4, 5});
  auto y = codec.roundTrip(x);
  CHECK(at::allclose(y.narrow(0, 0, 4), x.narrow(0, 0, 4), 0, 3.0 / 127));  // finite chunk
  CHECK(at::all(at::isnan(y.narrow(0, 4, 4))).item<bool>());  // the chunk with Inf: NaN
  CHECK_THROWS_WITH(xcomm::Int8Codec(0), Contains("chunk"));
  CHECK_THROWS_WITH(codec.packShards(at::ones({4}, at::kInt), 2), Contains("floating"));
}

TEST_CASE("int8 is deterministic", "[int8]") {
  xcomm::Int8Codec codec(128);
  auto x = randn(5000, 7);
  CHECK(at::equal(codec.packShards(x, 4), codec.packShards(x, 4)));
}

TEST_CASE("top-k sends the k largest magnitudes and keeps the rest", "[topk]") {
  xcomm::TopKCodec codec(/*approximate=*/false, /*errorFeedback=*/true);
  auto x = at::tensor(std::vector<float>{0.1f, -5.f, 0.2f, 3.f, -0.3f, 4.f});
  auto packed = codec.encode(0, x, 3);
  auto out = at::zeros({6});
  codec.decode(packed.view({1, -1}), 3, out, 1.0);
  CHECK(at::equal(out, at::tensor(std::vector<float>{0, -5.f, 0, 3.f, 0, 4.f})));
  // A copy: the codec updates its residuals in place.
  auto residual = codec.errorFeedback().state().at(0).clone();
  // Conservation: sent + residual == input.
  CHECK(at::allclose(out + residual, x));
  // The residual joins the next step's input.
  auto packed2 = codec.encode(0, at::zeros({6}), 3);
  auto out2 = at::zeros({6});
  codec.decode(packed2.view({1, -1}), 3, out2, 1.0);
  CHECK(at::allclose(out2 + codec.errorFeedback().state().at(0), residual));
}

TEST_CASE("top-k conservation over many steps, and k >= n sends everything", "[topk]") {
  xcomm::TopKCodec codec(false, true);
  auto total_in = at::zeros({300});
  auto total_out = at::zeros({300});
  for (int step = 0; step < 20; ++step) {
    auto g = randn(300, step);
    total_in += g;
    auto out = at::zeros({300});
    codec.decode(codec.encode(7, g, 10).view({1, -1}), 10, out, 1.0);
    total_out += out;
  }
  CHECK(at::allclose(total_out + codec.errorFeedback().state().at(7), total_in, 1e-5, 1e-5));

  xcomm::TopKCodec all(false, true);
  auto x = randn(5, 1);
  auto out = at::zeros({5});
  all.decode(all.encode(0, x, 99).view({1, -1}), 5, out, 1.0);
  CHECK(at::equal(out, x));
  CHECK(at::equal(all.errorFeedback().state().at(0), at::zeros({5})));
}

TEST_CASE("approximate top-k picks exactly k, nearly the exact set", "[topk]") {
  xcomm::TopKCodec exact(false, false), approx(true, false, 2048, 3);
  auto x = randn(200000, 11);
  const int64_t k = xcomm::TopKCodec::kFor(x.numel(), 0.01);
  auto a = at::zeros({x.numel()}), b = at::zeros({x.numel()});
  exact.decode(exact.encode(0, x, k).view({1, -1}), k, a, 1.0);
  approx.decode(approx.encode(0, x, k).view({1, -1}), k, b, 1.0);
  CHECK((b != 0).sum().item<int64_t>() == k);
  const double overlap = ((a != 0) & (b != 0)).sum().item<double>() / k;
  CHECK(overlap > 0.99);  // the trim is exact whenever the threshold lets >= k through
}

TEST_CASE("top-k decode sums ranks and divides; bad density is rejected", "[topk]") {
  xcomm::TopKCodec r0(false, false), r1(false, false);
  auto p0 = r0.encode(0, at::tensor(std::vector<float>{4, 0, 0}), 1);
  auto p1 = r1.encode(0, at::tensor(std::vector<float>{2, 0, 6}), 1);
  auto out = at::zeros({3});
  r0.decode(at::stack({p0, p1}), 1, out, 2.0);
  CHECK(at::equal(out, at::tensor(std::vector<float>{2, 0, 3})));
  CHECK_THROWS_WITH(xcomm::TopKCodec::kFor(10, 0.0), Contains("density"));
  CHECK_THROWS_WITH(xcomm::TopKCodec::kFor(10, 1.5), Contains("density"));
  CHECK(xcomm::TopKCodec::kFor(10, 1e-9) == 1);
  CHECK(xcomm::TopKCodec::kFor(0, 0.5) == 0);
}

TEST_CASE("top-k sends a NaN instead of hiding it in the residual", "[topk]") {
  xcomm::TopKCodec codec(false, true);
  auto x = at::tensor(std::vector<float>{1, NAN, 2, 3});
  auto out = at::zeros({4});
  codec.decode(codec.encode(0, x, 1).view({1, -1}), 1, out, 1.0);
  CHECK(std::isnan(out[1].item<float>()));
}

TEST_CASE("random-k positions are shared by seed, key and step", "[randomk]") {
  xcomm::RandomKCodec a(42, true), b(42, true), c(43, true);
  CHECK(at::equal(a.positions(1, 5, 10000, 0.1), b.positions(1, 5, 10000, 0.1)));
  CHECK_FALSE(at::equal(a.positions(1, 5, 10000, 0.1), a.positions(1, 6, 10000, 0.1)));
  CHECK_FALSE(at::equal(a.positions(1, 5, 10000, 0.1), c.positions(1, 5, 10000, 0.1)));
  const auto n = a.positions(0, 0, 100000, 0.1).numel();
  CHECK(n > 9000);
  CHECK(n < 11000);
  CHECK(a.positions(0, 0, 3, 1e-6).numel() == 1);  // never empty
  CHECK(a.positions(0, 0, 0, 0.5).numel() == 0);
  CHECK(a.positions(0, 0, 7, 1.0).numel() == 7);
  // Stratified: exactly ceil(density * numel) positions, one in each stratum
  // [i * numel / k, (i + 1) * numel / k), so ascending and distinct.
  auto strat = a.positions(2, 9, 100003, 0.013);
  const int64_t k = static_cast<int64_t>(std::ceil(0.013 * 100003));
  REQUIRE(strat.numel() == k);
  auto p = strat.accessor<int64_t, 1>();
  for (int64_t i = 0; i < k; ++i) {
    CHECK(p[i] >= i * 100003 / k);
    CHECK(p[i] < (i + 1) * 100003 / k);
  }
  CHECK_THROWS_WITH(a.positions(0, 0, 7, 0.0), Contains("density"));
}

TEST_CASE("random-k error feedback conserves the input", "[randomk]") {
  xcomm::RandomKCodec codec(1, true);
  auto total_in = at::zeros({500});
  auto total_out = at::zeros({500});
  for (int step = 0; step < 10; ++step) {
    auto g = randn(500, 50 + step);
    total_in += g;
    auto pos = codec.positions(3, step, 500, 0.2);
    auto values = codec.encode(3, g, pos);
    auto out = at::zeros({500});
    codec.decode(values, pos, out, 1.0);
    total_out += out;
  }
  CHECK(at::allclose(total_out + codec.errorFeedback().state().at(3), total_in, 1e-5, 1e-5));
}

TEST_CASE("error feedback refuses a bucket whose size changed", "[feedback]") {
  xcomm::ErrorFeedback fb;
  fb.store(0, at::zeros({4}));
  CHECK(at::equal(fb.compensate(0, at::ones({4})), at::ones({4})));
  CHECK_THROWS_WITH(fb.compensate(0, at::ones({5})), Contains("iteration 2"));
}
