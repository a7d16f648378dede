#include "backend/XcommBackend.hpp"

#include <algorithm>
#include <cctype>
#include <sstream>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "backend/InputChecks.hpp"
#include "backend/MinMaxLowering.hpp"
#include "backend/PremulLowering.hpp"
#include "backend/StoreText.hpp"
#include "backend/XcommWork.hpp"
#include "common/ErrorText.hpp"
#include "observe/Stats.hpp"
#include "observe/Timeline.hpp"
#include "schedule/CycleFusion.hpp"

namespace xcomm {
namespace {

c10::IValue listValue(const std::vector<at::Tensor>& ts) {
  return c10::IValue(ts);
}

std::string rankListText(const std::vector<int64_t>& ranks) {
  std::ostringstream text;
  for (size_t i = 0; i < ranks.size(); ++i) text << (i ? ", " : "") << ranks[i];
  return text.str();
}

c10::IValue listOfListsValue(const std::vector<std::vector<at::Tensor>>& lists) {
  c10::List<c10::List<at::Tensor>> value;
  for (const auto& list : lists) value.push_back(c10::List<at::Tensor>(list));
  return c10::IValue(value);
}

}  // namespace

XcommBackend::XcommBackend(c10::intrusive_ptr<XcommOptions> options, GroupPlan plan, Routes routes)
    : Backend(plan.rank, plan.size),
      options_(std::move(options)),
      plan_(std::move(plan)),
      routes_(std::move(routes)) {
  TORCH_CHECK(options_, "xcomm: options must not be null");
  TORCH_CHECK(routes_.cpu || routes_.cuda, "xcomm: a process group needs a CPU or a CUDA route");
  TORCH_CHECK(!routes_.cpu || routes_.cpuInner,
              "xcomm: a CPU route needs the inner route under it (point-to-point ops)");
  TORCH_CHECK(!routes_.shm || routes_.cpu == routes_.shm,
              "xcomm: the shared-memory route must be the CPU route");
  TORCH_CHECK(plan_.usesShm() == static_cast<bool>(routes_.shm), "xcomm: a ",
              groupShapeName(plan_.shape), " group ", plan_.usesShm() ? "needs" : "has no use for",
              " a shared-memory route");
  for (const std::shared_ptr<Route>& t : {routes_.cpu, std::shared_ptr<Route>(routes_.cuda)}) {
    TORCH_CHECK(!t || (t->rank() == rank_ && t->size() == size_), "xcomm: the route's rank/size (",
                t ? t->rank() : -1, "/", t ? t->size() : -1, ") differ from the group's (", rank_,
                "/", size_, ")");
  }
  const auto& compression = plan_.backendCompression;
  if (plan_.backendMethod() != Compression::kNone) {
    compressed_ = std::make_unique<CompressedAllreduce>(compression, size_);
    compressedReduceScatter_ = std::make_unique<CompressedReduceScatter>(
        compression, size_, compressed_->sharedCounters());
    if (compressed_->needsOwnTransport()) {
      TORCH_CHECK_VALUE(routes_.cpuCompressed, "xcomm: ", compressionName(compression.method),
                        " allreduce compression needs a second CPU backend for its own "
                        "collectives; build the group through init_process_group/new_group");
      compressRunner_ = std::make_unique<OrderedRunner>("xcomm compressed allreduce",
                                                        OrderedRunner::CallerThread::kNever);
    }
  }
  if (routes_.cpu && !(routes_.shm && !routes_.hierarchical)) {
    alltoallReduceScatter_ = std::make_unique<AlltoallReduceScatter>(size_);
  }
  stableRank_ = rank_;
  init();
}

XcommBackend::XcommBackend(Unconfigured, c10::intrusive_ptr<XcommOptions> options, GroupPlan plan)
    : Backend(plan.rank, plan.size), options_(std::move(options)), plan_(std::move(plan)) {
  TORCH_CHECK(options_, "xcomm: options must not be null");
  stableRank_ = rank_;
  init();
}

c10::intrusive_ptr<XcommBackend> XcommBackend::awaitingReconfigure(
    c10::intrusive_ptr<XcommOptions> options, int rank, int size) {
  TORCH_CHECK(options, "xcomm: options must not be null");
  auto plan = GroupPlan::plain(rank, size, *options, "no communicator until reconfigure()");
  return c10::make_intrusive<XcommBackend>(Unconfigured(), std::move(options), std::move(plan));
}

XcommBackend::~XcommBackend() = default;

void XcommBackend::swapGroup(XcommBackend& other) {
  using std::swap;
  swap(options_, other.options_);
  swap(plan_, other.plan_);
  swap(routes_, other.routes_);
  const uint64_t seq = seq_.exchange(other.seq_.load());
  other.seq_ = seq;
  swap(fusion_, other.fusion_);
  swap(fusionControl_, other.fusionControl_);
  swap(compressed_, other.compressed_);
  swap(compressedReduceScatter_, other.compressedReduceScatter_);
  swap(alltoallReduceScatter_, other.alltoallReduceScatter_);
  swap(pending_, other.pending_);
  swap(transportError_, other.transportError_);
  swap(predecessor_, other.predecessor_);
  swap(compressRunner_, other.compressRunner_);
  // The new group's namespace, where its shrinks meet (store_ and regroup_
  // stay: a reconfigure meets its members over the store this group was made on).
  swap(groupStore_, other.groupStore_);
  swap(shrinks_, other.shrinks_);
#if XCOMM_HAS_RECONFIGURE
  swap(rank_, other.rank_);  // const in c10d::Backend before torch 2.14
  swap(size_, other.size_);
#endif
}

void XcommBackend::setTimeout(std::chrono::milliseconds timeout) {
  options_->timeout = timeout;
  for (const auto& t : allRoutes()) t->setTimeout(timeout);
  if (fusion_) fusion_->setTimeout(timeout);  // its agreement rounds' control group
}

void XcommBackend::setFusionThreshold(size_t bytes, std::chrono::microseconds cycle,
                                      std::shared_ptr<Route> control) {
  TORCH_CHECK_VALUE(cycle.count() >= 0, "xcomm: the fusion cycle time must be >= 0");
  TORCH_CHECK_VALUE(cycle.count() == 0 || bytes > 0,
                    "xcomm: a fusion cycle time needs fusion_threshold_bytes > 0");
  TORCH_CHECK_VALUE(bytes == 0 || control,
                    "xcomm: tensor fusion needs a control backend (its agreement rounds)");
  if (fusion_) fusion_->stop();
  fusionControl_ = control;
  fusion_ = makeFusionBuffer(bytes, cycle, std::move(control), options_->timeout);
}

void XcommBackend::flushFused() {
  if (fusion_) fusion_->flush();
}

void XcommBackend::shutdown() {
  if (fusion_) fusion_->stop();
  if (fusionControl_) fusionControl_->shutdown();
  if (compressRunner_) compressRunner_->shutdown();
  for (const auto& t : allRoutes()) t->shutdown();
}

void XcommBackend::abort() {
  std::exception_ptr error;
  try {
    C10_THROW_ERROR(DistBackendError,
                    "xcomm: the process group was aborted while this op was pending "
                    "(ProcessGroup.abort()); its peers' part of it is abandoned");
  } catch (...) {
    error = std::current_exception();
  }
  pending_->failAll(error);  // first: no caller waits on what follows
  if (fusion_) fusion_->abort();
  for (const auto& t : allRoutes()) t->abort();
  // Let go of the CPU transports, on a thread of their own: their sockets
  // close as they go, so a peer blocked in Gloo waiting for this rank (which
  // Gloo's abort does not wake) fails at once instead of at its timeout, and
  // can shrink or reconfigure with the others. (Gloo's destructor may wait
  // for an op of its own blocked until its timeout: not on this thread.)
  struct Retired : c10::intrusive_ptr_target {
    Routes cpu;
    std::shared_ptr<Route> fusionControl;
  };
  auto retired = c10::make_intrusive<Retired>();
  std::swap(retired->cpu.cpu, routes_.cpu);
  std::swap(retired->cpu.cpuInner, routes_.cpuInner);
  std::swap(retired->cpu.cpuCompressed, routes_.cpuCompressed);
  std::swap(retired->cpu.shm, routes_.shm);
  std::swap(retired->cpu.hierarchical, routes_.hierarchical);
  std::swap(retired->cpu.checked, routes_.checked);
  std::swap(retired->fusionControl, fusionControl_);
  // No grace when this group goes: Gloo's part may wait for its timeout.
  retiredOnAbort_.push_back(
      std::make_unique<DeferredRelease>(std::move(retired), std::chrono::milliseconds(0)));
}

void XcommBackend::setRegroup(c10::intrusive_ptr<c10d::Store> store,
                              c10::intrusive_ptr<c10d::Store> groupStore, Regroup regroup) {
  store_ = std::move(store);
  groupStore_ = std::move(groupStore);
  regroup_ = std::move(regroup);
}

c10::intrusive_ptr<XcommBackend> XcommBackend::shrinkTo(const std::vector<int64_t>& excluded,
                                                        int shrinkFlags,
                                                        c10::intrusive_ptr<XcommOptions> options) {
  TORCH_CHECK_VALUE((shrinkFlags & ~kShrinkAbort) == 0, "xcomm.shrink: unknown shrink flags ",
                    shrinkFlags, "; xcomm knows SHRINK_DEFAULT (0) and SHRINK_ABORT (1)");
  TORCH_CHECK_VALUE(regroup_ && store_,
                    "xcomm.shrink: this group was not built by init_process_group, new_group "
                    "or create_with_store, so it cannot build its survivors' group");
  TORCH_CHECK_VALUE(groupStore_,
                    "xcomm.shrink: this group was created with enable_reconfigure=True and has "
                    "no communicator yet; call torch.distributed._reconfigure(...) first");
  std::vector<int64_t> sorted(excluded);
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK_VALUE(!sorted.empty(), "xcomm.shrink: name at least one rank to exclude");
  for (size_t i = 0; i < sorted.size(); ++i) {
    TORCH_CHECK_VALUE(sorted[i] >= 0 && sorted[i] < size_, "xcomm.shrink: rank ", sorted[i],
                      " is not in this group of ", size_, " ranks");
    TORCH_CHECK_VALUE(i == 0 || sorted[i] != sorted[i - 1], "xcomm.shrink: rank ", sorted[i],
                      " is excluded twice");
  }
  TORCH_CHECK_VALUE(!std::binary_search(sorted.begin(), sorted.end(), int64_t{rank_}),
                    "xcomm.shrink: this rank (", rank_,
                    ") is among the excluded ones; only the survivors call shrink");
  TORCH_CHECK_VALUE(static_cast<int64_t>(sorted.size()) < size_,
                    "xcomm.shrink: excluding every rank leaves no group");
  if (shrinkFlags & kShrinkAbort) {
    abort();
  } else {
    checkNotAborted("shrink");
    flushFused();
  }
  // Every survivor states whom it excludes, in a namespace of its own for
  // this shrink; a survivor excluding others than this one's would build a
  // different group (ranks waiting for each other until the timeout). Inside
  // this group's namespace: an earlier group of the same name over the same
  // store (destroy_process_group() + init_process_group()) left its shrinks'
  // keys in the store's own.
  const std::string space = "shrink/" + std::to_string(shrinks_++) + "/";
  const std::string mine = rankListText(sorted);
  std::vector<int64_t> survivors;
  for (int64_t r = 0; r < size_; ++r) {
    if (!std::binary_search(sorted.begin(), sorted.end(), r)) survivors.push_back(r);
  }
  const auto theirs = exchangeStoreTexts(
      groupStore_, space + "excluded/", rank_, mine, survivors, options_->timeout,
      [&](const std::string& why) {
        return c10::str("xcomm.shrink: not every survivor (ranks ", rankListText(survivors),
                        ") called shrink within the group's timeout (", options_->timeout.count(),
                        " ms): ", why);
      });
  for (size_t i = 0; i < survivors.size(); ++i) {
    TORCH_CHECK_VALUE(theirs[i] == mine, "xcomm.shrink: rank ", survivors[i], " excludes ranks [",
                      theirs[i], "] but rank ", rank_, " excludes [", mine,
                      "]; every survivor must exclude the same ranks");
  }
  const int newRank =
      rank_ - static_cast<int>(std::lower_bound(sorted.begin(), sorted.end(), int64_t{rank_}) -
                               sorted.begin());
  const int newSize = size_ - static_cast<int>(sorted.size());
  if (!options) options = c10::make_intrusive<XcommOptions>(*options_);
  // Fresh: this shrink's count in this group's namespace.
  auto successor = regroup_(c10::make_intrusive<c10d::PrefixStore>(space + "group", groupStore_),
                            newRank, newSize, std::move(options), /*freshNamespace=*/true);
  // torch destroys this group as soon as shrink returns; its destructor joins
  // transport threads the survivors' first collective need not wait for.
  successor->predecessor_ =
      std::make_unique<DeferredRelease>(c10::intrusive_ptr<XcommBackend>::reclaim_copy(this));
  return successor;
}

#if XCOMM_HAS_SHRINK
c10::intrusive_ptr<c10d::Backend> XcommBackend::shrink(
    const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
    const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride) {
  c10::intrusive_ptr<XcommOptions> options;
  if (optsOverride) {
    options = c10::dynamic_intrusive_pointer_cast<XcommOptions>(optsOverride);
    TORCH_CHECK_VALUE(options,
                      "xcomm.shrink: pg_options must be xcomm's options "
                      "(xcomm.Options(...).to_cpp()), got options of backend \"",
                      optsOverride->backend, "\"");
    options = c10::make_intrusive<XcommOptions>(*options);  // the new group's own copy
  }
  return shrinkTo(ranksToExclude, shrinkFlags, std::move(options));
}
#endif

std::string XcommBackend::reconfigureHandle() const {
  return "xcomm:" + std::to_string(rank_) + ":" + std::to_string(reconfigureUuid_) + ":" +
         std::to_string(stableRank_);
}

#if XCOMM_HAS_RECONFIGURE
namespace {

void checkReconfigureHandle(const std::string& handle) {
  const bool valid =
      handle.rfind("xcomm:", 0) == 0 && std::count(handle.begin(), handle.end(), ':') == 3;
  TORCH_CHECK_VALUE(valid, "xcomm.reconfigure: \"", handle,
                    "\" is not an xcomm reconfigure handle (get_reconfigure_handle() gives "
                    "\"xcomm:<rank>:<uuid>:<stable rank>\")");
}

std::vector<uint8_t> bytesOf(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

}  // namespace

void XcommBackend::reconfigureTo(int64_t uuid, std::vector<std::string> handles, bool ordered,
                                 std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(regroup_ && store_,
                    "xcomm.reconfigure: this group was not built by init_process_group, "
                    "new_group or create_with_store, so it cannot build another");
  TORCH_CHECK_VALUE(!handles.empty(), "xcomm.reconfigure: needs at least one handle");
  for (const auto& h : handles) checkReconfigureHandle(h);
  if (!ordered) std::sort(handles.begin(), handles.end());
  auto sorted = handles;
  std::sort(sorted.begin(), sorted.end());
  const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
  TORCH_CHECK_VALUE(twice == sorted.end(), "xcomm.reconfigure: the handle \"",
                    twice == sorted.end() ? std::string() : *twice,
                    "\" is given twice; every member's handle must be unique");
  const std::string mine = reconfigureHandle();
  const auto at = std::find(handles.begin(), handles.end(), mine);
  TORCH_CHECK_VALUE(at != handles.end(), "xcomm.reconfigure: this process's handle \"", mine,
                    "\" is not among the new group's handles");
  const int newRank = static_cast<int>(at - handles.begin());
  const int newSize = static_cast<int>(handles.size());
  const std::string space = "xcomm/reconfigure/" + std::to_string(uuid) + "/";
  // Every wait on the store below, the builder's included, ends at `timeout`:
  // a member that never comes fails the others then, not at the store's own
  // (often much longer) timeout.
  c10d::StoreTimeoutGuard storeTimeout(*store_, timeout);
  if (newRank == 0) {
    // A handle names the last uuid its process took, so a claim repeated by
    // the same members after a success differs from the claim made then.
    const auto claimed = store_->compareSet(space + "claimed", {}, bytesOf(mine));
    TORCH_CHECK(claimed == bytesOf(mine), "xcomm reconfigure uuid ", uuid,
                " was already used; each reconfigure() requires a unique uuid");
  }
  // A group whose transport failed (a dead peer) is aborted first: its
  // transports go, so a member still blocked in Gloo waiting for this one
  // fails at once and comes to this reconfigure, instead of at its timeout.
  if (getError() != c10d::ErrorType::SUCCESS && !pending_->aborted()) abort();
  // Build the new group beside the old one; take it only once every member
  // built its own, so that all of them change or none does.
  c10::intrusive_ptr<XcommBackend> successor;
  std::string failure;
  try {
    // Not fresh where this uuid was used before: its new rank 0 refuses it
    // above, and the others, who cannot know, must not read that use's keys.
    successor = regroup_(c10::make_intrusive<c10d::PrefixStore>(space + "group", store_), newRank,
                         newSize, c10::make_intrusive<XcommOptions>(*options_),
                         /*freshNamespace=*/false);
  } catch (const std::exception& e) {
    failure = messageOf(e);
    if (failure.empty()) failure = "failed";
  }
  std::vector<int64_t> members(newSize);
  for (int r = 0; r < newSize; ++r) members[r] = r;
  const auto built = exchangeStoreTexts(
      store_, space + "built/", newRank, failure.empty() ? "ok" : failure, members, timeout,
      [&](const std::string& why) {
        return c10::str("xcomm.reconfigure: not every member built the new group within ",
                        timeout.count(), " ms, so this process keeps its group (",
                        failure.empty() ? why : failure, ")");
      });
  for (int r = 0; r < newSize; ++r) {
    TORCH_CHECK_WITH(DistBackendError, built[r] == "ok", "xcomm.reconfigure: the new group's rank ",
                     r, " (", handles[r],
                     ") could not build it, so no member takes it: ", built[r]);
  }
  swapGroup(*successor);
  reconfigureUuid_ = uuid;
  // The old group, now held by `successor` alone, goes on a thread of its own.
  predecessor_ = std::make_unique<DeferredRelease>(std::move(successor));
}

c10::intrusive_ptr<c10d::Work> XcommBackend::reconfigure(const c10d::ReconfigureOptions& opts) {
  std::vector<std::string> handles;
  bool ordered = true;
  if (const auto* list = std::get_if<std::vector<c10d::ReconfigureHandle>>(&opts.handles)) {
    handles.assign(list->begin(), list->end());
  } else {
    const auto& set = std::get<std::unordered_set<c10d::ReconfigureHandle>>(opts.handles);
    handles.assign(set.begin(), set.end());
    ordered = false;
  }
  reconfigureTo(opts.uuid, std::move(handles), ordered, opts.timeout.value_or(options_->timeout));
  auto work =
      c10::make_intrusive<FutureWork>(rank_, c10d::OpType::UNKNOWN, "xcomm:reconfigure",
                                      c10::IValue(std::vector<at::Tensor>{}), tensorListType());
  work->markSucceeded();
  return work;
}
#endif

void XcommBackend::checkNotAborted(const char* op) const {
  TORCH_CHECK_WITH(DistBackendError, !pending_->aborted(), "xcomm.", op,
                   ": this process group was aborted; create a new one (or shrink/reconfigure "
                   "where supported) to go on");
  TORCH_CHECK_WITH(DistBackendError, configured(), "xcomm.", op,
                   ": this process group was created with enable_reconfigure=True and has no "
                   "communicator yet; call torch.distributed._reconfigure(...) first");
}

c10d::ErrorType XcommBackend::getError() {
  if (pending_->aborted()) return c10d::ErrorType::COMM_ERROR;
  return static_cast<c10d::ErrorType>(transportError_->load());
}

void XcommBackend::watchForErrors(const c10::intrusive_ptr<c10d::Work>& work) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = work->getFuture();
  } catch (const c10::Error&) {
    return;  // point to point: no future to watch
  }
  future->addCallback([state = transportError_](c10::ivalue::Future& done) {
    if (!done.hasError()) return;
    int kind = static_cast<int>(c10d::ErrorType::COMM_ERROR);
    try {
      std::rethrow_exception(done.exception_ptr());
    } catch (const c10::ValueError&) {
      return;  // the caller's mistake (ranks called different ops): the group is fine
    } catch (const c10::TypeError&) {
      return;
    } catch (const std::exception& e) {
      std::string text = messageOf(e);
      std::transform(text.begin(), text.end(), text.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      if (text.find("timed out") != std::string::npos ||
          text.find("timeout") != std::string::npos ||
          text.find("did not take part within") != std::string::npos) {
        kind = static_cast<int>(c10d::ErrorType::TIMEOUT);
      }
    } catch (...) {
    }
    int expected = static_cast<int>(c10d::ErrorType::SUCCESS);
    state->compare_exchange_strong(expected, kind);  // the first error counts
  });
}

std::vector<std::shared_ptr<Route>> XcommBackend::allRoutes() const {
  std::vector<std::shared_ptr<Route>> all;
  if (routes_.cpu) all.push_back(routes_.cpu);
  if (routes_.cuda) all.push_back(routes_.cuda);
  // The check's group, where it carries the compressed collectives, is
  // the checked route's to time out, shut down and abort.
  const bool ownCompressedRoute =
      routes_.cpuCompressed && !(routes_.checked && routes_.checked->uses(*routes_.cpuCompressed));
  if (ownCompressedRoute) all.push_back(routes_.cpuCompressed);
  return all;
}

Route& XcommBackend::routeFor(const at::Tensor& t, const char* op, bool flushFused) {
  checkNotAborted(op);
  if (flushFused) this->flushFused();
  const bool cuda = t.device().is_cuda();
  Route* route = cuda ? static_cast<Route*>(routes_.cuda.get()) : routes_.cpu.get();
  TORCH_CHECK_VALUE(route, "xcomm.", op, ": this process group has no ",
                    cuda ? "CUDA (NCCL)" : "CPU", " backend for a tensor on ", t.device().str(),
                    cuda ? "; CUDA needs torch with CUDA, NCCL and a visible GPU" : "");
  return *route;
}

InnerRoute& XcommBackend::pointToPointRoute(const at::Tensor& t, const char* op) {
  routeFor(t, op);  // the same checks, and held fused ops go first
  return t.device().is_cuda() ? *routes_.cuda : *routes_.cpuInner;
}

bool XcommBackend::backendHasPremul(const at::Tensor& t) const {
  return t.device().is_cuda();
}

c10::intrusive_ptr<DelegatedWork> XcommBackend::wrap(c10::intrusive_ptr<c10d::Work> inner,
                                                     c10d::OpType type,
                                                     std::function<void()> finalize,
                                                     c10::IValue result, int64_t issuedUs,
                                                     uint64_t bytes, const std::string& op,
                                                     const std::vector<at::Tensor>& inputs) {
  return wrapCounted(std::move(inner), type, std::move(finalize), std::move(result), issuedUs,
                     c10d::opTypeToString(type), bytes, bytes, profilingTitle(op), inputs);
}

c10::intrusive_ptr<DelegatedWork> XcommBackend::wrapCounted(
    c10::intrusive_ptr<c10d::Work> inner, c10d::OpType type, std::function<void()> finalize,
    c10::IValue result, int64_t issuedUs, const std::string& statsName, uint64_t bytes,
    uint64_t wireBytes, const char* title, const std::vector<at::Tensor>& inputs) {
  if (!inner) {
    // The inner backend ran a synchronous op (async_op=False) on the caller's
    // stream and returned no work, as NCCL does since torch 2.7: the op is
    // already ordered there. Finish ours the same way and return none too;
    // torch waits only on a work it gets.
    if (finalize) finalize();
    recordAfterDeviceOp(inputs, statsName, bytes, wireBytes, issuedUs);
    return {};
  }
  auto resultType = result.type();
  auto work =
      c10::make_intrusive<DelegatedWork>(rank_, type, std::move(inner), std::move(finalize),
                                         std::move(result), std::move(resultType), title, inputs);
  pending_->add(work);
  watchForErrors(work);
  // xcomm.stats() and the timeline, timed from the issue: an inner backend may run
  // a small op inline and be done before it returns.
  recordOnCompletion(work, statsName, bytes, wireBytes, issuedUs);
  return work;
}

template <typename Target, typename Call>
c10::intrusive_ptr<c10d::Work> XcommBackend::delegate(const char* op, Target& target,
                                                      c10d::OpType type, c10::IValue result,
                                                      const std::vector<at::Tensor>& inputs,
                                                      Call&& call) {
  seq_++;
  // Counted before the op is issued: nothing may fail once it is.
  const uint64_t bytes = payloadBytes(result);
  const int64_t issuedUs = Timeline::nowUs();
  TensorStaging staging;
  auto work = call(target, staging);
  return wrap(std::move(work), type, staging.copyBack(), std::move(result), issuedUs, bytes, op,
              inputs);
}

c10::intrusive_ptr<c10d::Work> XcommBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  constexpr const char* op = "broadcast";
  checks::tensorList(op, tensors);
  checks::rank(op, opts.rootRank, size_, "root");
  return delegate(op, routeFor(tensors[0], op), c10d::OpType::BROADCAST, listValue(tensors),
                  tensors, [&](Route& route, TensorStaging& staging) {
                    auto staged = staging.inOut(tensors);
                    return route.run(Op::broadcast(staged, opts));
                  });
}

