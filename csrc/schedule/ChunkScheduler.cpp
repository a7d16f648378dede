#include "schedule/ChunkScheduler.hpp"

#include <deque>
#include <string>

#include <c10/util/Exception.h>

#include "observe/Timeline.hpp"

namespace xcomm {
namespace {

constexpr const char* kTrack = "engine 2: transfer";

}  // namespace

ChunkScheduler::ChunkScheduler(std::vector<at::Tensor> buffers, int64_t chunkBytes, bool priority,
                               c10::intrusive_ptr<c10d::Backend> backend, LandedFn onLanded,
                               ErrorFn onError, int maxInFlight)
    : buffers_(std::move(buffers)),
      priority_(priority),
      backend_(std::move(backend)),
      onLanded_(std::move(onLanded)),
      onError_(std::move(onError)),
      maxInFlight_(maxInFlight) {
  TORCH_CHECK_VALUE(chunkBytes > 0, "xcomm.ChunkScheduler: chunk_bytes must be > 0, got ",
                    chunkBytes);
  TORCH_CHECK_VALUE(maxInFlight >= 1, "xcomm.ChunkScheduler: max_in_flight must be >= 1, got ",
                    maxInFlight);
  TORCH_CHECK_VALUE(backend_, "xcomm.ChunkScheduler: a backend is required");
  world_ = backend_->getSize();
  for (size_t b = 0; b < buffers_.size(); ++b) {
    const auto& buf = buffers_[b];
    TORCH_CHECK_VALUE(buf.dim() == 1 && buf.is_contiguous(),
                      "xcomm.ChunkScheduler: bucket buffers must be flat contiguous tensors");
    const int64_t chunkElems = std::max<int64_t>(1, chunkBytes / buf.element_size());
    for (int64_t start = 0; start < buf.numel(); start += chunkElems) {
      chunks_.push_back({static_cast<int>(b), start, std::min(chunkElems, buf.numel() - start)});
    }
  }
}

ChunkScheduler::~ChunkScheduler() {
  try {
    abort();
  } catch (...) {  // NOLINT(bugprone-empty-catch): nothing to report from a destructor
  }
}

void ChunkScheduler::markReady(const std::vector<int>& buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int b : buckets) {
    TORCH_CHECK_VALUE(b >= 0 && b < static_cast<int>(buffers_.size()),
                      "xcomm.ChunkScheduler: no bucket ", b);
    ready_.insert(b);
  }
  cv_.notify_all();
  if (!thread_.joinable()) {
    order_.clear();
    thread_ = std::thread([this] { run(); });
  }
}

void ChunkScheduler::join() {
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  ready_.clear();
}

void ChunkScheduler::abort() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    cv_.notify_all();
  }
  join();
  std::lock_guard<std::mutex> lock(mutex_);
  stop_ = false;
}

std::vector<int> ChunkScheduler::order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return order_;
}

int ChunkScheduler::nextChunk(const std::vector<bool>& sent,
                              const std::vector<bool>& everywhere) const {
  int firstUnsent = -1;
  int best = -1;
  for (int c = 0; c < static_cast<int>(chunks_.size()); ++c) {
    if (sent[c]) continue;
    if (firstUnsent < 0) firstUnsent = c;
    // Highest bucket first (the layers nearest the input); in a bucket, in order.
    if (priority_ && everywhere[c] && (best < 0 || chunks_[c].bucket > chunks_[best].bucket)) {
      best = c;
    }
  }
  return best >= 0 ? best : firstUnsent;
}

void ChunkScheduler::run() {
  const int n = static_cast<int>(chunks_.size());
  std::vector<bool> sent(n, false);
  std::vector<bool> everywhere(n, false);
  std::vector<int> left(buffers_.size(), 0);
  std::vector<int64_t> firstIssueUs(buffers_.size(), 0);
  for (const auto& c : chunks_) left[c.bucket]++;
  struct InFlight {
    int chunk;
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor message;
    int64_t issuedUs;
  };
  std::deque<InFlight> inFlight;

  auto completeOldest = [&] {
    InFlight f = std::move(inFlight.front());
    inFlight.pop_front();
    f.work->wait();
    const int64_t landedUs = Timeline::nowUs();
    const Chunk& c = chunks_[f.chunk];
    buffers_[c.bucket].narrow(0, c.start, c.length).copy_(f.message.narrow(0, 0, c.length));
    const at::Tensor counts = f.message.narrow(0, c.length, n)
                                  .to(at::TensorOptions().dtype(at::kDouble).device(at::kCPU))
                                  .contiguous();
    const double* counted = counts.data_ptr<double>();
    for (int j = 0; j < n; ++j) everywhere[j] = counted[j] > world_ - 0.5;
    TraceSpan span;
    span.name = "bucket " + std::to_string(c.bucket) + " chunk " + std::to_string(f.chunk);
    span.category = "transfer";
    span.track = kTrack;
    span.startUs = f.issuedUs;
    span.durationUs = landedUs - f.issuedUs;
    span.args["bytes"] = std::to_string(c.length * f.message.element_size());
    span.args["priority"] = priority_ ? "True" : "False";
    Timeline::global().add(std::move(span));
    if (--left[c.bucket] == 0) onLanded_(c.bucket, firstIssueUs[c.bucket]);
  };

  try {
    for (int i = 0; i < n; ++i) {
      // The choice depends only on results completed so far, and the loop
      // completes them at the same points on every rank.
      const int c = nextChunk(sent, everywhere);
      const Chunk& chunk = chunks_[c];
      const at::Tensor& bucket = buffers_[chunk.bucket];
      std::vector<double> flags(n, 0.0);
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || ready_.count(chunk.bucket) > 0; });
        if (stop_) return;
        for (int j = 0; j < n; ++j) {
          if (ready_.count(chunks_[j].bucket)) flags[j] = 1.0;
        }
      }
      const at::Tensor readyHere = at::tensor(flags, at::kDouble).to(bucket.options());
      // Packing this chunk overlaps the transfer of the one in flight.
      at::Tensor message = at::cat({bucket.narrow(0, chunk.start, chunk.length), readyHere});
      const int64_t issuedUs = Timeline::nowUs();
      if (!firstIssueUs[chunk.bucket]) firstIssueUs[chunk.bucket] = issuedUs;
      std::vector<at::Tensor> tensors{message};
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
      auto work = backend_->allreduce(tensors, opts);
      inFlight.push_back({c, std::move(work), std::move(message), issuedUs});
      sent[c] = true;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        order_.push_back(c);
      }
      if (static_cast<int>(inFlight.size()) >= maxInFlight_) completeOldest();
    }
    while (!inFlight.empty()) completeOldest();
  } catch (...) {
    onError_(std::current_exception());
  }
}

}  // namespace xcomm
