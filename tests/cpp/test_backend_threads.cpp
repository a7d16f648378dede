// XcommBackend's C++-only path: ranks are threads sharing a HashStore, as a
// LibTorch program would run them; results are checked against arithmetic.
#include <atomic>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "RankThreads.hpp"
#include "backend/GroupBuilder.hpp"
#include "backend/StoreRoute.hpp"
#include "backend/XcommBackend.hpp"
#include "backend/XcommWork.hpp"
#include "common/TorchCompat.hpp"
#include "observe/Stats.hpp"
#include "schedule/BucketLauncher.hpp"
#include "schedule/ChunkScheduler.hpp"
#include "schedule/CycleFusion.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

#include "RankChecks.hpp"

using Catch::Contains;
using xcomm::XcommBackend;

namespace {

using RankFn = std::function<void(XcommBackend&, int rank, int size)>;

// Runs fn on `size` ranks; rethrows the first rank's failure.
void runRanks(int size, const RankFn& fn,
              std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  xcomm::testing::onRankThreads(size, [&](int r, const c10::intrusive_ptr<c10d::Store>& store) {
    auto backend =
        XcommBackend::createWithStore(store, r, size, xcomm::XcommOptions::create(timeout));
    fn(*backend, r, size);
    backend->shutdown();
  });
}

at::Tensor rankValues(int rank, int64_t n, at::ScalarType dtype) {
  return (at::arange(n, at::kLong) + 10 * (rank + 1)).to(dtype);
}

}  // namespace

TEST_CASE("allreduce on every op matches the arithmetic", "[backend]") {
  for (int size : {1, 2, 3, 4}) {
    runRanks(size, [](XcommBackend& b, int rank, int size) {
      using R = c10d::ReduceOp;
      for (auto op : {R::SUM, R::PRODUCT, R::MIN, R::MAX, R::BAND, R::BOR, R::BXOR}) {
        std::vector<at::Tensor> ts{rankValues(rank, 5, at::kLong)};
        c10d::AllreduceOptions opts;
        opts.reduceOp = c10d::ReduceOp(op);
        b.allreduce(ts, opts)->wait();
        auto expected = rankValues(0, 5, at::kLong);
        for (int r = 1; r < size; ++r) {
          auto x = rankValues(r, 5, at::kLong);
          switch (op) {
            case R::SUM:
              expected += x;
              break;
            case R::PRODUCT:
              expected *= x;
              break;
            case R::MIN:
              expected = at::minimum(expected, x);
              break;
            case R::MAX:
              expected = at::maximum(expected, x);
              break;
            case R::BAND:
              expected = expected.bitwise_and(x);
              break;
            case R::BOR:
              expected = expected.bitwise_or(x);
              break;
            default:
              expected = expected.bitwise_xor(x);
              break;
          }
        }
        RANK_INFO_CHECK("size " << size << " op " << int(op), at::equal(ts[0], expected));
      }
    });
  }
}

TEST_CASE("float AVG and PREMUL_SUM, bitwise identical on every rank", "[backend]") {
  std::vector<at::Tensor> results(3);
  runRanks(3, [&](XcommBackend& b, int rank, int size) {
    std::vector<at::Tensor> avg{at::full({4}, 1.0 + rank)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::AVG);
    b.allreduce(avg, opts)->wait();
    RANK_CHECK(at::allclose(avg[0], at::full({4}, 2.0)));

    std::vector<at::Tensor> pre{at::rand({64}, at::TensorOptions().dtype(at::kFloat)) + rank};
    opts.reduceOp = xcomm::compat::makePreMulSum(0.5);
    b.allreduce(pre, opts)->wait();
    results[rank] = pre[0];
  });
  CHECK(at::equal(results[0], results[1]));
  CHECK(at::equal(results[1], results[2]));
}

TEST_CASE("non-contiguous tensors are reduced element by element", "[backend]") {
  runRanks(2, [](XcommBackend& b, int rank, int size) {
    auto base = at::zeros({8});
    base.index_put_({at::indexing::Slice(0, at::indexing::None, 2)}, 1.0 + rank);
    std::vector<at::Tensor> ts{base.slice(0, 0, 8, 2)};  // stride 2
    b.allreduce(ts)->wait();
    RANK_CHECK(at::equal(ts[0], at::full({4}, 3.0)));
    // The elements between the strided ones are untouched.
    RANK_CHECK(at::equal(base.slice(0, 1, 8, 2), at::zeros({4})));
  });
}