const CompressedAllreduce* XcommBackend::compression() const {
  if (compressed_) return compressed_.get();
  return routes_.hierarchical ? routes_.hierarchical->leaderCompression() : nullptr;
}

c10::intrusive_ptr<c10d::Work> XcommBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  constexpr const char* op = "all_reduce";
  checks::tensorList(op, tensors);
  // AVG of integers as NCCL defines it: the sum divided by the group size,
  // rounded toward zero (Lightning's sync_dist sends it to non-Gloo backends).
  const bool integerAvg = opts.reduceOp.op_ == c10d::ReduceOp::AVG &&
                          at::isIntegralType(tensors[0].scalar_type(), /*includeBool=*/false);
  if (!integerAvg) checks::reduceOp(op, opts.reduceOp, tensors[0].scalar_type());
  auto& route = routeFor(tensors[0], op, /*flushFused=*/false);
  seq_++;
  const int64_t issuedUs = Timeline::nowUs();
  if (compressed_ && compressed_->applies(tensors, opts)) {
    flushFused();  // held ops go first: every rank issues in program order
    return compressedAllreduce(tensors[0], opts);
  }
  TensorStaging staging;
  const PremulLowering premul(opts.reduceOp, backendHasPremul(tensors[0]));
  const MinMaxLowering minmax(opts.reduceOp, tensors[0]);
  auto staged = minmax.lowers() ? minmax.inOut(staging, tensors) : premul.inOut(staging, tensors);
  auto innerOpts = minmax.options(premul.options(opts));
  std::function<void()> finalize = staging.copyBack();
  if (integerAvg && !tensors[0].device().is_cuda()) {  // NCCL averages integers itself
    innerOpts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
    finalize = [copyBack = std::move(finalize), tensors, size = size_] {
      if (copyBack) copyBack();
      for (const auto& t : tensors) t.div_(size, "trunc");
    };
  }
  if (fusion_ && staged.size() == 1 && fusion_->accepts(staged[0], innerOpts)) {
    return fusion_->enqueue(routes_.cpu, rank_, staged[0], innerOpts, std::move(finalize),
                            listValue(tensors), profilingTitle("all_reduce:fused"));
  }
  flushFused();
  auto result = listValue(tensors);
  const uint64_t bytes = payloadBytes(result);  // before the op is issued
  // A hierarchical group compresses the step between hosts only (its
  // leaders, HierarchicalRoute): every rank counts the op under the method, with
  // what a leader sends, as a group compressing every step does.
  const CompressedAllreduce* leaders = routes_.hierarchical && tensors[0].device().is_cpu()
                                           ? routes_.hierarchical->leaderCompression()
                                           : nullptr;
  if (leaders && leaders->applies(staged, innerOpts)) {
    const uint64_t wireBytes = leaders->payloadBytes(staged[0]);
    auto work = route.run(Op::allreduce(staged, innerOpts));
    return wrapCounted(std::move(work), c10d::OpType::ALLREDUCE, std::move(finalize),
                       std::move(result), issuedUs, leaders->statsName(), bytes, wireBytes,
                       profilingTitle(op), tensors);
  }
  auto work = route.run(Op::allreduce(staged, innerOpts));
  return wrap(std::move(work), c10d::OpType::ALLREDUCE, std::move(finalize), std::move(result),
              issuedUs, bytes, op, tensors);
}

