#pragma once
// ChunkScheduler: chunked, priority-ordered reduction of gradient buckets
// (ByteScheduler-style), the engine behind GradientBucketer(schedule=
// "fifo" | "priority").
//
// Every bucket (one flat tensor) is cut into chunks of at most `chunkBytes`.
// A thread of its own sends one chunk at a time, at most `maxInFlight` on the
// wire: the ready chunk of highest priority (the highest bucket index, i.e.
// the layers nearest the input, which the next forward needs first), or the
// lowest chunk index (FIFO).
//
// All ranks must issue the same chunks in the same order although each sees
// its gradients become ready at different times. So each chunk carries a
// readiness vector (1 for every chunk this rank has ready), summed by the same
// allreduce: after chunk k lands every rank knows which chunks were ready on
// all ranks and picks the next from those (else the lowest unsent chunk,
// waiting for it locally). Completions are consumed at fixed points of the
// loop, so the information behind each choice, and the choice, is the same on
// every rank; the data is reduced exactly as one allreduce would.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace xcomm {

class ChunkScheduler {
 public:
  struct Chunk {
    int bucket;
    int64_t start;   // first element in the bucket
    int64_t length;  // elements
  };
  // Runs on the scheduler's thread once every chunk of `bucket` is reduced
  // into its buffer; `firstIssueUs` is when its first chunk went out
  // (Timeline::nowUs()).
  using LandedFn = std::function<void(int bucket, int64_t firstIssueUs)>;
  // Runs on the scheduler's thread when a transfer fails; the thread then stops.
  using ErrorFn = std::function<void(std::exception_ptr)>;

  ChunkScheduler(std::vector<at::Tensor> buffers, int64_t chunkBytes, bool priority,
                 c10::intrusive_ptr<c10d::Backend> backend, LandedFn onLanded, ErrorFn onError,
                 int maxInFlight = 2);
  ~ChunkScheduler();
  ChunkScheduler(const ChunkScheduler&) = delete;
  ChunkScheduler& operator=(const ChunkScheduler&) = delete;

  // These buckets are complete (at once: the thread sees all of them or none);
  // starts this iteration's thread on first use.
  void markReady(const std::vector<int>& buckets);
  // Waits for this iteration's thread, then resets for the next iteration.
  void join();
  // Stops the thread at its next choice and joins it.
  void abort();

  const std::vector<Chunk>& chunks() const { return chunks_; }
  // The chunks in the order last sent.
  std::vector<int> order() const;
  bool priority() const { return priority_; }
  int maxInFlight() const { return maxInFlight_; }

 private:
  void run();
  int nextChunk(const std::vector<bool>& sent, const std::vector<bool>& everywhere) const;

  std::vector<at::Tensor> buffers_;
  bool priority_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  LandedFn onLanded_;
  ErrorFn onError_;
  int maxInFlight_;
  int world_;
  std::vector<Chunk> chunks_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::set<int> ready_;
  bool stop_ = false;
  std::vector<int> order_;
  std::thread thread_;
};

}  // namespace xcomm
