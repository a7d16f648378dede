#pragma once
// Per-operation communication statistics, process-wide and thread-safe.
//
// Every collective that XcommBackend issues is recorded when it completes;
// xcomm's Python engine (the gradient bucketer) records its compressed
// bucket reductions here too, so one table shows bytes in vs. bytes on the
// wire for both.
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace xcomm {

struct OpStats {
  uint64_t calls = 0;
  uint64_t failures = 0;
  uint64_t bytesIn = 0;      // payload handed to the op by the caller
  uint64_t bytesOnWire = 0;  // payload actually communicated (smaller when compressed)
  double queuedSeconds = 0;  // waiting inside xcomm before the transfer started
  double wireSeconds = 0;    // transfer start to completion
};

class StatsRegistry {
 public:
  static StatsRegistry& global();

  void record(const std::string& op, uint64_t bytesIn, uint64_t bytesOnWire, double queuedSeconds,
              double wireSeconds, bool failed = false);
  std::map<std::string, OpStats> snapshot() const;
  void reset();

 private:
  mutable std::mutex mutex_;
  std::map<std::string, OpStats> ops_;
};

// Bytes of every tensor in `value` (a tensor, a list, or a list of lists).
uint64_t payloadBytes(const c10::IValue& value);

// Records `work`, which sent `wireBytes` for the `bytes` handed to it (less
// when compressed), in the global stats (and as a span on the global
// timeline, when enabled) once its future completes (for a future on GPUs,
// which completes when the op is queued: once a CUDA event after it has
// completed, waited for on a thread of its own), timed from `startUs`
// (Timeline::nowUs() taken before the op was issued: a transport may run an
// op inline and be done before it returns). Works without a future
// (point-to-point) are counted at issue, with no time.
void recordOnCompletion(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op,
                        uint64_t bytes, uint64_t wireBytes, int64_t startUs);

// Records a synchronous op that just returned, issued at `startUs`: at once
// for host tensors; for device tensors once their devices' current streams
// (which the op is ordered before) have run it.
void recordAfterDeviceOp(const std::vector<at::Tensor>& tensors, const std::string& op,
                         uint64_t bytes, uint64_t wireBytes, int64_t startUs);
// Records an op that just completed (or failed), issued at `startUs`: the
// global stats and a timeline span, as recordOnCompletion does.
void recordCompleted(const std::string& op, uint64_t bytes, uint64_t wireBytes, int64_t startUs,
                     bool failed);

}  // namespace xcomm
