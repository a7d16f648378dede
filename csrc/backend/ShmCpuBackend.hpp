#pragma once
// ShmCpuBackend: the CPU transport of a group whose ranks all share one host.
//
// Allreduce, broadcast, allgather, reduce_scatter, all_to_all (list and flat
// forms) and barrier run over ShmTransport on a worker thread (in issue order); a call
// with async_op=False on an idle backend runs on the caller's thread instead,
// which saves two thread hand-offs. Everything else, and dtypes without a
// shared-memory kernel, goes to the fallback backend (Gloo), so the group
// keeps every op Gloo has.
//
// Hierarchical mode, for a group spanning hosts with several ranks per host:
// the transport then covers this host's ranks only, and allreduce runs as a
// shared-memory allreduce inside the host, an allreduce among one leader per
// host (local rank 0) through the `leaders` backend (Gloo), and a
// shared-memory broadcast from the leader. Only the leaders' traffic crosses
// hosts: N bytes per host instead of a flat ring's 2(p-1)/p N per rank.
// Each host's ranks agree over shared memory; the leaders agree with each
// other through a CheckedCpuBackend over `leaderChecks` (small sums ride in
// that check), and a leader whose step failed (hosts that disagree, a host
// that never came) hands its error to its host's ranks in the broadcast, so
// every rank raises it and the host stays in step.
// With `leaderCompression` the leaders' step alone is compressed (fp16/bf16
// cast or int8, collectives/compressed/CompressedAllreduce): the bytes that cross hosts
// shrink 2-4x more while the sums inside a host stay exact.
// Every other op goes to the fallback over the whole group.
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend/CheckedCpuBackend.hpp"
#include "collectives/compressed/CompressedAllreduce.hpp"
#include "runtime/OrderedRunner.hpp"
#include "transport/ShmTransport.hpp"

namespace xcomm {

class ShmCpuBackend : public c10d::Backend {
 public:
  struct Config {
    ShmTransport::Config transport;
    size_t smallAllreduceBytes = 256 << 10;
    // Hierarchical mode: how the leaders' allreduce is compressed.
    CompressionConfig leaderCompression;
    // Hierarchical mode with leader checks: bytes per leader a sum may carry
    // in the check (CheckedCpuBackend's carryBytes).
    int64_t leaderCarryBytes = 0;
    // Whether the leaders' checked backend may send large all-to-alls and
    // all-gathers as messages (GroupSettings::directExchange).
    bool leaderDirectExchange = true;
  };

  // Collective over `store`: null on every rank when the segment cannot be
  // set up (then the caller keeps using `fallback` alone); `whyNot` says why.
  static c10::intrusive_ptr<ShmCpuBackend> tryCreate(const c10::intrusive_ptr<c10d::Store>& store,
                                                     int rank, int size,
                                                     std::chrono::milliseconds timeout,
                                                     c10::intrusive_ptr<c10d::Backend> fallback,
                                                     Config config, std::string* whyNot = nullptr);

  // Hierarchical: `transport` spans this host's ranks, `rank`/`size` are the
  // group's; `leaders` (an allreduce among local rank 0 of every host) is set
  // on local rank 0 only, and `leaderChecks` (a group of the same ranks,
  // null: the leaders do not check each other) with it; `hosts` is the
  // number of hosts (leaders). Collective over this host's ranks.
  static c10::intrusive_ptr<ShmCpuBackend> tryCreateHierarchical(
      const c10::intrusive_ptr<c10d::Store>& localStore, int localRank, int localSize, int rank,
      int size, int hosts, std::chrono::milliseconds timeout,
      c10::intrusive_ptr<c10d::Backend> fallback, c10::intrusive_ptr<c10d::Backend> leaders,
      c10::intrusive_ptr<c10d::Backend> leaderChecks, Config config, std::string* whyNot = nullptr);

  ShmCpuBackend(std::unique_ptr<ShmTransport> transport, c10::intrusive_ptr<c10d::Backend> fallback,
                std::chrono::milliseconds timeout, Config config);
  ShmCpuBackend(std::unique_ptr<ShmTransport> transport, int rank, int size, int hosts,
                c10::intrusive_ptr<c10d::Backend> fallback,
                c10::intrusive_ptr<c10d::Backend> leaders,
                c10::intrusive_ptr<c10d::Backend> leaderChecks, std::chrono::milliseconds timeout,
                Config config);
  ~ShmCpuBackend() override;