c10::intrusive_ptr<c10d::Work> XcommBackend::compressedAllreduce(
    at::Tensor& tensor, const c10d::AllreduceOptions& opts) {
  const int64_t startUs = Timeline::nowUs();
  const std::string& statsName = compressed_->statsName();
  const uint64_t bytesIn = tensor.numel() * tensor.element_size();
  const uint64_t bytesOnWire = compressed_->payloadBytes(tensor);
  const char* title =
      profilingTitle(std::string("all_reduce:") + compressionName(compressed_->config().method));
  if (compressed_->issuesOnCaller(tensor)) {
    std::function<void()> finalize;
    auto inner = compressed_->start(routeFor(tensor, "all_reduce"), tensor, opts, finalize);
    return wrapCounted(std::move(inner), c10d::OpType::ALLREDUCE, std::move(finalize),
                       listValue({tensor}), startUs, statsName, bytesIn, bytesOnWire, title,
                       {tensor});
  }
  auto work =
      c10::make_intrusive<FutureWork>(rank_, c10d::OpType::ALLREDUCE, title, listValue({tensor}),
                                      tensorListType(), std::vector<at::Tensor>{tensor});
  pending_->add(work);
  watchForErrors(work);
  auto* algorithm = compressed_.get();
  auto compressedRoute = routes_.cpuCompressed;
  // Its collectives run on a group of their own: first every rank agrees,
  // in the group's order, that this is the call (else an allreduce here
  // against another op there would wait for each other until the timeout).
  c10::intrusive_ptr<c10d::Work> agreed = routes_.cpu->agree(Op::allreduce({tensor}, opts));
  // auto's ops are counted once it chose: ALLREDUCE_AUTO_NONE/_BF16/_INT8.
  const bool chooses = algorithm->autoCompression() != nullptr;
  compressRunner_->submit(finishing(work, [algorithm, compressedRoute, tensor, opts, chooses,
                                           statsName, bytesIn, startUs, agreed]() mutable {
    std::exception_ptr error;
    Compression ran = Compression::kAuto;
    try {
      if (agreed) agreed->wait();
      ran = algorithm->run(*compressedRoute, tensor, opts);
    } catch (...) {
      error = std::current_exception();
    }
    if (chooses) {
      std::string name = statsName;
      if (ran != Compression::kAuto) {
        name += '_';
        for (const char* c = compressionName(ran); *c; ++c) {
          name += static_cast<char>(std::toupper(static_cast<unsigned char>(*c)));
        }
      }
      recordCompleted(name, bytesIn, algorithm->payloadBytes(tensor, ran), startUs,
                      error != nullptr);
    }
    if (error) std::rethrow_exception(error);
    return -1;
  }));
  if (!chooses) recordOnCompletion(work, statsName, bytesIn, bytesOnWire, startUs);
  return work;
}

