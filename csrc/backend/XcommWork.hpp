#pragma once
// Work objects returned by xcomm's collectives.
//
// DelegatedWork wraps the Work of a transport backend (Gloo, NCCL) and adds
// the step that copies staged results back into the caller's tensors.
// FutureWork is completed by xcomm's own worker threads.
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "runtime/OrderedRunner.hpp"

namespace xcomm {

// The future type of collectives whose result is a list of tensors.
c10::TypePtr tensorListType();

// "xcomm:<op>" as a string that lives as long as the process: the profiler
// keeps the pointer a Work hands it, not a copy.
const char* profilingTitle(const std::string& op);
// `prefix` + `op`, kept for the process's life as profilingTitle's are.
const char* profilingTitle(const std::string& prefix, const std::string& op);

// Runs a callable exactly once, from whichever thread gets there first; later
// callers block until it finished. An exception is rethrown to every caller.
class RunOnce {
 public:
  explicit RunOnce(std::function<void()> fn) : fn_(std::move(fn)) {}
  void run();

 private:
  std::function<void()> fn_;
  std::once_flag once_;
  std::exception_ptr error_;
};

class DelegatedWork : public c10d::Work {
 public:
  // `finalize` may be empty. When set, it runs once after `inner` succeeded and
  // before this work counts as complete; the future then holds `result`.
  // Under torch.profiler the op is one async event `profilingTitle` (with
  // `inputs`' shapes) that ends when this work completes, as Gloo's do.
  DelegatedWork(int rank, c10d::OpType opType, c10::intrusive_ptr<c10d::Work> inner,
                std::function<void()> finalize, c10::IValue result, c10::TypePtr resultType,
                const char* profilingTitle = nullptr, const std::vector<at::Tensor>& inputs = {});

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override;
  // getFuture() then raises as Gloo's does for works that have none (its
  // reduce-scatters), so code moving between the two sees the same API.
  void hideFuture() { futureHidden_ = true; }
  // The group was aborted: a CPU op still pending fails now with `error`
  // (wait() raises it, the future holds it) instead of waiting inside its
  // transport, whose own threads may stay blocked until their timeout.
  // CUDA works and point-to-point works (no future) are left to their backend.
  void failIfPending(const std::exception_ptr& error);

 private:
  // A CPU work's completion, by its op or by an abort, whichever comes first;
  // shared with the inner future's callback, which may outlive the work.
  struct Completion {
    std::mutex mutex;
    std::condition_variable changed;
    bool done = false;         // the op itself finished (succeeded or failed)
    bool aborting = false;     // an abort claimed it (before settling the future)
    std::exception_ptr abort;  // set when the group aborted first, once the future is
    std::atomic<bool> settled{false};
    c10::intrusive_ptr<c10::ivalue::Future> future;  // what getFuture() hands out
    std::string op;                                  // names the op in what its transport raised
    void settle(c10::ivalue::Future* from, const std::exception_ptr& error);
  };
  bool abortedFirst() const;
  // What the transport raised, naming this op (common/ErrorText.hpp).
  std::exception_ptr named(const std::exception_ptr& raised) const;
  std::string op_;  // "all_reduce": the profiling title without "xcomm:"
  c10::intrusive_ptr<c10d::Work> inner_;
  c10::intrusive_ptr<c10::ivalue::Future> innerFuture_;  // null for point-to-point works
  std::shared_ptr<RunOnce> finalize_;                    // null when nothing is staged
  c10::intrusive_ptr<c10::ivalue::Future> chained_;      // inner's future + finalize
  // Ends the profiler event (once): in the future's callback, and at the
  // latest when wait() or isCompleted() first says the op is done.
  void endProfiling();

  c10::IValue result_;
  // Null when no profiler recorded at construction; a point-to-point work (no
  // future) ends its event in wait() only.
  std::shared_ptr<RunOnce> endProfiling_;
  bool futureHidden_ = false;
  std::shared_ptr<Completion> completion_;  // CPU works with a future; else null
};

class FutureWork : public c10d::Work {
 public:
  FutureWork(int rank, c10d::OpType opType, const char* profilingTitle, c10::IValue result,
             c10::TypePtr resultType, const std::vector<at::Tensor>& inputs = {});

  // The first of these wins; a later one is ignored (the group aborted the
  // work while its step still ran).
  void markSucceeded(int sourceRank = -1);
  void markFailed(std::exception_ptr error);

  int sourceRank() const override { return sourceRank_; }
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::IValue result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  int sourceRank_ = -1;
  std::atomic<bool> settled_{false};
};

// Gloo's reduce_scatter works have no future; xcomm's behave the same so
// that code moving between the two sees the same API.
class FuturelessWork : public FutureWork {
 public:
  using FutureWork::FutureWork;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    TORCH_CHECK(false, "Work::getFuture not implemented.");
  }
};

// The works a group handed out that may still be pending, so that abort()
// fails every one of them at once, and new ops after it are refused.
class PendingWorks {
 public:
  void add(const c10::intrusive_ptr<DelegatedWork>& work);
  void add(const c10::intrusive_ptr<FutureWork>& work);
  // Fails every pending work with `error`; works added later fail at once.
  void failAll(const std::exception_ptr& error);
  bool aborted() const { return aborted_.load(); }

 private:
  // The entries pruned, freed by the caller after it unlocks: a work whose
  // last reference is one of them frees the user's tensors with it, which
  // may take the GIL (docs/architecture.md, what a thread may drop under a
  // lock).
  struct Pruned {
    std::vector<c10::weak_intrusive_ptr<DelegatedWork>> delegated;
    std::vector<c10::weak_intrusive_ptr<FutureWork>> own;
  };
  Pruned pruneLocked();
  std::mutex mutex_;
  std::vector<c10::weak_intrusive_ptr<DelegatedWork>> delegated_;
  std::vector<c10::weak_intrusive_ptr<FutureWork>> own_;
  size_t pruneAt_ = 64;
  std::exception_ptr error_;
  std::atomic<bool> aborted_{false};
};

// The OrderedRunner step that runs `body` and finishes `work` with its
// outcome: succeeded with the source rank `body` returns (-1: none), or
// failed with what it threw.
OrderedRunner::Step finishing(c10::intrusive_ptr<FutureWork> work, std::function<int()> body);

}  // namespace xcomm