TEST_CASE("broadcast, allgather, gather and scatter move the right data", "[backend]") {
  runRanks(3, [](XcommBackend& b, int rank, int size) {
    for (int root = 0; root < size; ++root) {
      std::vector<at::Tensor> ts{rankValues(rank, 4, at::kFloat)};
      c10d::BroadcastOptions bo;
      bo.rootRank = root;
      b.broadcast(ts, bo)->wait();
      RANK_CHECK(at::equal(ts[0], rankValues(root, 4, at::kFloat)));
    }
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int r = 0; r < size; ++r) outs[0].push_back(at::zeros({4}, at::kInt));
    std::vector<at::Tensor> in{rankValues(rank, 4, at::kInt)};
    auto work = b.allgather(outs, in);
    work->wait();
    for (int r = 0; r < size; ++r) RANK_CHECK(at::equal(outs[0][r], rankValues(r, 4, at::kInt)));

    at::Tensor flatOut = at::zeros({4 * size}, at::kInt);
    b._allgather_base(flatOut, in[0])->wait();
    RANK_CHECK(at::equal(flatOut.view({size, 4})[size - 1], rankValues(size - 1, 4, at::kInt)));

    std::vector<std::vector<at::Tensor>> gathered;
    if (rank == 1)
      gathered = {{at::zeros({4}, at::kInt), at::zeros({4}, at::kInt), at::zeros({4}, at::kInt)}};
    c10d::GatherOptions go;
    go.rootRank = 1;
    b.gather(gathered, in, go)->wait();
    if (rank == 1) RANK_CHECK(at::equal(gathered[0][2], rankValues(2, 4, at::kInt)));

    std::vector<std::vector<at::Tensor>> toScatter;
    if (rank == 0)
      toScatter = {
          {rankValues(0, 4, at::kInt), rankValues(1, 4, at::kInt), rankValues(2, 4, at::kInt)}};
    std::vector<at::Tensor> got{at::zeros({4}, at::kInt)};
    b.scatter(got, toScatter)->wait();
    RANK_CHECK(at::equal(got[0], rankValues(rank, 4, at::kInt)));
  });
}

TEST_CASE("the coalesced all-gathers and reduce-scatter run on the store route, one op per tensor",
          "[backend]") {
  // A C++-only group's inner route is StoreRoute: these were c10d's "not
  // supported" before it ran them.
  runRanks(3, [](XcommBackend& b, int rank, int size) {
    std::vector<at::Tensor> ins{rankValues(rank, 2, at::kFloat), rankValues(rank, 5, at::kFloat)};
    std::vector<at::Tensor> outs{at::zeros({2 * size}), at::zeros({5 * size})};
    b.allgather_into_tensor_coalesced(outs, ins)->wait();
    for (int r = 0; r < size; ++r) {
      RANK_CHECK(at::equal(outs[0].narrow(0, 2 * r, 2), rankValues(r, 2, at::kFloat)));
      RANK_CHECK(at::equal(outs[1].narrow(0, 5 * r, 5), rankValues(r, 5, at::kFloat)));
    }

    // c10d's lists: one per rank, of one tensor per input.
    std::vector<std::vector<at::Tensor>> lists;
    for (int r = 0; r < size; ++r) lists.push_back({at::zeros({2}), at::zeros({5})});
    b.allgather_coalesced(lists, ins)->wait();
    for (int r = 0; r < size; ++r) {
      RANK_CHECK(at::equal(lists[r][0], rankValues(r, 2, at::kFloat)));
      RANK_CHECK(at::equal(lists[r][1], rankValues(r, 5, at::kFloat)));
    }

    // Every rank gives (rank + 1) * arange: rank r's shard of the sum is
    // 6 * arange over its rows.
    std::vector<at::Tensor> full{at::arange(3 * size, at::kFloat) * (rank + 1),
                                 at::arange(size, at::kFloat) * (rank + 1)};
    std::vector<at::Tensor> shards{at::zeros({3}), at::zeros({1})};
    b.reduce_scatter_tensor_coalesced(shards, full)->wait();
    RANK_CHECK(at::equal(shards[0], at::arange(3 * rank, 3 * rank + 3, at::kFloat) * 6));
    RANK_CHECK(at::equal(shards[1], at::full({1}, 6.0 * rank)));
  });
}

TEST_CASE("a C++-only group refuses monitored_barrier and names the backend that has one",
          "[backend]") {
  // Gloo's is the only monitored barrier; the store route says so, as
  // c10d's default does for a backend without one.
  runRanks(2, [](XcommBackend& b, int /*rank*/, int /*size*/) {
    c10d::BarrierOptions opts;
    opts.timeout = std::chrono::milliseconds(2000);
    RANK_CHECK_THROWS_WITH(b.monitoredBarrier(opts, false),
                           Catch::Contains("does not support monitoredBarrier, only GLOO"));
  });
}

