// The shared-memory transport and its kernels, with ranks as threads of this
// process over one HashStore (the segment and futex protocol are the same as
// between processes).
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "RankThreads.hpp"
#include "collectives/reduce/ReduceKernels.hpp"
#include "collectives/reduce/VectorReduce.hpp"
#include "collectives/shm/ShmCollectives.hpp"
#include "transport/ShmTransport.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

using RedOp = c10d::ReduceOp::RedOpType;

namespace {

std::vector<std::string> shmFiles() {
  std::vector<std::string> names;
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) {
      const std::string name = e->d_name;
      if (name.rfind("xcomm-shm-", 0) == 0) names.push_back(name);
    }
    closedir(dir);
  }
  return names;
}

at::Tensor input(at::ScalarType dtype, int64_t n, int seed, bool small) {
  at::manual_seed(seed);
  if (dtype == at::kBool) return at::randint(0, 2, {n}).to(at::kBool);
  if (at::isFloatingType(dtype)) {
    auto t = at::randn({n}, at::kDouble);
    if (small) t = 0.5 + t.abs().clamp_max(2.0) / 2;
    return t.to(dtype);
  }
  return at::randint(dtype == at::kByte ? 0 : -100, 100, {n}, at::kLong).to(dtype);
}

// Runs fn(rank, transport) on `size` threads, each with its own transport.
void onRanks(int size, size_t slotBytes, const std::function<void(int, xcomm::ShmTransport&)>& fn) {
  xcomm::testing::onRankThreads(size, [&](int r, const c10::intrusive_ptr<c10d::Store>& store) {
    xcomm::ShmTransport::Config config;
    config.slotBytes = slotBytes;
    std::string whyNot;
    auto transport = xcomm::ShmTransport::create(store, r, size, config, &whyNot);
    TORCH_CHECK(transport, "no transport: ", whyNot);
    fn(r, *transport);
  });
}

xcomm::shm::Deadline in(std::chrono::milliseconds ms) {
  return std::chrono::steady_clock::now() + ms;
}

}  // namespace

TEST_CASE("reduceBuffers folds sources in order like reduceInto, for every dtype and op",
          "[shm][reduce]") {
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kHalf,  at::kBFloat16,
                                              at::kChar,  at::kByte,   at::kShort, at::kInt,
                                              at::kLong,  at::kBool};
  const std::vector<RedOp> ops = {RedOp::SUM,  RedOp::PRODUCT, RedOp::MIN, RedOp::MAX,
                                  RedOp::BAND, RedOp::BOR,     RedOp::BXOR};
  for (auto dtype : dtypes) {
    for (auto op : ops) {
      if (!xcomm::reduceOpSupports(op, dtype)) continue;
      for (int n = 1; n <= 4; ++n) {
        for (int64_t count : {0, 1, 1023, 1025, 3001}) {
          INFO("dtype " << c10::toString(dtype) << " op " << xcomm::reduceOpName(op) << " n " << n
                        << " count " << count);
          std::vector<at::Tensor> srcs;
          std::vector<const void*> ptrs;
          for (int k = 0; k < n; ++k) {
            srcs.push_back(input(dtype, count, 7 * k + 1, op == RedOp::PRODUCT));
            ptrs.push_back(srcs.back().data_ptr());
          }
          // Reference: ATen's ops in the same order; 16-bit floats in float32,
          // rounded once (what reduceBuffers promises).
          const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
          auto expected = half ? srcs[0].to(at::kFloat) : srcs[0].clone();
          for (int k = 1; k < n; ++k) {
            auto x = half ? srcs[k].to(at::kFloat) : srcs[k];
            xcomm::reduceInto(expected, x, op);
          }
          expected = expected.to(dtype);
          auto got = at::empty({count}, at::TensorOptions().dtype(dtype));
          xcomm::reduceBuffers(got.data_ptr(), ptrs.data(), n, count, dtype, op);
          CHECK(at::equal(got, expected));
        }
      }
    }
  }
}