c10::intrusive_ptr<c10d::Work> XcommBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  constexpr const char* op = "all_reduce_coalesced";
  checks::tensorList(op, tensors);
  checks::reduceOp(op, opts.reduceOp, tensors[0].scalar_type());
  return delegate(
      op, routeFor(tensors[0], op), c10d::OpType::ALLREDUCE_COALESCED, listValue(tensors), tensors,
      [&](Route& route, TensorStaging& staging) {
        const PremulLowering premul(opts.reduceOp, backendHasPremul(tensors[0]));
        const MinMaxLowering minmax(opts.reduceOp, tensors[0]);
        auto staged =
            minmax.lowers() ? minmax.inOut(staging, tensors) : premul.inOut(staging, tensors);
        return route.run(Op::allreduceCoalesced(staged, minmax.options(premul.options(opts))));
      });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::reduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::ReduceOptions& opts) {
  constexpr const char* op = "reduce";
  checks::tensorList(op, tensors);
  checks::rank(op, opts.rootRank, size_, "root");
  checks::reduceOp(op, opts.reduceOp, tensors[0].scalar_type());
  return delegate(op, routeFor(tensors[0], op), c10d::OpType::REDUCE, listValue(tensors), tensors,
                  [&](Route& route, TensorStaging& staging) {
                    const PremulLowering premul(opts.reduceOp, backendHasPremul(tensors[0]));
                    const MinMaxLowering minmax(opts.reduceOp, tensors[0]);
                    // Lowered to a scaled SUM, a non-root rank sends a scaled copy,
                    // so its tensor keeps its values; the root's tensor receives the
                    // result. On keys, every rank's tensor gets what Gloo leaves in
                    // its keys, decoded: the root the result, the others what Gloo's
                    // algorithm leaves there, as for any other dtype.
                    auto staged = minmax.lowers() ? minmax.inOut(staging, tensors)
                                  : premul.lowers() && rank_ != opts.rootRank
                                      ? premul.in(staging, tensors)
                                      : premul.inOut(staging, tensors);
                    return route.run(Op::reduce(staged, minmax.options(premul.options(opts))));
                  });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr const char* op = "all_gather";
  checks::tensorList(op, inputs, "input");
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "xcomm.all_gather: got ", outputs.size(),
                    " output lists for ", inputs.size(), " input tensors");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checks::listForEveryRank(op, outputs[i], size_, inputs[i].numel(), "output");
    for (const auto& out : outputs[i]) {
      checks::sameDeviceAndDtype(op, out, inputs[i], "output", "input");
    }
  }
  return delegate(op, routeFor(inputs[0], op), c10d::OpType::ALLGATHER, listOfListsValue(outputs),
                  inputs, [&](Route& route, TensorStaging& staging) {
                    auto stagedIn = staging.in(inputs);
                    auto stagedOut = staging.out(outputs);
                    return route.run(Op::allgather(stagedOut, stagedIn, opts));
                  });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                             const c10d::AllgatherOptions& opts) {
  constexpr const char* op = "all_gather_into_tensor";
  checks::tensorList(op, {input}, "input");
  checks::tensorList(op, {output}, "output");
  checks::sameDeviceAndDtype(op, output, input, "output", "input");
  checks::allgatherBase(output, input, size_);
  return delegate(op, routeFor(input, op), c10d::OpType::_ALLGATHER_BASE, listValue({output}),
                  {input}, [&](Route& route, TensorStaging& staging) {
                    auto stagedIn = staging.in(input);
                    auto stagedOut = staging.out(output);
                    return route.run(Op::allgatherBase(stagedOut, stagedIn, opts));
                  });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr const char* op = "all_gather_into_tensor_coalesced";
  checks::tensorList(op, inputs, "input");
  checks::tensorList(op, outputs, "output");
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "xcomm.", op, ": got ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checks::sameDeviceAndDtype(op, outputs[i], inputs[i], "output", "input");
    checks::allgatherBase(outputs[i], inputs[i], size_);
  }
  return delegate(op, routeFor(inputs[0], op), c10d::OpType::COALESCED, listValue(outputs), inputs,
                  [&](Route& route, TensorStaging& staging) {
                    auto stagedIn = staging.in(inputs);
                    auto stagedOut = staging.out(outputs);
                    return route.run(Op::allgatherIntoTensorCoalesced(stagedOut, stagedIn, opts));
                  });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::GatherOptions& opts) {
  constexpr const char* op = "gather";
  checks::tensorList(op, inputs, "input");
  checks::rank(op, opts.rootRank, size_, "root");
  TORCH_CHECK_VALUE(inputs.size() == 1, "xcomm.gather: expects one input tensor, got ",
                    inputs.size());
  if (rank_ == opts.rootRank) {
    TORCH_CHECK_VALUE(outputs.size() == 1, "xcomm.gather: the root needs one output list, got ",
                      outputs.size());
    checks::listForEveryRank(op, outputs[0], size_, inputs[0].numel(), "gather");
    for (const auto& out : outputs[0]) {
      checks::sameDeviceAndDtype(op, out, inputs[0], "output", "input");
    }
  } else {
    TORCH_CHECK_VALUE(outputs.empty(), "xcomm.gather: only the root (rank ", opts.rootRank,
                      ") passes a gather list");
  }
  return delegate(op, routeFor(inputs[0], op), c10d::OpType::GATHER, listOfListsValue(outputs),
                  inputs, [&](Route& route, TensorStaging& staging) {
                    auto stagedIn = staging.in(inputs);
                    auto stagedOut = staging.out(outputs);
                    return route.run(Op::gather(stagedOut, stagedIn, opts));
                  });
}

