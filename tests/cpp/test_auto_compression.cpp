// Options(compression="auto"): the cost model against its formula, and the
// choice it implies at the two ends of the link range.
#include "collectives/compressed/AutoCompression.hpp"

#include <cmath>

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
  CHECK(AutoCompression::predict(Compression::kNone, n, 4, w, chunk, in) ==
        Approx(1e-4 + ring * n * 4 * 1e-9));
  CHECK(AutoCompression::predict(Compression::kBf16, n, 4, w, chunk, in) ==
        Approx(2e-9 * n + 1e-4 + ring * n * 2 * 1e-9));
  CHECK(AutoCompression::predict(Compression::kInt8, n, 4, w, chunk, in) ==
        Approx(3e-9 * n + 2e-4 + ring * n * (1 + 4.0 / chunk) * 1e-9));
  // float64 doubles none's bytes; the codecs' wire stays the same
  CHECK(AutoCompression::predict(Compression::kNone, n, 8, w, chunk, in) ==
        Approx(1e-4 + ring * n * 8 * 1e-9));
}

TEST_CASE("auto's model prefers none on a fast link and int8 on a slow one", "[auto]") {
  const int64_t n = 1 << 22, chunk = 1024;
  auto best = [&](double secondsPerByte) {
    const AutoInputs in{1e-4, secondsPerByte, 1e-9, 2e-9};
    Compression pick = Compression::kNone;
    double least = 1e300;
    for (Compression m : AutoCompression::kMethods) {
      const double t = AutoCompression::predict(m, n, 4, 2, chunk, in);
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
}
