// Python bindings of the compressed collectives the Python surfaces call:
// the allreduces chained in C++ (csrc/collectives/chains/BucketChain.hpp),
// xcomm._C.PowerSgdAllreduce, Int8Allreduce, TopKAllreduce and
// RandomKAllreduce, one per hook state, started by the hooks in
// python/xcomm/hooks/; and CompressedRows, the compressed reduce-scatter's
// arithmetic (collectives/compressed/CompressedRows.hpp) that
// FSDP2's state shares with the backend; CompletionClock, when a future
// completed, for auto's timing.
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>

#include "collectives/chains/Int8Allreduce.hpp"
#include "collectives/chains/PowerSgdAllreduce.hpp"
#include "collectives/chains/SparseAllreduce.hpp"
#include "collectives/compressed/CompressedRows.hpp"
#include "python/Bindings.hpp"

namespace py = pybind11;

namespace xcomm::python {
namespace {

using PythonFuture = std::shared_ptr<torch::jit::PythonFutureWrapper>;

// DDP reads a Python hook's result as a Python object.
xcomm::ChainResult pythonResult() {
  return {c10::PyObjectType::get(), [](const at::Tensor& averaged) {
            py::gil_scoped_acquire gil;
            return torch::jit::toIValue(py::cast(averaged), c10::PyObjectType::get());
          }};
}

xcomm::FuturePtr futureOf(const PythonFuture& turn) {
  return turn ? turn->fut : xcomm::FuturePtr();
}

// Starts a chain without the GIL (collectives may complete inline and run the
// next phases here); returns (result, issued) as Python futures.
template <typename Start>
py::tuple startWithoutGil(Start start) {
  xcomm::StartedBucket started;
  {
    py::gil_scoped_release release;
    started = start();
  }
  return py::make_tuple(std::make_shared<torch::jit::PythonFutureWrapper>(started.result),
                        std::make_shared<torch::jit::PythonFutureWrapper>(started.issued));
}

// When a future completed, read later without a Python callback on it. auto
// times every bucket's reduction; a Python done-callback on the future DDP
// waits for takes the GIL on the thread that completes it, so the chain's
// next work waited behind the training thread's Python (int8 under auto took
// 5-6% longer a step at 0.1 Gbit/s than without the timing).
class CompletionClock {
 public:
  explicit CompletionClock(const xcomm::FuturePtr& future)
      : doneAt_(std::make_shared<std::atomic<double>>(kPending)) {
    std::weak_ptr<std::atomic<double>> slot = doneAt_;
    future->addCallback([slot](c10::ivalue::Future& done) {
      const auto seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
              .count();
      if (auto s = slot.lock()) s->store(done.hasError() ? kFailed : seconds);
    });
  }
  // None while pending; NaN if it failed; else seconds on time.perf_counter()'s
  // clock (both CLOCK_MONOTONIC on Linux).
  py::object doneAt() const {
    const double at = doneAt_->load();
    if (at == kPending) return py::none();
    return py::float_(at == kFailed ? std::nan("") : at);
  }

