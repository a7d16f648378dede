// What every auto shares (the cost model against its formula, the link
// estimate, the closed loop's factors, the codec calibration, the choice
// rule) and the
// backend's choice at the two ends of the link range.
#include "collectives/compressed/AutoCompression.hpp"
#include "collectives/compressed/CodecCalibration.hpp"
#include "collectives/compressed/CompressedRows.hpp"
#include "collectives/compressed/LinkEstimate.hpp"
#include "collectives/compressed/MethodChoice.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

using xcomm::AutoCompression;
using xcomm::AutoInputs;
using xcomm::Compression;

TEST_CASE("auto's predictions are the documented formula", "[auto]") {
  const AutoInputs in{1e-4, 1e-9, 2e-9, 3e-9};  // 1 GB/s
  const int64_t n = 1 << 20, chunk = 256;
  const int w = 4;
  const double ring = 2.0 * (w - 1) / w;
  CHECK(AutoCompression::predict(Compression::kNone, n, 4, w, chunk, in).total() ==
        Approx(1e-4 + ring * n * 4 * 1e-9));
  CHECK(AutoCompression::predict(Compression::kBf16, n, 4, w, chunk, in).total() ==
        Approx(2e-9 * n + 1e-4 + ring * n * 2 * 1e-9));
  CHECK(AutoCompression::predict(Compression::kInt8, n, 4, w, chunk, in).total() ==
        Approx(3e-9 * n + 2e-4 + ring * n * (1 + 4.0 / chunk) * 1e-9));
  // float64 doubles none's bytes; the codecs' wire stays the same
  CHECK(AutoCompression::predict(Compression::kNone, n, 8, w, chunk, in).total() ==
        Approx(1e-4 + ring * n * 8 * 1e-9));
}

TEST_CASE("auto's model prefers none on a fast link and int8 on a slow one", "[auto]") {
  const int64_t n = 1 << 22, chunk = 1024;
  auto best = [&](double secondsPerByte) {
    const AutoInputs in{1e-4, secondsPerByte, 1e-9, 2e-9};
    Compression pick = Compression::kNone;
    double least = 1e300;
    for (Compression m : AutoCompression::kMethods) {
      const double t = AutoCompression::predict(m, n, 4, 2, chunk, in).total();
      if (t < least) {
        least = t;
        pick = m;
      }
    }
    return pick;
  };
  CHECK(best(1.0 / 100e9) == Compression::kNone);   // 100 GB/s: no codec pays
  CHECK(best(1.0 / 12.5e6) == Compression::kInt8);  // 0.1 Gbit/s: the fewest bytes win
}

TEST_CASE("auto's observed factors correct what ran and lend the least to what did not", "[auto]") {
  using xcomm::ObservedFactors;
  ObservedFactors o(3);       // the link, bf16, int8
  CHECK(o.factor(0) == 1.0);  // nothing seen: the calibration stands
  CHECK(o.source(2) == -1);
  o.record(2, 0.010, 0.001);  // int8 took 10x its prediction
  o.record(2, 0.030, 0.003);
  const auto ratios = o.local();
  CHECK(ratios[0] == 0.0);
  CHECK(ratios[2] == Approx(10.0));
  o.update(ratios);
  CHECK(o.factor(2) == Approx(10.0));
  CHECK(o.source(2) == 2);
  // bf16 never ran: predicted with int8's correction, the only codec seen
  CHECK(o.source(1) == 2);
  CHECK(o.factor(1) == Approx(10.0));
  // the link is corrected by none's runs only
  CHECK(o.source(0) == -1);
  CHECK(o.factor(0) == 1.0);
  // a period without int8 keeps its factor; the sums start again
  CHECK(o.local()[2] == 0.0);
  o.update({0.5, 0.0, 0.0});
  CHECK(o.factor(0) == Approx(0.5));
  CHECK(o.factor(2) == Approx(10.0));
  // one odd reading is bounded
  o.update({0.0, 1e6, 0.0});
  CHECK(o.factor(1) == ObservedFactors::kCeiling);
  CHECK(o.source(1) == 1);
  // a seen key's later readings are averaged in geometrically: one noisy
  // round moves int8's 10x by its square root, not to the reading
  o.update({0.0, 0.0, 1.0});
  CHECK(o.factor(2) == Approx(std::sqrt(10.0)));
  o.update({0.0, 0.0, 1.0});
  CHECK(o.factor(2) == Approx(std::sqrt(std::sqrt(10.0))));
  // the corrected prediction: none f_link * wire, a codec f_m * (codec + f_link * wire)
  CHECK(o.predict(0, 0.0, 0.008) == Approx(0.5 * 0.008));
  CHECK(o.base(2, 0.001, 0.004) == Approx(0.001 + 0.5 * 0.004));
  CHECK(o.predict(2, 0.001, 0.004) == Approx(o.factor(2) * (0.001 + 0.5 * 0.004)));
  CHECK_THROWS_WITH(o.factor(3), Catch::Contains("3 keys, not key 3"));
  CHECK_THROWS_WITH(o.update({1.0}), Catch::Contains("1 observed ratios for 3 keys"));
  CHECK_THROWS_WITH(o.restore(1, 0.0, true), Catch::Contains("must be a positive number"));
  CHECK_THROWS_WITH(ObservedFactors(0), Catch::Contains("at least the link's key"));
}