TEST_CASE("reduceBuffers may write into one of its sources", "[shm][reduce]") {
  auto a = at::arange(3000, at::kFloat);
  auto b = at::ones({3000}, at::kFloat);
  const void* srcs[] = {a.data_ptr(), b.data_ptr()};
  xcomm::reduceBuffers(b.data_ptr(), srcs, 2, 3000, at::kFloat, RedOp::SUM);
  CHECK(at::equal(b, at::arange(3000, at::kFloat) + 1));
}

TEST_CASE("shm collectives give every rank the exact result, across chunks", "[shm]") {
  for (int size : {2, 3, 4}) {
    for (int64_t n : {0, 1, 17, 1000}) {
      INFO("size " << size << " n " << n);
      std::vector<at::Tensor> results(size);
      // 256-byte slots: 1000 int32 elements span many chunks.
      onRanks(size, 256, [&](int rank, xcomm::ShmTransport& t) {
        auto x = at::arange(n, at::kInt) * (rank + 1);
        xcomm::shm::allreduce(t, x, RedOp::SUM, in(std::chrono::seconds(20)), /*smallBytes=*/64);
        results[rank] = x;

        auto b = rank == size - 1 ? at::arange(n, at::kLong) : at::zeros({n}, at::kLong);
        xcomm::shm::broadcast(t, b, size - 1, in(std::chrono::seconds(20)));
        TORCH_CHECK(at::equal(b, at::arange(n, at::kLong)), "broadcast wrong on rank ", rank);

        std::vector<at::Tensor> outs;
        for (int r = 0; r < size; ++r) outs.push_back(at::empty({n}, at::kShort));
        xcomm::shm::allgather(t, at::full({n}, rank, at::kShort), outs,
                              in(std::chrono::seconds(20)));
        for (int r = 0; r < size; ++r) {
          TORCH_CHECK(at::equal(outs[r], at::full({n}, r, at::kShort)), "allgather wrong");
        }

        std::vector<at::Tensor> ins;
        for (int r = 0; r < size; ++r) ins.push_back(at::full({n}, 10 * r + rank, at::kLong));
        auto out = at::empty({n}, at::kLong);
        xcomm::shm::reduceScatter(t, out, ins, RedOp::MAX, in(std::chrono::seconds(20)));
        TORCH_CHECK(at::equal(out, at::full({n}, 10 * rank + size - 1, at::kLong)),
                    "reduce_scatter wrong on rank ", rank);
        xcomm::shm::barrier(t, in(std::chrono::seconds(20)));
      });
      const int factor = size * (size + 1) / 2;
      for (const auto& r : results) CHECK(at::equal(r, at::arange(n, at::kInt) * factor));
    }
  }
  CHECK(shmFiles().empty());  // unlinked once every rank had mapped it
}

namespace {

// Rank s sends rank d (s + 2d) % 5 rows of `cols` elements, valued
// 1000 s + 100 d + i: zero-sized pieces and pieces of different sizes.
int64_t rowsFrom(int s, int d) {
  return (s + 2 * d) % 5;
}

}  // namespace

TEST_CASE("shm all_to_all moves every pair's piece, uneven and across rounds", "[shm][alltoall]") {
  // 256-byte slots: a header of 2 x size counts, then regions of a few bytes,
  // so the larger pieces take many rounds; 1 MiB: one round.
  for (size_t slot : {size_t{256}, size_t{1} << 20}) {
    for (int size : {2, 3, 4}) {
      INFO("size " << size << " slot " << slot);
      std::vector<std::string> errors(size);
      onRanks(size, slot, [&](int rank, xcomm::ShmTransport& t) {
        try {
          for (int64_t cols : {int64_t{1}, int64_t{7}}) {
            std::vector<at::Tensor> sends, recvs;
            for (int d = 0; d < size; ++d) {
              const int64_t rows = rowsFrom(rank, d);
              sends.push_back(at::arange(rows * cols, at::kDouble) + 1000 * rank + 100 * d);
              recvs.push_back(at::full({rowsFrom(d, rank) * cols}, -1.0, at::kDouble));
            }
            xcomm::shm::alltoall(t, sends, recvs, in(std::chrono::seconds(20)), "all_to_all");
            for (int s = 0; s < size; ++s) {
              const auto expected =
                  at::arange(rowsFrom(s, rank) * cols, at::kDouble) + 1000 * s + 100 * rank;
              TORCH_CHECK(at::equal(recvs[s], expected), "rank ", rank, " got a wrong piece from ",
                          s, " (cols ", cols, ")");
            }
          }
        } catch (const std::exception& e) {
          errors[rank] = e.what();
        }
      });
      for (int r = 0; r < size; ++r) CHECK(errors[r] == "");
    }
  }
}