TEST_CASE("under the profiler a C++-only group's op shows its store route's event inside xcomm's",
          "[backend]") {
  // The store route's works carry c10d's "<backend>:<op>" titles, as Gloo's do.
  static std::atomic<int> xcommEvents{0}, storeEvents{0};
  xcommEvents = 0;
  storeEvents = 0;
  auto handle = at::addGlobalCallback(at::RecordFunctionCallback(
      [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
        const std::string name = fn.name();
        if (name == "xcomm:all_reduce") xcommEvents++;
        if (name == "store:all_reduce") storeEvents++;
        return nullptr;
      }));
  runRanks(2, [](XcommBackend& b, int rank, int size) {
    std::vector<at::Tensor> ts{at::ones({4})};
    b.allreduce(ts)->wait();
    RANK_CHECK(at::equal(ts[0], at::full({4}, 2.0)));
  });
  at::removeCallback(handle);
  CHECK(xcommEvents.load() == 2);
  CHECK(storeEvents.load() == 2);
}

TEST_CASE("reduce_scatter_tensor and uneven all_to_all_single", "[backend]") {
  runRanks(2, [](XcommBackend& b, int rank, int size) {
    auto in = at::arange(6, at::kFloat) * (rank + 1);  // sum over ranks = 3 * arange
    auto out = at::zeros({3});
    b._reduce_scatter_base(out, in)->wait();
    RANK_CHECK(at::equal(out, at::arange(3 * rank, 3 * rank + 3, at::kFloat) * 3));

    // rank 0 sends 1 row to rank 0 and 2 rows to rank 1; rank 1 sends 3 and 0.
    std::vector<int64_t> inSplits =
        rank == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{3, 0};
    std::vector<int64_t> outSplits =
        rank == 0 ? std::vector<int64_t>{1, 3} : std::vector<int64_t>{2, 0};
    auto a2aIn = at::arange(3, at::kFloat) + 100 * rank;
    auto a2aOut = at::zeros({rank == 0 ? 4 : 2});
    b.alltoall_base(a2aOut, a2aIn, outSplits, inSplits)->wait();
    auto expected = rank == 0 ? at::tensor(std::vector<float>{0, 100, 101, 102})
                              : at::tensor(std::vector<float>{1, 2});
    RANK_CHECK(at::equal(a2aOut, expected));
  });
}

TEST_CASE("send/recv in a ring, recv from any source, and the future's value", "[backend]") {
  runRanks(3, [](XcommBackend& b, int rank, int size) {
    std::vector<at::Tensor> out{at::full({3}, double(rank))};
    std::vector<at::Tensor> in{at::zeros({3})};
    auto recvWork = b.recv(in, (rank + size - 1) % size, 7);
    b.send(out, (rank + 1) % size, 7)->wait();
    recvWork->wait();
    RANK_CHECK(at::equal(in[0], at::full({3}, double((rank + size - 1) % size))));

    if (rank == 0) {
      for (int i = 0; i < size - 1; ++i) {
        std::vector<at::Tensor> any{at::zeros({1})};
        auto w = b.recvAnysource(any, 3);
        w->wait();
        RANK_CHECK(any[0].item<float>() == float(w->sourceRank()));
      }
    } else {
      std::vector<at::Tensor> mine{at::full({1}, double(rank))};
      b.send(mine, 0, 3)->wait();
    }

    std::vector<at::Tensor> ts{at::ones({2})};
    auto work = b.allreduce(ts);
    auto fut = work->getFuture();
    fut->wait();
    auto value = fut->value().toTensorVector();
    RANK_REQUIRE(value.size() == 1);
    RANK_CHECK(at::equal(value[0], at::full({2}, double(size))));
    b.barrier()->wait();
  });
}

TEST_CASE("over a TCPStore, a receive waiting on one thread does not hold up a send on another",
          "[backend]") {
  // Each rank has its own TCPStore client, as separate processes would. Both
  // post a receive, let it start waiting, then send: a receive that blocked
  // in the client's wait would hold its connection, and both would time out.
  c10d::TCPStoreOptions serverOpts;
  serverOpts.port = 0;
  serverOpts.isServer = true;
  serverOpts.numWorkers = std::nullopt;
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", serverOpts);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        c10d::TCPStoreOptions opts;
        opts.port = server->getPort();
        opts.isServer = false;
        auto client = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
        xcomm::StoreRoute b(client, rank, 2, std::chrono::seconds(5));
        std::vector<at::Tensor> in{at::zeros({4})};
        auto recvWork = b.recv(in, 1 - rank, 0);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        std::vector<at::Tensor> out{at::full({4}, double(rank + 1))};
        b.send(out, 1 - rank, 0)->wait();
        recvWork->wait();
        RANK_CHECK(at::equal(in[0], at::full({4}, double(2 - rank))));
        b.shutdown();
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(3));
}

