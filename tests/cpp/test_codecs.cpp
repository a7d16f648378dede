// Codecs: round-trip error bounds, error-feedback conservation, determinism
// and edge cases, against the arithmetic each codec promises.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>

#include "compress/ErrorFeedback.hpp"
#include "compress/Int8Codec.hpp"
#include "compress/RandomKCodec.hpp"
#include "compress/TopKCodec.hpp"
#include "compress/kernels/CodecKernels.hpp"

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

// Gradients unlike randn, as real models give them.
// `nonzero` of the elements drawn from randn at random positions, the rest exact zeros.
at::Tensor zeroHeavy(int64_t n, double nonzero, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto x = at::zeros({n});
  auto pos = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong))
                 .narrow(0, 0, std::max<int64_t>(1, std::llround(nonzero * n)));
  x.index_copy_(0, pos, at::randn({pos.numel()}, gen, at::TensorOptions().dtype(at::kFloat)));
  return x;
}

// An embedding table's gradient, flat: `touched` of its `dim`-wide rows nonzero.
at::Tensor rowSparse(int64_t rows, int64_t dim, double touched, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto table = at::zeros({rows, dim});
  auto hit = at::randperm(rows, gen, at::TensorOptions().dtype(at::kLong))
                 .narrow(0, 0, std::max<int64_t>(1, std::llround(touched * rows)));
  table.index_copy_(0, hit,
                    at::randn({hit.numel(), dim}, gen, at::TensorOptions().dtype(at::kFloat)));
  return table.view({-1});
}

// The inputs the robustness tests share, 1M elements each.
std::vector<std::pair<std::string, at::Tensor>> unevenGradients() {
  return {{"99.7% zeros", zeroHeavy(1 << 20, 0.003, 1)},
          {"all equal", at::full({1 << 20}, 0.25f)},
          {"0.5% of 64-wide rows", rowSparse(1 << 14, 64, 0.005, 2)}};
}

at::Tensor bits(const at::Tensor& t) {
  return t.contiguous().view(at::kInt);
}

// A top-k payload against plain arithmetic on `acc` (input + residual):
// exactly k ascending indices holding acc's values bit for bit, every kept
// magnitude at least the k-th largest (torch's topk), every other at most
// it, and among the entries equal to it, those of lowest index (the codec's
// tie rule).
void checkTopK(const at::Tensor& packed, const at::Tensor& acc, int64_t k) {
  REQUIRE(packed.numel() == 8 * k);
  auto idx = packed.narrow(0, 0, 4 * k).view(at::kInt).to(at::kLong);
  auto vals = packed.narrow(0, 4 * k, 4 * k).view(at::kFloat);
  CHECK(at::all(idx.narrow(0, 1, k - 1) > idx.narrow(0, 0, k - 1)).item<bool>());
  CHECK(at::equal(bits(vals), bits(acc.index_select(0, idx))));
  auto mag = acc.abs();
  const float kth = std::get<0>(at::topk(mag, k)).min().item<float>();
  auto kept = at::zeros({acc.numel()}, at::kBool).index_fill_(0, idx, true);
  CHECK(at::all(mag.masked_select(kept) >= kth).item<bool>());
  CHECK(at::all(mag.masked_select(kept.logical_not()) <= kth).item<bool>());
  const int64_t above = (mag > kth).sum().item<int64_t>();
  auto tied = at::nonzero(mag == kth).view({-1});
  CHECK(at::equal(at::nonzero(kept & (mag == kth)).view({-1}), tied.narrow(0, 0, k - above)));
}

// The bits of a tensor of 2, 4 or 8-byte elements, for exact comparison.
at::Tensor bitsOf(const at::Tensor& t) {
  const auto size = t.element_size();
  return t.contiguous().view(size == 2 ? at::kShort : size == 4 ? at::kInt : at::kLong);
}

