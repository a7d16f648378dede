// Top-k's CUDA kernels (compress/cuda/TopKKernels.cu) on the emulated GPU,
// against the selection TopKCodec promises: the k largest magnitudes (ties:
// lower index; NaN above Inf), packed as [k int32 indices ascending | k
// float32 values], the sent entries zeroed in the residual; and the decode's
// rank-ordered sums. Both the radix path and the sampled path run.
#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <utility>
#include <vector>

#include "EmulatedTestUtil.hpp"
#include "compress/cuda/CudaCodecs.hpp"

#include <catch2/catch.hpp>

namespace {

uint32_t keyOf(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b & 0x7fffffffu;
}

// The reference: packed payload and the residual after it.
struct Expected {
  std::vector<int32_t> idx;
  std::vector<float> val;
  at::Tensor residual;
};

Expected expectedTopk(const at::Tensor& a, int64_t k) {
  const int64_t n = a.numel();
  const float* p = a.data_ptr<float>();
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t x, int32_t y) { return keyOf(p[x]) > keyOf(p[y]); });
  Expected e;
  e.idx.assign(order.begin(), order.begin() + k);
  std::sort(e.idx.begin(), e.idx.end());
  e.residual = a.clone();
  for (int32_t i : e.idx) {
    e.val.push_back(p[i]);
    e.residual.data_ptr<float>()[i] = 0.f;
  }
  return e;
}

void checkPayload(const at::Tensor& packed, const Expected& e, int64_t k) {
  const auto* idx = reinterpret_cast<const int32_t*>(packed.data_ptr<uint8_t>());
  const auto* val = reinterpret_cast<const float*>(packed.data_ptr<uint8_t>() + 4 * k);
  int64_t wrongIdx = -1, wrongVal = -1;
  for (int64_t i = 0; i < k; ++i) {
    if (wrongIdx < 0 && idx[i] != e.idx[i]) wrongIdx = i;
    if (wrongVal < 0 && keyOf(val[i]) != keyOf(e.val[i])) wrongVal = i;
  }
  INFO("first wrong index slot " << wrongIdx << ", first wrong value slot " << wrongVal);
  CHECK(wrongIdx == -1);
  CHECK(std::memcmp(val, e.val.data(), 4 * k) == 0);
}

struct SelectEnv {
  explicit SelectEnv(const char* value) {
    if (value != nullptr) {
      setenv("XCOMM_TOPK_SELECT", value, 1);
    } else {
      unsetenv("XCOMM_TOPK_SELECT");
    }
  }
  ~SelectEnv() { unsetenv("XCOMM_TOPK_SELECT"); }
};

}  // namespace

TEST_CASE("emulated top-k encode selects exactly the CPU's entries", "[emulated][topk]") {
  // n >= 2^16 with k <= n / 8 takes the sampled path by default.
  struct Case {
    const char* name;
    int64_t n;
    double density;
    int kind;  // 0 randn, 1 layered, 2 crowded, 3 crowded with larger entries among the ties
  };
  const Case cases[] = {
      {"small randn (radix)", 3000, 0.05, 0},
      {"k = n (radix)", 517, 1.0, 0},
      {"crowded ties (radix)", 5000, 0.1, 2},
      {"sampled randn", 70000, 0.01, 0},
      {"sampled layered", 131072, 0.01, 1},
      {"sampled crowded ties", 90000, 0.02, 2},
      {"sampled, odd length", 65539, 0.004, 0},
      // The k-th key below the largest: entries above it come after more
      // ties than are taken (three and four pack tiles).
      {"crowded ties below the top (radix)", 70000, 0.3, 2},
      {"sampled, ties among larger entries", 100000, 0.02, 3},
  };
  for (const char* select : {static_cast<const char*>(nullptr), "radix"}) {
    SelectEnv env(select);
    for (const auto& c : cases) {
      for (bool withResidual : {false, true}) {
        DYNAMIC_SECTION(c.name << (withResidual ? ", with residual" : "")
                               << (select ? ", XCOMM_TOPK_SELECT=radix" : "")) {
          at::Tensor src = c.kind == 0   ? emutest::randn(c.n, c.n)
                           : c.kind == 1 ? emutest::layered(c.n, c.n)
                                         : emutest::crowded(c.n, c.n);
          if (c.kind == 3) src.slice(0, 0, c.n, 97).mul_(4);  // 1% larger, spread out
          at::Tensor residual =
              withResidual ? emutest::randn(c.n, c.n + 1).mul_(0.5) : at::Tensor();
          const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(c.density * c.n));
          at::Tensor a = withResidual ? src + residual : src.clone();
          const Expected e = expectedTopk(a, k);
          at::Tensor packed = at::empty({8 * k}, at::kByte);
          xcomm::cuda::topkEncode(src, residual, k, packed);
          checkPayload(packed, e, k);
          if (withResidual) {
            INFO("first residual difference at " << emutest::firstDifference(residual, e.residual));
            CHECK(emutest::sameBits(residual, e.residual));
          }
        }
      }
    }
  }
}

