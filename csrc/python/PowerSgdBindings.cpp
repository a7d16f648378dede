// Python bindings of the PowerSGD codec: xcomm._C.PowerSgdCodec, driven by
// python/xcomm/hooks/powersgd.py. The compute phases release the GIL: they
// run in collective callbacks, beside the training thread.
#include <torch/csrc/utils/pybind.h>

#include "compress/PowerSgdCodec.hpp"
#include "compress/cuda/CudaCodecs.hpp"
#include "python/Bindings.hpp"

namespace py = pybind11;

namespace xcomm::python {
namespace {

at::Tensor tensorOrUndefined(const py::object& obj) {
  return obj.is_none() ? at::Tensor() : obj.cast<at::Tensor>();
}

py::object tensorOrNone(const at::Tensor& t) {
  return t.defined() ? py::cast(t) : py::none();
}

void bindPowerSgd(py::module_& m) {
  using Codec = xcomm::PowerSgdCodec;
  py::class_<Codec, std::shared_ptr<Codec>>(m, "PowerSgdCodec", R"(PowerSGD's computation for DDP
buckets, without the collectives (see xcomm.hooks.powersgd, which drives it).
Per step and bucket: set_layout (when the bucket changed), prepare, allreduce
the wire, reduce_p, allreduce Q, finish.)")
      .def(py::init([](int64_t rank, double minCompressionRate, double epsilon,
                       bool useErrorFeedback, bool warmStart, bool batchSameShape) {
             xcomm::PowerSgdOptions o;
             o.matrixApproximationRank = rank;
             o.minCompressionRate = minCompressionRate;
             o.orthogonalizationEpsilon = epsilon;
             o.useErrorFeedback = useErrorFeedback;
             o.warmStart = warmStart;
             o.batchTensorsWithSameShape = batchSameShape;
             return std::make_shared<Codec>(o);
           }),
           py::kw_only(), py::arg("matrix_approximation_rank") = 1,
           py::arg("min_compression_rate") = 2.0, py::arg("orthogonalization_epsilon") = 0.0,
           py::arg("use_error_feedback") = true, py::arg("warm_start") = true,
           py::arg("batch_tensors_with_same_shape") = false)
      .def("set_layout", &Codec::setLayout, py::arg("bucket"), py::arg("buffer"),
           py::arg("gradients"), py::arg("keys"),
           "Declares the bucket's gradients (views into buffer) and their parameter keys.")
      .def("has_layout", &Codec::hasLayout, py::arg("bucket"))
      .def("needs_seed", &Codec::needsSeed, py::arg("bucket"),
           "Whether the next prepare draws random Qs (and so needs a seed).")
      .def(
          "prepare",
          [](Codec& c, int64_t bucket, const at::Tensor& buffer, std::optional<uint64_t> seed) {
            auto info = c.prepare(bucket, buffer, seed);
            return std::make_tuple(info.wire, info.qNumel, info.numelBefore, info.numelAfter);
          },
          py::arg("bucket"), py::arg("buffer"), py::arg("seed") = py::none(),
          py::call_guard<py::gil_scoped_release>(),
          "Phase 1. Returns (wire, q_numel, numel_before, numel_after); allreduce the wire.")
      .def("reduce_p", &Codec::reduceP, py::arg("bucket"), py::arg("summed_wire"),
           py::arg("world_size"), py::call_guard<py::gil_scoped_release>(),
           "Phase 2. Returns Q to allreduce (empty when nothing is compressed).")
      .def("finish", &Codec::finish, py::arg("bucket"), py::arg("summed_q"), py::arg("world_size"),
           py::call_guard<py::gil_scoped_release>(),
           "Phase 3: decompresses into the bucket buffer.")
      .def("abort_step", &Codec::abortStep, py::arg("bucket"))
      .def("state_keys", &Codec::stateKeys)
      .def(
          "param_state",
          [](const Codec& c, int64_t key) {
            auto s = c.paramState(key);
            return py::make_tuple(tensorOrNone(s.error), tensorOrNone(s.q));
          },
          py::arg("key"), "(error, q) of a parameter, copies; None where it has none.")
      .def(
          "set_param_state",
          [](Codec& c, int64_t key, const py::object& error, const py::object& q) {
            c.setParamState(key, {tensorOrUndefined(error), tensorOrUndefined(q)});
          },
          py::arg("key"), py::arg("error"), py::arg("q"))
      .def("warm_buckets", &Codec::warmBuckets)
      .def("set_warm_buckets", &Codec::setWarmBuckets, py::arg("buckets"))
      .def("clear_state", &Codec::clearState)
      .def("compression_ranks", &Codec::compressionRanks, py::arg("bucket"));

  // The GPU products on their own, for tests against torch.mm (the codec
  // calls them only where XCOMM_POWERSGD_MATMUL=xcomm, as these do).
  m.def("_powersgd_project", &xcomm::cuda::powersgdProject, py::arg("p"), py::arg("m"),
        py::arg("q"), "p = m @ q with xcomm's CUDA kernel; False where it does not apply.");
  m.def("_powersgd_project_back", &xcomm::cuda::powersgdProjectBack, py::arg("q"), py::arg("m"),
        py::arg("p"), py::arg("finite"),
        "q = m.T @ p where finite, with xcomm's CUDA kernels; False where they do not apply.");
  m.def(
      "_powersgd_unpack_uncompressed",
      [](const at::Tensor& buffer, const py::object& error, const at::Tensor& wire,
         const at::Tensor& index, int64_t worldSize) {
        return xcomm::cuda::powersgdUnpackUncompressed(buffer, tensorOrUndefined(error), wire,
                                                       index, worldSize);
      },
      py::arg("buffer"), py::arg("error"), py::arg("wire"), py::arg("index"), py::arg("world_size"),
      "The uncompressed tensors after their allreduce, with xcomm's CUDA kernel: "
      "buffer[index] = wire / world_size, and error[index] = the old buffer[index] minus that "
      "where it is finite; False where it does not apply.");
  m.def(
      "_gram_schmidt_batch",
      [](const std::vector<at::Tensor>& xs, double eps, const py::object& finite) {
        return xcomm::cuda::gramSchmidtBatch(xs, eps, tensorOrUndefined(finite));
      },
      py::arg("xs"), py::arg("eps"), py::arg("finite") = py::none(),
      "Gram-Schmidt of every matrix in xs, in place, with xcomm's CUDA kernels (and whether "
      "each was finite, into the bool tensor `finite`); False where they do not apply.");
}

}  // namespace

XCOMM_REGISTER_BINDINGS(powersgd, bindPowerSgd);

}  // namespace xcomm::python