#if XCOMM_HAS_GATHER_SINGLE
c10::intrusive_ptr<c10d::Work> XcommBackend::gather_into_tensor(at::Tensor& output,
                                                                at::Tensor& input,
                                                                const c10d::GatherOptions& opts) {
  constexpr const char* op = "gather_single";
  checks::rank(op, opts.rootRank, size_, "root");
  std::vector<at::Tensor> inputs{input};
  std::vector<std::vector<at::Tensor>> outputs;
  if (rank_ == opts.rootRank) {
    checks::sameDeviceAndDtype(op, output, input, "output", "input");
    TORCH_CHECK_VALUE(output.is_contiguous(), "xcomm.gather_single: the output tensor must be ",
                      "contiguous");
    TORCH_CHECK_VALUE(output.numel() == input.numel() * size_,
                      "xcomm.gather_single: the output has ", output.numel(),
                      " elements; it must hold ", size_, " x ", input.numel(),
                      " (one input per rank)");
    // Row r of the output is rank r's input.
    auto rows = output.view({size_, input.numel()});
    std::vector<at::Tensor> perRank;
    perRank.reserve(size_);
    for (int64_t r = 0; r < size_; ++r) {
      perRank.push_back(rows[r].view(input.sizes()));
    }
    outputs.push_back(std::move(perRank));
  }
  return XcommBackend::gather(outputs, inputs, opts);
}
#endif