TEST_CASE("a missing peer is an error within the timeout, not a hang", "[backend]") {
  const auto start = std::chrono::steady_clock::now();
  // Rank 1 shuts its backend down without joining: it announces that it
  // left (CheckedRoute::announceDeparture), or, if rank 0's check began
  // after its connections closed, rank 0 times out. Either names rank 1.
  CHECK_THROWS_WITH(runRanks(
                        2,
                        [](XcommBackend& b, int rank, int size) {
                          if (rank == 1) return;  // never joins the collective
                          std::vector<at::Tensor> ts{at::ones({2})};
                          b.allreduce(ts)->wait();
                        },
                        std::chrono::milliseconds(500)),
                    (Contains("timed out") || Contains("left the group") ||
                     Contains("connection to rank 1 was lost")) &&
                        Contains("rank 1"));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
}

TEST_CASE("bad input raises before anything is sent", "[backend]") {
  runRanks(1, [](XcommBackend& b, int rank, int size) {
    std::vector<at::Tensor> floats{at::ones({2})};
    c10d::AllreduceOptions band;
    band.reduceOp = c10d::ReduceOp(c10d::ReduceOp::BAND);
    CHECK_THROWS_WITH(b.allreduce(floats, band), Contains("BAND"));
    c10d::BroadcastOptions bo;
    bo.rootRank = 3;
    CHECK_THROWS_WITH(b.broadcast(floats, bo), Contains("root rank 3"));
    at::Tensor out = at::zeros({3});
    CHECK_THROWS_WITH(b._allgather_base(out, floats[0]), Contains("output tensor has 3"));
  });
}

TEST_CASE("fused small allreduces equal the arithmetic and travel together", "[fusion]") {
  const auto fusedBefore = [] {
    auto snap = xcomm::StatsRegistry::global().snapshot();
    auto it = snap.find("ALLREDUCE_FUSED");
    return it == snap.end() ? uint64_t{0} : it->second.calls;
  }();
  constexpr int kSize = 2;
  auto controlStore = c10::make_intrusive<c10d::HashStore>();
  runRanks(kSize, [&](XcommBackend& b, int rank, int size) {
    auto control = std::make_shared<xcomm::StoreRoute>(
        c10::make_intrusive<c10d::PrefixStore>("fusion", controlStore), rank, size,
        std::chrono::seconds(20));
    b.setFusionThreshold(1024, {}, control);
    std::vector<std::vector<at::Tensor>> held;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int64_t n : {3, 17, 40, 1}) {  // 244 bytes of int64: one transfer
      held.push_back({rankValues(rank, n, at::kLong)});
      works.push_back(b.allreduce(held.back()));
    }
    works.back()->wait();  // asking for one result sends them all
    for (size_t i = 0; i < works.size(); ++i) {
      works[i]->wait();
      auto expected = rankValues(0, held[i][0].numel(), at::kLong);
      for (int r = 1; r < size; ++r) expected += rankValues(r, held[i][0].numel(), at::kLong);
      RANK_CHECK(at::equal(held[i][0], expected));
    }
  });
  const auto snap = xcomm::StatsRegistry::global().snapshot();
  // One fused transfer per rank (both ranks share the process-wide registry).
  CHECK(snap.at("ALLREDUCE_FUSED").calls - fusedBefore == kSize);
}

TEST_CASE("a fusion plan cuts held ops by kind and threshold, from the ops alone", "[fusion]") {
  std::vector<at::Tensor> tensors{at::zeros({10}), at::zeros({10}), at::zeros({10}, at::kLong),
                                  at::zeros({30}), at::zeros({30}), at::zeros({1})};
  c10d::AllreduceOptions sum;
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MAX);
  std::vector<const c10d::AllreduceOptions*> opts{&sum, &sum, &sum, &sum, &sum, &max};
  std::vector<std::pair<const at::Tensor*, const c10d::AllreduceOptions*>> ops;
  for (size_t i = 0; i < tensors.size(); ++i) ops.emplace_back(&tensors[i], opts[i]);
  // 40+40 float bytes | int64 | 120 float bytes (a second 120 would pass 200) | 120 | MAX
  const auto groups = xcomm::FusionPlan{}.groups(ops, 200);
  const std::vector<std::pair<size_t, size_t>> expected{{0, 2}, {2, 3}, {3, 4}, {4, 5}, {5, 6}};
  CHECK(groups == expected);
  CHECK(xcomm::FusionPlan{}.groups({}, 200).empty());
}