 private:
  static constexpr double kPending = -1.0;
  static constexpr double kFailed = -2.0;
  std::shared_ptr<std::atomic<double>> doneAt_;
};

constexpr const char* kTurnDoc =
    " Returns (result, issued): futures of buffer (the average) and of the bucket's last "
    "collective issued. The first collective waits for `turn` (a future that fails only with a "
    "real error) or, without one, for the previous bucket started here.";

void bindChains(py::module_& m) {
  py::class_<xcomm::PowerSgdAllreduce, std::shared_ptr<xcomm::PowerSgdAllreduce>>(
      m, "PowerSgdAllreduce", R"(PowerSGD's two allreduces of a DDP bucket, chained in C++
(see csrc/collectives/chains/PowerSgdAllreduce.hpp). One per hook state: buckets take
turns, so every rank issues the collectives in the same order.)")
      .def(py::init([] { return std::make_shared<xcomm::PowerSgdAllreduce>(pythonResult()); }))
      .def(
          "start",
          [](xcomm::PowerSgdAllreduce& self, std::shared_ptr<xcomm::PowerSgdCodec> codec,
             c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t bucket, at::Tensor buffer,
             at::Tensor wire, const PythonFuture& turn) {
            return startWithoutGil([&] {
              return self.start(std::move(codec), std::move(group), bucket, std::move(buffer),
                                std::move(wire), futureOf(turn));
            });
          },
          py::arg("codec"), py::arg("group"), py::arg("bucket"), py::arg("buffer"), py::arg("wire"),
          py::arg("turn") = nullptr,
          (std::string("After codec.prepare(bucket, buffer) returned wire: allreduce it, "
                       "reduce_p, allreduce Q, finish.") +
           kTurnDoc)
              .c_str());

  py::class_<xcomm::Int8Allreduce, std::shared_ptr<xcomm::Int8Allreduce>>(
      m, "Int8Allreduce", R"(The int8 hook's alltoall and allgather of a DDP bucket, chained
in C++ (see csrc/collectives/chains/Int8Allreduce.hpp). One per hook state: buckets take
turns, so every rank issues the collectives in the same order.)")
      .def(py::init([] { return std::make_shared<xcomm::Int8Allreduce>(pythonResult()); }))
      .def(
          "start",
          [](xcomm::Int8Allreduce& self, std::shared_ptr<xcomm::Int8Codec> codec,
             c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor buffer, at::Tensor flat,
             std::optional<at::Tensor> index, at::Tensor packed, const PythonFuture& turn) {
            return startWithoutGil([&] {
              return self.start(std::move(codec), std::move(group), std::move(buffer),
                                std::move(flat), index.value_or(at::Tensor()), std::move(packed),
                                futureOf(turn));
            });
          },
          py::arg("codec"), py::arg("group"), py::arg("buffer"), py::arg("flat"), py::arg("index"),
          py::arg("packed"), py::arg("turn") = nullptr,
          (std::string("After codec.pack_shards(flat, world) returned packed: alltoall it, "
                       "reduce_and_pack, allgather, unpack_all into flat, and flat into "
                       "buffer[index] where index is given.") +
           kTurnDoc)
              .c_str());

  py::class_<xcomm::TopKAllreduce, std::shared_ptr<xcomm::TopKAllreduce>>(
      m, "TopKAllreduce", R"(The top-k hook's allgather and decode of a DDP bucket, chained
in C++ (see csrc/collectives/chains/SparseAllreduce.hpp). One per hook state.)")
      .def(py::init([] { return std::make_shared<xcomm::TopKAllreduce>(pythonResult()); }))
      .def(
          "start",
          [](xcomm::TopKAllreduce& self, std::shared_ptr<xcomm::TopKCodec> codec,
             c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor buffer, at::Tensor flat,
             std::optional<at::Tensor> index, at::Tensor packed, int64_t k,
             const PythonFuture& turn) {
            return startWithoutGil([&] {
              return self.start(std::move(codec), std::move(group), std::move(buffer),
                                std::move(flat), index.value_or(at::Tensor()), std::move(packed), k,
                                futureOf(turn));
            });
          },
          py::arg("codec"), py::arg("group"), py::arg("buffer"), py::arg("flat"), py::arg("index"),
          py::arg("packed"), py::arg("k"), py::arg("turn") = nullptr,
          (std::string("After codec.encode(key, flat, k) returned packed: allgather it, decode "
                       "into flat, and flat into buffer[index] where index is given.") +
           kTurnDoc)
              .c_str());

  py::class_<xcomm::RandomKAllreduce, std::shared_ptr<xcomm::RandomKAllreduce>>(
      m, "RandomKAllreduce", R"(The random-k hook's allreduce and decode of a DDP bucket,
chained in C++ (see csrc/collectives/chains/SparseAllreduce.hpp). One per hook state.)")
      .def(py::init([] { return std::make_shared<xcomm::RandomKAllreduce>(pythonResult()); }))
      .def(
          "start",
          [](xcomm::RandomKAllreduce& self, std::shared_ptr<xcomm::RandomKCodec> codec,
             c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor buffer, at::Tensor flat,
             std::optional<at::Tensor> index, at::Tensor values, at::Tensor positions,
             const PythonFuture& turn) {
            return startWithoutGil([&] {
              return self.start(std::move(codec), std::move(group), std::move(buffer),
                                std::move(flat), index.value_or(at::Tensor()), std::move(values),
                                std::move(positions), futureOf(turn));
            });
          },
          py::arg("codec"), py::arg("group"), py::arg("buffer"), py::arg("flat"), py::arg("index"),
          py::arg("values"), py::arg("positions"), py::arg("turn") = nullptr,
          (std::string("After codec.encode(key, flat, positions) returned values: allreduce "
                       "them, decode into flat, and flat into buffer[index] where index is "
                       "given.") +
           kTurnDoc)
              .c_str());

  py::class_<CompletionClock>(m, "CompletionClock", R"(When a future completed, without a
Python callback on it (one would take the GIL on the thread completing the future).)")
      .def(py::init([](const PythonFuture& future) {
             TORCH_CHECK_VALUE(future, "xcomm.CompletionClock: needs a torch.futures.Future");
             return CompletionClock(future->fut);
           }),
           py::arg("future"))
      .def_property_readonly("done_at", &CompletionClock::doneAt,
                             "None while pending, NaN if it failed, else time.perf_counter() "
                             "seconds when it completed.");

  py::class_<xcomm::CompressedRows>(m, "CompressedRows", R"(The compressed reduce-scatter's
arithmetic, as the backend's compression= route runs it (see
csrc/collectives/compressed/CompressedRows.hpp): encode the input's rows, all-to-all
them (the caller's collective), reduce_into the output.)")
      .def(py::init([](const std::string& method, int size,
                       std::shared_ptr<xcomm::Int8Codec> codec) {
             return xcomm::CompressedRows(xcomm::parseCompression(method), size, std::move(codec));
           }),
           py::arg("method"), py::arg("size"), py::arg("codec") = nullptr,
           "method: 'fp16', 'bf16' or 'int8' (which needs codec); size: the group's.")
      .def("encode", &xcomm::CompressedRows::encode, py::arg("input"),
           py::arg("feedback") = nullptr, py::arg("key") = 0,
           py::call_guard<py::gil_scoped_release>(),
           "Row j of input encoded for rank j; with feedback, the key's residual is added "
           "first and keeps what the encoding lost.")
      .def("reduce_into", &xcomm::CompressedRows::reduceInto, py::arg("received"),
           py::arg("output"), py::arg("mean"), py::call_guard<py::gil_scoped_release>(),
           "The received rows decoded and summed in rank order (float32, float64 for a "
           "float64 output), divided by the group size under mean, into output.");
}

}  // namespace

XCOMM_REGISTER_BINDINGS(chains, bindChains);

}  // namespace xcomm::python
