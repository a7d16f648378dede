#pragma once
// XcommBackend: the c10d::Backend behind init_process_group(backend="xcomm"),
// and xcomm's only one above a transport.
//
// Every call is checked and staged here, converted once into an Op
// (runtime/Op.hpp), and handed to the route of the tensors' device
// (runtime/Route.hpp): for CPU tensors the route the group's plan names
// (CheckedRoute over Gloo, ShmRoute, HierarchicalRoute, or Gloo as it is),
// for CUDA tensors NCCL. What the group is (its GroupPlan) and its routes come
// from GroupBuilder. ("Inner route": what the routes are built on, a whole
// c10d backend (Gloo, NCCL) or, in a C++-only program, xcomm's StoreRoute;
// "transport": a byte mover under csrc/transport/.)
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/CheckedRoute.hpp"
#include "backend/GroupPlan.hpp"
#include "backend/HierarchicalRoute.hpp"
#include "backend/ShmRoute.hpp"
#include "backend/TensorStaging.hpp"
#include "backend/XcommOptions.hpp"
#include "backend/XcommWork.hpp"
#include "collectives/compressed/CompressedAllreduce.hpp"
#include "collectives/compressed/CompressedReduceScatter.hpp"
#include "collectives/gloo/AlltoallReduceScatter.hpp"
#include "common/TorchCompat.hpp"
#include "runtime/DeferredRelease.hpp"
#include "runtime/OrderedRunner.hpp"
#include "runtime/Route.hpp"
#include "schedule/FusionBuffer.hpp"

namespace xcomm {

class XcommBackend : public c10d::Backend {
 public:
  // The routes, one per device type; either may be null.
  struct Routes {
    std::shared_ptr<Route> cpu;
    // The whole Gloo (or store route) under the CPU route: point-to-point
    // ops, which match by tag rather than by order, go to it directly.
    std::shared_ptr<InnerRoute> cpuInner;
    std::shared_ptr<InnerRoute> cuda;  // NCCL
    // The CPU inner route of int8/auto-compressed allreduces, whose
    // collectives run on a worker thread and must not mix with other ops:
    // the check's group (CheckedRoute's), or one of their own when unchecked.
    std::shared_ptr<InnerRoute> cpuCompressed;
    // Where the CPU route is one of these (also `cpu`), its counters.
    std::shared_ptr<ShmRouteBase> shm;
    std::shared_ptr<HierarchicalRoute> hierarchical;
    // The checks around Gloo (`cpu`, or a hierarchical group's fallback).
    std::shared_ptr<CheckedRoute> checked;
  };

  // Groups are built by buildGroup (backend/GroupBuilder.hpp), which makes
  // the routes `plan` names.
  XcommBackend(c10::intrusive_ptr<XcommOptions> options, GroupPlan plan, Routes routes);
  ~XcommBackend() override;

  // The C++-only entry point: CPU collectives over xcomm's store transport,
  // nothing but a c10d::Store needed (all ranks pass stores of one server).
  static c10::intrusive_ptr<XcommBackend> createWithStore(
      const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
      c10::intrusive_ptr<XcommOptions> options = XcommOptions::create());

  // How a successor of this group is built (a shrink's survivors, a
  // reconfigure's members): a group of `size` ranks over `store` in which
  // this rank is `rank`; `freshNamespace` where no group can have used
  // `store`'s keys before (see buildGroup). buildGroup sets it, with the store it built this group
  // over (where a reconfigure meets members of other groups) and the namespace it drew for this
  // group (where a shrink meets only this group's members; null while an enable_reconfigure group
  // has no communicator).
  using Regroup = std::function<c10::intrusive_ptr<XcommBackend>(
      const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
      c10::intrusive_ptr<XcommOptions> options, bool freshNamespace)>;
  void setRegroup(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Store> groupStore,
                  Regroup regroup);

