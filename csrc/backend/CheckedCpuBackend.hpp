#pragma once
// CheckedCpuBackend: the CPU backend of a group without shared memory (one
// rank per host, or shared memory off), with every collective checked
// against the other ranks' before it runs.
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
// One worker thread issues the checks and then the ops in the caller's
// order; it does not wait for an op to finish before checking the next, so
// consecutive async ops still overlap (their transfers share the link
// anyway). The caller's thread never blocks on the check.
// Options(check_collectives=False) leaves Gloo unwrapped.
#include <atomic>
#include <chrono>
#include <functional>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend/XcommWork.hpp"
#include "runtime/OpQueue.hpp"

namespace xcomm {

class CheckedCpuBackend : public c10d::Backend {
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

  // `inner` runs the ops; `checks` (a group of the same ranks no other op
  // uses) carries the descriptors.
  CheckedCpuBackend(c10::intrusive_ptr<c10d::Backend> inner,
                    c10::intrusive_ptr<c10d::Backend> checks, std::chrono::milliseconds timeout);
  ~CheckedCpuBackend() override;

  // The inner backend's name ("gloo"): that is what moves the data.
  const std::string getBackendName() const override { return inner_->getBackendName(); }
  const c10::intrusive_ptr<c10d::Backend>& inner() const { return inner_; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  void abort() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // Point-to-point ops match by tag, not by order: passed straight through.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  // After every queued op has been issued (it waits on the caller's thread).
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  // Counted here, when an op is called: Gloo counts when the worker issues
  // it, later, and the debug wrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL)
  // compares the ranks' numbers right after each call.
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;

 private:
  using Issue = std::function<c10::intrusive_ptr<c10d::Work>()>;
  // Queues: agree on `call` (and on `pairs`, every rank's bytes to and from
  // every rank, for an all_to_all), then `issue()`; the returned work
  // completes with the inner op's work. `title` names the op in errors.
  c10::intrusive_ptr<c10d::Work> submit(const char* title, Call call, std::vector<int64_t> pairs,
                                        std::vector<at::Tensor> outputs,
                                        std::chrono::milliseconds timeout, bool withFuture,
                                        Issue issue);
  // Every rank's `row` (sent to and received from every rank with `tag`
  // over the checks group); a peer missing at `timeout` is a
  // DistBackendError naming it and `title`.
  std::vector<std::vector<int64_t>> exchange(const char* title, const std::vector<int64_t>& row,
                                             int tag, std::chrono::milliseconds timeout);
  std::chrono::milliseconds limit(std::chrono::milliseconds timeout) const;

  c10::intrusive_ptr<c10d::Backend> inner_;
  c10::intrusive_ptr<c10d::Backend> checks_;
  std::atomic<int64_t> timeoutMs_;
  std::atomic<uint64_t> seq_{0};  // ops called, point-to-point included
  OpQueue queue_{"xcomm collective checks"};
};

}  // namespace xcomm
