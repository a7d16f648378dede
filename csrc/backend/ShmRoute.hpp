#pragma once
// ShmRoute: the CPU route of a group whose ranks all share one host.
//
// Allreduce, broadcast, allgather, reduce_scatter, all_to_all (list and flat
// forms) and barrier run over ShmTransport on a worker thread (in issue
// order); a call with async_op=False on an idle route runs on the caller's
// thread instead, which saves two thread hand-offs. Everything else, and
// dtypes without a shared-memory kernel, goes to the fallback route (Gloo),
// after the ranks agreed over shared memory that they all call it, so the
// group keeps every op Gloo has.
//
// ShmRouteBase holds what this route and HierarchicalRoute (several hosts,
// shared memory inside each) share: the segment, the ordered worker, the
// fallback.
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "runtime/OrderedRunner.hpp"
#include "runtime/Route.hpp"
#include "transport/ShmTransport.hpp"

namespace xcomm {

class ShmRouteBase : public Route {
 public:
  struct Config {
    ShmTransport::Config transport;
    size_t smallAllreduceBytes = 256 << 10;
  };
  ~ShmRouteBase() override;

  std::string name() const override { return "xcomm-shm"; }
  const std::shared_ptr<Route>& fallback() const { return fallback_; }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    fallback_->monitoredBarrier(opts, waitAllRanks);
  }
  void setTimeout(std::chrono::milliseconds timeout) override;
  std::chrono::milliseconds timeout() const override {
    return std::chrono::milliseconds(timeoutMs_.load());
  }
  void shutdown() override;
  void abort() override;
  // How many ops ran over shared memory (for tests and stats).
  uint64_t shmOps() const { return shmOps_.load(); }
  // What the route was built with (segment sizes, spin time).
  const Config& config() const { return config_; }

 protected:
  using Clock = std::chrono::steady_clock;
  // `rank`/`size` are the group's; `transport` may span fewer ranks (one host's).
  ShmRouteBase(std::unique_ptr<ShmTransport> transport, int rank, int size,
               std::shared_ptr<Route> fallback, std::chrono::milliseconds timeout, Config config);
  // Runs `body` in issue order and returns the work that reports it.
  c10::intrusive_ptr<c10d::Work> submit(const Op& op, std::function<void(Clock::time_point)> body,
                                        bool countAsShm = true);
  // Whether shared memory reduces these tensors under `op`.
  static bool reducible(const std::vector<at::Tensor>& tensors, c10d::ReduceOp::RedOpType op);
  static bool plainCpu(const std::vector<at::Tensor>& tensors);
  std::unique_ptr<ShmTransport> transport_;
  std::shared_ptr<Route> fallback_;
  std::atomic<int64_t> timeoutMs_;
  Config config_;
  std::atomic<uint64_t> shmOps_{0};
  // Synchronous ops run on the caller's thread when nothing is queued: the
  // segment's steps are the ones worth those two saved thread hand-offs.
  OrderedRunner runner_{"xcomm shm queue", OrderedRunner::CallerThread::kWhenIdle};
};

class ShmRoute final : public ShmRouteBase {
 public:
  // Finishes the segment's set-up (collective; begun with `config.transport`
  // over the group): null on every rank when the segment cannot be set up
  // (then the caller keeps using `fallback` alone); `whyNot` says why.
  static std::shared_ptr<ShmRoute> tryCreate(ShmTransport::Setup& setup,
                                             std::chrono::milliseconds timeout,
                                             std::shared_ptr<Route> fallback, Config config,
                                             std::string* whyNot = nullptr);
  ShmRoute(std::unique_ptr<ShmTransport> transport, std::shared_ptr<Route> fallback,
           std::chrono::milliseconds timeout, Config config);

  c10::intrusive_ptr<c10d::Work> run(Op op) override;
  // As a fallback op that runs nothing: an op over shared memory has
  // another descriptor, so it and this one disagree.
  c10::intrusive_ptr<c10d::Work> agree(const Op& op) override;

 private:
  // An op the fallback runs: it first passes a shared-memory agreement
  // barrier (op, root, dtype, reduce op, bytes), in issue order with the
  // shared-memory ops: a rank whose op runs here and one whose op runs there
  // (a user's mismatch) then both raise at once, where they would otherwise
  // wait for each other until the timeout.
  c10::intrusive_ptr<c10d::Work> viaFallback(Op op);
};

}  // namespace xcomm