TEST_CASE("shm all_to_all: a pair whose sizes disagree raises on every rank, which stay in step",
          "[shm][alltoall]") {
  std::vector<std::string> errors(3);
  std::vector<at::Tensor> after(3);
  onRanks(3, 4096, [&](int rank, xcomm::ShmTransport& t) {
    // Rank 2 expects 3 floats from rank 1, which sends it 2.
    std::vector<at::Tensor> sends, recvs;
    for (int r = 0; r < 3; ++r) {
      sends.push_back(at::ones({2}, at::kFloat));
      recvs.push_back(at::zeros({rank == 2 && r == 1 ? 3 : 2}, at::kFloat));
    }
    try {
      xcomm::shm::alltoall(t, sends, recvs, in(std::chrono::seconds(20)), "all_to_all_single");
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
    after[rank] = at::full({3}, static_cast<float>(rank));
    xcomm::shm::allreduce(t, after[rank], RedOp::SUM, in(std::chrono::seconds(20)));
  });
  for (int r = 0; r < 3; ++r) {
    CHECK_THAT(errors[r], Catch::Contains("all_to_all_single: rank 1 sends 8 bytes to rank 2, but "
                                          "rank 2 expects 12 bytes from rank 1"));
    CHECK(at::equal(after[r], at::full({3}, 3.0f)));
  }
}

TEST_CASE("shm all_to_all against another collective raises on both ranks", "[shm][alltoall]") {
  std::vector<std::string> errors(2);
  onRanks(2, 4096, [&](int rank, xcomm::ShmTransport& t) {
    auto x = at::ones({4}, at::kFloat);
    std::vector<at::Tensor> sends{x, x}, recvs{at::empty({4}), at::empty({4})};
    try {
      if (rank == 0) {
        xcomm::shm::allreduce(t, x, RedOp::SUM, in(std::chrono::seconds(20)));
      } else {
        xcomm::shm::alltoall(t, sends, recvs, in(std::chrono::seconds(20)), "all_to_all");
      }
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_THAT(errors[r], Catch::Contains("rank 0: all_reduce(SUM, Float, 16 bytes); rank 1: "
                                          "all_to_all(Float)"));
  }
}

TEST_CASE("a missing peer times out at the deadline, then the transport stays broken", "[shm]") {
  std::atomic<bool> done{false};
  onRanks(2, 4096, [&](int rank, xcomm::ShmTransport& t) {
    if (rank == 1) {
      // Never arrives, and keeps its transport (ending it would mark it departed).
      while (!done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    struct Done {
      std::atomic<bool>& flag;
      ~Done() { flag.store(true); }
    } releaseRank1{done};
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(xcomm::shm::barrier(t, in(std::chrono::milliseconds(200))),
                      Catch::Contains("timed out waiting for rank 1"));
    const auto waited = std::chrono::steady_clock::now() - start;
    CHECK(waited >= std::chrono::milliseconds(200));
    CHECK(waited < std::chrono::seconds(5));
    CHECK_FALSE(t.brokenBy().empty());
    CHECK_THROWS_WITH(xcomm::shm::barrier(t, in(std::chrono::seconds(10))),
                      Catch::Contains("broken by an earlier failure"));
  });
}

TEST_CASE("a peer that departs fails the others' wait for it at once, naming it", "[shm]") {
  std::atomic<bool> done{false};
  std::vector<std::string> errors(2);
  std::chrono::steady_clock::duration waited{};
  onRanks(2, 4096, [&](int rank, xcomm::ShmTransport& t) {
    xcomm::shm::barrier(t, in(std::chrono::seconds(10)));  // both arrive once
    if (rank == 1) {
      // Leaves the group (as shutdown does) but lives on: its pid says nothing.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      t.depart();
      while (!done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      xcomm::shm::barrier(t, in(std::chrono::seconds(20)));
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
    waited = std::chrono::steady_clock::now() - start;
    done.store(true);
  });
  CHECK_THAT(errors[0], Catch::Contains("rank 1 (pid") && Catch::Contains("left the group"));
  CHECK(waited < std::chrono::seconds(2));  // not the 20 s deadline
}

TEST_CASE("a peer that arrived and then departed is no failure", "[shm]") {
  std::vector<std::string> errors(2);
  onRanks(2, 4096, [&](int rank, xcomm::ShmTransport& t) {
    try {
      if (rank == 1) {
        xcomm::shm::barrier(t, in(std::chrono::seconds(10)));
        t.depart();  // its arrival was made: rank 0's wait for it succeeds
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      xcomm::shm::barrier(t, in(std::chrono::seconds(10)));
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  });
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
}

TEST_CASE("ranks that disagree on the op raise on every rank and stay in step", "[shm]") {
  // Catch's assertions are not thread-safe: the ranks record, the test checks.
  std::vector<std::string> errors(2);
  std::vector<at::Tensor> after(2);
  onRanks(2, 4096, [&](int rank, xcomm::ShmTransport& t) {
    auto x = at::ones({rank == 0 ? 4 : 8}, at::kFloat);
    try {
      xcomm::shm::allreduce(t, x, RedOp::SUM, in(std::chrono::seconds(20)));
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
    after[rank] = at::ones({5}, at::kFloat);
    xcomm::shm::allreduce(t, after[rank], RedOp::SUM, in(std::chrono::seconds(20)));
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_THAT(errors[r], Catch::Contains("called different collectives"));
    CHECK_THAT(errors[r], Catch::Contains("16 bytes"));
    CHECK_THAT(errors[r], Catch::Contains("32 bytes"));
    CHECK(at::equal(after[r], at::full({5}, 2.0f)));
  }
}

TEST_CASE("ranks that disagree on a broadcast's root raise on every rank, the roots too", "[shm]") {
  // Each rank believes it is the root: without the first chunk's full
  // barrier both would return at once, each with its own data.
  std::vector<std::string> errors(2);
  std::vector<at::Tensor> after(2);
  onRanks(2, 4096, [&](int rank, xcomm::ShmTransport& t) {
    auto x = at::full({4}, static_cast<float>(rank));
    try {
      xcomm::shm::broadcast(t, x, /*root=*/rank, in(std::chrono::seconds(20)));
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
    after[rank] = at::full({3}, static_cast<float>(rank + 5));
    xcomm::shm::broadcast(t, after[rank], /*root=*/1, in(std::chrono::seconds(20)));
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_THAT(errors[r], Catch::Contains("broadcast(root=0"));
    CHECK_THAT(errors[r], Catch::Contains("broadcast(root=1"));
    CHECK(at::equal(after[r], at::full({3}, 6.0f)));
  }
}

TEST_CASE("agree() makes an op run elsewhere and a shared-memory op fail on both ranks", "[shm]") {
  std::vector<std::string> errors(2);
  onRanks(2, 4096, [&](int rank, xcomm::ShmTransport& t) {
    auto x = at::ones({4}, at::kFloat);
    try {
      if (rank == 0) {
        xcomm::shm::allreduce(t, x, RedOp::SUM, in(std::chrono::seconds(20)));
      } else {
        namespace d = xcomm::shm::detail;
        xcomm::shm::agree(
            t, {d::describe(d::OpCode::kFallback, at::kFloat, 0, 0, /*ALLTOALL_BASE*/ 8), 0},
            in(std::chrono::seconds(20)), "all_to_all_single");
      }
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_THAT(errors[r], Catch::Contains("rank 0: all_reduce(SUM, Float, 16 bytes)"));
  }
}

TEST_CASE("requestAbort makes a wait in progress fail at once", "[shm]") {
  std::string error;
  std::chrono::steady_clock::duration waited{};
  std::atomic<xcomm::ShmTransport*> rank0{nullptr};
  onRanks(2, 4096, [&](int rank, xcomm::ShmTransport& t) {
    if (rank == 1) {  // never arrives; aborts rank 0's wait instead
      while (!rank0.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      rank0.load()->requestAbort();
      return;
    }
    rank0 = &t;
    const auto start = std::chrono::steady_clock::now();
    try {
      xcomm::shm::barrier(t, in(std::chrono::seconds(60)));
    } catch (const std::exception& e) {
      error = e.what();
    }
    waited = std::chrono::steady_clock::now() - start;
  });
  CHECK_THAT(error, Catch::Contains("aborted"));
  CHECK(waited < std::chrono::seconds(5));
}

namespace {

// This process's pid namespace inode and start time, as ShmTransport reads them.
uint64_t myPidNamespace() {
  char link[64] = {};
  const ssize_t n = readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
  const char* open = n > 0 ? std::strchr(link, '[') : nullptr;
  return open ? std::strtoull(open + 1, nullptr, 10) : 0;
}

uint64_t myStartTime() {
  std::ifstream in("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::istringstream fields(text.substr(text.rfind(')') + 2));
  std::string field;
  for (int i = 3; i <= 21; ++i) fields >> field;
  uint64_t start = 0;
  fields >> start;
  return start;
}

// Creates a segment named as ShmTransport names them, for the creator given.
std::string plantSegment(uint64_t pidNamespace, int pid, uint64_t startTime, const char* random) {
  const std::string name = "xcomm-shm-" + std::to_string(pidNamespace) + "-" + std::to_string(pid) +
                           "-" + std::to_string(startTime) + "-" + random;
  const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  REQUIRE(fd >= 0);
  close(fd);
  return name;
}

bool shmFileExists(const std::string& name) {
  const auto files = shmFiles();
  return std::find(files.begin(), files.end(), name) != files.end();
}

}  // namespace

TEST_CASE(
    "a segment whose creator is gone is removed; a live creator's, or another namespace's, "
    "is kept",
    "[shm][setup]") {
  const uint64_t ns = myPidNamespace();
  if (ns == 0) {
    WARN("no /proc/self/ns/pid: segments' creators cannot be told apart here");
    return;
  }
  const int pid = getpid();
  const uint64_t start = myStartTime();
  // The same pid with another start time: the pid reused after its creator died.
  const auto orphan = plantSegment(ns, pid, start + 1, "0123456789abcdef0123456789abcde0");
  const auto live = plantSegment(ns, pid, start, "0123456789abcdef0123456789abcde1");
  const auto foreign = plantSegment(ns + 1, pid, start + 1, "0123456789abcdef0123456789abcde2");
  const int removed = xcomm::ShmTransport::removeOrphanedSegments();
  const bool orphanLeft = shmFileExists(orphan);
  const bool liveLeft = shmFileExists(live);
  const bool foreignLeft = shmFileExists(foreign);
  for (const auto& name : {orphan, live, foreign}) shm_unlink(("/" + name).c_str());
  CHECK(removed >= 1);
  CHECK_FALSE(orphanLeft);
  CHECK(liveLeft);
  CHECK(foreignLeft);
}

TEST_CASE("a new group's set-up removes a segment its dead creator left behind", "[shm][setup]") {
  const uint64_t ns = myPidNamespace();
  if (ns == 0) {
    WARN("no /proc/self/ns/pid: segments' creators cannot be told apart here");
    return;
  }
  const auto orphan =
      plantSegment(ns, getpid(), myStartTime() + 1, "fedcba9876543210fedcba9876543210");
  onRanks(2, 4096, [](int, xcomm::ShmTransport&) {});
  const bool orphanLeft = shmFileExists(orphan);
  shm_unlink(("/" + orphan).c_str());
  CHECK_FALSE(orphanLeft);
}

namespace {

void napMs(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

// Every rank sets a segment up in its two halves, with `beforeBegin(rank)`
// and `betweenHalves(rank)` run where the group builder does other work, then
// all-reduces rank + 1 through it: each rank's sum.
std::vector<double> sumsThroughSetUp(int size, const std::function<void(int)>& beforeBegin,
                                     const std::function<void(int)>& betweenHalves) {
  std::vector<double> sums(size);
  xcomm::testing::onRankThreads(size, [&](int r, const c10::intrusive_ptr<c10d::Store>& store) {
    xcomm::ShmTransport::Config config;
    config.slotBytes = 1 << 16;
    beforeBegin(r);
    auto setup = xcomm::ShmTransport::Setup::begin(store, r, size, config);
    betweenHalves(r);
    std::string whyNot;
    auto transport = setup->finish(&whyNot);
    TORCH_CHECK(transport, "no transport: ", whyNot);
    auto t = at::full({1000}, static_cast<double>(r + 1), at::kDouble);
    xcomm::shm::allreduce(*transport, t, RedOp::SUM, in(std::chrono::seconds(20)));
    sums[r] = t[999].item<double>();
  });
  return sums;
}

}  // namespace

TEST_CASE(
    "a set-up finished after other work gives working segments; one dropped unfinished leaves "
    "nothing in /dev/shm",
    "[shm][setup]") {
  const int size = 3;
  // Begun, then (as the group builder does while Gloo connects) other work,
  // then finished: the ranks reduce through the segment.
  const auto sums = sumsThroughSetUp(
      size, [](int) {}, [](int r) { napMs(20 * r); });
  for (double s : sums) CHECK(s == 6.0);
  CHECK(shmFiles().empty());

  // Begun and dropped (the other work threw): rank 0 had created and named
  // the segment, and its pages were being reserved.
  xcomm::testing::onRankThreads(size, [&](int r, const c10::intrusive_ptr<c10d::Store>& store) {
    xcomm::ShmTransport::Config config;
    config.slotBytes = 1 << 20;
    auto setup = xcomm::ShmTransport::Setup::begin(store, r, size, config);
    if (r == 0) TORCH_CHECK(!shmFiles().empty(), "rank 0 created no segment");
  });
  CHECK(shmFiles().empty());
}

TEST_CASE(
    "a non-creator's set-up whose rank 0 never names the segment fails at the store's timeout",
    "[shm][setup]") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::milliseconds(300));
  xcomm::ShmTransport::Config config;
  config.slotBytes = 1 << 16;
  const auto started = std::chrono::steady_clock::now();
  // Rank 1 of 2 sets up; rank 0 never does (it died before naming a segment).
  auto setup = xcomm::ShmTransport::Setup::begin(store, 1, 2, config);
  std::string whyNot;
  CHECK_THROWS_AS(setup->finish(&whyNot), c10::DistStoreError);
  setup.reset();
  const auto waited = std::chrono::steady_clock::now() - started;
  CHECK(waited >= std::chrono::milliseconds(250));
  CHECK(waited < std::chrono::seconds(5));
  CHECK(shmFiles().empty());
}

TEST_CASE("a non-creator's set-up begun before rank 0 named the segment waits for the name",
          "[shm][setup]") {
  const auto sums = sumsThroughSetUp(
      2, [](int r) { napMs(r == 0 ? 100 : 0); }, [](int) {});
  for (double s : sums) CHECK(s == 3.0);
  CHECK(shmFiles().empty());
}
