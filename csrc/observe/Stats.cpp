#include "observe/Stats.hpp"

#include <chrono>

#include <algorithm>
#include <memory>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "observe/Timeline.hpp"
#include "runtime/CompletionPool.hpp"

namespace xcomm {
namespace {

// Threads that wait for device events, so an op on a GPU is recorded when it
// completes there. Leaked on purpose: at exit a static's destructor would
// join threads still blocked in a CUDA driver that is being torn down.
CompletionPool& eventWaiters() {
  static auto* pool = new CompletionPool(4);
  return *pool;
}

// Records the op once each device's current stream reaches this point: an
// event on each marks the op's end. Called where those streams wait for the
// op: in a device future's callback (c10's Future runs callbacks on streams
// that wait for its events) or after a synchronous op.
void recordAfterStreams(const std::vector<c10::Device>& devices, std::string op, uint64_t bytes,
                        uint64_t wireBytes, int64_t startUs) {
  auto events = std::make_shared<std::vector<c10::Event>>();
  for (const c10::Device& device : devices) {
    c10::impl::VirtualGuardImpl impl(device.type());
    events->emplace_back(device.type());
    events->back().record(impl.getStream(device));
  }
  eventWaiters().run([events, op = std::move(op), bytes, wireBytes, startUs] {
    for (c10::Event& e : *events) e.synchronize();
    recordCompleted(op, bytes, wireBytes, startUs, /*failed=*/false);
  });
}

}  // namespace

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
    if (!done.hasError() && !done.devices().empty()) {
      recordAfterStreams(done.devices(), op, bytes, wireBytes, startUs);
      return;
    }
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

void recordAfterDeviceOp(const std::vector<at::Tensor>& tensors, const std::string& op,
                         uint64_t bytes, uint64_t wireBytes, int64_t startUs) {
  std::vector<c10::Device> devices;
  for (const at::Tensor& t : tensors) {
    if (t.defined() && !t.device().is_cpu() &&
        std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  if (devices.empty()) {
    recordCompleted(op, bytes, wireBytes, startUs, /*failed=*/false);
    return;
  }
  recordAfterStreams(devices, op, bytes, wireBytes, startUs);
}

}  // namespace xcomm