// checkTopK for a bucket of any floating dtype: magnitudes compared in
// float64, which holds float16, bfloat16, float32 and float64 exactly.
void checkTopKOf(const at::Tensor& packed, const at::Tensor& acc, int64_t k) {
  const int64_t size = acc.element_size();
  REQUIRE(packed.numel() == (4 + size) * k);
  auto idx = packed.narrow(0, 0, 4 * k).view(at::kInt).to(at::kLong);
  // clone: float64 values are 8-byte aligned only for even k
  auto vals = packed.narrow(0, 4 * k, size * k).clone().view(acc.scalar_type());
  CHECK(at::all(idx.narrow(0, 1, k - 1) > idx.narrow(0, 0, k - 1)).item<bool>());
  CHECK(at::equal(bitsOf(vals), bitsOf(acc.index_select(0, idx))));
  auto mag = acc.abs().to(at::kDouble);
  const double kth = std::get<0>(at::topk(mag, k)).min().item<double>();
  auto kept = at::zeros({acc.numel()}, at::kBool).index_fill_(0, idx, true);
  CHECK(at::all(mag.masked_select(kept) >= kth).item<bool>());
  CHECK(at::all(mag.masked_select(kept.logical_not()) <= kth).item<bool>());
  const int64_t above = (mag > kth).sum().item<int64_t>();
  auto tied = at::nonzero(mag == kth).view({-1});
  CHECK(at::equal(at::nonzero(kept & (mag == kth)).view({-1}), tied.narrow(0, 0, k - above)));
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

TEST_CASE("top-k on zero-heavy, tie-heavy and row-sparse gradients: the exact top k", "[topk]") {
  for (const auto& [name, g] : unevenGradients()) {
    const int64_t n = g.numel(), k = xcomm::TopKCodec::kFor(n, 0.01);
    xcomm::TopKCodec codec(/*approximate=*/false, /*errorFeedback=*/true);
    auto residual = at::zeros({n});
    for (int step = 0; step < 3; ++step) {
      INFO(name << ", step " << step);
      auto acc = g + residual;
      auto packed = codec.encode(0, g, k);
      checkTopK(packed, acc, k);
      // What was sent and what stays behind add up to the input, exactly.
      auto sent = at::zeros({n});
      codec.decode(packed.view({1, -1}), k, sent, 1.0);
      residual =
          acc.clone().index_fill_(0, packed.narrow(0, 0, 4 * k).view(at::kInt).to(at::kLong), 0);
      CHECK(at::equal(bits(codec.errorFeedback().find(0)), bits(residual)));
      CHECK(at::equal(sent + residual, acc));
      // The selection stays a few k pairs whatever the input: a threshold
      // that most of the bucket equals (0, or the one value) is counted, not
      // collected (collected, every element was a candidate).
      const auto& sel = codec.lastSelection();
      CHECK_FALSE(sel.exact);
      CHECK(sel.candidates <= 2 * k);
      CHECK(sel.reread <= 3 * k + 64);
    }
  }
}

TEST_CASE("top-k below the nonzeros of a zero-heavy gradient, and on one tie", "[topk]") {
  // 0.3% nonzero at 0.1% density: the k are all nonzero, no zero is sent.
  auto g = zeroHeavy(1 << 20, 0.003, 5);
  xcomm::TopKCodec codec(false, false);
  const int64_t k = xcomm::TopKCodec::kFor(g.numel(), 0.001);
  auto packed = codec.encode(0, g, k);
  checkTopK(packed, g, k);
  CHECK(at::all(packed.narrow(0, 4 * k, 4 * k).view(at::kFloat) != 0).item<bool>());
  CHECK(codec.lastSelection().reread == 0);
  // Fewer than k nonzero in all: every nonzero goes, then the first zeros.
  auto few = zeroHeavy(1 << 20, 0.0001, 6);
  packed = codec.encode(0, few, k);
  checkTopK(packed, few, k);
  CHECK(at::sum(packed.narrow(0, 4 * k, 4 * k).view(at::kFloat) != 0).item<int64_t>() ==
        (few != 0).sum().item<int64_t>());
  // -0 and +0 are one magnitude: the lowest indices go, each with its sign.
  auto zeros = at::zeros({100000});
  zeros.narrow(0, 0, 50000).fill_(-0.0f);
  packed = codec.encode(0, zeros, 1000);
  checkTopK(packed, zeros, 1000);
  CHECK(at::equal(bits(packed.narrow(0, 4000, 4000).view(at::kFloat)),
                  bits(at::full({1000}, -0.0f))));
}

TEST_CASE("top-k on float16, bfloat16 and float64 buckets: the scan, the float32 rule", "[topk]") {
  std::vector<std::pair<std::string, at::Tensor>> inputs = unevenGradients();
  inputs.emplace_back("randn", randn(1 << 20, 9));
  for (auto dtype : {at::kHalf, at::kBFloat16, at::kDouble}) {
    for (const auto& [name, input] : inputs) {
      const auto g = input.to(dtype);
      const int64_t n = g.numel(), k = xcomm::TopKCodec::kFor(n, 0.01);
      xcomm::TopKCodec codec(/*approximate=*/false, /*errorFeedback=*/true);
      xcomm::TopKCodec widened(false, false);  // float32 on the upcast values
      auto residual = at::zeros({n}, g.options());
      for (int step = 0; step < 3; ++step) {
        INFO(c10::toString(dtype) << " " << name << ", step " << step);
        // In the bucket's dtype, as the residual is kept; the first step's
        // residual is the input itself (-0 stays -0).
        auto acc = step > 0 ? g + residual : g.clone();
        auto packed = codec.encode(0, g, k);
        const auto& sel = codec.lastSelection();
        CHECK(sel.route == xcomm::TopKRoute::kScan);
        CHECK_FALSE(sel.exact);
        // The scan collected or re-read the k (at::topk records neither).
        CHECK(sel.candidates + sel.reread >= k);
        CHECK(sel.candidates <= 2 * k);
        checkTopKOf(packed, acc, k);
        auto idx = packed.narrow(0, 0, 4 * k).view(at::kInt);
        if (dtype != at::kDouble) {
          auto ref = widened.encode(0, acc.to(at::kFloat), k);
          CHECK(at::equal(idx, ref.narrow(0, 0, 4 * k).view(at::kInt)));
          CHECK(at::equal(packed.narrow(0, 4 * k, 2 * k).view(dtype).to(at::kFloat),
                          ref.narrow(0, 4 * k, 4 * k).view(at::kFloat)));
        }
        residual = acc.clone().index_fill_(0, idx.to(at::kLong), 0);
        auto kept = codec.errorFeedback().find(0);
        REQUIRE(kept.scalar_type() == dtype);
        CHECK(at::equal(bitsOf(kept), bitsOf(residual)));
      }
    }
  }
  // The route is what ran: a strided bucket still takes at::topk.
  xcomm::TopKCodec codec(false, false, /*sampleSize=*/64);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  auto distinct = at::randperm(2048, gen, at::TensorOptions().dtype(at::kLong)).to(at::kHalf);
  auto strided = at::stack({distinct, distinct}, 1).view({-1}).slice(0, 0, 4096, 2);
  REQUIRE_FALSE(strided.is_contiguous());
  auto packed = codec.encode(0, strided, 100);
  CHECK(codec.lastSelection().route == xcomm::TopKRoute::kTorch);
  // Distinct magnitudes: at::topk picks the same set.
  auto scanned = codec.encode(0, strided.contiguous(), 100);
  CHECK(codec.lastSelection().route == xcomm::TopKRoute::kScan);
  auto sorted = std::get<0>(packed.narrow(0, 0, 400).view(at::kInt).sort());
  CHECK(at::equal(sorted, scanned.narrow(0, 0, 400).view(at::kInt)));
}

TEST_CASE("top-k on float64 orders by the doubles, not by their float32 rounding", "[topk]") {
  // Not the float32 route on rounded values: 1 + 2^-40 rounds to 1.0f, and
  // 1e300 and 1e301 both to Inf, which would make each pair a tie the lower
  // index wins.
  const int64_t n = 1 << 16;
  auto g = at::ones({n}, at::kDouble);
  g.narrow(0, n - 100, 100).fill_(1.0 + std::ldexp(1.0, -40));
  g[1000] = 1e300;
  g[n - 1] = -1e301;
  xcomm::TopKCodec codec(false, false);
  auto packed = codec.encode(0, g, 1);
  CHECK(codec.lastSelection().route == xcomm::TopKRoute::kScan);
  CHECK(packed.narrow(0, 0, 4).view(at::kInt).item<int32_t>() == n - 1);
  packed = codec.encode(0, g, 101);  // every magnitude above 1.0, no tie
  checkTopKOf(packed, g, 101);
  auto idx = packed.narrow(0, 0, 4 * 101).view(at::kInt);  // ascending
  CHECK(idx[0].item<int32_t>() == 1000);
  CHECK(idx[1].item<int32_t>() == n - 100);  // the larger doubles, not indices 0 and 1
  CHECK(idx[100].item<int32_t>() == n - 1);
  // An odd k leaves the values unaligned in the payload; two ranks' decode
  // is still the sum of their doubles (the at::topk route threw here).
  auto twice = at::zeros({n}, at::kDouble);
  codec.decode(at::stack({packed, packed}), 101, twice, 1.0);
  CHECK(at::equal(twice.index_select(0, idx.to(at::kLong)),
                  2 * g.index_select(0, idx.to(at::kLong))));
  CHECK((twice != 0).sum().item<int64_t>() == 101);
  // NaN ranks above Inf and is sent; one tie at 1.0 goes to the lowest index.
  g[5] = std::nan("");
  g[6] = -std::numeric_limits<double>::infinity();
  packed = codec.encode(0, g, 104);
  idx = packed.narrow(0, 0, 4 * 104).view(at::kInt);
  const std::vector<int32_t> head = {0, 5, 6, 1000, static_cast<int32_t>(n - 100)};
  for (size_t i = 0; i < head.size(); ++i) CHECK(idx[i].item<int32_t>() == head[i]);
  CHECK(std::isnan(packed.narrow(0, 4 * 104, 8 * 104).view(at::kDouble)[1].item<double>()));
}

TEST_CASE("top-k decode of uneven gradients is index_add in rank order, divided", "[topk]") {
  for (const auto& [name, g] : unevenGradients()) {
    INFO(name);
    const int64_t n = g.numel(), k = xcomm::TopKCodec::kFor(n, 0.01);
    xcomm::TopKCodec r0(false, true), r1(false, true);
    auto p0 = r0.encode(0, g, k);
    auto p1 = r1.encode(0, g * -3.0 + zeroHeavy(n, 0.01, 9), k);
    auto out = at::empty({n});
    r0.decode(at::stack({p0, p1}), k, out, 2.0);
    auto ref = at::zeros({n});
    for (const auto& p : {p0, p1}) {
      ref.index_add_(0, p.narrow(0, 0, 4 * k).view(at::kInt).to(at::kLong),
                     p.narrow(0, 4 * k, 4 * k).view(at::kFloat));
    }
    CHECK(at::equal(bits(out), bits(ref / 2.0)));
  }
}

TEST_CASE("random-k on zero-heavy, tie-heavy and row-sparse gradients", "[randomk]") {
  for (const auto& [name, g] : unevenGradients()) {
    INFO(name);
    const int64_t n = g.numel();
    xcomm::RandomKCodec codec(11, true);
    auto residual = at::zeros({n});
    for (int step = 0; step < 2; ++step) {
      auto pos = codec.positions(0, step, n, 0.01);
      auto acc = g + residual;
      auto values = codec.encode(0, g, pos);
      CHECK(at::equal(bits(values), bits(acc.index_select(0, pos))));
      residual = acc.clone().index_fill_(0, pos, 0);
      CHECK(at::equal(bits(codec.errorFeedback().find(0)), bits(residual)));
      auto out = at::full({n}, 7.0f);
      codec.decode(values, pos, out, 2.0);
      auto ref = at::zeros({n}).index_copy_(0, pos, values / 2.0);
      CHECK(at::equal(bits(out), bits(ref)));
    }
  }
}

TEST_CASE("int8 on zero-heavy, tie-heavy and row-sparse gradients is the chunk arithmetic",
          "[int8]") {
  const int64_t chunk = 1024;
  xcomm::Int8Codec codec(chunk);
  for (const auto& [name, g] : unevenGradients()) {
    INFO(name);
    // scale = max |x| / 127 per chunk (1 where the chunk is all zero),
    // q = round(x * (1 / scale)) ties to even, decoded q * scale.
    auto chunks = g.view({-1, chunk});
    auto absmax = std::get<0>(chunks.abs().max(1, true));
    auto scale = at::where(absmax > 0, absmax / 127.0f, at::ones_like(absmax));
    auto q = at::round(chunks * (1.0f / scale)).to(at::kChar);  // an integer: no -0
    auto ref = (q.to(at::kFloat) * scale).view({-1});
    CHECK(at::equal(bits(codec.roundTrip(g)), bits(ref)));
    // With feedback: the residual keeps exactly what the shards do not carry.
    xcomm::ErrorFeedback feedback;
    auto packed = codec.packShardsWithFeedback(g, 2, feedback, 0);
    auto sent = at::empty({g.numel()});
    codec.unpackAll(packed, codec.shardElems(g.numel(), 2), sent);
    CHECK(at::equal(bits(sent), bits(ref)));
    CHECK(at::equal(bits(feedback.find(0)), bits(g - ref)));
  }
}

TEST_CASE("top-k kernels: every instruction set counts ties and takes them in order",
          "[topk][kernels]") {
  // 0 and 2 are each shared by many entries; 3 and -3 are one magnitude.
  const int64_t n = 1000 + 7;  // a tail past every vector width
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) {
    v[i] = i % 5 == 0 ? 2.f : i % 11 == 0 ? (i % 2 ? -3.f : 3.f) : i % 13 == 0 ? 0.5f : 0.f;
  }
  const uint32_t two = xcomm::kernels::magnitudeKey(2.f);
  std::vector<int32_t> wantAbove, wantTies;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = xcomm::kernels::magnitudeKey(v[i]);
    if (key > two) wantAbove.push_back(static_cast<int32_t>(i));
    if (key == two) wantTies.push_back(static_cast<int32_t>(i));
  }
  int tested = 0;
  for (const char* isa : {"default", "avx2", "avx512"}) {
    const auto* kern = xcomm::kernels::codecKernelsFor(isa);
    if (kern == nullptr) continue;
    INFO(isa);
    ++tested;
    std::vector<int32_t> idx(n);
    std::vector<float> val(n);
    int64_t ties = -1;
    const int64_t count =
        kern->topkScan(v.data(), nullptr, 0, n, two, idx.data(), val.data(), n, &ties);
    REQUIRE(count == static_cast<int64_t>(wantAbove.size()));
    CHECK(std::equal(wantAbove.begin(), wantAbove.end(), idx.begin()));
    for (int64_t i = 0; i < count; ++i) CHECK(val[i] == v[idx[i]]);
    CHECK(ties == static_cast<int64_t>(wantTies.size()));
    // With a residual: a = src + residual is stored back, and scanned.
    std::vector<float> res(n, 1.f);
    kern->topkScan(v.data(), res.data(), 0, n, two, idx.data(), val.data(), n, &ties);
    CHECK(res[0] == 3.f);
    CHECK(ties == std::count(v.begin(), v.end(), -3.f));  // |-3 + 1| is the one 2 left
    // Ties from an offset, capped: the first `cap` in index order.
    for (int64_t cap :
         {int64_t{0}, int64_t{1}, int64_t{17}, static_cast<int64_t>(wantTies.size())}) {
      std::vector<int32_t> got(cap + 1, -1);
      CHECK(kern->topkTies(v.data(), 0, n, two, got.data(), cap) == cap);
      CHECK(std::equal(wantTies.begin(), wantTies.begin() + cap, got.begin()));
      CHECK(got[cap] == -1);  // nothing written past the cap
    }
    std::vector<int32_t> tail(8);
    const int64_t late = kern->topkTies(v.data(), 990, n, two, tail.data(), 8);
    CHECK(late == 4);  // 990, 995, 1000, 1005
    CHECK(tail[3] == 1005);
  }
  CHECK(tested >= 1);
}