TEST_CASE("emulated top-k encode handles NaN, Inf and unaligned buffers", "[emulated][topk]") {
  const int64_t n = 80000, k = 800;
  at::Tensor base = emutest::randn(n + 1, 5);
  base[17] = std::numeric_limits<float>::quiet_NaN();
  base[40000] = -std::numeric_limits<float>::infinity();
  base[79999] = std::numeric_limits<float>::infinity();
  // One element in: not 16-byte aligned, so the kernels take their scalar loads.
  at::Tensor residual = base.narrow(0, 1, n);
  at::Tensor a = residual.clone();
  const Expected e = expectedTopk(a, k);
  at::Tensor packed = at::empty({8 * k}, at::kByte);
  xcomm::cuda::topkEncode(at::Tensor(), residual, k, packed);
  checkPayload(packed, e, k);
  CHECK(emutest::sameBits(residual, e.residual));
  const auto* idx = reinterpret_cast<const int32_t*>(packed.data_ptr<uint8_t>());
  CHECK(std::find(idx, idx + k, 16) != idx + k);  // the NaN (index 17 of base) was sent
}

TEST_CASE("emulated top-k sampled path falls back to every entry where the sample misleads",
          "[emulated][topk]") {
  // The sample reads entries j * n / samples + n / samples / 2 (samples =
  // min(32768, n / 8), as TopKKernels.cu's kSamples). Scaling those entries alone misleads it both
  // ways:
  // - sampled entries large, the rest tiny: the threshold sits among the
  //   sampled entries, and far fewer than k are at or above it;
  // - sampled entries tiny, the rest large: nearly every entry is a
  //   candidate, and the candidate lists overflow.
  // Either way the selection must run over every entry and give the same
  // bits. 300000 entries: ten pack tiles.
  const int64_t n = 300000, k = 3000;
  const int64_t samples = std::min<int64_t>(32768, n / 8);
  for (bool sampleLarge : {true, false}) {
    for (bool withResidual : {false, true}) {
      DYNAMIC_SECTION((sampleLarge ? "too few candidates" : "candidate lists overflow")
                      << (withResidual ? ", with residual" : "")) {
        at::Tensor src = emutest::randn(n, 31);
        at::Tensor scale = at::full({n}, sampleLarge ? 1e-3f : 1e3f);
        for (int64_t j = 0; j < samples; ++j) scale[j * n / samples + n / samples / 2] = 1.f;
        src.mul_(scale);
        at::Tensor residual =
            withResidual ? emutest::randn(n, 32).mul_(scale).mul_(0.25) : at::Tensor();
        at::Tensor a = withResidual ? src + residual : src.clone();
        const Expected e = expectedTopk(a, k);
        at::Tensor packed = at::empty({8 * k}, at::kByte);
        xcomm::cuda::topkEncode(src, residual, k, packed);
        checkPayload(packed, e, k);
        if (withResidual) CHECK(emutest::sameBits(residual, e.residual));
      }
    }
  }
}

TEST_CASE("emulated top-k encode refuses a bucket its int32 indices cannot address",
          "[emulated][topk]") {
  // 2^31 elements over a small buffer: the check runs before any entry is read.
  std::vector<float> few(16);
  at::Tensor huge = at::from_blob(few.data(), {int64_t{1} << 31}, at::kFloat);
  at::Tensor packed = at::empty({8}, at::kByte);
  CHECK_THROWS_WITH(xcomm::cuda::topkEncode(huge, at::Tensor(), 1, packed),
                    Catch::Contains("at most 2^31 - 1 elements"));
}