TEST_CASE("the link's factor is dropped when the reading it corrects moves over 2x", "[auto]") {
  using xcomm::ObservedFactors;
  // The MLP at 10 Gbit/s: the first probe read 1.3 Gbit/s, uncompressed
  // buckets ran at 0.29x that prediction; later probes read 6.0 Gbit/s.
  const double slowReading = 8.0 / 1.3e9, fastReading = 8.0 / 6.0e9;
  ObservedFactors o(2);
  CHECK_FALSE(o.setLink(slowReading));  // nothing seen: nothing to drop
  o.update({0.29, 0.0});                // none seen against the 1.3 Gbit/s reading
  CHECK(o.linkSeenAt() == slowReading);
  CHECK(o.factor(0) == Approx(0.29));
  // A reading within 2x keeps it (noise, or a small change the factor follows).
  CHECK_FALSE(o.setLink(slowReading / 1.9));
  CHECK(o.factor(0) == Approx(0.29));
  // 0.29 applied to 6.0 Gbit/s would predict 21 Gbit/s on a 10 Gbit/s link;
  // none has not run since (a period of top-k alone): dropped.
  o.update({0.0, 1.0});
  CHECK(o.setLink(fastReading));
  CHECK(o.factor(0) == 1.0);
  CHECK_FALSE(o.seen(0));
  CHECK(o.predict(0, 0.0, 0.055) == Approx(0.055));  // the reading stands
  // none seen against the new reading: learned again, against it.
  o.update({0.9, 0.0});
  CHECK(o.factor(0) == Approx(0.9));
  CHECK(o.linkSeenAt() == fastReading);
  CHECK_FALSE(o.setLink(fastReading));
  // A period without none, then a reading 4x slower: dropped the same way.
  o.update({0.0, 1.0});
  CHECK(o.setLink(fastReading * 4));
  CHECK(o.factor(0) == 1.0);
  // none seen in the period just folded, then a reading 4x off: the factor is
  // carried to it, so the corrected link stays where none ran.
  o.update({0.5, 0.0});
  CHECK(o.linkSeenAt() == fastReading * 4);
  CHECK_FALSE(o.setLink(fastReading));
  CHECK(o.seen(0));
  CHECK(o.factor(0) == Approx(2.0));
  CHECK(o.predict(0, 0.0, 1.0) == Approx(2.0));
  CHECK(o.linkSeenAt() == fastReading);
  // A checkpoint from before the reading was kept: the next reading is taken as it.
  ObservedFactors restored(2);
  restored.restore(0, 0.5, true);
  CHECK_FALSE(restored.setLink(fastReading));
  CHECK(restored.linkSeenAt() == fastReading);
  CHECK(restored.setLink(slowReading));
  CHECK_THROWS_WITH(restored.restoreLinkSeenAt(-1.0), Catch::Contains("must be >= 0"));
}

