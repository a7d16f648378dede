#pragma once
// Allreduce with fewer bytes on the wire, chosen per process group through
// xcomm.Options(compression=...), so code that only calls all_reduce gains too.
//
// - fp16 / bf16: the tensor is cast down (AVG divides first, so the sum of
//   world-size means cannot overflow where the inputs did not), reduced as SUM
//   by the transport in the low precision, and cast back: 2x fewer bytes.
// - int8: the compressed reduce-scatter + allgather of Int8Codec (one float32
//   scale per chunk): about 4x fewer bytes than float32, and traffic per rank
//   stays flat as ranks grow. It runs two collectives one after the other, on a
//   transport of its own, so their order can never mix with other collectives.
//
// Compression is lossy and stateless (no error feedback: the backend cannot
// know which tensors are the same gradient across steps; use the DDP hooks in
// xcomm.hooks for error feedback). Every rank gets bitwise the same result.
// Only lone float32/float64 CPU tensors under SUM or AVG of at least
// `minBytes` are compressed; everything else goes through uncompressed.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "collectives/chains/Int8Allreduce.hpp"
#include "common/Compression.hpp"
#include "compress/Int8Codec.hpp"
#include "runtime/Route.hpp"

namespace xcomm {

// Link bytes per rank: what a bandwidth-optimal collective on the
// uncompressed tensors would have sent (a ring allreduce; an all-to-all
// reduce-scatter), and what the compressed ones sent (the ring equivalent for
// casts, alltoall + allgather for int8, the all-to-all of a reduce-scatter).
// One set per group, shared by its compressed allreduce and reduce-scatter.
// xcomm.stats() counts payloads instead (bytes_in / bytes_on_wire).
struct CompressionCounters {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> linkBytesBefore{0};
  std::atomic<int64_t> linkBytesSent{0};
};

class AutoCompression;

class CompressedAllreduce {
 public:
  CompressedAllreduce(CompressionConfig config, int size);
  ~CompressedAllreduce();

  const CompressionConfig& config() const { return config_; }
  const CompressionCounters& counters() const { return *counters_; }
  // For the group's other compressed collectives to count into.
  std::shared_ptr<CompressionCounters> sharedCounters() const { return counters_; }
  // Its row in xcomm.stats(), e.g. ALLREDUCE_INT8.
  const std::string& statsName() const { return statsName_; }

  // Whether this allreduce is compressed: a float tensor under SUM or AVG, of
  // at least compression_min_bytes, in a group of 2 or more; on the CPU, or
  // on a GPU for the casts and (where xcomm's CUDA kernels are built) int8.
  // auto, and int8 without the kernels, leave GPU tensors to NCCL exact, with
  // a warning the first time.
  bool applies(const std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) const;
  // The CPU routes of int8 and auto wait on their collectives, so they run on
  // a worker thread over a transport of their own (run()); that transport is
  // needed whenever the group's method is one of them.
  bool needsOwnTransport() const {
    return config_.method == Compression::kInt8 || config_.method == Compression::kAuto;
  }
  // Whether `tensor`'s allreduce is issued on the caller's thread (start()):
  // the casts, and int8 on a GPU, whose collectives and kernels are all
  // ordered on streams, so issuing them never waits for the link.
  bool issuesOnCaller(const at::Tensor& tensor) const {
    return isCast(config_.method) || (config_.method == Compression::kInt8 && tensor.is_cuda());
  }
  // The compressed payload of `tensor` with `method` (what xcomm.stats()
  // counts as on the wire; the group's method by default, not auto).
  int64_t payloadBytes(const at::Tensor& tensor) const;
  int64_t payloadBytes(const at::Tensor& tensor, Compression method) const;

  // For issuesOnCaller(tensor): issues the compressed allreduce on
  // `transport` and returns the work of its last collective; `finalize` (run
  // once that work succeeded) writes the result into `tensor`. The casts are
  // one low-precision SUM. int8 on a GPU is an all-to-all of the packed
  // shards, waited for on the current stream (not the host), the reduction
  // and requantization of this rank's shard, and the allgather returned.
  c10::intrusive_ptr<c10d::Work> start(Route& transport, const at::Tensor& tensor,
                                       const c10d::AllreduceOptions& opts,
                                       std::function<void()>& finalize);

  // The whole allreduce on `transport` (a whole backend of this algorithm's
  // own), waited for: the group's method, or for auto the one it chooses now
  // (which may first measure the link on `transport`). Returns the method
  // that ran. Call it on one thread, in issue order. SUM or AVG of one float
  // tensor (applies()).
  Compression run(InnerRoute& transport, const at::Tensor& tensor,
                  const c10d::AllreduceOptions& opts);
  // Null unless the group's method is auto.
  const AutoCompression* autoCompression() const { return auto_.get(); }

 private:
  // One call counted: `tensor` is what a ring allreduce would have sent,
  // `sentBytes` what this rank's link carried instead.
  void count(const at::Tensor& tensor, int64_t sentBytes);
  c10::intrusive_ptr<c10d::Work> startCast(Route& transport, const at::Tensor& tensor,
                                           const c10d::AllreduceOptions& opts,
                                           std::function<void()>& finalize, Compression method);
  // int8 as start() describes it, on the transport's own all-to-all and
  // all-gather: the route of CUDA tensors (NCCL).
  c10::intrusive_ptr<c10d::Work> startInt8(Route& transport, const at::Tensor& tensor,
                                           const c10d::AllreduceOptions& opts,
                                           std::function<void()>& finalize);
  // int8 waited for on the calling thread. CPU tensors: the int8 chain (the
  // DDP hook's one body, chains/Int8Allreduce) over DirectExchange messages
  // on `transport` (tag 4, which nothing else on that group uses), until the
  // op's timeout, else the transport's; other devices: startInt8. Once one
  // failed, every later call raises at once, naming that failure.
  void runInt8(InnerRoute& transport, const at::Tensor& tensor, const c10d::AllreduceOptions& opts);

  CompressionConfig config_;
  std::string statsName_;
  int size_;
  std::shared_ptr<const Int8Codec> int8_;
  // What the first failed CPU int8 exchange raised (empty: none failed). Its
  // messages may be left half-exchanged on the transport, so later int8
  // allreduces fail at once rather than pair with stale messages.
  std::string int8Failed_;
  std::unique_ptr<AutoCompression> auto_;
  std::shared_ptr<CompressionCounters> counters_ = std::make_shared<CompressionCounters>();
};

}  // namespace xcomm
