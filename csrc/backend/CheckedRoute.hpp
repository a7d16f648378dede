#pragma once
// CheckedRoute: the CPU route of a group without shared memory (one rank
// per host, or shared memory off), and of the ops a hierarchical group
// sends between hosts: Gloo, with every collective checked against the
// other ranks' before it runs.
//
// Gloo answers ranks that call different collectives in three ways, none of
// them an error naming the problem: different sizes or dtypes abort the
// receiving process (gloo::EnforceNotMet, terminate), sometimes after
// handing a rank garbage; different reduce ops return a silently wrong sum;
// different ops or roots wait for the timeout. Here each collective first
// sends a small descriptor (op, dtype, reduce op, root, bytes) to every
// other rank and receives theirs, point to point over a Gloo group of its
// own (in groups of up to 16 ranks the row also holds an all_to_all's send
// and receive sizes, checked pair by pair); on a mismatch every rank raises
// the same ValueError naming both calls, and none issues the op, so the
// group stays in step and usable. A rank that does not take part fails the
// others' check at the timeout, named.
//
// A small op rides in the check's own message (collectives/
// CarriedCollectives.hpp): every collective whose bytes from one rank to
// another are at most `carryBytes`, and barrier, completes with the
// exchange and never reaches Gloo.
//
// Once agreed on, an all-to-all or all-gather of dense tensors moves as
// point-to-point messages on the checks group (collectives/gloo/DirectExchange.hpp),
// not as Gloo's collective, which fills a rate-limited link only about half.
//
// One worker thread issues the checks and then the ops in the caller's
// order; it does not wait for an op to finish before checking the next, so
// consecutive async ops still overlap (their transfers share the link
// anyway). Synchronous ops too: see OrderedRunner.hpp for why not the caller's thread.
// Options(check_collectives=False) leaves Gloo unwrapped (a RawRoute).
// Point-to-point ops match by tag, not by order: they go to Gloo directly
// (XcommBackend).
#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend/XcommWork.hpp"
#include "collectives/gloo/CarriedCollectives.hpp"
#include "collectives/gloo/DirectExchange.hpp"
#include "runtime/OrderedRunner.hpp"
#include "runtime/Route.hpp"

namespace xcomm {

class CheckedRoute final : public Route {
 public:
  // What every rank must agree on (a sparse tensor's bytes legitimately
  // differ between ranks and count as 0).
  struct Call {
    c10d::OpType type = c10d::OpType::UNKNOWN;
    at::ScalarType dtype = at::ScalarType::Undefined;
    int64_t redOp = -1;
    int64_t root = -1;
    int64_t bytes = 0;
    int64_t tensors = 0;
  };

  // `inner` runs the ops; `checks` (a group of the same ranks that no other
  // op uses, but for the backend's compressed allreduce, on tags this route
  // never posts, and its Gloo collectives, which this route never issues)
  // carries the descriptors, and ops of up to `carryBytes` per rank
  // (0: none). Every rank must pass the same `carryBytes`, and a nonzero one
  // needs a `checks` whose receives accept shorter messages than their
  // buffer (Gloo's do). Errors call a member `memberName` and its number
  // ("rank 1"; a hierarchical group's leaders are "host 1"). `directExchange`
  // (agreed by the group's ranks): large all-to-alls and all-gathers go as
  // messages; false keeps them on Gloo's collectives.
  CheckedRoute(std::shared_ptr<InnerRoute> inner, std::shared_ptr<InnerRoute> checks,
               std::chrono::milliseconds timeout, int64_t carryBytes = 0,
               std::string memberName = "rank", bool directExchange = true);
  ~CheckedRoute() override;

  // The inner backend's name ("gloo"): that is what moves the data.
  std::string name() const override { return inner_->name(); }
  int64_t carryBytes() const { return carryBytes_; }
  // Whether `route` is one this route runs on (its inner or its checks group).
  bool uses(const InnerRoute& route) const {
    return &route == inner_.get() || &route == checks_.get();
  }
  // Ops completed by the check's exchange alone (never issued on Gloo).
  uint64_t carriedOps() const { return carriedOps_.load(); }
  // Ops sent as point-to-point messages (DirectExchange), not Gloo's collectives.
  uint64_t directOps() const { return directOps_.load(); }

