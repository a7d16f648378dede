#include "observe/Stats.hpp"

#include <chrono>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include "observe/Timeline.hpp"

namespace xcomm {

StatsRegistry& StatsRegistry::global() {
  static StatsRegistry registry;
  return registry;
}

void StatsRegistry::record(const std::string& op, uint64_t bytesIn, uint64_t bytesOnWire,
                           double queuedSeconds, double wireSeconds, bool failed) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& s = ops_[op];
  s.calls += 1;
  s.failures += failed ? 1 : 0;
  s.bytesIn += bytesIn;
  s.bytesOnWire += bytesOnWire;
  s.queuedSeconds += queuedSeconds;
  s.wireSeconds += wireSeconds;
}

std::map<std::string, OpStats> StatsRegistry::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ops_;
}

void StatsRegistry::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  ops_.clear();
}

uint64_t payloadBytes(const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    // A sparse COO tensor sends its indices and values; it has no storage of its own.
    if (t.is_sparse()) return t._indices().nbytes() + t._values().nbytes();
    if (t.layout() != at::kStrided) return t.numel() * t.element_size();
    return t.nbytes();
  }
  uint64_t total = 0;
  if (value.isList()) {
    for (const auto& item : value.toListRef()) total += payloadBytes(item);
  }
  return total;
}

void recordOnCompletion(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op,
                        uint64_t bytes, uint64_t wireBytes, int64_t startUs) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = work->getFuture();
  } catch (const c10::Error&) {
    // Point-to-point works of some transports have no future.
    StatsRegistry::global().record(op, bytes, wireBytes, 0.0, 0.0);
    return;
  }
  future->addCallback([op, bytes, wireBytes, startUs](c10::ivalue::Future& done) {
    recordCompleted(op, bytes, wireBytes, startUs, done.hasError());
  });
}

void recordCompleted(const std::string& op, uint64_t bytes, uint64_t wireBytes, int64_t startUs,
                     bool failed) {
  const int64_t endUs = Timeline::nowUs();
  // Delegated ops are handed to the transport at once: no xcomm queue.
  StatsRegistry::global().record(op, bytes, wireBytes, 0.0, (endUs - startUs) * 1e-6, failed);
  Timeline::global().add(TraceSpan{op,
                                   "transfer",
                                   "xcomm backend ops",
                                   startUs,
                                   endUs - startUs,
                                   {{"bytes", std::to_string(bytes)},
                                    {"bytes_on_wire", std::to_string(wireBytes)},
                                    {"status", failed ? "error" : "ok"}}});
}

}  // namespace xcomm