TEST_CASE("a fusion cycle sends held ops unasked, the same groups on every rank", "[fusion]") {
  constexpr int kSize = 2;
  auto controlStore = c10::make_intrusive<c10d::HashStore>();
  runRanks(kSize, [&](XcommBackend& b, int rank, int size) {
    auto control = std::make_shared<xcomm::StoreRoute>(
        c10::make_intrusive<c10d::PrefixStore>("fusion", controlStore), rank, size,
        std::chrono::seconds(20));
    b.setFusionThreshold(1024, std::chrono::milliseconds(5), control);
    // Rank 1 starts late: rank 0's first round waits for it to catch up.
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    std::vector<std::vector<at::Tensor>> held;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int64_t n : {3, 17, 40, 1, 9, 2}) {
      held.push_back({rankValues(rank, n, at::kLong)});
      works.push_back(b.allreduce(held.back()));
      if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(3));
    }
    // Nobody waits: isCompleted() does not hurry a cycle, its thread sends.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    bool done = false;
    while (!done && std::chrono::steady_clock::now() < deadline) {
      done = true;
      for (auto& w : works) done = done && w->isCompleted();
      if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    RANK_CHECK(done);
    for (size_t i = 0; i < works.size(); ++i) {
      works[i]->wait();
      auto expected = rankValues(0, held[i][0].numel(), at::kLong);
      for (int r = 1; r < size; ++r) expected += rankValues(r, held[i][0].numel(), at::kLong);
      RANK_CHECK(at::equal(held[i][0], expected));
    }
    // Another collective after the held ops: it goes after them everywhere.
    std::vector<at::Tensor> big{rankValues(rank, 1000, at::kLong)};
    b.allreduce(big)->wait();
    RANK_CHECK(at::equal(big[0], rankValues(0, 1000, at::kLong) + rankValues(1, 1000, at::kLong)));
  });
}

TEST_CASE("bad fusion-cycle and bucket-launcher settings are refused with a message",
          "[fusion][schedule]") {
  auto controlStore = c10::make_intrusive<c10d::HashStore>();
  runRanks(1, [&](XcommBackend& b, int rank, int size) {
    auto control = std::make_shared<xcomm::StoreRoute>(
        c10::make_intrusive<c10d::PrefixStore>("fusion", controlStore), rank, size,
        std::chrono::seconds(20));
    const std::chrono::milliseconds cycle(5);
    CHECK_THROWS_WITH(b.setFusionThreshold(0, cycle, control),
                      Contains("needs fusion_threshold_bytes > 0"));
    CHECK_THROWS_WITH(b.setFusionThreshold(1024, cycle), Contains("needs a control backend"));
    CHECK_THROWS_WITH(b.setFusionThreshold(1024), Contains("needs a control backend"));
    CHECK_THROWS_WITH(b.setFusionThreshold(1024, std::chrono::microseconds(-1), control),
                      Contains("must be >= 0"));

    auto backend = c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(&b);
    using Launcher = xcomm::BucketLauncher;
    CHECK_THROWS_WITH(Launcher({}, {}, backend), Contains("no buckets"));
    CHECK_THROWS_WITH(Launcher({at::zeros({2, 2})}, {{0, 0, 4}}, backend),
                      Contains("flat contiguous"));
    CHECK_THROWS_WITH(Launcher({at::zeros({4})}, {{0, 2, 3}}, backend),
                      Contains("outside its bucket"));
    CHECK_THROWS_WITH(Launcher({at::zeros({4})}, {{0, 0, 3}}, backend),
                      Contains("cover 3 of its 4"));
    Launcher launcher({at::zeros({4})}, {{0, 0, 4}}, backend);
    CHECK_THROWS_WITH(launcher.gradReady(1, at::zeros({4})), Contains("no parameter 1"));
    CHECK_THROWS_WITH(launcher.gradReady(0, at::zeros({3})), Contains("gradient of 3 elements"));
    CHECK_THROWS_WITH(launcher.future(2), Contains("no bucket 2"));

    // An allreduce after shutdown fails its work instead of waiting for a round.
    b.setFusionThreshold(1024, cycle, control);
    b.shutdown();
    std::vector<at::Tensor> late{at::ones({3})};
    CHECK_THROWS_WITH(b.allreduce(late)->wait(), Contains("shut down"));
  });
}

TEST_CASE("the bucket launcher averages in index order and copies the mean back", "[schedule]") {
  runRanks(2, [](XcommBackend& b, int rank, int size) {
    // Bucket 0: params 0 (3 elems) and 1 (2); bucket 1: param 2 (4).
    std::vector<at::Tensor> buffers{at::zeros({5}), at::zeros({4})};
    std::vector<xcomm::BucketLauncher::Slot> slots{{0, 0, 3}, {0, 3, 2}, {1, 0, 4}};
    auto backend = c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(&b);
    xcomm::BucketLauncher launcher(buffers, slots, backend);
    for (int iteration = 0; iteration < 2; ++iteration) {
      std::vector<at::Tensor> grads{rankValues(rank + iteration, 3, at::kFloat).view({3, 1}),
                                    rankValues(rank + iteration, 2, at::kFloat),
                                    rankValues(rank + iteration, 4, at::kFloat).view({2, 2})};
      std::vector<at::Tensor> expected;
      for (int p = 0; p < 3; ++p) {
        auto sum = at::zeros_like(grads[p]);
        for (int r = 0; r < size; ++r) {
          sum += rankValues(r + iteration, grads[p].numel(), at::kFloat).view(grads[p].sizes());
        }
        expected.push_back(sum / size);
      }
      // Bucket 1 fills first; it may not go before bucket 0 (same order on every rank).
      launcher.gradReady(2, grads[2]);
      RANK_CHECK(launcher.launched() == 0);
      RANK_CHECK_THROWS_WITH(launcher.gradReady(2, grads[2]), Contains("ready twice"));
      launcher.gradReady(0, grads[0]);
      RANK_CHECK(launcher.launched() == 0);
      launcher.gradReady(1, grads[1]);
      RANK_CHECK(launcher.launched() == 2);
      for (int bucket = 0; bucket < 2; ++bucket) {
        auto future = launcher.future(bucket);
        future->wait();
        RANK_CHECK(!future->hasError());
        RANK_CHECK(launcher.landedUs(bucket) >= launcher.readyUs(bucket));
      }
      for (int p = 0; p < 3; ++p) RANK_CHECK(at::allclose(grads[p], expected[p]));
      launcher.reset();
    }
  });
}

