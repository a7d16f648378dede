// Bindings of the int8, top-k and random-k codecs (xcomm._C).
#include <optional>

#include <pybind11/stl.h>

#include "compress/Int8Codec.hpp"
#include "compress/RandomKCodec.hpp"
#include "compress/TopKCodec.hpp"
#include "compress/kernels/CodecKernels.hpp"
#include "python/Bindings.hpp"

namespace py = pybind11;

namespace {

template <typename Codec>
void bindFeedbackState(py::class_<Codec, std::shared_ptr<Codec>>& cls) {
  cls.def(
         "feedback_state",
         [](Codec& c) {
           std::map<int64_t, at::Tensor> copy;
           for (const auto& [key, t] : c.errorFeedback().state()) copy[key] = t.clone();
           return copy;
         },
         "The error-feedback residuals by bucket key (copies), for checkpoints.")
      .def(
          "load_feedback_state",
          [](Codec& c, std::map<int64_t, at::Tensor> state) {
            for (auto& [key, t] : state) t = t.clone();
            c.errorFeedback().load(std::move(state));
          },
          py::arg("state"))
      .def(
          "set_feedback",
          [](Codec& c, int64_t key, const at::Tensor& residual) {
            c.errorFeedback().store(key, residual.clone());
          },
          py::arg("key"), py::arg("residual"));
}

void bindCodecs(py::module_& m) {
  m.def(
      "codec_kernels_isa", [] { return std::string(xcomm::kernels::codecKernels().isa); },
      "The instruction set the codec kernels run with (default, avx2, avx512).");
  py::class_<xcomm::ErrorFeedback>(m, "ErrorFeedback", "Per-bucket error-feedback residuals.")
      .def(py::init<>())
      .def("compensate", &xcomm::ErrorFeedback::compensate, py::arg("key"), py::arg("input"),
           py::call_guard<py::gil_scoped_release>())
      .def("store", &xcomm::ErrorFeedback::store, py::arg("key"), py::arg("residual"))
      .def("clear", &xcomm::ErrorFeedback::clear)
      .def(
          "get",
          [](const xcomm::ErrorFeedback& f, int64_t key) -> std::optional<at::Tensor> {
            at::Tensor t = f.find(key);
            if (!t.defined()) return std::nullopt;
            return t;
          },
          py::arg("key"), "The live residual of `key` (not a copy), or None.")
      .def("erase", &xcomm::ErrorFeedback::erase, py::arg("key"))
      .def("state",
           [](const xcomm::ErrorFeedback& f) {
             std::map<int64_t, at::Tensor> copy;
             for (const auto& [key, t] : f.state()) copy[key] = t.clone();
             return copy;
           })
      .def(
          "load",
          [](xcomm::ErrorFeedback& f, std::map<int64_t, at::Tensor> state) {
            for (auto& [key, t] : state) t = t.clone();
            f.load(std::move(state));
          },
          py::arg("state"));

  py::class_<xcomm::Int8Codec, std::shared_ptr<xcomm::Int8Codec>>(
      m, "Int8Codec", "int8 quantization with a float32 scale per chunk.")
      .def(py::init<int64_t>(), py::arg("chunk_elems") = xcomm::kDefaultInt8ChunkElems)
      .def_readonly_static("DEFAULT_CHUNK_ELEMS", &xcomm::kDefaultInt8ChunkElems)
      .def_property_readonly("chunk_elems", &xcomm::Int8Codec::chunkElems)
      .def("shard_elems", &xcomm::Int8Codec::shardElems, py::arg("numel"), py::arg("world"))
      .def("packed_bytes", &xcomm::Int8Codec::packedBytes, py::arg("elems"))
      .def("pack_shards", &xcomm::Int8Codec::packShards, py::arg("flat"), py::arg("world"),
           py::call_guard<py::gil_scoped_release>())
      .def("pack_shards_with_feedback", &xcomm::Int8Codec::packShardsWithFeedback, py::arg("flat"),
           py::arg("world"), py::arg("feedback"), py::arg("key"),
           py::call_guard<py::gil_scoped_release>(),
           "pack_shards of flat + the key's residual, leaving the new residual in `feedback`.")
      .def("row_elems", &xcomm::Int8Codec::rowElems, py::arg("numel"), py::arg("rows"))
      .def(
          "pack_rows",
          [](const xcomm::Int8Codec& c, const at::Tensor& flat, int rows,
             xcomm::ErrorFeedback* feedback,
             int64_t key) { return c.packRows(flat, rows, feedback, key); },
          py::arg("flat"), py::arg("rows"), py::arg("feedback") = nullptr, py::arg("key") = 0,
          py::call_guard<py::gil_scoped_release>(),
          "flat cut into `rows` equal rows, each quantized and padded to whole chunks; "
          "with `feedback`, the key's residual is added first and keeps the error.")
      .def("reduce_and_pack", &xcomm::Int8Codec::reduceAndPack, py::arg("received"),
           py::arg("shard_elems"), py::arg("divisor"), py::call_guard<py::gil_scoped_release>(),
           "reduce_shards(received) / divisor, quantized: pack of the reduced shard.")
      .def("reduce_shards", &xcomm::Int8Codec::reduceShards, py::arg("received"),
           py::arg("shard_elems"), py::call_guard<py::gil_scoped_release>())
      .def("pack", &xcomm::Int8Codec::pack, py::arg("shard"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "unpack_all",
          [](const xcomm::Int8Codec& c, const at::Tensor& gathered, int64_t shard, at::Tensor out) {
            c.unpackAll(gathered, shard, out);
          },
          py::arg("gathered"), py::arg("shard_elems"), py::arg("out"),
          py::call_guard<py::gil_scoped_release>())
      .def("round_trip", &xcomm::Int8Codec::roundTrip, py::arg("flat"),
           py::call_guard<py::gil_scoped_release>());

  py::class_<xcomm::TopKCodec, std::shared_ptr<xcomm::TopKCodec>> topk(
      m, "TopKCodec", "Top-k sparsification with error feedback.");
  topk.def(py::init<bool, bool, int64_t, uint64_t>(), py::arg("approximate"),
           py::arg("error_feedback"), py::arg("sample_size") = 4096, py::arg("seed") = 0)
      .def_static("k_for", &xcomm::TopKCodec::kFor, py::arg("numel"), py::arg("density"))
      .def_static("packed_bytes", &xcomm::TopKCodec::packedBytes, py::arg("k"), py::arg("dtype"))
      .def_static("split_k", &xcomm::TopKCodec::splitK, py::arg("flat"), py::arg("segments"),
                  py::arg("k"), py::call_guard<py::gil_scoped_release>(),
                  "k split between the consecutive segments of `flat` (their sizes) in "
                  "proportion to each one's non-zero entries, each at most its size.")
      .def(
          "encode",
          [](xcomm::TopKCodec& c, int64_t key, const at::Tensor& flat, int64_t k,
             const std::vector<int64_t>& segments) {
            return c.encode(key, flat, k, c.hasErrorFeedback() ? &c.errorFeedback() : nullptr,
                            segments);
          },
          py::arg("key"), py::arg("flat"), py::arg("k"),
          py::arg("segments") = std::vector<int64_t>{}, py::call_guard<py::gil_scoped_release>(),
          "Selects k entries and packs them; with `segments` (the sizes of the tensors the "
          "bucket is laid out from), k is split between them by split_k, each selecting its own.")
      .def(
          "encode_with_feedback",
          [](xcomm::TopKCodec& c, int64_t key, const at::Tensor& flat, int64_t k,
             xcomm::ErrorFeedback& feedback, const std::vector<int64_t>& segments) {
            return c.encode(key, flat, k, &feedback, segments);
          },
          py::arg("key"), py::arg("flat"), py::arg("k"), py::arg("feedback"),
          py::arg("segments") = std::vector<int64_t>{}, py::call_guard<py::gil_scoped_release>(),
          "encode with the residual of `key` kept in `feedback` (a shared ErrorFeedback).")
      .def(
          "decode",
          [](const xcomm::TopKCodec& c, const at::Tensor& gathered, int64_t k, at::Tensor out,
             double divisor) { c.decode(gathered, k, out, divisor); },
          py::arg("gathered"), py::arg("k"), py::arg("out"), py::arg("divisor"),
          py::call_guard<py::gil_scoped_release>())
      .def("get_rng_state", &xcomm::TopKCodec::rngState)
      .def("set_rng_state", &xcomm::TopKCodec::setRngState, py::arg("state"))
      .def(
          "last_selection",
          [](const xcomm::TopKCodec& c) {
            const auto& s = c.lastSelection();
            const char* route = s.route == xcomm::TopKRoute::kScan    ? "scan"
                                : s.route == xcomm::TopKRoute::kCuda  ? "cuda"
                                : s.route == xcomm::TopKRoute::kTorch ? "torch"
                                                                      : "none";
            py::dict d;
            d["route"] = route;
            d["candidates"] = s.candidates;
            d["reread"] = s.reread;
            d["exact"] = s.exact;
            return d;
          },
          "How the last encode selected: route 'scan' (the fused CPU selection), 'cuda', "
          "'torch' (at::topk) or 'none'; for 'scan', the (index, value) candidates its scans "
          "collected, the elements it read again and whether the full selection ran.");
  bindFeedbackState(topk);

  py::class_<xcomm::RandomKCodec, std::shared_ptr<xcomm::RandomKCodec>> randk(
      m, "RandomKCodec", "Random-k sparsification from a shared seed.");
  randk.def(py::init<uint64_t, bool>(), py::arg("seed"), py::arg("error_feedback"))
      .def("positions", &xcomm::RandomKCodec::positions, py::arg("key"), py::arg("step"),
           py::arg("numel"), py::arg("density"), py::arg("device") = at::Device(at::kCPU),
           py::call_guard<py::gil_scoped_release>())
      .def("encode",
           py::overload_cast<int64_t, const at::Tensor&, const at::Tensor&>(
               &xcomm::RandomKCodec::encode),
           py::arg("key"), py::arg("flat"), py::arg("positions"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "encode_with_feedback",
          [](xcomm::RandomKCodec& c, int64_t key, const at::Tensor& flat,
             const at::Tensor& positions,
             xcomm::ErrorFeedback& feedback) { return c.encode(key, flat, positions, &feedback); },
          py::arg("key"), py::arg("flat"), py::arg("positions"), py::arg("feedback"),
          py::call_guard<py::gil_scoped_release>(),
          "encode with the residual of `key` kept in `feedback` (a shared ErrorFeedback).")
      .def(
          "decode",
          [](const xcomm::RandomKCodec& c, const at::Tensor& reduced, const at::Tensor& positions,
             at::Tensor out, double divisor) { c.decode(reduced, positions, out, divisor); },
          py::arg("reduced"), py::arg("positions"), py::arg("out"), py::arg("divisor"),
          py::call_guard<py::gil_scoped_release>());
  bindFeedbackState(randk);
}

}  // namespace

XCOMM_REGISTER_BINDINGS(codecs, bindCodecs);
