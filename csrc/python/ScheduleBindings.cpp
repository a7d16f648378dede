// Bindings of the engine's observability: the stats registry and the timeline
// (xcomm._C). The Python faces are xcomm.stats and xcomm.trace.
#include <torch/csrc/utils/pybind.h>

#include "backend/XcommBackend.hpp"
#include "python/Bindings.hpp"
#include "schedule/BucketLauncher.hpp"
#include "schedule/ChunkScheduler.hpp"
#include "schedule/Stats.hpp"
#include "schedule/Timeline.hpp"

namespace py = pybind11;

namespace {

// A Python callable kept alive from C++ threads: dropped under the GIL.
std::shared_ptr<py::function> holdCallable(py::function f) {
  return std::shared_ptr<py::function>(std::make_unique<py::function>(std::move(f)).release(),
                                       [](py::function* p) {
                                         py::gil_scoped_acquire gil;
                                         std::unique_ptr<py::function> owned(p);
                                       });
}

// The scheduler as Python holds it: destroyed with the GIL released, since
// stopping its thread may wait for a callback that needs the GIL.
struct PyChunkScheduler {
  std::unique_ptr<xcomm::ChunkScheduler> impl;
  ~PyChunkScheduler() {
    py::gil_scoped_release noGil;
    impl.reset();
  }
};

void bindChunkScheduler(py::module_& m) {
  py::class_<PyChunkScheduler>(m, "ChunkScheduler")
      .def(py::init([](std::vector<at::Tensor> buffers, int64_t chunkBytes, bool priority,
                       const c10::intrusive_ptr<c10d::Backend>& backend, py::function onLanded,
                       py::function onError, int maxInFlight) {
             auto landed = holdCallable(std::move(onLanded));
             auto failed = holdCallable(std::move(onError));
             auto s = std::make_unique<PyChunkScheduler>();
             s->impl = std::make_unique<xcomm::ChunkScheduler>(
                 std::move(buffers), chunkBytes, priority, backend,
                 [landed](int bucket, int64_t firstIssueUs) {
                   py::gil_scoped_acquire gil;
                   (*landed)(bucket, firstIssueUs);
                 },
                 [failed](std::exception_ptr error) {
                   py::gil_scoped_acquire gil;
                   try {
                     std::rethrow_exception(error);
                   } catch (py::error_already_set& e) {
                     (*failed)(e.value());
                   } catch (const std::exception& e) {
                     (*failed)(py::module_::import("builtins").attr("RuntimeError")(e.what()));
                   }
                 },
                 maxInFlight);
             return s;
           }),
           py::arg("buffers"), py::arg("chunk_bytes"), py::arg("priority"), py::arg("backend"),
           py::arg("on_bucket_landed"), py::arg("on_error"), py::arg("max_in_flight") = 2)
      .def(
          "mark_ready",
          [](PyChunkScheduler& s, const std::vector<int>& buckets) { s.impl->markReady(buckets); },
          py::arg("buckets"), py::call_guard<py::gil_scoped_release>())
      .def(
          "join", [](PyChunkScheduler& s) { s.impl->join(); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "abort", [](PyChunkScheduler& s) { s.impl->abort(); },
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("chunks",
                             [](const PyChunkScheduler& s) {
                               py::list out;
                               for (const auto& c : s.impl->chunks())
                                 out.append(py::make_tuple(c.bucket, c.start, c.length));
                               return out;
                             })
      .def_property_readonly("order", [](const PyChunkScheduler& s) { return s.impl->order(); });
}

void bindBucketLauncher(py::module_& m) {
  using xcomm::BucketLauncher;
  py::class_<BucketLauncher>(m, "BucketLauncher")
      .def(py::init([](std::vector<at::Tensor> buffers,
                       const std::vector<std::tuple<int, int64_t, int64_t>>& slots,
                       const c10::intrusive_ptr<c10d::Backend>& backend) {
             std::vector<BucketLauncher::Slot> converted;
             converted.reserve(slots.size());
             for (const auto& [bucket, offset, numel] : slots) {
               converted.push_back({bucket, offset, numel});
             }
             return std::make_unique<BucketLauncher>(std::move(buffers), std::move(converted),
                                                     backend);
           }),
           py::arg("buffers"), py::arg("slots"), py::arg("backend"),
           "Fills flat buckets with gradients (x 1/n) and allreduces each the moment it and "
           "every earlier bucket are full; slots: (bucket, offset, numel) per parameter.")
      .def("grad_ready", &BucketLauncher::gradReady, py::arg("param"), py::arg("grad"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "done", [](const BucketLauncher& l, int b) { return l.future(b)->completed(); },
          py::arg("bucket"))
      .def(
          "wait",
          [](const BucketLauncher& l, int b) {
            auto future = l.future(b);
            future->wait();
            if (future->hasError()) std::rethrow_exception(future->exception_ptr());
          },
          py::arg("bucket"), py::call_guard<py::gil_scoped_release>(),
          "Waits for the bucket's reduction and copy-back; raises its error.")
      .def("ready_us", &BucketLauncher::readyUs, py::arg("bucket"))
      .def("landed_us", &BucketLauncher::landedUs, py::arg("bucket"))
      .def_property_readonly("launched", &BucketLauncher::launched)
      .def("reset", &BucketLauncher::reset, py::call_guard<py::gil_scoped_release>());
}

void bindSchedule(py::module_& m) {
  bindChunkScheduler(m);
  bindBucketLauncher(m);
  m.def(
      "stats_snapshot",
      [] {
        py::dict out;
        for (const auto& [op, s] : xcomm::StatsRegistry::global().snapshot()) {
          py::dict d;
          d["calls"] = s.calls;
          d["failures"] = s.failures;
          d["bytes_in"] = s.bytesIn;
          d["bytes_on_wire"] = s.bytesOnWire;
          d["time_queued_s"] = s.queuedSeconds;
          d["time_on_wire_s"] = s.wireSeconds;
          out[py::str(op)] = d;
        }
        return out;
      },
      "A copy of the per-op statistics: {op: {calls, failures, bytes_in, bytes_on_wire, "
      "time_queued_s, time_on_wire_s}}.");
  m.def(
      "stats_reset", [] { xcomm::StatsRegistry::global().reset(); }, "Clears all statistics.");
  m.def(
      "stats_record",
      [](const std::string& op, uint64_t bytesIn, uint64_t bytesOnWire, double queued, double wire,
         bool failed) {
        xcomm::StatsRegistry::global().record(op, bytesIn, bytesOnWire, queued, wire, failed);
      },
      py::arg("op"), py::arg("bytes_in"), py::arg("bytes_on_wire"), py::arg("time_queued_s"),
      py::arg("time_on_wire_s"), py::arg("failed") = false,
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "set_fusion_threshold",
      [](const c10::intrusive_ptr<xcomm::XcommBackend>& backend, size_t bytes, double cycleMs,
         const c10::intrusive_ptr<c10d::Backend>& control) {
        // A positive cycle below 1 us still means "a cycle", not "on demand";
        // setFusionThreshold refuses a negative one.
        const auto us = static_cast<int64_t>(cycleMs * 1000.0);
        backend->setFusionThreshold(
            bytes, std::chrono::microseconds(cycleMs > 0 ? std::max<int64_t>(us, 1) : us), control);
      },
      py::arg("backend"), py::arg("bytes"), py::arg("cycle_ms") = 0.0,
      py::arg("control") = c10::intrusive_ptr<c10d::Backend>(),
      py::call_guard<py::gil_scoped_release>(),
      "Fuses small async CPU allreduces of this backend into transfers of up to `bytes` "
      "(0: off). With cycle_ms > 0 a background thread sends them every cycle after agreeing "
      "with the other ranks over `control` (a ProcessGroupGloo no other op uses).");
  m.def(
      "fusion_cycle_ms",
      [](const c10::intrusive_ptr<xcomm::XcommBackend>& backend) {
        return backend->fusionCycle().count() / 1000.0;
      },
      py::arg("backend"));
  m.def(
      "fusion_threshold",
      [](const c10::intrusive_ptr<xcomm::XcommBackend>& backend) {
        return backend->fusionThreshold();
      },
      py::arg("backend"));

  m.def("timeline_now_us", &xcomm::Timeline::nowUs,
        "Microseconds on the timeline's clock (CLOCK_MONOTONIC).");
  m.def(
      "timeline_set_enabled", [](bool on) { xcomm::Timeline::global().setEnabled(on); },
      py::arg("enabled"));
  m.def("timeline_enabled", [] { return xcomm::Timeline::global().enabled(); });
  m.def(
      "timeline_add",
      [](std::string name, std::string category, std::string track, int64_t startUs,
         int64_t durationUs, std::map<std::string, std::string> args) {
        xcomm::Timeline::global().add(xcomm::TraceSpan{std::move(name), std::move(category),
                                                       std::move(track), startUs, durationUs,
                                                       std::move(args)});
      },
      py::arg("name"), py::arg("category"), py::arg("track"), py::arg("start_us"),
      py::arg("duration_us"), py::arg("args") = std::map<std::string, std::string>{});
  m.def("timeline_clear", [] { xcomm::Timeline::global().clear(); });
  m.def("timeline_span_count", [] { return xcomm::Timeline::global().spans().size(); });
  m.def(
      "timeline_chrome_json", [](int pid) { return xcomm::Timeline::global().toChromeJson(pid); },
      py::arg("pid"));
}

}  // namespace

XCOMM_REGISTER_BINDINGS(schedule, bindSchedule);