TEST_CASE("the chunk scheduler sends the first layers first, the same order on every rank",
          "[schedule]") {
  // Buckets of 10, 6 and 4 floats in chunks of 4: chunks 0-2 | 3-4 | 5. All
  // are marked ready at once; after chunk 0 lands (one in flight) every chunk
  // is known ready everywhere, so the last bucket (the first layers) goes next.
  for (bool priority : {false, true}) {
    runRanks(2, [priority](XcommBackend& b, int rank, int size) {
      std::vector<at::Tensor> buffers;
      std::vector<at::Tensor> expected;
      for (int64_t n : {10, 6, 4}) {
        buffers.push_back(rankValues(rank, n, at::kFloat));
        expected.push_back(rankValues(0, n, at::kFloat) + rankValues(1, n, at::kFloat));
      }
      std::vector<int> landed;
      std::exception_ptr error;
      auto backend = c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(&b);
      xcomm::ChunkScheduler scheduler(
          buffers, 16, priority, backend, [&](int bucket, int64_t) { landed.push_back(bucket); },
          [&](std::exception_ptr e) { error = e; }, /*maxInFlight=*/1);
      scheduler.markReady({0, 1, 2});
      scheduler.join();
      RANK_CHECK(!error);
      RANK_CHECK(scheduler.order() == (priority ? std::vector<int>{0, 5, 3, 4, 1, 2}
                                                : std::vector<int>{0, 1, 2, 3, 4, 5}));
      RANK_CHECK(landed == (priority ? std::vector<int>{2, 1, 0} : std::vector<int>{0, 1, 2}));
      for (size_t i = 0; i < buffers.size(); ++i) RANK_CHECK(at::equal(buffers[i], expected[i]));
      (void)size;
    });
  }
}

namespace {

// An inner route that answers a synchronous op as NCCL does since torch
// 2.7: it runs the op on the caller's stream and returns no work.
class NoWorkWhenSync : public xcomm::StoreRoute {
 public:
  using StoreRoute::StoreRoute;
  c10::intrusive_ptr<c10d::Work> run(xcomm::Op op) override {
    const bool keepWork = op.asyncOp || op.kind != xcomm::OpKind::kAllreduce;
    auto work = StoreRoute::run(std::move(op));
    if (keepWork) return work;
    work->wait();
    return {};
  }
};

}  // namespace

TEST_CASE("a synchronous op whose inner backend returns no work returns none, finished",
          "[backend]") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  xcomm::InnerBackendFactory factory;
  factory.cpu = [](const c10::intrusive_ptr<c10d::Store>& prefixed, int r, int n,
                   std::chrono::milliseconds timeout) -> std::shared_ptr<xcomm::InnerRoute> {
    return std::make_shared<NoWorkWhenSync>(prefixed, r, n, timeout);
  };
  auto b =
      xcomm::buildGroup(store, 0, 1, xcomm::XcommOptions::create(std::chrono::seconds(10)), factory,
                        /*allowShm=*/false);
  // Non-contiguous and a PREMUL_SUM the inner backend lacks: xcomm stages a
  // scaled copy and must copy the result back before it returns.
  auto base = at::arange(8, at::kFloat).reshape({2, 4});
  std::vector<at::Tensor> tensors{base.t()};
  c10d::AllreduceOptions opts;
  opts.reduceOp = xcomm::compat::makePreMulSum(2.0);
  opts.asyncOp = false;
  auto work = b->allreduce(tensors, opts);
  CHECK(!work);
  CHECK(at::equal(base, 2 * at::arange(8, at::kFloat).reshape({2, 4})));
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.asyncOp = true;
  work = b->allreduce(tensors, opts);
  REQUIRE(work);
  CHECK(work->wait());
}

