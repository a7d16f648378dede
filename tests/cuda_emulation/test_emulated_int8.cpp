// int8's CUDA kernels (compress/cuda/Int8Kernels.cu) on the emulated GPU,
// bit for bit against Int8Codec's CPU route: the packed shards, with and
// without error feedback, packed rows, the rank-ordered reduce (to floats
// and re-packed) and the decode.
#include <vector>

#include "EmulatedTestUtil.hpp"
#include "compress/ErrorFeedback.hpp"
#include "compress/Int8Codec.hpp"
#include "compress/cuda/CudaCodecs.hpp"

#include <catch2/catch.hpp>

namespace {

// Chunk sizes that take the kernels' warp-per-chunk and block-per-chunk forms.
constexpr int64_t kChunks[] = {32, 256, 1024, 4096};

}  // namespace

TEST_CASE("emulated int8 encode packs the CPU's bytes", "[emulated][int8]") {
  for (int64_t chunk : kChunks) {
    xcomm::Int8Codec codec(chunk);
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{8191}, int64_t{20000}}) {
      for (int world : {1, 3}) {
        DYNAMIC_SECTION("chunk " << chunk << ", n " << n << ", world " << world) {
          at::Tensor x = emutest::layered(n, n + world);
          const int64_t shard = codec.shardElems(n, world);
          at::Tensor want = codec.packShards(x, world);
          at::Tensor got = at::empty({world, codec.packedBytes(shard)}, at::kByte);
          xcomm::cuda::int8Encode(x, at::Tensor(), n, world, shard, shard, chunk, got);
          CHECK(emutest::sameBits(got, want));
        }
      }
    }
  }
}

TEST_CASE("emulated int8 encode with error feedback leaves the CPU's residual",
          "[emulated][int8]") {
  for (int64_t chunk : kChunks) {
    xcomm::Int8Codec codec(chunk);
    const int64_t n = 12345;
    const int world = 2;
    const int64_t shard = codec.shardElems(n, world);
    xcomm::ErrorFeedback feedback;
    at::Tensor residual;  // the emulated side's
    for (int step = 0; step < 3; ++step) {
      DYNAMIC_SECTION("chunk " << chunk << ", step " << step) {
        at::Tensor g = emutest::randn(n, 10 * step + chunk);
        at::Tensor want = codec.packShardsWithFeedback(g, world, feedback, /*key=*/7);
        at::Tensor got = at::empty({world, codec.packedBytes(shard)}, at::kByte);
        if (!residual.defined()) {  // the first step seeds the residual with the gradient
          residual = g.clone();
          xcomm::cuda::int8Encode(at::Tensor(), residual, n, world, shard, shard, chunk, got);
        } else {
          xcomm::cuda::int8Encode(g, residual, n, world, shard, shard, chunk, got);
        }
        CHECK(emutest::sameBits(got, want));
        INFO("first residual difference at "
             << emutest::firstDifference(residual, feedback.find(7)));
        CHECK(emutest::sameBits(residual, feedback.find(7)));
      }
    }
  }
}

TEST_CASE("emulated int8 packs rows as packRows", "[emulated][int8]") {
  xcomm::Int8Codec codec(256);
  const int64_t n = 3 * 1000;
  const int rows = 3;
  at::Tensor x = emutest::randn(n, 3);
  at::Tensor want = codec.packRows(x, rows, nullptr, 0);
  at::Tensor got = at::empty({rows, codec.packedBytes(codec.rowElems(n, rows))}, at::kByte);
  xcomm::cuda::int8Encode(x, at::Tensor(), n, rows, n / rows, codec.rowElems(n, rows), 256, got);
  CHECK(emutest::sameBits(got, want));
}

TEST_CASE("emulated int8 reduce and decode give the CPU's sums", "[emulated][int8]") {
  for (int64_t chunk : kChunks) {
    xcomm::Int8Codec codec(chunk);
    const int world = 3;
    const int64_t n = 3 * chunk * 2 + 5;
    const int64_t shard = codec.shardElems(n, world);
    std::vector<at::Tensor> packed;
    for (int r = 0; r < world; ++r) packed.push_back(codec.packShards(emutest::randn(n, r), world));
    // The rows of shard 1 from every rank, as a reduce-scatter delivers them.
    std::vector<at::Tensor> mine;
    for (int r = 0; r < world; ++r) mine.push_back(packed[r][1]);
    at::Tensor received = at::stack(mine).contiguous();
    DYNAMIC_SECTION("chunk " << chunk << ": reduce to floats") {
      at::Tensor want = codec.reduceShards(received, shard);
      at::Tensor got = at::empty({shard}, at::kFloat);
      xcomm::cuda::int8Reduce(received, shard, chunk, 1.f, got, at::Tensor());
      CHECK(emutest::sameBits(got, want));
    }
    DYNAMIC_SECTION("chunk " << chunk << ": reduce, divide and pack") {
      at::Tensor want = codec.reduceAndPack(received, shard, world);
      at::Tensor got = at::empty({codec.packedBytes(shard)}, at::kByte);
      xcomm::cuda::int8Reduce(received, shard, chunk, static_cast<float>(world), at::Tensor(), got);
      CHECK(emutest::sameBits(got, want));
    }
    DYNAMIC_SECTION("chunk " << chunk << ": decode") {
      at::Tensor want = at::empty({n});
      codec.unpackAll(packed[0], shard, want);
      at::Tensor got = at::empty({n});
      xcomm::cuda::int8Decode(packed[0], shard, chunk, n, got);
      CHECK(emutest::sameBits(got, want));
    }
  }
}
