#include "schedule/BucketLauncher.hpp"

#include <string>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/record_function_ops.h>

#include "observe/Stats.hpp"
#include "observe/Timeline.hpp"

namespace xcomm {
namespace {

// The tracks of GradientBucketer's timeline (python/xcomm/bucketer.py).
constexpr const char* kEncodeTrack = "engine 1: encode (backward thread)";
constexpr const char* kTransferTrack = "engine 2: transfer";
constexpr const char* kDecodeTrack = "engine 3: decode (completion thread)";

std::string bucketName(int index, const char* what) {
  return "xcomm::bucket" + std::to_string(index) + "::" + what;
}

}  // namespace

BucketLauncher::BucketLauncher(std::vector<at::Tensor> buffers, std::vector<Slot> slots,
                               c10::intrusive_ptr<c10d::Backend> backend)
    : slots_(std::move(slots)), seen_(slots_.size(), false), backend_(std::move(backend)) {
  TORCH_CHECK_VALUE(backend_, "xcomm.BucketLauncher: a backend is required");
  TORCH_CHECK_VALUE(!buffers.empty(), "xcomm.BucketLauncher: no buckets");
  for (const auto& buffer : buffers) {
    // A CUDA bucket's future would need its streams: those stay on the Python path.
    TORCH_CHECK_VALUE(buffer.device().is_cpu(), "xcomm.BucketLauncher: CPU buckets only");
  }
  scale_ = 1.0 / backend_->getSize();
  std::vector<int64_t> covered(buffers.size(), 0);
  for (auto& buffer : buffers) {
    TORCH_CHECK_VALUE(buffer.dim() == 1 && buffer.is_contiguous(),
                      "xcomm.BucketLauncher: bucket buffers must be flat contiguous tensors");
    auto bucket = std::make_shared<Bucket>();
    bucket->buffer = std::move(buffer);
    buckets_.push_back(std::move(bucket));
  }
  for (const auto& s : slots_) {
    TORCH_CHECK_VALUE(s.bucket >= 0 && s.bucket < static_cast<int>(buckets_.size()) &&
                          s.offset >= 0 && s.numel >= 0 &&
                          s.offset + s.numel <= buckets_[s.bucket]->buffer.numel(),
                      "xcomm.BucketLauncher: a slot lies outside its bucket");
    ++buckets_[s.bucket]->slots;
    covered[s.bucket] += s.numel;
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    TORCH_CHECK_VALUE(covered[b] == buckets_[b]->buffer.numel() && buckets_[b]->slots > 0,
                      "xcomm.BucketLauncher: the slots of bucket ", b, " cover ", covered[b],
                      " of its ", buckets_[b]->buffer.numel(), " elements");
  }
  reset();
}

void BucketLauncher::reset() {
  // Last iteration's grads and futures are freed after the lock (declared
  // before it): a grad may be the last reference to a tensor whose Python
  // object takes the GIL to free, and future()/launched() take this lock
  // from Python.
  std::vector<std::vector<std::pair<at::Tensor, Slot>>> oldGrads;
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> oldFutures;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& b : buckets_) {
    b->pending = b->slots;
    b->readyUs = 0;
    b->landedUs = 0;
    oldGrads.push_back(std::exchange(b->grads, {}));
    oldFutures.push_back(
        std::exchange(b->future, c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get())));
  }
  seen_.assign(slots_.size(), false);
  nextLaunch_ = 0;
}

void BucketLauncher::gradReady(int param, const at::Tensor& grad) {
  TORCH_CHECK_VALUE(param >= 0 && param < static_cast<int>(slots_.size()),
                    "xcomm.BucketLauncher: no parameter ", param);
  const Slot slot = slots_[param];
  auto& bucket = *buckets_[slot.bucket];
  TORCH_CHECK_VALUE(grad.numel() == slot.numel, "xcomm.BucketLauncher: parameter ", param,
                    " has a gradient of ", grad.numel(), " elements, its slot ", slot.numel);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!seen_[param], "xcomm.BucketLauncher: parameter ", param,
                " became ready twice in one iteration");
    seen_[param] = true;
  }
  // Outside the lock: each slot is written by one thread, once.
  auto view = bucket.buffer.narrow(0, slot.offset, slot.numel);
  at::mul_out(view, grad.reshape({-1}), c10::Scalar(scale_));  // as DDP's reducer
  std::lock_guard<std::mutex> lock(mutex_);
  bucket.grads.emplace_back(grad, slot);
  if (--bucket.pending == 0) bucket.readyUs = Timeline::nowUs();
  // Launching under the lock keeps the index order even if gradients arrive
  // on several autograd threads.
  while (nextLaunch_ < static_cast<int>(buckets_.size()) && buckets_[nextLaunch_]->pending == 0) {
    launchLocked(nextLaunch_++);
  }
}

