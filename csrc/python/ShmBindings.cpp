// Python bindings of the shared-memory transport: xcomm._C.ShmCpuBackend.
#include <pybind11/chrono.h>

#include "backend/ShmCpuBackend.hpp"
#include "backend/XcommBackend.hpp"
#include "python/Bindings.hpp"

namespace py = pybind11;

namespace {

void bindShm(py::module_& m) {
  py::class_<xcomm::ShmCpuBackend, c10d::Backend, c10::intrusive_ptr<xcomm::ShmCpuBackend>>(
      m, "ShmCpuBackend")
      .def_static(
          "try_create",
          [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
             std::chrono::milliseconds timeout, const c10::intrusive_ptr<c10d::Backend>& fallback,
             size_t slotBytes, int spinMicros, size_t smallAllreduceBytes) {
            xcomm::ShmCpuBackend::Config config;
            config.transport.slotBytes = slotBytes;
            config.transport.spinMicros = spinMicros;
            config.smallAllreduceBytes = smallAllreduceBytes;
            std::string whyNot;
            c10::intrusive_ptr<xcomm::ShmCpuBackend> backend;
            {
              // Waits on the store for the other ranks: let other threads run.
              py::gil_scoped_release noGil;
              backend = xcomm::ShmCpuBackend::tryCreate(store, rank, size, timeout, fallback,
                                                        config, &whyNot);
            }
            return py::make_tuple(backend ? py::cast(backend) : py::none(), whyNot);
          },
          py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
          py::arg("fallback"), py::arg("slot_bytes") = size_t(1) << 20, py::arg("spin_us") = -1,
          py::arg("small_allreduce_bytes") = size_t(256) << 10,
          R"(Collective over ``store``: ``(backend, "")`` on every rank, or
``(None, reason)`` on every rank when the shared-memory segment could not be
set up (the group then uses ``fallback`` alone).)")
      .def_static(
          "try_create_hierarchical",
          [](const c10::intrusive_ptr<c10d::Store>& localStore, int localRank, int localSize,
             int rank, int size, int hosts, std::chrono::milliseconds timeout,
             const c10::intrusive_ptr<c10d::Backend>& fallback, const py::object& leaders,
             size_t slotBytes, int spinMicros, size_t smallAllreduceBytes,
             const std::string& leaderCompression, int64_t compressionMinBytes,
             int64_t int8ChunkElems) {
            xcomm::ShmCpuBackend::Config config;
            config.transport.slotBytes = slotBytes;
            config.transport.spinMicros = spinMicros;
            config.smallAllreduceBytes = smallAllreduceBytes;
            config.leaderCompression.method = xcomm::parseCompression(leaderCompression);
            config.leaderCompression.minBytes = compressionMinBytes;
            config.leaderCompression.int8ChunkElems = int8ChunkElems;
            c10::intrusive_ptr<c10d::Backend> leaderBackend;
            if (!leaders.is_none())
              leaderBackend = leaders.cast<c10::intrusive_ptr<c10d::Backend>>();
            std::string whyNot;
            c10::intrusive_ptr<xcomm::ShmCpuBackend> backend;
            {
              py::gil_scoped_release noGil;
              backend = xcomm::ShmCpuBackend::tryCreateHierarchical(
                  localStore, localRank, localSize, rank, size, hosts, timeout, fallback,
                  std::move(leaderBackend), config, &whyNot);
            }
            return py::make_tuple(backend ? py::cast(backend) : py::none(), whyNot);
          },
          py::arg("local_store"), py::arg("local_rank"), py::arg("local_size"), py::arg("rank"),
          py::arg("size"), py::arg("hosts"), py::arg("timeout"), py::arg("fallback"),
          py::arg("leaders"), py::arg("slot_bytes") = size_t(1) << 20, py::arg("spin_us") = -1,
          py::arg("small_allreduce_bytes") = size_t(256) << 10,
          py::arg("leader_compression") = "none", py::arg("compression_min_bytes") = 64 << 10,
          py::arg("int8_chunk_elems") = 1024,
          R"(Hierarchical allreduce for a group spanning hosts: collective over this
host's ranks (``local_store``); ``leaders`` is a backend over local rank 0 of
every ``hosts`` host, given on local rank 0 only; ``leader_compression``
(none, fp16, bf16, int8) compresses the leaders' step only. Returns
``(backend, "")`` or ``(None, reason)``.)")
      .def_property_readonly("hierarchical", &xcomm::ShmCpuBackend::hierarchical)
      .def_property_readonly("shm_ops", &xcomm::ShmCpuBackend::shmOps,
                             "How many collectives ran over shared memory.");

  m.def(
      "shm_ops_of",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) -> int64_t {
        const auto* xcomm = dynamic_cast<const xcomm::XcommBackend*>(backend.get());
        const auto* shm =
            xcomm ? dynamic_cast<const xcomm::ShmCpuBackend*>(xcomm->transports().cpu.get())
                  : nullptr;
        return shm ? static_cast<int64_t>(shm->shmOps()) : -1;
      },
      py::arg("backend"),
      "Collectives an xcomm backend ran over shared memory; -1 when its CPU transport is not "
      "shared memory.");
}

}  // namespace

XCOMM_REGISTER_BINDINGS(shm, bindShm);