TEST_CASE("the cost model's formulas for every method, allreduce and reduce-scatter", "[auto]") {
  using xcomm::BucketShape;
  using xcomm::LinkModel;
  const LinkModel link{2e-4, 1e8};
  const xcomm::CodecCosts costs{{"bf16", 1e-9},
                                {"int8", 5e-9},
                                {"topk", 8e-9},
                                {"powersgd_mnr", 1e-10},
                                {"powersgd_pass", 1e-9}};
  BucketShape b;
  b.numel = 1 << 20;
  b.world = 4;
  b.topkDensity = 0.01;
  const double n = static_cast<double>(b.numel), ring = 2.0 * 3 / 4;
  const auto topk = xcomm::predictAllreduce("topk", b, link, costs);
  const double k = std::ceil(0.01 * n);
  CHECK(topk.codecSeconds == Approx(8e-9 * n));
  CHECK(topk.wireSeconds == Approx(2e-4 + 3 * k * 8 / 1e8));  // an all-gather of (index, value)
  b.powersgdP = 1024 * 4 + 1024;
  b.powersgdQ = 1024 * 4;
  b.powersgdMultiplyAdds = 1024.0 * 1024 * 4;
  const auto ps = xcomm::predictAllreduce("powersgd", b, link, costs);
  CHECK(ps.codecSeconds == Approx(1e-10 * 1024 * 1024 * 4 + 1e-9 * n));
  CHECK(ps.wireSeconds == Approx(2 * 2e-4 + ring * 4 * (1024 * 4 * 2 + 1024) / 1e8));
  CHECK(xcomm::predictAllreduce("int8", b, link, costs).total() ==
        Approx(5e-9 * n + 2 * 2e-4 + ring * n * (1 + 4.0 / 1024) / 1e8));
  CHECK_THROWS_WITH(xcomm::predictAllreduce("zstd", b, link, costs),
                    Catch::Contains("unknown method 'zstd'"));
  CHECK_THROWS_WITH(xcomm::predictAllreduce("fp16", b, link, costs),
                    Catch::Contains("no calibrated cost for 'fp16'"));

  const LinkModel allToAll{2e-4, 2e8};
  b.int8ChunkElems = 256;
  CHECK(xcomm::predictReduceScatter("none", b, link, allToAll, costs).total() ==
        2e-4 + 4 * n / 1e8);
  CHECK(xcomm::predictReduceScatter("int8", b, link, allToAll, costs).total() ==
        Approx(5e-9 * n + 2e-4 + n * (1 + 4.0 / 256) / 2e8));
  CHECK_THROWS_WITH(xcomm::predictReduceScatter("topk", b, link, allToAll, costs),
                    Catch::Contains("unknown method 'topk'"));
}

TEST_CASE("auto's link estimate: median, probe sizing, spacing by cost, confirmations", "[auto]") {
  xcomm::LinkEstimate e(1, 0.01, 5);
  CHECK(e.latency() == 0.0);
  CHECK(e.secondsPerByte(0.004, 0.0) == 0.0);  // a group of one sends nothing
  e.agreementTook(2e-3);
  e.agreementTook(1e-3);
  CHECK(e.latency() == 1e-3);  // the least recent agreement
  CHECK(e.secondsPerByte(0.011, 1e7) == Approx(1e-9));
  CHECK(e.secondsPerByte(0.0015, 1e6) == Approx(0.75e-9));  // latency explains at most half
  const double tenGbit = 8.0 / 10e9;
  // The first round: no step timed, the probe keeps its size, every `interval` steps.
  const int64_t first = e.probeBytes();
  CHECK(e.fold(1e-4, 0.0, 0.0, {tenGbit})[0] == tenGbit);
  CHECK(e.probeBytes() == first);
  CHECK(e.stride(false) == 5);
  // 130 ms steps: 1% of 5 of them over the two runs of the probe at 10 Gbit/s.
  e.fold(1e-4, 0.13, 0.0, {tenGbit});
  CHECK(e.probeBytes() ==
        static_cast<int64_t>(std::min(0.01 * 5 * 0.13 / 2 / tenGbit, 4.0 * first)));
  // The latencies make the round 6.8 ms, 5.2 steps' share: due in 6.
  CHECK(e.stride(false) == 6);
  // One reading 100x slower: the median (of three, the middle) holds, the
  // reading is a change, confirmed at the next step at most three times in a row.
  const auto median = e.fold(1e-4, 0.13, 0.0, {100 * tenGbit});
  CHECK(median[0] == tenGbit);
  CHECK(e.changed());
  CHECK(e.stride(true) == 1);
  CHECK(e.stride(true) == 1);
  CHECK(e.stride(true) == 1);
  CHECK(e.stride(true) > 1);
  // Rounds that take far longer than their bytes (a busy host's waits) are spaced out.
  xcomm::LinkEstimate busy(1, 0.01, 5);
  for (int i = 0; i < 3; ++i) busy.fold(1e-4, 0.02, 0.05, {tenGbit});
  CHECK(busy.roundOverheads().size() == 3);
  CHECK(busy.stride(false) >= static_cast<int64_t>(0.05 / (0.01 * 0.02)) - 1);
  CHECK_THROWS_WITH(busy.fold(1e-4, 0.02, 0.0, {1.0, 2.0}), Catch::Contains("2 readings for 1"));
  CHECK_THROWS_WITH(xcomm::LinkEstimate(0, 0.01, 5), Catch::Contains("at least one probe"));
  CHECK_THROWS_WITH(xcomm::LinkEstimate(1, 0.01, 0), Catch::Contains("interval must be > 0"));
  CHECK_THROWS_WITH(xcomm::LinkEstimate(1, 0.0, 5), Catch::Contains("probe_fraction"));
}

