// Bindings of the engine (xcomm._C): the chunk scheduler, the bucket launcher
// and backend-level fusion. The Python faces are xcomm.GradientBucketer,
// xcomm.scheduler and xcomm.Options(fusion_threshold_bytes=...).
#include <torch/csrc/utils/pybind.h>

#include "backend/XcommBackend.hpp"
#include "python/Bindings.hpp"
#include "schedule/BucketLauncher.hpp"
#include "schedule/ChunkScheduler.hpp"

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
      "set_fusion_threshold",
      [](xcomm::XcommBackend& backend, size_t bytes, double cycleMs,
         const c10::intrusive_ptr<c10d::Backend>& control) {
        // A positive cycle below 1 us still means "a cycle", not "on demand";
        // setFusionThreshold refuses a negative one.
        const auto us = static_cast<int64_t>(cycleMs * 1000.0);
        backend.setFusionThreshold(
            bytes, std::chrono::microseconds(cycleMs > 0 ? std::max<int64_t>(us, 1) : us),
            control ? std::make_shared<xcomm::RawRoute>(control) : nullptr);
      },
      py::arg("backend"), py::arg("bytes"), py::arg("cycle_ms") = 0.0,
      py::arg("control") = c10::intrusive_ptr<c10d::Backend>(),
      py::call_guard<py::gil_scoped_release>(),
      "Fuses small async CPU allreduces of this backend into transfers of up to `bytes` "
      "(0: off). With cycle_ms > 0 a background thread sends them every cycle after agreeing "
      "with the other ranks over `control` (a ProcessGroupGloo no other op uses).");
  m.def(
      "fusion_cycle_ms",
      [](xcomm::XcommBackend& backend) { return backend.fusionCycle().count() / 1000.0; },
      py::arg("backend"));
  m.def(
      "fusion_threshold", [](xcomm::XcommBackend& backend) { return backend.fusionThreshold(); },
      py::arg("backend"));
}

}  // namespace

XCOMM_REGISTER_BINDINGS(schedule, bindSchedule);
