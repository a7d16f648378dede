#include "backend/XcommWork.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <unordered_set>

#include "common/ErrorText.hpp"

namespace xcomm {
namespace {

std::vector<at::Tensor> tensorsOf(const c10::IValue& value) {
  if (value.isTensorList()) {
    return value.toTensorVector();
  }
  if (value.isList()) {  // a list of lists (allgather, gather)
    std::vector<at::Tensor> flat;
    for (const auto& inner : value.toListRef()) {
      auto part = tensorsOf(inner);
      flat.insert(flat.end(), part.begin(), part.end());
    }
    return flat;
  }
  return {};
}

}  // namespace

const char* profilingTitle(const std::string& op) {
  return profilingTitle("xcomm:", op);
}

const char* profilingTitle(const std::string& prefix, const std::string& op) {
  static std::mutex mutex;
  static std::unordered_set<std::string> titles;  // node-based: c_str() stays put
  std::lock_guard<std::mutex> lock(mutex);
  return titles.insert(prefix + op).first->c_str();
}

c10::TypePtr tensorListType() {
  return c10::ListType::create(c10::TensorType::get());
}

void RunOnce::run() {
  std::call_once(once_, [this] {
    try {
      fn_();
    } catch (...) {
      error_ = std::current_exception();
    }
  });
  if (error_) {
    std::rethrow_exception(error_);
  }
}

DelegatedWork::DelegatedWork(int rank, c10d::OpType opType, c10::intrusive_ptr<c10d::Work> inner,
                             std::function<void()> finalize, c10::IValue result,
                             c10::TypePtr resultType, const char* profilingTitle,
                             const std::vector<at::Tensor>& inputs)
    : Work(rank, opType, profilingTitle, inputs),
      inner_(std::move(inner)),
      result_(std::move(result)) {
  TORCH_INTERNAL_ASSERT(inner_, "DelegatedWork needs an inner work");
  if (profilingTitle) {
    op_ = profilingTitle;
    if (op_.rfind("xcomm:", 0) == 0) op_ = op_.substr(6);
  } else {
    op_ = c10d::opTypeToString(opType);
  }
  try {
    innerFuture_ = inner_->getFuture();
  } catch (const c10::Error&) {
    // Point-to-point works have no future; wait() finalizes them.
  }
  if (finalize) {
    finalize_ = std::make_shared<RunOnce>(std::move(finalize));
    if (innerFuture_) {
      auto finalizeOnce = finalize_;
      auto value = result_;
      chained_ = innerFuture_->then(
          [finalizeOnce, value](c10::ivalue::Future& /*done*/) -> c10::IValue {
            finalizeOnce->run();
            return value;
          },
          std::move(resultType));
    }
  }
  // Set by Work's constructor only while a profiler records. This work never
  // calls finish(), so the event ends when the op is done: with its future,
  // or (point to point) in wait().
  if (recordFunctionEndCallback_) {
    endProfiling_ = std::make_shared<RunOnce>(std::move(recordFunctionEndCallback_));
    recordFunctionEndCallback_ = nullptr;
    if (auto done = chained_ ? chained_ : innerFuture_) {
      done->addCallback([end = endProfiling_](c10::ivalue::Future&) { end->run(); });
    }
  }
  // A CPU op's future, which an abort may complete before the op does. (A
  // CUDA future carries stream events that only its own completion sets.)
  auto done = chained_ ? chained_ : innerFuture_;
  if (done && done->devices().empty()) {
    completion_ = std::make_shared<Completion>();
    completion_->op = op_;
    completion_->future = c10::make_intrusive<c10::ivalue::Future>(done->elementType());
    done->addCallback([completion = completion_](c10::ivalue::Future& finished) {
      // The future first, as Gloo's works do: whoever wait() released finds
      // it done (torchft's Manager chains on it right after wait()).
      completion->settle(&finished, finished.hasError() ? finished.exception_ptr() : nullptr);
      {
        std::lock_guard<std::mutex> lock(completion->mutex);
        completion->done = true;
      }
      completion->changed.notify_all();
    });
  }
}

void DelegatedWork::Completion::settle(c10::ivalue::Future* from, const std::exception_ptr& error) {
  if (settled.exchange(true)) return;  // the op and an abort race: the first wins
  if (error) {
    future->setError(namedTransportFailure(op, "its transport", error));
  } else {
    future->markCompleted(from->value());
  }
}

bool DelegatedWork::abortedFirst() const {
  if (!completion_) return false;
  std::lock_guard<std::mutex> lock(completion_->mutex);
  return completion_->abort && !completion_->done;
}

void DelegatedWork::failIfPending(const std::exception_ptr& error) {
  if (!completion_) return;
  {
    std::lock_guard<std::mutex> lock(completion_->mutex);
    if (completion_->done || completion_->aborting) return;
    completion_->aborting = true;
  }
  endProfiling();
  completion_->settle(nullptr, error);  // the future first, as for the op itself
  {
    std::lock_guard<std::mutex> lock(completion_->mutex);
    completion_->abort = error;
  }
  completion_->changed.notify_all();
}

bool DelegatedWork::isCompleted() {
  if (abortedFirst()) return true;
  // A CPU transport may complete its future a moment before it marks its work
  // finished (Gloo does): whoever saw the future done must see this work done.
  // A CUDA future completes at launch, so there only the work itself counts.
  const bool cpuFuture = innerFuture_ && innerFuture_->devices().empty();
  const bool done = chained_ ? (cpuFuture || inner_->isCompleted()) && chained_->completed()
                             : inner_->isCompleted() || (cpuFuture && innerFuture_->completed());
  if (done) endProfiling();
  return done;
}

// xcomm's own works (FutureWork) count as finished before their future's
// callbacks run, so the callback that ends the profiler event may still be to
// come when wait() or isCompleted() says the op is done. The caller may then
// leave the profiler, which frees the event's record: an end after that wrote
// into freed memory (heap corruption, SIGSEGV/SIGABRT under torch 2.14's
// profiler). End it here first, as Gloo's works do before they count as done.
void DelegatedWork::endProfiling() {
  if (endProfiling_) endProfiling_->run();
}

bool DelegatedWork::isSuccess() const {
  if (abortedFirst()) return false;
  return inner_->isSuccess() && (!chained_ || !chained_->completed() || !chained_->hasError());
}

std::exception_ptr DelegatedWork::named(const std::exception_ptr& raised) const {
  return namedTransportFailure(op_, "its transport", raised);
}

std::exception_ptr DelegatedWork::exception() const {
  if (abortedFirst()) return completion_->abort;
  if (auto e = inner_->exception()) {
    return named(e);
  }
  if (chained_ && chained_->completed() && chained_->hasError()) {
    return named(chained_->exception_ptr());
  }
  return nullptr;
}

int DelegatedWork::sourceRank() const {
  return inner_->sourceRank();
}

std::vector<at::Tensor> DelegatedWork::result() {
  return finalize_ ? tensorsOf(result_) : inner_->result();
}

void DelegatedWork::synchronize() {
  inner_->synchronize();
  if (chained_) {
    chained_->wait();
  }
}

bool DelegatedWork::wait(std::chrono::milliseconds timeout) {
  if (completion_) {
    // Wait here, not inside the transport, so that an abort releases it.
    const auto started = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(completion_->mutex);
    auto ready = [this] { return completion_->done || completion_->abort != nullptr; };
    if (timeout == kNoTimeout) {
      completion_->changed.wait(lock, ready);
    } else {
      completion_->changed.wait_for(lock, timeout, ready);
    }
    if (completion_->abort && !completion_->done) {
      auto error = completion_->abort;
      lock.unlock();
      std::rethrow_exception(error);
    }
    if (timeout != kNoTimeout) {  // the transport's wait gets what is left of it
      const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - started);
      timeout = std::max(std::chrono::milliseconds(1), timeout - spent);
    }
  }
  bool ok = false;
  try {
    ok = inner_->wait(timeout);
  } catch (...) {
    if (inner_->isCompleted()) endProfiling();  // failed, not timed out
    std::rethrow_exception(named(std::current_exception()));
  }
  if (!finalize_) {
    endProfiling();
    return ok;
  }
  if (chained_) {
    chained_->wait();  // also orders the current CUDA stream after the copy-back
    endProfiling();
    if (chained_->hasError()) {
      std::rethrow_exception(named(chained_->exception_ptr()));
    }
  } else {
    finalize_->run();
    endProfiling();
  }
  return ok;
}