  const std::string getBackendName() const override { return "xcomm-shm"; }
  const c10::intrusive_ptr<c10d::Backend>& fallback() const { return fallback_; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  void abort() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
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
  // Checks, in this group's order, that every rank calls this allreduce, and
  // runs nothing: for an allreduce whose data moves elsewhere (the backend's
  // compressed allreduce). Flat groups only.
  c10::intrusive_ptr<c10d::Work> agreeOnAllreduce(const std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts);

  // Delegated to the fallback backend (after the agreement barrier).
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // How many ops ran over shared memory (for tests and stats).
  uint64_t shmOps() const { return shmOps_.load(); }
  // Leaders' steps carried by their check (a checked leader); -1 elsewhere.
  int64_t leaderCarriedOps() const {
    return checkedLeaders_ ? static_cast<int64_t>(checkedLeaders_->carriedOps()) : -1;
  }
  // True when the group spans hosts (see above).
  bool hierarchical() const { return hierarchical_; }
  // What the group was built with (segment sizes, spin time).
  const Config& config() const { return config_; }
  // The leaders' compression (hierarchical mode with one configured), else null.
  const CompressedAllreduce* leaderCompression() const { return leaderCompression_.get(); }

 private:
  // Runs `body` in issue order and returns the work that reports it.
  c10::intrusive_ptr<c10d::Work> submit(
      c10d::OpType type, const char* title, std::vector<at::Tensor> outputs, bool asyncOp,
      std::chrono::milliseconds timeout,
      std::function<void(std::chrono::steady_clock::time_point)> body, bool withFuture = true,
      bool countAsShm = true);
  // A collective the fallback runs. On a flat group it first passes a
  // shared-memory agreement barrier (op, root, dtype, reduce op, bytes), in
  // issue order with the shared-memory ops: a rank whose op runs here and one
  // whose op runs there (a user's mismatch) then both raise at once, where
  // they would otherwise wait for each other until the timeout.
  c10::intrusive_ptr<c10d::Work> viaFallback(c10d::OpType type, const char* title,
                                             std::vector<at::Tensor> outputs, bool asyncOp,
                                             std::chrono::milliseconds timeout,
                                             at::ScalarType dtype, int redOp, int root,
                                             uint64_t bytes,
                                             std::function<c10::intrusive_ptr<c10d::Work>()> issue);
  bool reducible(const std::vector<at::Tensor>& tensors, c10d::ReduceOp::RedOpType op) const;
  // Whether the data-movement ops (all but allreduce) run over shared memory.
  bool flat() const { return !hierarchical_; }
  void allreduceOne(at::Tensor& tensor, const c10d::ReduceOp& op,
                    std::chrono::steady_clock::time_point deadline);
  // A leader's allreduce with the other hosts' leaders (checked where they
  // check each other), leaving part of the time to `deadline` for handing
  // an error to the host.
  void leaderStep(at::Tensor& tensor, c10d::ReduceOp::RedOpType op, bool compress,
                  c10d::AllreduceOptions leaderOpts,
                  std::chrono::steady_clock::time_point deadline);
  // What the host's ranks raise when this leader's step failed with `e`.
  std::string leaderError(const std::exception& e) const;

  std::unique_ptr<ShmTransport> transport_;
  c10::intrusive_ptr<c10d::Backend> fallback_;
  c10::intrusive_ptr<c10d::Backend> leaders_;  // hierarchical, local rank 0 only
  // leaders_ behind the leaders' rank-agreement check (null: unchecked).
  c10::intrusive_ptr<CheckedCpuBackend> checkedLeaders_;
  bool hierarchical_ = false;
  std::unique_ptr<CompressedAllreduce> leaderCompression_;  // over the hosts
  std::atomic<int64_t> timeoutMs_;
  Config config_;
  std::atomic<uint64_t> shmOps_{0};
  // Synchronous ops run on the caller's thread when nothing is queued: the
  // segment's steps are the ones worth those two saved thread hand-offs.
  OrderedRunner runner_{"xcomm shm queue", OrderedRunner::CallerThread::kWhenIdle};
};

}  // namespace xcomm
