#include "schedule/FusionBuffer.hpp"

#include <algorithm>

#include <c10/util/Exception.h>

#include "schedule/Stats.hpp"
#include "schedule/Timeline.hpp"

namespace xcomm {
namespace {

bool elementwise(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      return true;
    default:
      return false;  // AVG and PREMUL_SUM are left to the unfused path
  }
}

bool sameKind(const at::Tensor& a, const c10d::AllreduceOptions& aOpts, const at::Tensor& b,
              const c10d::AllreduceOptions& bOpts) {
  return a.scalar_type() == b.scalar_type() && aOpts.reduceOp.op_ == bOpts.reduceOp.op_ &&
         aOpts.timeout == bOpts.timeout;
}

// A c10::Error (RuntimeError in Python) to fail works with.
std::exception_ptr errorPtr(const char* message) {
  try {
    TORCH_CHECK(false, message);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

}  // namespace

// ---------------------------------------------------------------- FusedWork

FusedWork::FusedWork(int rank, std::weak_ptr<FusionBuffer> buffer, c10::IValue result,
                     std::function<void()> finalize)
    : Work(rank, c10d::OpType::ALLREDUCE),
      buffer_(std::move(buffer)),
      result_(std::move(result)),
      finalize_(std::move(finalize)),
      future_(
          c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {
}

void FusedWork::expedite(bool resultNeeded) {
  if (future_->completed()) return;
  if (auto buffer = buffer_.lock()) buffer->expedite(resultNeeded);
}

bool FusedWork::isCompleted() {
  expedite(false);  // on demand, polling for the result is asking for it
  return future_->completed();
}

bool FusedWork::isSuccess() const {
  return future_->completed() && !future_->hasError();
}

std::exception_ptr FusedWork::exception() const {
  return future_->completed() && future_->hasError() ? future_->exception_ptr() : nullptr;
}

std::vector<at::Tensor> FusedWork::result() {
  return result_.isTensorList() ? result_.toTensorVector() : std::vector<at::Tensor>{};
}

void FusedWork::synchronize() {
  expedite(true);
}

bool FusedWork::wait(std::chrono::milliseconds /*timeout*/) {
  // The transport's own timeout bounds the transfer (and the control
  // transport's the agreement): a dead peer fails it.
  expedite(true);
  future_->wait();
  if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> FusedWork::getFuture() {
  expedite(false);  // on demand: DDP hooks chain on the future at once, never hold them
  return future_;
}

void FusedWork::complete(std::exception_ptr error) {
  if (!error && finalize_) {
    try {
      finalize_();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (error) {
    future_->setError(error);
    finish(error);
    return;
  }
  future_->markCompleted(result_);
  finish();
}

// ---------------------------------------------------------------- FusionPlan

std::vector<std::pair<size_t, size_t>> FusionPlan::groups(
    const std::vector<std::pair<const at::Tensor*, const c10d::AllreduceOptions*>>& ops,
    size_t thresholdBytes) const {
  std::vector<std::pair<size_t, size_t>> out;
  size_t begin = 0;
  size_t bytes = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto& [tensor, opts] = ops[i];
    const bool joins = i > begin &&
                       sameKind(*ops[begin].first, *ops[begin].second, *tensor, *opts) &&
                       bytes + tensor->nbytes() <= thresholdBytes;
    if (i > begin && !joins) {
      out.emplace_back(begin, i);
      begin = i;
      bytes = 0;
    }
    bytes += tensor->nbytes();
  }
  if (begin < ops.size()) out.emplace_back(begin, ops.size());
  return out;
}

// ---------------------------------------------------------------- FusionBuffer

FusionBuffer::FusionBuffer(size_t thresholdBytes, std::chrono::microseconds cycle,
                           c10::intrusive_ptr<c10d::Backend> control,
                           std::chrono::milliseconds timeout)
    : thresholdBytes_(thresholdBytes),
      cycle_(cycle),
      control_(std::move(control)),
      timeout_(timeout) {
  TORCH_CHECK_VALUE(cycle_.count() > 0, "xcomm: a fusion cycle time must be positive");
  TORCH_CHECK_VALUE(control_, "xcomm: a fusion cycle needs a control transport");
  thread_ = std::thread([this] { cycleLoop(); });
}

FusionBuffer::~FusionBuffer() {
  // Normally shutdown() (stop()) has sent everything already. Ops still held
  // here get one last round: it completes when the peers hold the same ops,
  // and fails at once if a peer is gone or after the timeout if it hangs.
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

bool FusionBuffer::accepts(const at::Tensor& tensor, const c10d::AllreduceOptions& opts) const {
  return thresholdBytes_ > 0 && tensor.device().is_cpu() && tensor.layout() == at::kStrided &&
         tensor.is_contiguous() && tensor.nbytes() < thresholdBytes_ &&
         elementwise(opts.reduceOp) && !opts.sparseIndices.has_value();
}

c10::intrusive_ptr<c10d::Work> FusionBuffer::enqueue(
    const c10::intrusive_ptr<c10d::Backend>& transport, int rank, at::Tensor tensor,
    const c10d::AllreduceOptions& opts, std::function<void()> finalize, c10::IValue result) {
  TORCH_CHECK(accepts(tensor, opts), "xcomm: internal error: a tensor fusion cannot hold");
  std::function<void()> attach;
  auto work = c10::make_intrusive<FusedWork>(rank, weak_from_this(), std::move(result),
                                             std::move(finalize));
  std::exception_ptr broken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (cycle_.count() > 0) {
      if (broken_ || stopping_) {
        broken = broken_
                     ? broken_
                     : errorPtr("xcomm: all_reduce issued on a process group that was shut down");
      } else {
        heldBytes_ += tensor.nbytes();
        held_.push_back(
            {std::move(tensor), work, transport, opts, std::chrono::steady_clock::now()});
        ++issuedCount_;
        if (heldBytes_ >= thresholdBytes_) urgent_ = true;
      }
    } else {
      const bool joins = !held_.empty() && sameKind(held_[0].tensor, held_[0].opts, tensor, opts) &&
                         transport.get() == held_[0].transport.get() &&
                         heldBytes_ + tensor.nbytes() <= thresholdBytes_;
      if (!joins) attach = flushLocked();
      heldBytes_ += tensor.nbytes();
      held_.push_back({std::move(tensor), work, transport, opts, {}});
    }
  }
  if (broken) {
    work->complete(broken);
    return work;
  }
  if (cycle_.count() > 0) {
    wake_.notify_one();  // the thread sleeps until something is held
  }
  if (attach) attach();
  return work;
}

void FusionBuffer::flush() {
  if (cycle_.count() == 0) {
    std::function<void()> attach;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      attach = flushLocked();
    }
    if (attach) attach();
    return;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  const int64_t target = issuedCount_;
  if (sentCount_ >= target) return;
  TORCH_CHECK(std::this_thread::get_id() != thread_.get_id(),
              "xcomm: internal error: fusion flush on its own thread");
  wantedCount_ = std::max(wantedCount_, target);
  wake_.notify_one();
  sent_.wait(lock, [&] { return sentCount_ >= target; });
}

void FusionBuffer::expedite(bool resultNeeded) {
  if (cycle_.count() == 0) {
    flush();
    return;
  }
  if (!resultNeeded) return;  // the cycle sends it anyway
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_.empty()) return;
    wantedCount_ = std::max(wantedCount_, issuedCount_);
  }
  wake_.notify_one();
}

void FusionBuffer::stop() {
  if (cycle_.count() == 0) {
    flush();
    return;
  }
  flush();  // every rank shuts down at the same point of its program
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
}

void FusionBuffer::abort() {
  if (cycle_.count() == 0) {
    flush();  // nothing blocks: held ops go to the transport, which aborts them
    return;
  }
  const auto error =
      errorPtr("xcomm: the process group was aborted before this fused all_reduce was sent");
  std::vector<Held> failed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failHeldLocked(error, failed);
    stopping_ = true;
  }
  wake_.notify_all();
  sent_.notify_all();
  for (auto& h : failed) h.work->complete(error);
  control_->abort();
}

std::function<void()> FusionBuffer::flushLocked() {
  if (held_.empty()) return {};
  auto group = std::make_shared<std::vector<Held>>(std::move(held_));
  held_.clear();
  heldBytes_ = 0;
  // Issued under the lock: fused transfers leave in program order.
  return issue(std::move(group));
}

std::function<void()> FusionBuffer::issue(std::shared_ptr<std::vector<Held>> held) {
  size_t bytes = 0;
  for (const auto& h : *held) bytes += h.tensor.nbytes();
  std::vector<at::Tensor> flat;
  if (held->size() == 1) {
    flat.push_back((*held)[0].tensor);  // nothing to fuse: in place
  } else {
    std::vector<at::Tensor> pieces;
    pieces.reserve(held->size());
    for (const auto& h : *held) pieces.push_back(h.tensor.reshape({-1}));
    flat.push_back(at::cat(pieces));
  }
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = (*held)[0].transport->allreduce(flat, (*held)[0].opts)->getFuture();
  } catch (...) {
    const auto error = std::current_exception();
    return [held, error] {
      for (auto& h : *held) h.work->complete(error);
    };
  }
  const int64_t startUs = Timeline::nowUs();
  return [=] {
    future->addCallback([held, flat, bytes, startUs](c10::ivalue::Future& done) {
      std::exception_ptr error = done.hasError() ? done.exception_ptr() : nullptr;
      if (!error && held->size() > 1) {
        try {
          int64_t offset = 0;
          for (auto& h : *held) {
            const int64_t n = h.tensor.numel();
            h.tensor.view({-1}).copy_(flat[0].narrow(0, offset, n));
            offset += n;
          }
        } catch (...) {
          error = std::current_exception();
        }
      }
      const int64_t endUs = Timeline::nowUs();
      StatsRegistry::global().record("ALLREDUCE_FUSED", bytes, bytes, 0.0, (endUs - startUs) * 1e-6,
                                     error != nullptr);
      Timeline::global().add(
          TraceSpan{"ALLREDUCE_FUSED",
                    "transfer",
                    "xcomm backend ops",
                    startUs,
                    endUs - startUs,
                    {{"bytes", std::to_string(bytes)}, {"ops", std::to_string(held->size())}}});
      for (auto& h : *held) h.work->complete(error);
    });
  };
}

// ---------------------------------------------------------------- cycle mode

int64_t FusionBuffer::negotiate(int64_t issued) {
  if (control_->getSize() == 1) return issued;  // nobody to agree with
  const int64_t startUs = Timeline::nowUs();
  std::vector<at::Tensor> counter{at::full({1}, issued, at::kLong)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MIN);
  opts.timeout = timeout_;
  auto work = control_->allreduce(counter, opts);
  work->wait(timeout_);
  const int64_t agreed = counter[0].item<int64_t>();
  Timeline::global().add(
      TraceSpan{"FUSION_ROUND",
                "negotiate",
                "xcomm fusion cycle",
                startUs,
                Timeline::nowUs() - startUs,
                {{"issued", std::to_string(issued)}, {"agreed", std::to_string(agreed)}}});
  return agreed;
}

void FusionBuffer::failHeldLocked(std::exception_ptr error, std::vector<Held>& out) {
  broken_ = error;
  for (auto& h : held_) out.push_back(std::move(h));
  held_.clear();
  heldBytes_ = 0;
  sentCount_ = issuedCount_;
}

void FusionBuffer::cycleLoop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] { return stopping_ || !held_.empty(); });
    if (held_.empty()) break;  // stopping with nothing held
    if (!hurryLocked()) {
      // A round starts at most one cycle after the oldest held op arrived.
      wake_.wait_until(lock, held_.front().heldAt + cycle_,
                       [&] { return hurryLocked() || held_.empty(); });
      if (held_.empty()) continue;  // abort() failed them meanwhile
    }
    urgent_ = false;
    const int64_t mine = issuedCount_;
    const int64_t sentBefore = sentCount_;
    lock.unlock();

    int64_t agreed = 0;
    std::exception_ptr error;
    try {
      agreed = negotiate(mine);
      TORCH_CHECK(agreed >= sentBefore && agreed <= mine,
                  "xcomm: fusion rounds disagree across ranks (", agreed, " ops agreed, ",
                  sentBefore, " sent, ", mine,
                  " issued here); do all ranks issue the same "
                  "all_reduce calls in the same order?");
    } catch (...) {
      error = std::current_exception();
    }

    lock.lock();
    if (!error && sentCount_ != sentBefore) {
      continue;  // abort() failed everything meanwhile
    }
    if (error) {
      std::vector<Held> failed;
      failHeldLocked(error, failed);
      lock.unlock();
      for (auto& h : failed) h.work->complete(error);
      sent_.notify_all();
      lock.lock();
      continue;
    }
    const auto count = static_cast<size_t>(agreed - sentCount_);
    std::vector<Held> round(std::make_move_iterator(held_.begin()),
                            std::make_move_iterator(held_.begin() + count));
    held_.erase(held_.begin(), held_.begin() + count);
    for (const auto& h : round) heldBytes_ -= h.tensor.nbytes();
    if (heldBytes_ >= thresholdBytes_) urgent_ = true;
    lock.unlock();

    // Only this thread issues fused transfers, in order; flush() callers
    // issue their own op once sentCount_ covers what they held.
    std::vector<std::pair<const at::Tensor*, const c10d::AllreduceOptions*>> ops;
    ops.reserve(round.size());
    for (const auto& h : round) ops.emplace_back(&h.tensor, &h.opts);
    const auto groups = FusionPlan{}.groups(ops, thresholdBytes_);
    std::vector<std::function<void()>> attaches;
    attaches.reserve(groups.size());
    for (const auto& [begin, end] : groups) {
      auto group =
          std::make_shared<std::vector<Held>>(std::make_move_iterator(round.begin() + begin),
                                              std::make_move_iterator(round.begin() + end));
      attaches.push_back(issue(std::move(group)));
    }

    lock.lock();
    sentCount_ = agreed;
    lock.unlock();
    sent_.notify_all();
    for (auto& attach : attaches) attach();
    lock.lock();
  }
}

}  // namespace xcomm