void BucketLauncher::launchLocked(int index) {
  auto bucket = buckets_[index];
  const int64_t startUs = Timeline::nowUs();
  const double queuedS = (startUs - bucket->readyUs) * 1e-6;
  const uint64_t bytes = bucket->buffer.nbytes();
  c10::intrusive_ptr<c10::ivalue::Future> transfer;
  {
    auto encode = torch::autograd::profiler::record_function_enter_new(bucketName(index, "encode"));
    std::vector<at::Tensor> tensors{bucket->buffer};
    try {
      transfer = backend_->allreduce(tensors)->getFuture();
    } catch (...) {
      encode->record.end();
      bucket->future->setError(std::current_exception());
      return;
    }
    encode->record.end();
  }
  const int64_t launchedUs = Timeline::nowUs();
  Timeline::global().add(TraceSpan{"bucket " + std::to_string(index) + " encode",
                                   "encode",
                                   kEncodeTrack,
                                   startUs,
                                   launchedUs - startUs,
                                   {{"bytes", std::to_string(bytes)}}});
  // The transfer as an async torch.profiler range: it ends when the future completes.
  auto range = torch::autograd::profiler::record_function_enter_new(bucketName(index, "transfer"));
  transfer = torch::autograd::profiler::_call_end_callbacks_on_fut_new(range, transfer);
  transfer->addCallback([bucket, index, bytes, queuedS, launchedUs](c10::ivalue::Future& done) {
    const int64_t landedUs = Timeline::nowUs();
    bucket->landedUs = landedUs;
    std::exception_ptr error = done.hasError() ? done.exception_ptr() : nullptr;
    if (!error) {
      try {
        auto decode =
            torch::autograd::profiler::record_function_enter_new(bucketName(index, "decode"));
        for (auto& [grad, slot] : bucket->grads) {
          grad.copy_(bucket->buffer.narrow(0, slot.offset, slot.numel).view(grad.sizes()));
        }
        decode->record.end();
      } catch (...) {
        error = std::current_exception();
      }
    }
    const int64_t doneUs = Timeline::nowUs();
    Timeline::global().add(TraceSpan{
        "bucket " + std::to_string(index) + " transfer",
        "transfer",
        kTransferTrack,
        launchedUs,
        landedUs - launchedUs,
        {{"bytes", std::to_string(bytes)}, {"queued_us", std::to_string(int64_t(queuedS * 1e6))}}});
    Timeline::global().add(TraceSpan{"bucket " + std::to_string(index) + " decode",
                                     "decode",
                                     kDecodeTrack,
                                     landedUs,
                                     doneUs - landedUs,
                                     {}});
    StatsRegistry::global().record("bucket_allreduce", bytes, bytes, queuedS,
                                   (landedUs - launchedUs) * 1e-6, error != nullptr);
    if (error) {
      bucket->future->setError(error);
    } else {
      bucket->future->markCompleted(bucket->buffer);
    }
  });
}

c10::intrusive_ptr<c10::ivalue::Future> BucketLauncher::future(int bucket) const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK_VALUE(bucket >= 0 && bucket < static_cast<int>(buckets_.size()),
                    "xcomm.BucketLauncher: no bucket ", bucket);
  return buckets_[bucket]->future;
}

int64_t BucketLauncher::readyUs(int bucket) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return buckets_.at(bucket)->readyUs;
}

int64_t BucketLauncher::landedUs(int bucket) const {
  return buckets_.at(bucket)->future->completed() ? buckets_.at(bucket)->landedUs : 0;
}

int BucketLauncher::launched() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return nextLaunch_;
}

}  // namespace xcomm
