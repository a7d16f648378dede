// Bindings of observability (xcomm._C): the stats registry and the timeline.
// The Python faces are xcomm.stats (opstats.py) and xcomm.trace.
#include <torch/csrc/utils/pybind.h>

#include "observe/Stats.hpp"
#include "observe/Timeline.hpp"
#include "python/Bindings.hpp"

namespace py = pybind11;

namespace {

void bindObserve(py::module_& m) {
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

XCOMM_REGISTER_BINDINGS(observe, bindObserve);