  // The survivors' group without the `excluded` ranks, built without them
  // (they must not call it): every survivor calls it with the same ranks,
  // which is checked (ValueError naming both lists). It is built as any
  // group is (GroupBuilder, on a fresh namespace of this group's store), so
  // its shape, shared-memory segment and auxiliary groups are the survivors';
  // its ranks are the survivors' in their old order. With kShrinkAbort in
  // `shrinkFlags` this group's pending ops fail first, else held fused ops
  // are sent first. `options` null: this group's. Compression state
  // (residuals, auto's measurements) starts afresh in the new group, on
  // every rank.
  static constexpr int kShrinkAbort = 1;  // c10d's SHRINK_ABORT
  c10::intrusive_ptr<XcommBackend> shrinkTo(const std::vector<int64_t>& excluded,
                                            int shrinkFlags = 0,
                                            c10::intrusive_ptr<XcommOptions> options = {});
#if XCOMM_HAS_SHRINK
#if XCOMM_VIRTUAL_CAPABILITIES
  bool supportsShrinking() const override {
    return static_cast<bool>(regroup_);
  }
#endif
  // dist.shrink_group from C++: shrinkTo with an XcommOptions override
  // (else this group's options). Python calls the binding's own shrink.
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranksToExclude, int shrinkFlags = 0,
      const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride = nullptr) override;
#endif

  // A group created with enable_reconfigure=True: it has no communicator
  // (every op raises, naming reconfigure) until reconfigure() gives it its
  // members. buildAwaitingReconfigure (GroupBuilder) makes it.
  static c10::intrusive_ptr<XcommBackend> awaitingReconfigure(
      c10::intrusive_ptr<XcommOptions> options, int rank, int size);
  // A key only this class can make: awaitingReconfigure's constructor is
  // public for make_intrusive alone.
  class Unconfigured {
    friend class XcommBackend;
    explicit Unconfigured() = default;
  };
  XcommBackend(Unconfigured, c10::intrusive_ptr<XcommOptions> options, GroupPlan plan);
  bool configured() const {
    return routes_.cpu || routes_.cuda;
  }

  // This process's handle for reconfigure: "xcomm:<rank>:<uuid>:<stable
  // rank>", with the uuid of the last reconfigure that succeeded here (-1:
  // none) and the rank this process had when the group was created (its
  // lasting identity). It changes with every successful reconfigure.
  std::string reconfigureHandle() const;
#if XCOMM_HAS_RECONFIGURE
  // Makes this group the one of `handles`' processes, as torch 2.14's
  // reconfigure contract says (Gloo's): a process's rank is its handle's
  // position (`ordered`), or its position after sorting the handles as
  // strings; the members meet under `uuid` in this group's store, where the
  // new rank 0 claims it (a uuid used before is refused, "already used");
  // the new group is built as any group is (GroupBuilder) and taken only once
  // every member built its own (then every one does; otherwise every one
  // keeps the old group and raises). Ops must not run meanwhile. The new
  // group's ops have this group's timeout; `timeout` bounds the meeting.
  // After an abort too: the new group works. Compression state starts afresh.
  void reconfigureTo(int64_t uuid, std::vector<std::string> handles, bool ordered,
                     std::chrono::milliseconds timeout);
#if XCOMM_VIRTUAL_CAPABILITIES
  bool supportsReconfigure() const override {
    return static_cast<bool>(regroup_);
  }
#endif
  c10d::ReconfigureHandle get_reconfigure_handle() const override {
    return reconfigureHandle();
  }
  // Blocks until done; returns a completed work.
  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& opts) override;