TEST_CASE("every auto's codec calibration times each method it is asked for", "[auto]") {
  const at::Tensor sample = at::randn({1 << 16});
  const auto costs = xcomm::calibrateAllreduceCodecs(
      sample, 2, 1024, 4, {"none", "bf16", "fp16", "int8", "topk", "powersgd"});
  std::vector<std::string> keys;
  for (const auto& [key, seconds] : costs) {
    keys.push_back(key);
    CHECK(seconds > 0);
    CHECK(seconds < 1e-3);  // per element: a millisecond would be a hang, not a codec
  }
  CHECK(keys ==
        std::vector<std::string>{"bf16", "fp16", "int8", "powersgd_mnr", "powersgd_pass", "topk"});
  // The keys it announces are the keys it gives, in the methods' order.
  CHECK(xcomm::allreduceCostKeys({"none", "bf16", "fp16", "int8", "topk", "powersgd"}) ==
        std::vector<std::string>{"bf16", "fp16", "int8", "topk", "powersgd_mnr", "powersgd_pass"});
  // The backend's auto asks for its two only.
  CHECK(xcomm::calibrateAllreduceCodecs(sample, 4, 256, 1, {"bf16", "int8"}).size() == 2);
  // FSDP2's: the table's lossy FSDP2 methods.
  const auto rows = xcomm::calibrateReduceScatterCodecs(at::randn({1001}), 2, 1024);
  CHECK(rows.size() == 3);
  CHECK(rows.count("bf16") == 1);
  CHECK(rows.count("fp16") == 1);
  CHECK_THROWS_WITH(xcomm::CompressedRows(Compression::kNone, 2, nullptr),
                    Catch::Contains("is one of bf16, fp16, int8, not none"));
  CHECK(rows.at("int8") > 0);
  CHECK_THROWS_WITH(
      xcomm::calibrateAllreduceCodecs(sample, 2, 1024, 4, {"zstd"}),
      Catch::Contains("no calibration for method 'zstd'; it calibrates bf16, fp16, int8, topk, "
                      "powersgd"));
  CHECK_THROWS_WITH(xcomm::calibrateAllreduceCodecs(at::empty({0}), 2, 1024, 4, {"bf16"}),
                    Catch::Contains("non-empty sample"));
  CHECK_THROWS_WITH(xcomm::calibrateAllreduceCodecs(sample, 0, 1024, 4, {"bf16"}),
                    Catch::Contains("group of >= 1 ranks, got 0"));
  CHECK_THROWS_WITH(xcomm::calibrateReduceScatterCodecs(at::randn({1}), 2, 1024),
                    Catch::Contains("needs at least 2 elements, got 1"));
}

TEST_CASE("every auto's choice: the least, ties to the earlier, hysteresis, never slower than none",
          "[auto]") {
  using xcomm::chooseMethod;
  // none, bf16, int8 (the table's order); no current method: the least.
  CHECK(chooseMethod({3.0, 2.0, 1.0}, -1, 0.1, 0) == 2);
  CHECK(chooseMethod({1.0, 1.0, 1.0}, -1, 0.1, 0) == 0);  // a tie goes to the cheaper codec
  CHECK(chooseMethod({2.0, 1.0, 1.0}, -1, 0.0, 0) == 1);
  // bf16 is kept while int8 is less than 10% faster, left when it is more.
  CHECK(chooseMethod({3.0, 1.0, 0.95}, 1, 0.1, 0) == 1);
  CHECK(chooseMethod({3.0, 1.0, 0.85}, 1, 0.1, 0) == 2);
  CHECK(chooseMethod({3.0, 1.0, 0.9}, 1, 0.1, 0) == 1);  // exactly the margin: kept
  // int8 seen slower than none is never kept, though within the margin of it.
  CHECK(chooseMethod({1.0, 1.2, 1.05}, 2, 0.1, 0) == 0);
  // Without none among the candidates, hysteresis alone.
  CHECK(chooseMethod({1.0, 1.05}, 1, 0.1, -1) == 1);
  // An infinite prediction (a method out of bounds) is never the least.
  CHECK(chooseMethod({INFINITY, 2.0}, 0, 0.1, -1) == 1);
  // Nor one that is not a number: it counts as the slowest.
  CHECK(chooseMethod({NAN, 2.0}, -1, 0.1, -1) == 1);
  CHECK(chooseMethod({1.0, NAN}, 1, 0.1, 0) == 0);
  CHECK_THROWS_WITH(chooseMethod({}, -1, 0.1, -1), Catch::Contains("no method to choose"));
  CHECK_THROWS_WITH(chooseMethod({1.0}, 1, 0.1, 0), Catch::Contains("current method 1"));
  CHECK_THROWS_WITH(chooseMethod({1.0}, 0, 0.1, 2), Catch::Contains("uncompressed method 2"));
  CHECK_THROWS_WITH(chooseMethod({1.0}, 0, 1.0, 0), Catch::Contains("switch margin"));
}