  c10::intrusive_ptr<c10d::Work> run(Op op) override;
  // The work fails with the mismatch's ValueError, or a missing peer's
  // error, on every rank.
  c10::intrusive_ptr<c10d::Work> agree(const Op& op) override;
  // After every queued op has been issued (it waits on the caller's thread).
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  std::chrono::milliseconds timeout() const override {
    return std::chrono::milliseconds(timeoutMs_.load());
  }
  void shutdown() override;
  void abort() override;

 private:
  using Issue = std::function<c10::intrusive_ptr<c10d::Work>()>;
  // How an op is checked and may move besides Gloo's collective.
  struct Checked {
    Call call;
    std::vector<int64_t> pairs;  // an all-to-all's bytes to and from every rank
    CarriedOp carry;             // in the check's message
    // As point-to-point messages (DirectExchange), once every rank may; null: never.
    std::function<DirectExchange::Posted()> direct;
  };
  Checked describe(const Op& op) const;
  // Agrees on `call` (and on `pairs`, every rank's bytes to and from every
  // rank, for an all_to_all); then completes the op with the exchange when
  // every rank can `carry` it, else `issue()`s it and completes the returned
  // work with the inner op's, on the worker. `title` names the op in errors.
  c10::intrusive_ptr<c10d::Work> submit(const char* title, Call call, std::vector<int64_t> pairs,
                                        std::vector<at::Tensor> outputs,
                                        std::chrono::milliseconds timeout, bool withFuture,
                                        Issue issue, CarriedOp carry = {});
  // What submit() does once the op's turn comes: `done` when the work is to
  // be completed now (carried, ran, or failed: `error`), else the inner op's
  // future completes it.
  struct Outcome {
    bool done = false;
    std::exception_ptr error;
    static Outcome complete() { return {true, nullptr}; }
    static Outcome failed(std::exception_ptr e) { return {true, std::move(e)}; }
    void mark(FutureWork& work) const;
  };
  Outcome runTurn(const char* title, const Call& call, const std::vector<int64_t>& pairs,
                  const CarriedOp& carry, std::chrono::milliseconds timeout, const Issue& issue,
                  const c10::intrusive_ptr<FutureWork>& work);
  // Every rank's row for this one: `outgoing[r]` (int64s) goes to rank r
  // with `tag` over the checks group, and a row of up to `capacity` int64s
  // comes back from each (rank order; this rank's is `outgoing[rank]`). A
  // peer missing at `timeout` is a DistBackendError naming it and `title`.
  std::vector<at::Tensor> exchange(const char* title, const std::vector<at::Tensor>& outgoing,
                                   int64_t capacity, int tag, std::chrono::milliseconds timeout);
  // Posts an op's messages with `post` (on the worker, in the op's turn) and
  // returns a work that completes once all of them did, or fails at the
  // op's time limit naming the peer.
  c10::intrusive_ptr<c10d::Work> issueDirect(const char* title, c10d::OpType type,
                                             std::vector<at::Tensor> outputs,
                                             std::chrono::milliseconds timeout,
                                             const std::function<DirectExchange::Posted()>& post);
  // Waits for the inner ops issued so far (a barrier's "earlier ops first").
  void drain(std::chrono::milliseconds timeout);
  // Sends every peer a descriptor row saying this rank left (shutdown).
  void announceDeparture();
  std::chrono::milliseconds limit(std::chrono::milliseconds timeout) const;

  std::shared_ptr<InnerRoute> inner_;
  std::shared_ptr<InnerRoute> checks_;
  const int64_t carryBytes_;
  const std::string memberName_;
  DirectExchange direct_;
  const bool directEnabled_;   // this rank may take DirectExchange
  bool directAgreed_ = false;  // every rank may, for the op being issued (worker only)
  std::atomic<int64_t> timeoutMs_;
  std::atomic<uint64_t> carriedOps_{0};
  std::atomic<uint64_t> directOps_{0};
  std::mutex submitMutex_;  // ops queued in the callers' order
  std::mutex inflightMutex_;
  std::vector<c10::intrusive_ptr<c10d::Work>> inflight_;  // issued inner ops, maybe not done
  // The departure rows' sends (announceDeparture), kept until the group ends.
  std::vector<c10::intrusive_ptr<c10d::Work>> departureSends_;
  // Carried and failed ops are completed off its worker: future callbacks
  // may wait for another op of this group, which needs the worker. Never on
  // the caller's thread: see OrderedRunner.hpp.
  OrderedRunner runner_{"xcomm collective checks", OrderedRunner::CallerThread::kNever};
};

}  // namespace xcomm