TEST_CASE("a synchronous compressed allreduce whose inner backend returns no work returns none",
          "[backend]") {
  // The fp16 cast route on NCCL: the low-precision SUM runs on the caller's
  // stream and NCCL answers with no work; xcomm must cast back before it
  // returns, and return none.
  xcomm::testing::onRankThreads(2, [](int r, const c10::intrusive_ptr<c10d::Store>& store) {
    xcomm::InnerBackendFactory factory;
    factory.cpu = [](const c10::intrusive_ptr<c10d::Store>& prefixed, int rank, int n,
                     std::chrono::milliseconds timeout) -> std::shared_ptr<xcomm::InnerRoute> {
      return std::make_shared<NoWorkWhenSync>(prefixed, rank, n, timeout);
    };
    auto options = xcomm::XcommOptions::create(std::chrono::seconds(20));
    options->compression.method = xcomm::Compression::kFp16;
    options->compression.minBytes = 0;
    // As on NCCL, which CheckedRoute does not wrap (it always returns a work).
    options->checkCollectives = false;
    auto b = xcomm::buildGroup(store, r, 2, options, factory, /*allowShm=*/false);
    // 1/3 is not a half: the result shows the cast happened.
    std::vector<at::Tensor> tensors{at::full({64}, 1.0 / 3 + r, at::kFloat)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.asyncOp = false;
    auto work = b->allreduce(tensors, opts);
    // The halves of both ranks' values, summed in half precision.
    const auto halves = at::tensor({1.0f / 3, 1.0f / 3 + 1}).to(at::kHalf);
    const float want = (halves[0] + halves[1]).to(at::kFloat).item<float>();
    RANK_CHECK(!work);
    RANK_CHECK(at::equal(tensors[0], at::full({64}, want, at::kFloat)));
    RANK_CHECK((b->compression() && b->compression()->counters().calls == 1));
    b->shutdown();
  });
}

namespace {

// A route whose every op has already completed when it returns: a fused
// transfer's callback then runs inside the fusion thread's attach().
class CompletedRoute final : public xcomm::Route {
 public:
  CompletedRoute() : Route(0, 1) {}
  std::string name() const override { return "completed"; }
  c10::intrusive_ptr<c10d::Work> run(xcomm::Op /*op*/) override {
    return c10::make_intrusive<CompletedWork>();
  }
  void monitoredBarrier(const c10d::BarrierOptions& /*opts*/, bool /*waitAllRanks*/) override {}
  void setTimeout(std::chrono::milliseconds /*timeout*/) override {}
  std::chrono::milliseconds timeout() const override { return std::chrono::seconds(5); }
  void shutdown() override {}
  void abort() override {}

 private:
  class CompletedWork final : public c10d::Work {
   public:
    CompletedWork() : future_(c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get())) {
      future_->markCompleted(c10::IValue());
    }
    bool isCompleted() override { return true; }
    bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

   private:
    c10::intrusive_ptr<c10::ivalue::Future> future_;
  };
};

// Whether a lock is free when a tensor is freed. A tensor freed by a
// background thread may own its Python object, which takes the GIL to free,
// while a Python thread holding the GIL takes the lock under test: freed
// under it, the two threads wait for each other for good. tensor()'s deleter
// runs `takesLock` on another thread and counts the free as under the lock
// unless that returns within 500 ms (the thread finishes once the lock is
// free again, and is joined by join() or the destructor).
class FreedUnderLockProbe {
 public:
  explicit FreedUnderLockProbe(std::function<void()> takesLock)
      : takesLock_(std::move(takesLock)) {}
  ~FreedUnderLockProbe() { join(); }
  FreedUnderLockProbe(const FreedUnderLockProbe&) = delete;
  FreedUnderLockProbe& operator=(const FreedUnderLockProbe&) = delete;

  // A float tensor over `data` (not owned) whose free is probed.
  at::Tensor tensor(float* data, int64_t numel) {
    return at::from_blob(data, {numel}, [this](void* /*unused*/) { onFree(); });
  }
  bool waitFreed(int count, std::chrono::seconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    return freedCv_.wait_for(lock, timeout, [&] { return freed_ >= count; });
  }
  int freed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return freed_;
  }
  int freedUnderLock() {
    std::lock_guard<std::mutex> lock(mutex_);
    return freedUnderLock_;
  }
  void join() {
    std::vector<std::thread> probes;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      probes.swap(probes_);
    }
    for (auto& probe : probes) probe.join();
  }

 private:
  void onFree() {
    auto granted = std::make_shared<std::promise<void>>();
    auto got = granted->get_future();
    std::thread probe([this, granted] {
      takesLock_();
      granted->set_value();
    });
    const bool free = got.wait_for(std::chrono::milliseconds(500)) == std::future_status::ready;
    std::lock_guard<std::mutex> lock(mutex_);
    probes_.push_back(std::move(probe));
    freedUnderLock_ += free ? 0 : 1;
    ++freed_;
    freedCv_.notify_all();
  }

  std::function<void()> takesLock_;
  std::mutex mutex_;
  std::condition_variable freedCv_;
  std::vector<std::thread> probes_;
  int freed_ = 0;
  int freedUnderLock_ = 0;
};

}  // namespace