void DelegatedWork::abort() {
  inner_->abort();
}

c10::intrusive_ptr<c10::ivalue::Future> DelegatedWork::getFuture() {
  TORCH_CHECK(!futureHidden_, "Work::getFuture not implemented.");
  if (completion_) return completion_->future;
  return chained_ ? chained_ : inner_->getFuture();
}

uint64_t DelegatedWork::getSequencenumber() const {
  return inner_->getSequencenumber();
}

FutureWork::FutureWork(int rank, c10d::OpType opType, const char* profilingTitle,
                       c10::IValue result, c10::TypePtr resultType,
                       const std::vector<at::Tensor>& inputs)
    : Work(rank, opType, profilingTitle, inputs),
      result_(std::move(result)),
      future_(c10::make_intrusive<c10::ivalue::Future>(std::move(resultType))) {}

// The work is marked finished before its future completes: whoever sees the
// future done (a callback, collect_all) must also see is_completed() true.
void FutureWork::markSucceeded(int sourceRank) {
  if (settled_.exchange(true)) return;
  sourceRank_ = sourceRank;
  finish();
  future_->markCompleted(result_);
}

void FutureWork::markFailed(std::exception_ptr error) {
  if (settled_.exchange(true)) return;
  finish(error);
  future_->setError(error);
}

