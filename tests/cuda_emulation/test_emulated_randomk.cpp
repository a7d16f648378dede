// random-k's CUDA kernels (compress/cuda/RandomKKernels.cu) on the emulated
// GPU: the device draws RandomKCodec's positions (same hash, same strata),
// and the add, gather and scatter match the CPU's arithmetic.
#include "EmulatedTestUtil.hpp"
#include "compress/RandomKCodec.hpp"
#include "compress/cuda/CudaCodecs.hpp"

#include <catch2/catch.hpp>

namespace {

// SplitMix64 as RandomKCodec's: the codec's base for (seed, key, step).
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

TEST_CASE("emulated random-k draws the CPU's positions", "[emulated][randomk]") {
  const uint64_t seed = 1234;
  xcomm::RandomKCodec codec(seed, /*errorFeedback=*/true);
  for (int64_t numel : {int64_t{10}, int64_t{1000}, int64_t{123457}}) {
    for (double density : {0.001, 0.01, 0.3}) {
      const int64_t key = 3, step = 11;
      at::Tensor want = codec.positions(key, step, numel, density);
      const uint64_t base = mix(seed ^ mix(static_cast<uint64_t>(key) ^ mix(step)));
      at::Tensor got = at::empty({want.numel()}, at::kLong);
      xcomm::cuda::randomkPositions(base, numel, got);
      INFO("numel " << numel << ", density " << density);
      CHECK(at::equal(got, want));
    }
  }
}

TEST_CASE("emulated random-k add, gather and scatter", "[emulated][randomk]") {
  const int64_t n = 10001;  // odd: the add's float4 part and its tail
  at::Tensor src = emutest::randn(n, 1);
  at::Tensor acc = emutest::randn(n, 2);
  at::Tensor want = src + acc;
  xcomm::cuda::addInto(src, acc);
  CHECK(emutest::sameBits(acc, want));

  xcomm::RandomKCodec codec(9, true);
  at::Tensor pos = codec.positions(0, 0, n, 0.05);
  at::Tensor values = at::empty({pos.numel()});
  at::Tensor before = acc.clone();
  xcomm::cuda::gatherPositions(acc, pos, values, /*zero=*/true);
  CHECK(emutest::sameBits(values, before.index_select(0, pos)));
  at::Tensor zeroed = before.index_fill(0, pos, 0.f);
  CHECK(emutest::sameBits(acc, zeroed));

  at::Tensor out = at::full({n}, 5.f);
  xcomm::cuda::scatterPositions(values, pos, 4.f, out);
  at::Tensor expected = at::zeros({n}).index_copy_(0, pos, values / 4.f);
  CHECK(emutest::sameBits(out, expected));
}