TEST_CASE("a fused op's tensor is freed outside the fusion's lock", "[fusion]") {
  // The fusion thread drops a round's ops; a Python thread takes the
  // fusion's lock in getFuture() and wait() (expedite).
  auto route = std::make_shared<CompletedRoute>();
  auto fusion =
      xcomm::makeFusionBuffer(1024, std::chrono::microseconds(0), route, std::chrono::seconds(5));
  FreedUnderLockProbe probe([&fusion] { fusion->expedite(true); });
  constexpr int kOps = 3;
  static float data[kOps][4] = {};
  for (int i = 0; i < kOps; ++i) {
    // Only the fusion holds the op and its tensor: its work is not kept.
    fusion->enqueue(route, 0, probe.tensor(data[i], 4), c10d::AllreduceOptions{}, nullptr,
                    c10::IValue());
  }
  CHECK(probe.waitFreed(kOps, std::chrono::seconds(10)));
  fusion->stop();
  probe.join();
  CHECK(probe.freedUnderLock() == 0);
}

TEST_CASE("a finished work is freed outside the pending works' lock", "[backend]") {
  // The group keeps weak references to the works it handed out (abort()
  // fails those still pending); a finished work the program dropped is freed
  // when its entry is pruned, and its tensors with it. Pruning runs in every
  // collective's call, under the list's lock.
  xcomm::PendingWorks pending;
  auto finished = [] {
    auto work = c10::make_intrusive<xcomm::FutureWork>(0, c10d::OpType::ALLREDUCE, nullptr,
                                                       c10::IValue(), c10::NoneType::get());
    work->markSucceeded();
    return work;
  };
  FreedUnderLockProbe probe([&] { pending.add(finished()); });  // add() takes the list's lock
  static float data[4] = {};
  {
    const at::Tensor tensor = probe.tensor(data, 4);
    auto work = c10::make_intrusive<xcomm::FutureWork>(
        0, c10d::OpType::ALLREDUCE, nullptr, c10::IValue(std::vector<at::Tensor>{tensor}),
        c10::ListType::create(c10::TensorType::get()));
    pending.add(work);
    work->markSucceeded();
  }  // the program's references are gone; the list's weak one keeps the work
  for (int i = 0; i < 80 && probe.freed() == 0; ++i) pending.add(finished());  // pruned at 64
  probe.join();
  CHECK(probe.freed() == 1);
  CHECK(probe.freedUnderLock() == 0);
}

TEST_CASE("the bucket launcher frees last iteration's grads outside its lock", "[schedule]") {
  // reset() drops the grads gradReady() kept for the copy-back, while Python
  // reads launched() or future() under the same lock.
  runRanks(1, [](XcommBackend& b, int /*rank*/, int /*size*/) {
    auto backend = c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(&b);
    xcomm::BucketLauncher launcher({at::zeros({4})}, {{0, 0, 4}}, backend);
    FreedUnderLockProbe probe([&launcher] { (void)launcher.launched(); });
    static float data[4] = {1, 2, 3, 4};
    launcher.gradReady(0, probe.tensor(data, 4));
    launcher.future(0)->wait();
    launcher.reset();  // the launcher held the grad's last reference
    probe.join();
    RANK_CHECK(probe.freed() == 1);
    RANK_CHECK(probe.freedUnderLock() == 0);
  });
}

TEST_CASE("a message received is kept when its store cannot delete it any more", "[backend]") {
  // A store whose host finished after a barrier's last message (rank 0 of a
  // LibTorch program exits) refuses the receiver's delete: the message itself
  // was read, so the collective succeeds.
  struct StoreThatCannotDelete : c10d::HashStore {
    std::atomic<int> deletesRefused{0};
    bool deleteKey(const std::string&) override {
      deletesRefused++;
      C10_THROW_ERROR(DistNetworkError, "Failed to recv, got 0 bytes (store host gone)");
    }
  };
  auto store = c10::make_intrusive<StoreThatCannotDelete>();
  xcomm::testing::onRankThreads(2, store, [](int rank, const c10::intrusive_ptr<c10d::Store>& s) {
    xcomm::StoreRoute route(s, rank, 2, std::chrono::seconds(5));
    std::vector<at::Tensor> t{at::full({3}, double(rank + 1))};
    route.run(xcomm::Op::allreduce(t, c10d::AllreduceOptions{}))->wait();
    RANK_CHECK(at::equal(t[0], at::full({3}, 3.0)));
    route.run(xcomm::Op::barrier(c10d::BarrierOptions{}))->wait();
    route.shutdown();
  });
  CHECK(store->deletesRefused.load() >= 4);  // each rank's allreduce and barrier message
}