std::vector<at::Tensor> FutureWork::result() {
  return tensorsOf(result_);
}

void PendingWorks::add(const c10::intrusive_ptr<DelegatedWork>& work) {
  Pruned pruned;  // freed after the lock
  std::unique_lock<std::mutex> lock(mutex_);
  if (error_) {
    auto error = error_;
    lock.unlock();
    work->failIfPending(error);
    return;
  }
  delegated_.emplace_back(work);
  pruned = pruneLocked();
  lock.unlock();
}

void PendingWorks::add(const c10::intrusive_ptr<FutureWork>& work) {
  Pruned pruned;  // freed after the lock
  std::unique_lock<std::mutex> lock(mutex_);
  if (error_) {
    auto error = error_;
    lock.unlock();
    work->markFailed(error);
    return;
  }
  own_.emplace_back(work);
  pruned = pruneLocked();
  lock.unlock();
}

PendingWorks::Pruned PendingWorks::pruneLocked() {
  Pruned pruned;
  if (delegated_.size() + own_.size() < pruneAt_) return pruned;
  auto gone = [](auto& weak) {
    auto strong = weak.lock();
    return !strong || strong->isCompleted();
  };
  // Moved out, not erased: the last reference to a finished work may be here.
  auto take = [&](auto& entries, auto& out) {
    auto kept = std::stable_partition(entries.begin(), entries.end(),
                                      [&](auto& weak) { return !gone(weak); });
    out.assign(std::make_move_iterator(kept), std::make_move_iterator(entries.end()));
    entries.erase(kept, entries.end());
  };
  take(delegated_, pruned.delegated);
  take(own_, pruned.own);
  pruneAt_ = std::max<size_t>(64, 2 * (delegated_.size() + own_.size()));
  return pruned;
}

void PendingWorks::failAll(const std::exception_ptr& error) {
  std::vector<c10::weak_intrusive_ptr<DelegatedWork>> delegated;
  std::vector<c10::weak_intrusive_ptr<FutureWork>> own;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) return;
    error_ = error;
    aborted_ = true;
    delegated.swap(delegated_);
    own.swap(own_);
  }
  // Outside the lock: a work's callbacks run here and may issue more ops.
  for (auto& weak : delegated) {
    if (auto work = weak.lock()) work->failIfPending(error);
  }
  for (auto& weak : own) {
    if (auto work = weak.lock()) work->markFailed(error);
  }
}

OrderedRunner::Step finishing(c10::intrusive_ptr<FutureWork> work, std::function<int()> body) {
  return [work = std::move(work), body = std::move(body)]() -> OrderedRunner::Completion {
    std::exception_ptr error;
    int sourceRank = -1;
    try {
      sourceRank = body();
    } catch (...) {
      error = std::current_exception();
    }
    return [work, error, sourceRank] {
      if (error) {
        work->markFailed(error);
      } else {
        work->markSucceeded(sourceRank);
      }
    };
  };
}

}  // namespace xcomm