TEST_CASE("emulated top-k decode sums ranks in order and divides once", "[emulated][topk]") {
  // 5000: two output tiles; 50000 with 2000 pairs: thirteen tiles, and the
  // tiles' searches of the index lists take several rounds.
  const auto [n, k] =
      GENERATE(std::pair<int64_t, int64_t>{5000, 300}, std::pair<int64_t, int64_t>{50000, 2000});
  const int world = 3;
  std::vector<at::Tensor> payloads;
  for (int r = 0; r < world; ++r) {
    at::Tensor x = emutest::randn(n, 100 + r);
    // The first 200 entries are large on every rank: chosen by all of them,
    // so their sums take three adds and one division.
    x.narrow(0, 0, 200).mul_(10);
    at::Tensor p = at::empty({8 * k}, at::kByte);
    xcomm::cuda::topkEncode(x, at::Tensor(), k, p);
    payloads.push_back(p);
  }
  at::Tensor rows = at::stack(payloads);
  for (float divisor : {1.f, 3.f}) {
    at::Tensor want = at::zeros({n});
    std::vector<bool> touched(n, false);
    float* w = want.data_ptr<float>();
    for (int r = 0; r < world; ++r) {
      const auto* idx = reinterpret_cast<const int32_t*>(rows[r].data_ptr<uint8_t>());
      const auto* val = reinterpret_cast<const float*>(rows[r].data_ptr<uint8_t>() + 4 * k);
      for (int64_t i = 0; i < k; ++i) {
        w[idx[i]] = w[idx[i]] + val[i];
        touched[idx[i]] = true;
      }
    }
    if (divisor != 1.f) {
      for (int64_t i = 0; i < n; ++i) {
        if (touched[i]) w[i] = w[i] / divisor;
      }
    }
    at::Tensor out = at::full({n}, 7.f);  // decode zeroes it first
    xcomm::cuda::topkDecode(rows, k, divisor, out);
    INFO("divisor " << divisor << ", first difference at " << emutest::firstDifference(out, want));
    CHECK(emutest::sameBits(out, want));
  }
}

TEST_CASE("emulated top-k decode rejects indices out of order", "[emulated][topk]") {
  const int64_t n = 100, k = 3;
  at::Tensor rows = at::zeros({1, 8 * k}, at::kByte);
  auto* idx = reinterpret_cast<int32_t*>(rows.data_ptr<uint8_t>());
  idx[0] = 3;
  idx[1] = 9;
  idx[2] = 9;  // twice: a payload no encode writes
  at::Tensor out = at::zeros({n});
  CHECK_THROWS_WITH(xcomm::cuda::topkDecode(rows, k, 1.f, out), Catch::Contains("__trap"));
}

TEST_CASE("emulated top-k decode of nothing writes zeros", "[emulated][topk]") {
  at::Tensor out = at::full({9000}, 3.f);
  xcomm::cuda::topkDecode(at::zeros({2, 0}, at::kByte), 0, 1.f, out);
  CHECK(at::equal(out, at::zeros({9000})));
}

TEST_CASE("emulated top-k decode rejects an index outside the bucket", "[emulated][topk]") {
  const int64_t n = 100, k = 2;
  at::Tensor rows = at::zeros({1, 8 * k}, at::kByte);
  auto* idx = reinterpret_cast<int32_t*>(rows.data_ptr<uint8_t>());
  idx[0] = 3;
  idx[1] = 100;  // one past the end: the kernel traps rather than write there
  at::Tensor out = at::zeros({n});
  CHECK_THROWS_WITH(xcomm::cuda::topkDecode(rows, k, 1.f, out), Catch::Contains("__trap"));
}

TEST_CASE("emulated top-k decode of pairs in a few tiles, at tile edges", "[emulated][topk]") {
  // 13 output tiles of 4096; each rank's pairs sit at tiles' first and last
  // entries and skip several tiles, so most tiles have no pair of a rank.
  const int64_t n = 50000, k = 4;
  const std::vector<std::vector<int32_t>> indices = {{0, 4095, 4096, 49999},
                                                     {5, 8191, 12288, 30000}};
  const int world = static_cast<int>(indices.size());
  at::Tensor rows = at::zeros({world, 8 * k}, at::kByte);
  at::Tensor want = at::zeros({n});
  for (int r = 0; r < world; ++r) {
    auto* idx = reinterpret_cast<int32_t*>(rows[r].data_ptr<uint8_t>());
    auto* val = reinterpret_cast<float*>(rows[r].data_ptr<uint8_t>() + 4 * k);
    for (int64_t j = 0; j < k; ++j) {
      idx[j] = indices[r][j];
      val[j] = 1.5f + static_cast<float>(r * k + j);
      want[idx[j]] = want[idx[j]].item<float>() + val[j];
    }
  }
  want.div_(2.f);
  want.masked_fill_(want == 0, 0.f);
  at::Tensor out = at::full({n}, 7.f);
  xcomm::cuda::topkDecode(rows, k, 2.f, out);
  INFO("first difference at " << emutest::firstDifference(out, want));
  CHECK(emutest::sameBits(out, want));
}
