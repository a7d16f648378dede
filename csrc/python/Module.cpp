// Python bindings: the module xcomm._C. Only bindings live here; the logic
// is in the layers under csrc/.
#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

#include "backend/XcommBackend.hpp"
#include "collectives/compressed/AutoCompression.hpp"
#include "compress/cuda/CudaCodecs.hpp"
#include "python/Bindings.hpp"
#include "python/NoGilHolder.hpp"

#include <map>
#include <string>
#include <vector>

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

PYBIND11_MODULE(_C, m) {
  m.doc() = "xcomm's C++ core: the c10d backend, its algorithms and transports.";
  // torch.distributed registers Store and Backend with pybind11; our classes
  // name them as arguments and base, so they must be registered first.
  py::module_::import("torch.distributed");
  // The first C++ error a process raises pages in the unwinder's tables and
  // the backtrace code (25-130 ms on a cold page cache, 1 s seen under disk
  // load): paid here, at import, not when an abort or a dead peer must be
  // reported within milliseconds.
  try {
    C10_THROW_ERROR(DistBackendError, "xcomm: raised once at import");
  } catch (const c10::Error&) {
  }

  py::class_<xcomm::XcommBackend, c10d::Backend, xcomm::python::NoGilHolder<xcomm::XcommBackend>>(
      m, "XcommBackend")
      // Bound here too: torch 2.14 binds Backend.get_error, torch 2.13 does not.
      .def("get_error", &xcomm::XcommBackend::getError, py::call_guard<py::gil_scoped_release>(),
           "The group's error state as torch.distributed's ErrorType: COMM_ERROR once "
           "aborted or after an op failed in its transport, TIMEOUT after one timed out, "
           "else SUCCESS (a caller's mistake, such as ranks calling different collectives, "
           "leaves it SUCCESS).")
      // Bound here too: torch binds shrink with options of its own base type,
      // which xcomm's (Python) options are not, and keeps the GIL while the
      // survivors' group is built.
      .def(
          "shrink",
          [](xcomm::XcommBackend& b, const std::vector<int64_t>& ranks, int flags,
             const py::object& options) -> c10::intrusive_ptr<xcomm::XcommBackend> {
            c10::intrusive_ptr<xcomm::XcommOptions> own;
            if (!options.is_none()) {
              py::object cpp = options;
              if (py::hasattr(options, "to_cpp")) {  // xcomm.Options
                cpp = options.attr("to_cpp")(b.getBackendOptions()->timeout);
              }
              TORCH_CHECK_VALUE(py::isinstance<xcomm::XcommOptions>(cpp),
                                "xcomm.shrink: pg_options must be an xcomm.Options, got ",
                                py::str(py::type::of(options)).cast<std::string>());
              own = c10::make_intrusive<xcomm::XcommOptions>(cpp.cast<xcomm::XcommOptions&>());
            }
            py::gil_scoped_release noGil;
            return b.shrinkTo(ranks, flags, std::move(own));
          },
          py::arg("ranks_to_exclude"), py::arg("shrink_flags") = 0,
          py::arg("opts_override") = py::none(),
          "The survivors' group without ``ranks_to_exclude`` (dist.shrink_group calls it; "
          "only the survivors do, all excluding the same ranks): built as any xcomm group, "
          "for its survivors' shape; SHRINK_ABORT (1) first fails this group's pending ops. "
          "``opts_override``: an xcomm.Options for the new group, else this group's.")
      .def_property_readonly(
          "compression_stats",
          [](const xcomm::XcommBackend& b) {
            py::dict d;
            const auto* c = b.compression();
            d["method"] = c ? xcomm::compressionName(c->config().method) : "none";
            d["calls"] = c ? c->counters().calls.load() : 0;
            d["link_bytes_before"] = c ? c->counters().linkBytesBefore.load() : 0;
            d["link_bytes_sent"] = c ? c->counters().linkBytesSent.load() : 0;
            if (const auto* a = c ? c->autoCompression() : nullptr) {
              const auto r = a->report();
              py::dict choices;
              for (size_t i = 0; i < xcomm::AutoCompression::kMethods.size(); ++i) {
                choices[xcomm::compressionName(xcomm::AutoCompression::kMethods[i])] = r.chosen[i];
              }
              py::dict in;
              in["latency_s"] = r.inputs.latencySeconds;
              in["bandwidth_bytes_per_s"] =
                  r.inputs.secondsPerByte > 0 ? 1.0 / r.inputs.secondsPerByte : 0.0;
              in["bf16_s_per_elem"] = r.inputs.bf16SecondsPerElem;
              in["int8_s_per_elem"] = r.inputs.int8SecondsPerElem;
              py::dict a2;
              a2["rounds"] = r.rounds;
              a2["next_round"] = r.nextRound;
              a2["probe_bytes"] = r.probeBytes;
              a2["chosen"] = choices;
              a2["inputs"] = in;
              a2["last"] = r.last;
              // The closed loop: per key, the observed/predicted factor its
              // predictions are multiplied by and whose observations it is
              // (the key's own, a codec that ran for one that has not, or
              // None: uncorrected).
              // Key 0 the link, key k the k-th method auto chooses from.
              std::vector<std::string> keys{"link"};
              for (size_t k = 1; k < xcomm::AutoCompression::kMethods.size(); ++k) {
                keys.emplace_back(xcomm::compressionName(xcomm::AutoCompression::kMethods[k]));
              }
              py::dict observed;
              for (size_t k = 0; k < r.factors.size(); ++k) {
                py::dict one;
                one["factor"] = r.factors[k];
                one["from"] = r.factorSources[k] < 0
                                  ? py::object(py::none())
                                  : py::object(py::str(keys[r.factorSources[k]]));
                observed[py::str(keys[k])] = one;
              }
              a2["observed"] = observed;
              d["auto"] = a2;
            }
            return d;
          },
          "Compressed allreduces and reduce-scatters of this group: calls, bytes a ring "
          "allreduce (all-to-all reduce-scatter) would have sent per rank, bytes sent per rank; "
          "with compression='auto', also what it chose (counts per method), its rounds (count, "
          "the choice the next is due at, the next probe's bytes), the inputs every "
          "rank agreed on, the observed/predicted factors it corrects its predictions by "
          "('observed': per key link, bf16, int8, the factor and the key it comes from), and "
          "its last choice with the predictions behind it.")
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
      .def_property_readonly("shm_ops", &xcomm::XcommBackend::shmOps,
                             "Collectives run over shared memory; -1 when the group uses none.")
      .def_property_readonly("carried_ops", &xcomm::XcommBackend::carriedOps,
                             "Collectives completed by the rank-agreement check's own exchange "
                             "(never issued on Gloo); -1 when the group's Gloo is not checked.")
      .def_property_readonly("direct_ops", &xcomm::XcommBackend::directOps,
                             "All-to-alls and all-gathers sent as point-to-point messages "
                             "(every piece straight to its rank) instead of Gloo's collectives; "
                             "-1 when the group's Gloo is not checked.")
      .def_property_readonly("leader_carried_ops", &xcomm::XcommBackend::leaderCarriedOps,
                             "A hierarchical group's allreduce steps between hosts completed by "
                             "the leaders' check; -1 except on a leader whose check is on.")
      .def_property_readonly("cpu_backend_name",
                             [](const xcomm::XcommBackend& b) {
                               const auto& t = b.routes().cpu;
                               return t ? t->name() : std::string();
                             })
      .def_property_readonly("cuda_backend_name",
                             [](const xcomm::XcommBackend& b) {
                               const auto& t = b.routes().cuda;
                               return t ? t->name() : std::string();
                             })
      // As ProcessGroupGloo/NCCL bind it (torch binds it on those two only):
      // changes the timeout of every later op of the group, inner backends
      // included.
      .def(
          "_set_default_timeout",
          [](xcomm::XcommBackend& b, std::chrono::milliseconds timeout) { b.setTimeout(timeout); },
          py::arg("timeout"), py::call_guard<py::gil_scoped_release>());

  xcomm::python::bindAll(m);

  // Whether GPU buckets are encoded by xcomm's CUDA kernels (else the codecs
  // take them through the host).
  m.attr("cuda_codecs") = xcomm::cuda::codecsBuilt();
#ifdef XCOMM_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
}
