// DirectExchange: all-to-all and all-gather as point-to-point messages, on
// rank threads over the store transport; results checked against arithmetic.
#include <chrono>
#include <vector>

#include "RankThreads.hpp"
#include "backend/StoreRoute.hpp"
#include "collectives/gloo/DirectExchange.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

#include "RankChecks.hpp"

using Catch::Contains;
using xcomm::DirectExchange;

namespace {

// What rank `src` sends rank `dst` in the uneven all-to-all: some pieces empty.
int64_t piece(int src, int dst) {
  return (src + dst) % 3 == 1 ? 0 : 5 + 3 * src + dst;
}

double valueAt(int src, int dst, int64_t i) {
  return 1000.0 * src + 100.0 * dst + static_cast<double>(i);
}

constexpr auto kLimit = std::chrono::seconds(10);

}  // namespace

TEST_CASE("DirectExchange's all-to-all and all-gather move every piece to its rank", "[direct]") {
  const int size = 3;
  xcomm::testing::onRankThreads(size, [&](int rank, const c10::intrusive_ptr<c10d::Store>& store) {
    xcomm::StoreRoute p2p(store, rank, size, kLimit);
    DirectExchange direct(p2p, 3);

    // Uneven all_to_all_single of doubles; twice, so the second exchange's
    // messages match after the first's on the same tag.
    for (int round = 0; round < 2; ++round) {
      std::vector<int64_t> sendBytes, recvBytes;
      std::vector<at::Tensor> mine;
      int64_t inElems = 0, outElems = 0;
      for (int p = 0; p < size; ++p) {
        auto t = at::arange(piece(rank, p), at::kDouble) + valueAt(rank, p, round);
        mine.push_back(t);
        sendBytes.push_back(piece(rank, p) * 8);
        recvBytes.push_back(piece(p, rank) * 8);
        inElems += piece(rank, p);
        outElems += piece(p, rank);
      }
      at::Tensor input = at::cat(mine);
      REQUIRE(input.numel() == inElems);
      at::Tensor output = at::full({outElems}, -1.0, at::kDouble);
      auto posted = direct.postAlltoall(output, input, sendBytes, recvBytes);
      DirectExchange::waitAll(posted, "all_to_all_single", "rank",
                              std::chrono::steady_clock::now() + kLimit, kLimit);
      int64_t at = 0;
      for (int p = 0; p < size; ++p) {
        auto expected = at::arange(piece(p, rank), at::kDouble) + valueAt(p, rank, round);
        RANK_CHECK(at::equal(output.narrow(0, at, piece(p, rank)), expected));
        at += piece(p, rank);
      }
    }

    // all_gather_into_tensor of int64 rows, and the list form of bools.
    at::Tensor row = at::arange(7, at::kLong) + 100 * rank;
    at::Tensor gathered = at::zeros({size * 7}, at::kLong);
    DirectExchange::waitAll(direct.postAllgather(gathered, row), "all_gather_into_tensor", "rank",
                            std::chrono::steady_clock::now() + kLimit, kLimit);
    std::vector<at::Tensor> flags;
    for (int p = 0; p < size; ++p) flags.push_back(at::zeros({4}, at::kBool));
    at::Tensor mineFlags = at::arange(4, at::kLong).remainder(size).eq(rank);
    DirectExchange::waitAll(direct.postAllgather(flags, mineFlags), "all_gather", "rank",
                            std::chrono::steady_clock::now() + kLimit, kLimit);
    for (int p = 0; p < size; ++p) {
      RANK_CHECK(at::equal(gathered.narrow(0, 7 * p, 7), at::arange(7, at::kLong) + 100 * p));
      RANK_CHECK(at::equal(flags[p], at::arange(4, at::kLong).remainder(size).eq(p)));
    }
    p2p.shutdown();
  });
}

TEST_CASE("a peer that never sends fails DirectExchange's wait at its limit, named", "[direct]") {
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  xcomm::testing::onRankThreads(2, [&](int rank, const c10::intrusive_ptr<c10d::Store>& store) {
    const auto limit = std::chrono::milliseconds(300);
    xcomm::StoreRoute p2p(store, rank, 2, limit);
    if (rank == 1) return;  // never posts its messages
    DirectExchange direct(p2p, 3);
    at::Tensor in = at::ones({2, 8});
    at::Tensor out = at::zeros({2, 8});
    auto posted = direct.postAlltoall(out, in, {32, 32}, {32, 32});
    try {
      DirectExchange::waitAll(posted, "all_to_all_single", "rank",
                              std::chrono::steady_clock::now() + limit, limit);
    } catch (const c10::DistBackendError& e) {
      error = e.what_without_backtrace();
    }
    p2p.shutdown();
  });
  CHECK_THAT(error, Contains("xcomm.all_to_all_single: the transfer with rank 1 did not complete "
                             "within 300 ms"));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
}
