#pragma once
// Route: how one device's collectives of a group run: agreed between the
// ranks, kept in the group's order, and moved.
//
// XcommBackend is the group's only c10d::Backend. It converts each c10d call
// into an Op (runtime/Op.hpp) and hands it to the route of the tensors'
// device; the algorithms under collectives/ and schedule/ issue their own
// collectives through the same interface, with the one-tensor helpers below.
// The routes:
// - InnerRoute (below): what a group is built on, a route that also carries
//   point-to-point messages; its implementations are
//   - RawRoute (below): a whole c10d backend as it is (NCCL; Gloo unchecked;
//     an algorithm's own transport): every Op goes to Op::issue, the one
//     place an op reaches Gloo or NCCL;
//   - StoreRoute (backend/): xcomm's own collectives over a c10d::Store, a
//     C++-only program's stand-in for Gloo;
// - CheckedRoute (backend/): Gloo behind a rank-agreement check, small ops
//   carried in the check's message, large all-to-alls and all-gathers as
//   messages;
// - ShmRoute (backend/): a group on one host, over a shared-memory segment;
// - HierarchicalRoute (backend/): several ranks per host on several hosts
//   (shared memory inside a host, the hosts' leaders between them).
// A route that has no algorithm of its own for an op hands it to the route
// under it (its `fallback`: an InnerRoute or CheckedRoute), in its own order.
#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "runtime/Op.hpp"

namespace xcomm {

class Route {
 public:
  Route(int rank, int size) : rank_(rank), size_(size) {}
  virtual ~Route() = default;
  Route(const Route&) = delete;
  Route& operator=(const Route&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // What moves the data, for users' eyes ("gloo", "nccl", "xcomm-shm").
  virtual std::string name() const = 0;

  // Runs `op` after every op run on this route before it, on every rank;
  // returns its work (null: a synchronous op the backend already ordered on
  // the caller's stream, as NCCL's).
  virtual c10::intrusive_ptr<c10d::Work> run(Op op) = 0;
  // Checks, in this route's order, that every rank calls `op`, and moves
  // nothing: for an op whose data moves on another route (a compressed
  // allreduce's own collectives). Null where this route does not check.
  virtual c10::intrusive_ptr<c10d::Work> agree(const Op& op) {
    (void)op;
    return {};
  }
  // dist.monitored_barrier on the Gloo under this route.
  virtual void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) = 0;

  virtual void setTimeout(std::chrono::milliseconds timeout) = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
  // Ends the route after this rank's ops; peers still waiting fail.
  virtual void shutdown() = 0;
  // Pending waits inside the route fail (where its transport can be woken).
  virtual void abort() = 0;

  // One tensor per op, for algorithms.
  c10::intrusive_ptr<c10d::Work> allreduce(const at::Tensor& tensor,
                                           const c10d::AllreduceOptions& opts) {
    return run(Op::allreduce({tensor}, opts));
  }
  c10::intrusive_ptr<c10d::Work> allgather(const at::Tensor& output, const at::Tensor& input,
                                           const c10d::AllgatherOptions& opts) {
    return run(Op::allgatherBase(output, input, opts));
  }
  c10::intrusive_ptr<c10d::Work> alltoall(const at::Tensor& output, const at::Tensor& input,
                                          const c10d::AllToAllOptions& opts) {
    return run(Op::alltoallBase(output, input, {}, {}, opts));
  }

 protected:
  const int rank_;
  const int size_;
};

// A route with point-to-point messages besides its collectives: the inner
// backends a group's routes are built on (its Gloo groups, NCCL, or the store
// route), and what a route falls back to. Messages between two ranks on one
// tag match in posting order; they are not ordered with the collectives.
class InnerRoute : public Route {
 public:
  using Route::Route;
  // One tensor per call, as c10d passes it. A send's work may complete once
  // its bytes left (before the peer received them).
  virtual c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                              int tag) = 0;
  virtual c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                              int tag) = 0;
  // The work's sourceRank() names the sender.
  virtual c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                                       int tag) = 0;
};

// A whole c10d backend (Gloo, NCCL) as a route.
class RawRoute final : public InnerRoute {
 public:
  explicit RawRoute(c10::intrusive_ptr<c10d::Backend> backend);
  std::string name() const override { return backend_->getBackendName(); }
  c10::intrusive_ptr<c10d::Work> run(Op op) override { return op.issue(*backend_); }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override {
    return backend_->send(tensors, dstRank, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override {
    return backend_->recv(tensors, srcRank, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return backend_->recvAnysource(tensors, tag);
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    backend_->monitoredBarrier(opts, waitAllRanks);
  }
  void setTimeout(std::chrono::milliseconds timeout) override;
  std::chrono::milliseconds timeout() const override {
    return std::chrono::milliseconds(timeoutMs_.load());
  }
  void shutdown() override { backend_->shutdown(); }
  void abort() override { backend_->abort(); }

 private:
  c10::intrusive_ptr<c10d::Backend> backend_;
  std::atomic<int64_t> timeoutMs_{0};
};

}  // namespace xcomm
