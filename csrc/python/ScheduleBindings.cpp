// Bindings of the engine's observability: the stats registry and the timeline
// (xcomm._C). The Python faces are xcomm.stats and xcomm.trace.
#include <torch/csrc/utils/pybind.h>

#include "backend/XcommBackend.hpp"
#include "python/Bindings.hpp"
#include "schedule/Stats.hpp"
#include "schedule/Timeline.hpp"

namespace py = pybind11;

namespace {

void bindSchedule(py::module_& m) {
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
      [](const c10::intrusive_ptr<xcomm::XcommBackend>& backend, size_t bytes) {
        backend->setFusionThreshold(bytes);
      },
      py::arg("backend"), py::arg("bytes"),
      "Fuses small async CPU allreduces of this backend into transfers of up to `bytes` "
      "(0: off).");
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
