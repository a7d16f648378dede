// CompressedAllreduce's int8 route on the CPU: its all-to-all and all-gather
// go as point-to-point messages (DirectExchange) on its transport. Checked on
// rank threads over the store transport against the codec's own arithmetic
// run on one thread, and against a peer that never sends.
#include <chrono>
#include <string>
#include <vector>

#include "RankThreads.hpp"
#include "backend/StoreRoute.hpp"
#include "collectives/compressed/CompressedAllreduce.hpp"
#include "compress/Int8Codec.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

#include "RankChecks.hpp"

using Catch::Contains;

namespace {

constexpr int64_t kChunk = 64;

xcomm::CompressionConfig int8Config() {
  xcomm::CompressionConfig config;
  config.method = xcomm::Compression::kInt8;
  config.minBytes = 0;
  config.int8ChunkElems = kChunk;
  return config;
}

// Rank r's input: a different ramp per rank, so every shard's scale differs.
at::Tensor inputOf(int rank, int64_t numel) {
  return at::linspace(-1.0 - rank, 2.0 + 3 * rank, numel, at::kFloat).sin() * (rank + 1);
}

// The int8 allreduce spelled out on one thread with the same codec: each
// rank's shards, each shard reduced in rank order, every result unpacked.
at::Tensor expectedInt8(int size, int64_t numel, bool mean) {
  xcomm::Int8Codec codec(kChunk);
  const int64_t shard = codec.shardElems(numel, size);
  std::vector<at::Tensor> packed;
  for (int r = 0; r < size; ++r) packed.push_back(codec.packShards(inputOf(r, numel), size));
  std::vector<at::Tensor> reduced;
  for (int d = 0; d < size; ++d) {
    std::vector<at::Tensor> rows;
    for (int r = 0; r < size; ++r) rows.push_back(packed[r][d]);
    reduced.push_back(codec.reduceAndPack(at::stack(rows), shard, mean ? size : 1));
  }
  at::Tensor out = at::empty({numel}, at::kFloat);
  codec.unpackAll(at::cat(reduced), shard, out);
  return out;
}

}  // namespace

TEST_CASE("the int8 allreduce on the CPU equals its codec's arithmetic, every rank alike",
          "[compressed]") {
  const int size = 3;
  const auto limit = std::chrono::seconds(10);
  for (const bool mean : {false, true}) {
    for (const int64_t numel : {int64_t{1}, int64_t{1000}, int64_t{4099}}) {
      const at::Tensor expected = expectedInt8(size, numel, mean);
      xcomm::testing::onRankThreads(
          size, [&](int rank, const c10::intrusive_ptr<c10d::Store>& store) {
            auto transport = std::make_shared<xcomm::StoreRoute>(store, rank, size, limit);
            xcomm::CompressedAllreduce algorithm(int8Config(), size);
            c10d::AllreduceOptions opts;
            opts.reduceOp = c10d::ReduceOp(mean ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM);
            // twice: the second's messages match after the first's on one tag
            for (int round = 0; round < 2; ++round) {
              at::Tensor t = inputOf(rank, numel);
              // outside RANK_CHECK, which holds Catch's lock while it evaluates
              const auto ran = algorithm.run(*transport, t, opts);
              RANK_CHECK(ran == xcomm::Compression::kInt8);
              RANK_CHECK(at::equal(t, expected));
            }
            // a non-contiguous tensor is reduced in place all the same
            at::Tensor wide = at::zeros({numel, 2}, at::kFloat);
            at::Tensor column = wide.select(1, 0);
            column.copy_(inputOf(rank, numel));
            algorithm.run(*transport, column, opts);
            RANK_CHECK(at::equal(column, expected));
            RANK_CHECK(at::equal(wide.select(1, 1), at::zeros({numel}, at::kFloat)));
            transport->shutdown();
          });
    }
  }
}

TEST_CASE(
    "an int8 allreduce whose peer never sends fails at the op's timeout, named, and so do later "
    "ones",
    "[compressed]") {
  std::string error, nextError;
  auto took = std::chrono::milliseconds(0), nextTook = std::chrono::milliseconds(0);
  xcomm::testing::onRankThreads(2, [&](int rank, const c10::intrusive_ptr<c10d::Store>& store) {
    // The transport's own limit is longer: only the op's timeout can end the
    // wait in time. (Its receive thread waits out that limit at shutdown.)
    auto transport = std::make_shared<xcomm::StoreRoute>(store, rank, 2, std::chrono::seconds(3));
    if (rank == 1) return;  // never joins
    xcomm::CompressedAllreduce algorithm(int8Config(), 2);
    c10d::AllreduceOptions opts;
    opts.timeout = std::chrono::milliseconds(300);
    at::Tensor t = at::ones({5000});
    const auto start = std::chrono::steady_clock::now();
    try {
      algorithm.run(*transport, t, opts);
    } catch (const c10::DistBackendError& e) {
      error = e.what_without_backtrace();
    }
    took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                 start);
    // Its messages are half-exchanged: the next int8 allreduce fails at once,
    // naming the first failure, instead of pairing with stale messages.
    const auto again = std::chrono::steady_clock::now();
    try {
      algorithm.run(*transport, t, opts);
    } catch (const c10::DistBackendError& e) {
      nextError = e.what_without_backtrace();
    }
    nextTook = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - again);
    transport->shutdown();
  });
  CHECK_THAT(nextError, Contains("an earlier int8 all_reduce of this group failed") &&
                            Contains("rank 1") && Contains("abort or shrink"));
  CHECK(nextTook < std::chrono::milliseconds(100));
  CHECK_THAT(error,
             Contains("all_reduce (int8, all-to-all)") && Contains("rank 1") && Contains("300 ms"));
  // the op's 300 ms, not the transport's 3 s
  INFO(error << " after " << took.count() << " ms");
  CHECK(took >= std::chrono::milliseconds(250));
  CHECK(took < std::chrono::seconds(2));
}