c10::intrusive_ptr<c10d::Work> XcommBackend::scatter(std::vector<at::Tensor>& outputs,
                                                     std::vector<std::vector<at::Tensor>>& inputs,
                                                     const c10d::ScatterOptions& opts) {
  constexpr const char* op = "scatter";
  checks::tensorList(op, outputs, "output");
  checks::rank(op, opts.rootRank, size_, "root");
  TORCH_CHECK_VALUE(outputs.size() == 1, "xcomm.scatter: expects one output tensor, got ",
                    outputs.size());
  if (rank_ == opts.rootRank) {
    TORCH_CHECK_VALUE(inputs.size() == 1, "xcomm.scatter: the root needs one input list, got ",
                      inputs.size());
    checks::listForEveryRank(op, inputs[0], size_, outputs[0].numel(), "scatter");
    for (const auto& in : inputs[0]) {
      checks::sameDeviceAndDtype(op, in, outputs[0], "input", "output");
    }
  } else {
    TORCH_CHECK_VALUE(inputs.empty(), "xcomm.scatter: only the root (rank ", opts.rootRank,
                      ") passes a scatter list");
  }
  const auto sent = inputs.empty() ? std::vector<at::Tensor>{} : inputs[0];  // the root's
  return delegate(op, routeFor(outputs[0], op), c10d::OpType::SCATTER, listValue(outputs), sent,
                  [&](Route& route, TensorStaging& staging) {
                    std::vector<std::vector<at::Tensor>> stagedIn;
                    for (const auto& list : inputs) stagedIn.push_back(staging.in(list));
                    auto stagedOut = staging.out(outputs);
                    return route.run(Op::scatter(stagedOut, stagedIn, opts));
                  });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  constexpr const char* op = "reduce_scatter";
  checks::tensorList(op, outputs, "output");
  checks::reduceOp(op, opts.reduceOp, outputs[0].scalar_type());
  TORCH_CHECK_VALUE(inputs.size() == outputs.size(), "xcomm.reduce_scatter: got ", inputs.size(),
                    " input lists for ", outputs.size(), " outputs");
  for (size_t i = 0; i < outputs.size(); ++i) {
    checks::listForEveryRank(op, inputs[i], size_, outputs[i].numel(), "input");
    for (const auto& in : inputs[i]) {
      checks::sameDeviceAndDtype(op, in, outputs[i], "input", "output");
    }
  }
  std::vector<at::Tensor> flatInputs;
  for (const auto& list : inputs) flatInputs.insert(flatInputs.end(), list.begin(), list.end());
  return delegate(
      op, routeFor(outputs[0], op), c10d::OpType::REDUCE_SCATTER, listValue(outputs), flatInputs,
      [&](Route& route, TensorStaging& staging) {
        const PremulLowering premul(opts.reduceOp, backendHasPremul(outputs[0]));
        const MinMaxLowering minmax(opts.reduceOp, outputs[0]);
        std::vector<std::vector<at::Tensor>> stagedIn;
        for (const auto& list : inputs) {
          stagedIn.push_back(minmax.lowers() ? minmax.in(list) : premul.in(staging, list));
        }
        auto stagedOut = minmax.lowers() ? minmax.out(staging, outputs) : staging.out(outputs);
        return route.run(
            Op::reduceScatter(stagedOut, stagedIn, minmax.options(premul.options(opts))));
      });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  constexpr const char* op = "reduce_scatter_tensor";
  checks::tensorList(op, {input}, "input");
  checks::tensorList(op, {output}, "output");
  checks::sameDeviceAndDtype(op, output, input, "output", "input");
  checks::reduceOp(op, opts.reduceOp, input.scalar_type());
  checks::reduceScatterBase(output, input, size_);
  if (compressedReduceScatter_ && compressedReduceScatter_->applies(input, opts)) {
    auto& route = routeFor(input, op);  // flushes held ops: every rank issues in program order
    seq_++;
    const int64_t startUs = Timeline::nowUs();
    std::function<void()> finalize;
    auto innerWork = compressedReduceScatter_->start(route, output, input, opts, finalize);
    return wrapCounted(
        std::move(innerWork), c10d::OpType::_REDUCE_SCATTER_BASE, std::move(finalize),
        listValue({output}), startUs, compressedReduceScatter_->statsName(),
        input.numel() * input.element_size(), compressedReduceScatter_->payloadBytes(input),
        profilingTitle(std::string(op) + ":" + compressionName(plan_.backendCompression.method)),
        {input});
  }
  // MIN/MAX of floats run on keys (MinMaxLowering), on the delegated route.
  const bool minmaxKeys = MinMaxLowering(opts.reduceOp, input).lowers();
  if (!minmaxKeys && alltoallReduceScatter_ &&
      alltoallReduceScatter_->applies(output, input, opts)) {
    auto& route = routeFor(input, op);  // flushes held ops first
    seq_++;
    auto result = listValue({output});
    const uint64_t bytes = payloadBytes(result);
    const int64_t issuedUs = Timeline::nowUs();
    std::function<void()> finalize;
    // A route that checks the ranks' calls sees a reduce_scatter_tensor, not
    // an all_to_all_single (Op::asReduceScatter).
    auto transfer = alltoallReduceScatter_->start(route, output, input, opts, finalize);
    auto work = wrap(std::move(transfer), c10d::OpType::_REDUCE_SCATTER_BASE, std::move(finalize),
                     std::move(result), issuedUs, bytes, op, {input});
    if (work) work->hideFuture();  // as Gloo's reduce-scatter: no future
    return work;
  }
  return delegate(op, routeFor(input, op), c10d::OpType::_REDUCE_SCATTER_BASE, listValue({output}),
                  {input}, [&](Route& route, TensorStaging& staging) {
                    const PremulLowering premul(opts.reduceOp, backendHasPremul(input));
                    const MinMaxLowering minmax(opts.reduceOp, input);
                    auto stagedIn = minmax.lowers() ? minmax.in(input) : premul.in(staging, input);
                    auto stagedOut =
                        minmax.lowers() ? minmax.out(staging, output) : staging.out(output);
                    return route.run(Op::reduceScatterBase(stagedOut, stagedIn,
                                                           minmax.options(premul.options(opts))));
                  });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  constexpr const char* op = "reduce_scatter_tensor_coalesced";
  checks::tensorList(op, inputs, "input");
  checks::tensorList(op, outputs, "output");
  checks::reduceOp(op, opts.reduceOp, inputs[0].scalar_type());
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "xcomm.", op, ": got ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checks::sameDeviceAndDtype(op, outputs[i], inputs[i], "output", "input");
    checks::reduceScatterBase(outputs[i], inputs[i], size_);
  }
  return delegate(
      op, routeFor(inputs[0], op), c10d::OpType::COALESCED, listValue(outputs), inputs,
      [&](Route& route, TensorStaging& staging) {
        const PremulLowering premul(opts.reduceOp, backendHasPremul(inputs[0]));
        const MinMaxLowering minmax(opts.reduceOp, inputs[0]);
        auto stagedIn = minmax.lowers() ? minmax.in(inputs) : premul.in(staging, inputs);
        auto stagedOut = minmax.lowers() ? minmax.out(staging, outputs) : staging.out(outputs);
        return route.run(Op::reduceScatterTensorCoalesced(stagedOut, stagedIn,
                                                          minmax.options(premul.options(opts))));
      });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                           std::vector<int64_t>& outputSplits,
                                                           std::vector<int64_t>& inputSplits,
                                                           const c10d::AllToAllOptions& opts) {
  constexpr const char* op = "all_to_all_single";
  checks::tensorList(op, {input}, "input");
  checks::tensorList(op, {output}, "output");
  checks::sameDeviceAndDtype(op, output, input, "output", "input");
  checks::splits(op, inputSplits, input, size_, "input");
  checks::splits(op, outputSplits, output, size_, "output");
  return delegate(
      op, routeFor(input, op), c10d::OpType::ALLTOALL_BASE, listValue({output}), {input},
      [&](Route& route, TensorStaging& staging) {
        auto stagedIn = staging.in(input);
        auto stagedOut = staging.out(output);
        return route.run(Op::alltoallBase(stagedOut, stagedIn, outputSplits, inputSplits, opts));
      });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllToAllOptions& opts) {
  constexpr const char* op = "all_to_all";
  checks::tensorList(op, inputs, "input");
  checks::tensorList(op, outputs, "output");
  TORCH_CHECK_VALUE(
      static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
      "xcomm.all_to_all: needs one input and one output tensor per rank (", size_, "), got ",
      inputs.size(), " inputs and ", outputs.size(), " outputs");
  checks::sameDeviceAndDtype(op, outputs[0], inputs[0], "output", "input");
  return delegate(op, routeFor(inputs[0], op), c10d::OpType::ALLTOALL, listValue(outputs), inputs,
                  [&](Route& route, TensorStaging& staging) {
                    auto stagedIn = staging.in(inputs);
                    auto stagedOut = staging.out(outputs);
                    return route.run(Op::alltoall(stagedOut, stagedIn, opts));
                  });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::send(std::vector<at::Tensor>& tensors, int dstRank,
                                                  int tag) {
  constexpr const char* op = "send";
  checks::tensorList(op, tensors);
  checks::rank(op, dstRank, size_, "destination");
  TORCH_CHECK_VALUE(tensors.size() == 1, "xcomm.send: expects one tensor, got ", tensors.size());
  return delegate(op, pointToPointRoute(tensors[0], op), c10d::OpType::SEND, listValue(tensors),
                  tensors, [&](InnerRoute& inner, TensorStaging& staging) {
                    auto staged = staging.in(tensors);
                    return inner.send(staged, dstRank, tag);
                  });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                  int tag) {
  constexpr const char* op = "recv";
  checks::tensorList(op, tensors);
  checks::rank(op, srcRank, size_, "source");
  TORCH_CHECK_VALUE(tensors.size() == 1, "xcomm.recv: expects one tensor, got ", tensors.size());
  return delegate(op, pointToPointRoute(tensors[0], op), c10d::OpType::RECV, listValue(tensors),
                  tensors, [&](InnerRoute& inner, TensorStaging& staging) {
                    auto staged = staging.out(tensors);
                    return inner.recv(staged, srcRank, tag);
                  });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                           int tag) {
  constexpr const char* op = "recv";
  checks::tensorList(op, tensors);
  TORCH_CHECK_VALUE(tensors.size() == 1, "xcomm.recv: expects one tensor, got ", tensors.size());
  // Named as Gloo names it under torch.profiler: "xcomm:recvAnySource".
  return delegate("recvAnySource", pointToPointRoute(tensors[0], op), c10d::OpType::RECVANYSOURCE,
                  listValue(tensors), tensors, [&](InnerRoute& inner, TensorStaging& staging) {
                    auto staged = staging.out(tensors);
                    return inner.recvAnysource(staged, tag);
                  });
}

c10::intrusive_ptr<c10d::Work> XcommBackend::barrier(const c10d::BarrierOptions& opts) {
  checkNotAborted("barrier");
  flushFused();
  const bool useCuda = !routes_.cpu || (opts.device && opts.device->is_cuda() && routes_.cuda);
  Route& route = useCuda ? static_cast<Route&>(*routes_.cuda) : *routes_.cpu;
  seq_++;
  const int64_t issuedUs = Timeline::nowUs();
  auto work = route.run(Op::barrier(opts));
  return wrap(std::move(work), c10d::OpType::BARRIER, {}, listValue({}), issuedUs, 0, "barrier",
              {});
}

c10::intrusive_ptr<c10d::Work> XcommBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr const char* op = "all_gather_coalesced";
  checks::tensorList(op, inputs, "input");
  TORCH_CHECK_VALUE(outputs.size() == static_cast<size_t>(size_), "xcomm: ", op, " needs ", size_,
                    " output lists (one per rank), got ", outputs.size());
  for (const auto& list : outputs) {
    TORCH_CHECK_VALUE(list.size() == inputs.size(), "xcomm: ", op,
                      ": every output list needs one tensor per input (", inputs.size(), "), got ",
                      list.size());
  }
  return delegate(op, routeFor(inputs[0], op), c10d::OpType::ALLGATHER_COALESCED,
                  listOfListsValue(outputs), inputs, [&](Route& route, TensorStaging&) {
                    return route.run(Op::allgatherCoalesced(outputs, inputs, opts));
                  });
}

void XcommBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  checkNotAborted("monitored_barrier");
  flushFused();
  TORCH_CHECK_VALUE(routes_.cpu,
                    "xcomm.monitored_barrier: this process group has no CPU backend "
                    "(monitored_barrier is Gloo's)");
  routes_.cpu->monitoredBarrier(opts, waitAllRanks);
}

}  // namespace xcomm
