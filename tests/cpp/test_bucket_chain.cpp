// BucketChain, the chaining under the PowerSGD and int8 hooks' C++ chains:
// the turns that keep every rank's collectives in DDP's bucket order, a
// failure reaching the bucket and every later one, the group let go once the
// last collective is out. Against a process group whose collectives complete
// when the test says, so every interleaving here is deterministic.
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "collectives/chains/BucketChain.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

using Catch::Contains;
using xcomm::FuturePtr;

namespace {

class ManualWork : public c10d::Work {
 public:
  explicit ManualWork(FuturePtr future) : future_(std::move(future)) {}
  FuturePtr getFuture() override { return future_; }
  bool wait(std::chrono::milliseconds) override {
    future_->wait();
    return true;
  }

 private:
  FuturePtr future_;
};

// Records each allreduce's tag (its tensor's value) in issue order; the test
// completes or fails their futures.
class ManualGroup : public c10d::ProcessGroup {
 public:
  ManualGroup() : c10d::ProcessGroup(0, 2) {}

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions&) override {
    issued.push_back(tensors.at(0).item<int64_t>());
    futures.push_back(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors()));
    return c10::make_intrusive<ManualWork>(futures.back());
  }

  void complete(size_t i) { futures.at(i)->markCompleted(c10::IValue(std::vector<at::Tensor>{})); }
  void fail(size_t i, const std::string& message) {
    futures.at(i)->setError(std::make_exception_ptr(std::runtime_error(message)));
  }

  std::vector<int64_t> issued;
  std::vector<FuturePtr> futures;
};

// Two collectives per bucket, tagged 10 * id + 1 and 10 * id + 2.
class TwoCollectives : public xcomm::BucketStep {
 public:
  TwoCollectives(c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t id, int* aborts)
      : BucketStep(std::move(group), at::full({1}, id, at::kLong), xcomm::ChainResult()),
        id_(id),
        aborts_(aborts) {}

  void issueFirst() override {
    then<TwoCollectives>(collective(1), [](TwoCollectives& s) {
      auto done = s.collective(2);
      s.markIssued();
      s.then<TwoCollectives>(done, [](TwoCollectives& t) { t.complete(); });
    });
  }

 private:
  void abort() override { ++*aborts_; }

  FuturePtr collective(int64_t which) {
    at::Tensor tag = at::full({1}, 10 * id_ + which, at::kLong);
    return collectives().allreduce(tag);
  }

  int64_t id_;
  int* aborts_;
};

std::string errorOf(const FuturePtr& f) {
  REQUIRE(f->completed());
  REQUIRE(f->hasError());
  return f->tryRetrieveErrorMessage();
}

}  // namespace

TEST_CASE("a bucket's first collective waits for the previous bucket's last", "[chain]") {
  auto group = c10::make_intrusive<ManualGroup>();
  xcomm::BucketTurns turns;
  int aborts = 0;
  auto a = turns.start(std::make_shared<TwoCollectives>(group, 1, &aborts));
  auto b = turns.start(std::make_shared<TwoCollectives>(group, 2, &aborts));
  CHECK(group->issued == std::vector<int64_t>{11});  // b waits for a's second
  group->complete(0);
  CHECK(group->issued == std::vector<int64_t>{11, 12, 21});
  CHECK(a.issued->completed());
  CHECK_FALSE(b.issued->completed());
  group->complete(2);  // b's first, before a's second completes
  CHECK(group->issued == std::vector<int64_t>{11, 12, 21, 22});
  CHECK_FALSE(a.result->completed());
  group->complete(1);
  group->complete(3);
  REQUIRE(a.result->completed());
  REQUIRE(b.result->completed());
  CHECK_FALSE(a.result->hasError());
  CHECK(a.result->value().toTensor().item<int64_t>() == 1);  // the step's buffer
  CHECK(b.result->value().toTensor().item<int64_t>() == 2);
  CHECK(aborts == 0);
}

TEST_CASE("a failed collective fails its bucket and every later one, which issue nothing",
          "[chain]") {
  auto group = c10::make_intrusive<ManualGroup>();
  xcomm::BucketTurns turns;
  int aborts = 0;
  auto a = turns.start(std::make_shared<TwoCollectives>(group, 1, &aborts));
  auto b = turns.start(std::make_shared<TwoCollectives>(group, 2, &aborts));
  auto c = turns.start(std::make_shared<TwoCollectives>(group, 3, &aborts));
  group->complete(0);
  group->fail(1, "link down");  // a's second, after its turn was passed on
  CHECK_THAT(errorOf(a.result), Contains("link down"));
  CHECK_FALSE(b.result->completed());  // b already issued: its own collectives decide
  group->fail(2, "peer gone");         // b's first
  CHECK_THAT(errorOf(b.result), Contains("peer gone"));
  CHECK_THAT(errorOf(b.issued), Contains("peer gone"));
  CHECK_THAT(errorOf(c.result), Contains("peer gone"));  // waited for b's turn
  CHECK(group->issued == std::vector<int64_t>{11, 12, 21});
  CHECK(aborts == 3);
}

TEST_CASE("an external turn orders the chain, and its failure fails the bucket", "[chain]") {
  auto group = c10::make_intrusive<ManualGroup>();
  xcomm::BucketTurns turns;
  int aborts = 0;
  auto turn = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
  auto a = turns.start(std::make_shared<TwoCollectives>(group, 1, &aborts), turn);
  CHECK(group->issued.empty());
  turn->markCompleted(c10::IValue());
  CHECK(group->issued == std::vector<int64_t>{11});

  auto failed = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
  auto b = turns.start(std::make_shared<TwoCollectives>(group, 2, &aborts), failed);
  failed->setError(std::make_exception_ptr(std::runtime_error("an earlier method failed")));
  CHECK_THAT(errorOf(b.result), Contains("an earlier method failed"));
  CHECK(group->issued == std::vector<int64_t>{11});
  CHECK(aborts == 1);
}

TEST_CASE("a chain lets go of its group once its last collective is issued", "[chain]") {
  // A chain may end on one of the group's threads; holding the last reference
  // there would make the group's destructor join the thread it runs on.
  auto group = c10::make_intrusive<ManualGroup>();
  xcomm::BucketTurns turns;
  int aborts = 0;
  auto a = turns.start(std::make_shared<TwoCollectives>(group, 1, &aborts));
  CHECK(group.use_count() == 2);
  group->complete(0);
  CHECK(group.use_count() == 1);
  CHECK_FALSE(a.result->completed());
  group->complete(1);
  CHECK(a.result->completed());
}

TEST_CASE("a chain needs a process group", "[chain]") {
  int aborts = 0;
  CHECK_THROWS_WITH(TwoCollectives(nullptr, 1, &aborts), Contains("needs a process group"));
}
