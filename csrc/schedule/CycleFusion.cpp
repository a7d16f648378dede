#include "schedule/CycleFusion.hpp"

#include <algorithm>
#include <iterator>

#include <c10/util/Exception.h>

#include "observe/Timeline.hpp"

namespace xcomm {
namespace {

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
                       sameFusionKind(*ops[begin].first, *ops[begin].second, *tensor, *opts) &&
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

// ---------------------------------------------------------------- CycleFusion

CycleFusion::CycleFusion(size_t thresholdBytes, std::chrono::microseconds cycle,
                         std::shared_ptr<Route> control, std::chrono::milliseconds timeout)
    : FusionBuffer(thresholdBytes),
      onDemand_(cycle.count() == 0),
      cycle_(onDemand_ ? kOnDemandJoin : cycle),
      control_(std::move(control)),
      timeoutMs_(timeout.count()) {
  TORCH_CHECK_VALUE(cycle_.count() > 0, "xcomm: a fusion cycle time must be >= 0");
  TORCH_CHECK_VALUE(control_, "xcomm: tensor fusion needs a control transport");
  thread_ = std::thread([this] { cycleLoop(); });
}

CycleFusion::~CycleFusion() {
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

void CycleFusion::hold(Held held) {
  auto work = held.work;
  std::exception_ptr broken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_ || stopping_) {
      broken = broken_ ? broken_
                       : errorPtr("xcomm: all_reduce issued on a process group that was shut down");
    } else {
      held.heldAt = std::chrono::steady_clock::now();
      holdLocked(std::move(held));
      ++issuedCount_;
      if (heldBytes_ >= thresholdBytes_) urgent_ = true;
    }
  }
  if (broken) {
    work->complete(broken);
    return;
  }
  wake_.notify_one();  // the thread sleeps until something is held
}

void CycleFusion::flush() {
  std::unique_lock<std::mutex> lock(mutex_);
  const int64_t target = issuedCount_;
  if (sentCount_ >= target) return;
  TORCH_CHECK(std::this_thread::get_id() != thread_.get_id(),
              "xcomm: internal error: fusion flush on its own thread");
  wantedCount_ = std::max(wantedCount_, target);
  wake_.notify_one();
  sent_.wait(lock, [&] { return sentCount_ >= target; });
}

void CycleFusion::expedite(bool resultNeeded) {
  // With a cycle, the next round sends it anyway; on demand, any interest
  // (DDP takes a bucket's future at once) asks for a round now.
  if (!resultNeeded && !onDemand_) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_.empty()) return;
    wantedCount_ = std::max(wantedCount_, issuedCount_);
  }
  wake_.notify_one();
}

void CycleFusion::stop() {
  flush();  // every rank shuts down at the same point of its program
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
}

void CycleFusion::abort() {
  const auto error =
      errorPtr("xcomm: the process group was aborted before this fused all_reduce was sent");
  std::vector<Held> failed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failed = failHeldLocked(error);
    stopping_ = true;
  }
  wake_.notify_all();
  sent_.notify_all();
  for (auto& h : failed) h.work->complete(error);
  control_->abort();
}

void CycleFusion::setTimeout(std::chrono::milliseconds timeout) {
  timeoutMs_ = timeout.count();
  control_->setTimeout(timeout);
}

int64_t CycleFusion::negotiate(int64_t issued) {
  if (control_->size() == 1) return issued;  // nobody to agree with
  const int64_t startUs = Timeline::nowUs();
  std::vector<at::Tensor> counter{at::full({1}, issued, at::kLong)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MIN);
  opts.timeout = std::chrono::milliseconds(timeoutMs_.load());
  auto work = control_->allreduce(counter[0], opts);
  work->wait(opts.timeout);
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

std::vector<FusionBuffer::Held> CycleFusion::failHeldLocked(std::exception_ptr error) {
  broken_ = error;
  sentCount_ = issuedCount_;
  return takeLocked(held_.size());
}

void CycleFusion::cycleLoop() {
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
      std::vector<Held> failed = failHeldLocked(error);
      lock.unlock();
      for (auto& h : failed) h.work->complete(error);
      failed.clear();  // outside the lock: see the end of the loop
      sent_.notify_all();
      lock.lock();
      continue;
    }
    std::vector<Held> round = takeLocked(static_cast<size_t>(agreed - sentCount_));
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
    // The ops go before the lock is taken again: a transfer that completed
    // while attaching leaves its ops here, and a tensor whose last reference
    // this is may own its Python object, which takes the GIL to free. A
    // Python thread holding the GIL takes this lock in getFuture() or wait()
    // (expedite): freed under it, the two waited for each other for good (a
    // DDP fp16 hook's fused all_reduces, 1 Lightning run in 40).
    attaches.clear();
    round.clear();
    lock.lock();
  }
}

std::shared_ptr<FusionBuffer> makeFusionBuffer(size_t thresholdBytes,
                                               std::chrono::microseconds cycle,
                                               std::shared_ptr<Route> control,
                                               std::chrono::milliseconds timeout) {
  if (thresholdBytes == 0) return nullptr;
  return std::make_shared<CycleFusion>(thresholdBytes, cycle, std::move(control), timeout);
}

}  // namespace xcomm