#endif

  const std::string getBackendName() const override {
    return "xcomm";
  }
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override {
    return options_;
  }
  const Routes& routes() const {
    return routes_;
  }
  const GroupPlan& plan() const {
    return plan_;
  }
  // Null when the group compresses nothing. A hierarchical group compresses
  // only its leaders' step (in its HierarchicalRoute), and reports it here.
  const CompressedAllreduce* compression() const;
  // Collectives run over shared memory; -1 when the group uses none.
  int64_t shmOps() const {
    return routes_.shm ? static_cast<int64_t>(routes_.shm->shmOps()) : -1;
  }
  // Ops carried by the rank-agreement check alone; -1 when Gloo is not checked.
  int64_t carriedOps() const {
    return routes_.checked ? static_cast<int64_t>(routes_.checked->carriedOps()) : -1;
  }
  // Ops sent as point-to-point messages instead of Gloo's collectives; -1
  // when Gloo is not checked.
  int64_t directOps() const {
    return routes_.checked ? static_cast<int64_t>(routes_.checked->directOps()) : -1;
  }
  // Steps between hosts carried by the leaders' check (a hierarchical
  // group's leader); -1 elsewhere.
  int64_t leaderCarriedOps() const {
    return routes_.hierarchical ? routes_.hierarchical->leaderCarriedOps() : -1;
  }
  void setTimeout(std::chrono::milliseconds timeout) override;
  // Fuses small async CPU allreduces into one transfer up to this many bytes
  // (schedule/FusionBuffer.hpp); 0, the default, turns fusion off. A
  // background thread sends held ops after agreeing with the other ranks
  // over `control`, a backend no other op uses: every cycle, or on demand
  // when `cycle` is 0. All ranks must call this together.
  void setFusionThreshold(size_t bytes, std::chrono::microseconds cycle = {},
                          std::shared_ptr<Route> control = {});
  size_t fusionThreshold() const {
    return fusion_ ? fusion_->thresholdBytes() : 0;
  }
  std::chrono::microseconds fusionCycle() const {
    return fusion_ ? fusion_->cycle() : std::chrono::microseconds{0};
  }
  void shutdown() override;
  // Every CPU op still pending fails at once (wait() raises, futures hold the
  // error), whatever route it took, and later ops are refused; then the inner
  // backends abort. A route's own threads may stay blocked in their transport
  // until the op's timeout, but no caller waits for them.
  void abort() override;
  // COMM_ERROR once aborted or after an op failed in its transport, TIMEOUT
  // after one timed out; SUCCESS otherwise (a caller's mistake, such as ranks
  // calling different collectives, is not the group's error).
  c10d::ErrorType getError() override;

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
#if XCOMM_HAS_GATHER_SINGLE
  // torch 2.14's gather_single, through its alias (the older names are the
  // ones to override): a gather into one flat tensor on the root. Gloo has
  // none; xcomm runs it as a gather into views of that tensor.
  c10::intrusive_ptr<c10d::Work> gather_into_tensor(
      at::Tensor& output, at::Tensor& input,
      const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
#endif
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
      std::vector<int64_t>& inputSplits,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  // Deprecated in c10d, still called by torch's own tests and older code.
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  // Gloo's, on the group's Gloo backend: a barrier that names the ranks that
  // did not arrive in time (dist.monitored_barrier).
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false) override;
  // Ops called on this group, counted as they are called (not as a route
  // issues them): the debug wrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL) compares
  // the ranks' numbers right after each call.
  void setSequenceNumberForGroup() override {
    seq_ = 0;
  }
  uint64_t getSequenceNumberForGroup() override {
    return seq_.load();
  }

 private:
  // The route for `t`'s device; every op but a fusable allreduce first
  // sends what fusion holds, so collectives keep their issue order.
  Route& routeFor(const at::Tensor& t, const char* op, bool flushFused = true);
  void flushFused();
  // The group's routes that exist (CPU, CUDA, the compressed allreduce's own).
  std::vector<std::shared_ptr<Route>> allRoutes() const;
  // The raw backend that carries `t`'s point-to-point messages: Gloo (or
  // NCCL) itself, since routes order collectives only. It first makes the
  // checks and the fused-ops flush a collective on `t` would make.
  InnerRoute& pointToPointRoute(const at::Tensor& t, const char* op);
  // Whether the inner backend for `t` implements PREMUL_SUM itself (NCCL does).
  bool backendHasPremul(const at::Tensor& t) const;
  // What every tensor op but all_reduce does after its checks, given the
  // route for its tensors (routeFor) or a point-to-point op's backend: count
  // the op, note the issue time, let `call(target, staging)` stage the
  // tensors and start the op there, and wrap its work with `result` as the
  // op's result.
  // `inputs` are what the profiler shows as the op's input shapes (Gloo's choice:
  // what this rank contributes).
  template <typename Target, typename Call>
  c10::intrusive_ptr<c10d::Work> delegate(const char* op, Target& target, c10d::OpType type,
                                          c10::IValue result, const std::vector<at::Tensor>& inputs,
                                          Call&& call);
  // The work the caller gets: `inner` plus `finalize`, run once the inner work
  // succeeded (after any copy-back); counted in xcomm.stats() and the
  // timeline, and one "xcomm:<op>" event under torch.profiler. Null when
  // `inner` is (a synchronous op already ordered on the caller's stream).
  c10::intrusive_ptr<DelegatedWork> wrap(c10::intrusive_ptr<c10d::Work> inner, c10d::OpType type,
                                         std::function<void()> finalize, c10::IValue result,
                                         int64_t issuedUs, uint64_t bytes, const std::string& op,
                                         const std::vector<at::Tensor>& inputs);
  // wrap, counted as `statsName` with `wireBytes` sent for `bytes` (a
  // compressed op), titled `title` under the profiler.
  c10::intrusive_ptr<DelegatedWork> wrapCounted(c10::intrusive_ptr<c10d::Work> inner,
                                                c10d::OpType type, std::function<void()> finalize,
                                                c10::IValue result, int64_t issuedUs,
                                                const std::string& statsName, uint64_t bytes,
                                                uint64_t wireBytes, const char* title,
                                                const std::vector<at::Tensor>& inputs);

  c10::intrusive_ptr<c10d::Work> compressedAllreduce(at::Tensor& tensor,
                                                     const c10d::AllreduceOptions& opts);
  // DistBackendError naming `op` once the group was aborted, or while it
  // awaits its first reconfigure().
  void checkNotAborted(const char* op) const;
  // Takes `other`'s group (plan, routes, fusion, compression,
  // pending works, rank and size) and leaves it this one's; what says who
  // this process is and how groups are built (store, regroup, handle) stays.
  void swapGroup(XcommBackend& other);
  // Keeps the group's error state (getError) from `work`'s outcome.
  void watchForErrors(const c10::intrusive_ptr<c10d::Work>& work);

  c10::intrusive_ptr<XcommOptions> options_;
  GroupPlan plan_;
  c10::intrusive_ptr<c10d::Store> store_;       // what a reconfigure's successor is built over
  c10::intrusive_ptr<c10d::Store> groupStore_;  // what a shrink's successor is built over
  Regroup regroup_;
  int shrinks_ = 0;               // successors built: each takes a fresh store namespace
  int64_t stableRank_ = 0;        // the rank this process had when the group was created
  int64_t reconfigureUuid_ = -1;  // of the last reconfigure that succeeded here
  Routes routes_;
  std::shared_ptr<FusionBuffer> fusion_;  // null: fusion off
  // The fusion rounds' own transport: shut down with the group, so that
  // peers in a round fail at once (shared memory marks this rank departed).
  std::shared_ptr<Route> fusionControl_;
  std::atomic<uint64_t> seq_{0};  // ops called (getSequenceNumberForGroup)
  std::unique_ptr<CompressedAllreduce> compressed_;
  std::unique_ptr<CompressedReduceScatter> compressedReduceScatter_;
  // Uncompressed reduce-scatter on a CPU group whose data does not move over
  // shared memory: half Gloo's bytes (null in a flat shared-memory group).
  std::unique_ptr<AlltoallReduceScatter> alltoallReduceScatter_;
  // What abort() fails; and the first error a transport reported (getError).
  std::unique_ptr<PendingWorks> pending_ = std::make_unique<PendingWorks>();
  // (Shared with the works' callbacks, which may outlive the group.)
  std::shared_ptr<std::atomic<int>> transportError_ =
      std::make_shared<std::atomic<int>>(static_cast<int>(c10d::ErrorType::SUCCESS));
  // The group this one was shrunk from, released off the survivors' path.
  std::unique_ptr<DeferredRelease> predecessor_;
  // The CPU transports an abort let go of (see abort()).
  std::vector<std::unique_ptr<DeferredRelease>> retiredOnAbort_;
  // Runs compressed allreduces that need their own group's collectives, in
  // issue order (declared last: stops before the rest goes).
  std::unique_ptr<OrderedRunner> compressRunner_;
};

}  // namespace xcomm
