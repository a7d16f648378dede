#include "schedule/FusionBuffer.hpp"

#include <iterator>
#include <utility>

#include <c10/util/Exception.h>

#include "common/AgreedCall.hpp"
#include "common/ErrorText.hpp"
#include "observe/Stats.hpp"
#include "observe/Timeline.hpp"

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

}  // namespace

// ---------------------------------------------------------------- FusedWork

FusedWork::FusedWork(int rank, std::weak_ptr<FusionBuffer> buffer, c10::IValue result,
                     std::function<void()> finalize, const char* profilingTitle,
                     const std::vector<at::Tensor>& inputs)
    : Work(rank, c10d::OpType::ALLREDUCE, profilingTitle, inputs),
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

bool FusedWork::wait(std::chrono::milliseconds timeout) {
  // The group's timeout bounds the transfer (and the control transport's the
  // agreement): a dead peer fails it. A shorter bound of the caller's is
  // Work's own wait, which complete() ends through finish().
  expedite(true);
  if (timeout != kNoTimeout) return c10d::Work::wait(timeout);
  future_->wait();
  if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> FusedWork::getFuture() {
  expedite(false);  // on demand: DDP hooks chain on the future at once, never hold them
  return future_;
}

void FusedWork::complete(std::exception_ptr error) {
  if (error) {
    // The fused transfer's (or its agreement's) transport raised it: named
    // as the caller's op, not as Gloo's bare "Operation timed out!".
    error = namedTransportFailure("all_reduce", "a fused transfer's transport", error);
  } else if (finalize_) {
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

// ---------------------------------------------------------------- FusionBuffer

bool sameFusionKind(const at::Tensor& a, const c10d::AllreduceOptions& aOpts, const at::Tensor& b,
                    const c10d::AllreduceOptions& bOpts) {
  // The agreed dtypes too: a fused transfer describes itself to the ranks'
  // agreement by its first op, so float MIN's keys (common/AgreedCall.hpp)
  // never travel with an int32 MIN.
  return a.scalar_type() == b.scalar_type() &&
         agreedDtype(a.scalar_type(), aOpts.reduceOp) ==
             agreedDtype(b.scalar_type(), bOpts.reduceOp) &&
         aOpts.reduceOp.op_ == bOpts.reduceOp.op_ && aOpts.timeout == bOpts.timeout;
}

bool FusionBuffer::accepts(const at::Tensor& tensor, const c10d::AllreduceOptions& opts) const {
  return thresholdBytes_ > 0 && tensor.device().is_cpu() && tensor.layout() == at::kStrided &&
         tensor.is_contiguous() && tensor.nbytes() < thresholdBytes_ &&
         elementwise(opts.reduceOp) && !opts.sparseIndices.has_value();
}

c10::intrusive_ptr<c10d::Work> FusionBuffer::enqueue(const std::shared_ptr<Route>& transport,
                                                     int rank, at::Tensor tensor,
                                                     const c10d::AllreduceOptions& opts,
                                                     std::function<void()> finalize,
                                                     c10::IValue result,
                                                     const char* profilingTitle) {
  TORCH_CHECK(accepts(tensor, opts), "xcomm: internal error: a tensor fusion cannot hold");
  auto work =
      c10::make_intrusive<FusedWork>(rank, weak_from_this(), std::move(result), std::move(finalize),
                                     profilingTitle, std::vector<at::Tensor>{tensor});
  hold({std::move(tensor), work, transport, opts, {}});
  return work;
}

void FusionBuffer::holdLocked(Held held) {
  heldBytes_ += held.tensor.nbytes();
  held_.push_back(std::move(held));
}

std::vector<FusionBuffer::Held> FusionBuffer::takeLocked(size_t count) {
  std::vector<Held> out(std::make_move_iterator(held_.begin()),
                        std::make_move_iterator(held_.begin() + count));
  held_.erase(held_.begin(), held_.begin() + count);
  for (const auto& h : out) heldBytes_ -= h.tensor.nbytes();
  return out;
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
    future = (*held)[0].transport->allreduce(flat[0], (*held)[0].opts)->getFuture();
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

}  // namespace xcomm
