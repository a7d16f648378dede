// Python bindings: the module xcomm._C. Only bindings live here; the logic
// is in the layers under csrc/.
#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

#include "backend/XcommBackend.hpp"
#include "python/Bindings.hpp"

#include <map>
#include <string>

namespace py = pybind11;

namespace xcomm::python {
namespace {

std::map<std::string, BindFn>& registry() {
  static std::map<std::string, BindFn> functions;
  return functions;
}

}  // namespace

BindingRegistrar::BindingRegistrar(const char* name, BindFn fn) {
  registry()[name] = fn;
}

void bindAll(pybind11::module_& m) {
  for (const auto& [name, fn] : registry()) fn(m);
}

}  // namespace xcomm::python

namespace {

c10::intrusive_ptr<c10d::Backend> backendOrNull(const py::object& obj) {
  if (obj.is_none()) {
    return {};
  }
  return obj.cast<c10::intrusive_ptr<c10d::Backend>>();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "xcomm's C++ core: the c10d backend and its transports.";
  // torch.distributed registers Store and Backend with pybind11; our classes
  // name them as arguments and base, so they must be registered first.
  py::module_::import("torch.distributed");

  py::class_<xcomm::XcommBackend, c10d::Backend, c10::intrusive_ptr<xcomm::XcommBackend>>(
      m, "XcommBackend")
      .def(py::init([](int rank, int size, std::chrono::milliseconds timeout, const py::object& cpu,
                       const py::object& cuda) {
             xcomm::XcommBackend::Transports transports{backendOrNull(cpu), backendOrNull(cuda)};
             return c10::make_intrusive<xcomm::XcommBackend>(
                 rank, size, xcomm::XcommOptions::create(timeout), std::move(transports));
           }),
           py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("cpu_transport"),
           py::arg("cuda_transport"),
           R"(Builds the backend over transport backends made in Python
(a ProcessGroupGloo for CPU tensors, a ProcessGroupNCCL for CUDA tensors).)")
      .def_static(
          "create_with_store",
          [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
             std::chrono::milliseconds timeout) {
            return xcomm::XcommBackend::createWithStore(store, rank, size,
                                                        xcomm::XcommOptions::create(timeout));
          },
          py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
          R"(Builds the backend with xcomm's own store transport for CPU tensors
(the C++-only path; slow, needs nothing but the store).)")
      .def_property_readonly("cpu_transport_name",
                             [](const xcomm::XcommBackend& b) {
                               const auto& t = b.transports().cpu;
                               return t ? t->getBackendName() : std::string();
                             })
      .def_property_readonly("cuda_transport_name", [](const xcomm::XcommBackend& b) {
        const auto& t = b.transports().cuda;
        return t ? t->getBackendName() : std::string();
      });

  xcomm::python::bindAll(m);

#ifdef XCOMM_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
}
