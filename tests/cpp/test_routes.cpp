// Op and RawRoute: each of c10d's list-shaped calls, converted once into an
// Op (runtime/Op.hpp), reaches a whole backend as the same call with the same
// tensors and options; an Op tells a route what it needs to know of the call;
// Route's one-tensor helpers are the calls their names say.
#include <chrono>
#include <string>
#include <vector>

#include "runtime/Op.hpp"
#include "runtime/Route.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

namespace {

using c10d::OpType;
using xcomm::Op;
using xcomm::OpKind;
using Tensors = std::vector<at::Tensor>;
using TensorLists = std::vector<std::vector<at::Tensor>>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// Records each call (its name, first tensor, root or reduce op, splits); every
// op "completes" at once.
class RecordingBackend final : public c10d::Backend {
 public:
  RecordingBackend() : Backend(1, 2) {}
  const std::string getBackendName() const override { return "recording"; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }

  struct Call {
    std::string name;
    at::Tensor first;
    int64_t root = -1;
    c10d::ReduceOp::RedOpType redOp = c10d::ReduceOp::UNUSED;
    std::vector<int64_t> splits;
  };
  std::vector<Call> calls;
  std::chrono::milliseconds timeout_{0};

  WorkPtr broadcast(Tensors& t, const c10d::BroadcastOptions& o) override {
    return record({"broadcast", t[0], o.rootRank});
  }
  WorkPtr allreduce(Tensors& t, const c10d::AllreduceOptions& o) override {
    return record({"allreduce", t[0], -1, o.reduceOp.op_});
  }
  WorkPtr allreduce_coalesced(Tensors& t, const c10d::AllreduceCoalescedOptions& o) override {
    return record({"allreduce_coalesced", t[0], -1, o.reduceOp.op_});
  }
  WorkPtr reduce(Tensors& t, const c10d::ReduceOptions& o) override {
    return record({"reduce", t[0], o.rootRank, o.reduceOp.op_});
  }
  WorkPtr allgather(TensorLists& out, Tensors&, const c10d::AllgatherOptions&) override {
    return record({"allgather", out[0][0]});
  }
  WorkPtr _allgather_base(at::Tensor& out, at::Tensor&, const c10d::AllgatherOptions&) override {
    return record({"_allgather_base", out});
  }
  WorkPtr allgather_into_tensor_coalesced(Tensors& out, Tensors&,
                                          const c10d::AllgatherOptions&) override {
    return record({"allgather_into_tensor_coalesced", out[0]});
  }
  WorkPtr allgather_coalesced(TensorLists& out, Tensors&, const c10d::AllgatherOptions&) override {
    return record({"allgather_coalesced", out[0][0]});
  }
  WorkPtr gather(TensorLists&, Tensors& in, const c10d::GatherOptions& o) override {
    return record({"gather", in[0], o.rootRank});
  }
  WorkPtr scatter(Tensors& out, TensorLists&, const c10d::ScatterOptions& o) override {
    return record({"scatter", out[0], o.rootRank});
  }
  WorkPtr reduce_scatter(Tensors& out, TensorLists&, const c10d::ReduceScatterOptions& o) override {
    return record({"reduce_scatter", out[0], -1, o.reduceOp.op_});
  }
  WorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor&,
                               const c10d::ReduceScatterOptions& o) override {
    return record({"_reduce_scatter_base", out, -1, o.reduceOp.op_});
  }
  WorkPtr reduce_scatter_tensor_coalesced(Tensors& out, Tensors&,
                                          const c10d::ReduceScatterOptions& o) override {
    return record({"reduce_scatter_tensor_coalesced", out[0], -1, o.reduceOp.op_});
  }
  WorkPtr alltoall_base(at::Tensor& out, at::Tensor&, std::vector<int64_t>& outSplits,
                        std::vector<int64_t>&, const c10d::AllToAllOptions&) override {
    return record({"alltoall_base", out, -1, c10d::ReduceOp::UNUSED, outSplits});
  }
  WorkPtr alltoall(Tensors& out, Tensors&, const c10d::AllToAllOptions&) override {
    return record({"alltoall", out[0]});
  }
  WorkPtr barrier(const c10d::BarrierOptions&) override { return record({"barrier", {}}); }

 private:
  WorkPtr record(Call call) {
    calls.push_back(std::move(call));
    return c10::make_intrusive<c10d::Work>();
  }
};

c10d::ReduceOp maxOp() {
  return c10d::ReduceOp(c10d::ReduceOp::MAX);
}

}  // namespace

TEST_CASE("every Op reaches a whole backend as the c10d call it was made from", "[routes]") {
  auto backend = c10::make_intrusive<RecordingBackend>();
  xcomm::RawRoute route(backend);
  const at::Tensor a = at::ones({4});
  const at::Tensor b = at::zeros({8});
  c10d::BroadcastOptions bcast;
  bcast.rootRank = 1;
  c10d::AllreduceOptions ar;
  ar.reduceOp = maxOp();
  c10d::AllreduceCoalescedOptions arc;
  arc.reduceOp = maxOp();
  c10d::ReduceOptions red;
  red.rootRank = 1;
  red.reduceOp = maxOp();
  c10d::GatherOptions gat;
  gat.rootRank = 1;
  c10d::ScatterOptions sca;
  sca.rootRank = 1;
  c10d::ReduceScatterOptions rs;
  rs.reduceOp = maxOp();
  const std::vector<Op> ops = {
      Op::broadcast({a}, bcast),
      Op::allreduce({a}, ar),
      Op::allreduceCoalesced({a}, arc),
      Op::reduce({a}, red),
      Op::allgather({{b, a}}, {a}, {}),
      Op::allgatherBase(b, a, {}),
      Op::allgatherIntoTensorCoalesced({b}, {a}, {}),
      Op::allgatherCoalesced({{b}, {a}}, {a}, {}),
      Op::gather({{b, a}}, {a}, gat),
      Op::scatter({b}, {{a, a}}, sca),
      Op::reduceScatter({b}, {{a, a}}, rs),
      Op::reduceScatterBase(b, a, rs),
      Op::reduceScatterTensorCoalesced({b}, {a}, rs),
      Op::alltoallBase(b, a, {3, 5}, {2, 2}, {}),
      Op::alltoall({b, a}, {a, b}, {}),
      Op::barrier({}),
  };
  for (const auto& op : ops) route.run(op);
  const std::vector<std::string> expected = {"broadcast",
                                             "allreduce",
                                             "allreduce_coalesced",
                                             "reduce",
                                             "allgather",
                                             "_allgather_base",
                                             "allgather_into_tensor_coalesced",
                                             "allgather_coalesced",
                                             "gather",
                                             "scatter",
                                             "reduce_scatter",
                                             "_reduce_scatter_base",
                                             "reduce_scatter_tensor_coalesced",
                                             "alltoall_base",
                                             "alltoall",
                                             "barrier"};
  REQUIRE(backend->calls.size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& call = backend->calls[i];
    INFO(expected[i]);
    CHECK(call.name == expected[i]);
  }
  // The caller's tensors themselves (no copies), and the options as given.
  const auto& calls = backend->calls;
  CHECK(calls[0].first.is_same(a));
  CHECK(calls[0].root == 1);
  CHECK(calls[1].redOp == c10d::ReduceOp::MAX);
  CHECK(calls[2].redOp == c10d::ReduceOp::MAX);
  CHECK((calls[3].root == 1 && calls[3].redOp == c10d::ReduceOp::MAX));
  CHECK(calls[4].first.is_same(b));
  CHECK(calls[5].first.is_same(b));
  CHECK(calls[8].root == 1);
  CHECK(calls[9].root == 1);
  CHECK(calls[11].redOp == c10d::ReduceOp::MAX);
  CHECK(calls[13].splits == std::vector<int64_t>{3, 5});
}

TEST_CASE("an Op tells a route what kind of call it is and what its work holds", "[routes]") {
  const at::Tensor piece = at::ones({2, 3});
  const at::Tensor whole = at::zeros({6, 3});
  // The flat allgather's work holds each rank's piece, as Gloo's future does.
  const Op gather = Op::allgatherBase(whole, piece, {});
  CHECK(gather.kind == OpKind::kAllgatherBase);
  CHECK(gather.type == OpType::_ALLGATHER_BASE);
  CHECK(std::string(gather.title) == "all_gather_into_tensor");
  REQUIRE(gather.result.size() == 3);
  CHECK(gather.result[1].sizes() == piece.sizes());
  CHECK(gather.result[1].data_ptr() == whole[2].data_ptr());
  // Not a concatenation of pieces (Gloo raises its own error): the output itself.
  const Op stacked = Op::allgatherBase(at::zeros({3, 2, 3}), piece, {});
  REQUIRE(stacked.result.size() == 1);

  // Both coalesced forms are COALESCED to c10d; the kinds tell them apart.
  const Op agc = Op::allgatherIntoTensorCoalesced({whole}, {piece}, {});
  const Op rsc = Op::reduceScatterTensorCoalesced({piece}, {whole}, {});
  CHECK(agc.type == rsc.type);
  CHECK(agc.kind != rsc.kind);
  // Reduce-scatters have no future, as Gloo's; everything else has one.
  CHECK_FALSE(rsc.withFuture);
  CHECK_FALSE(Op::reduceScatterBase(piece, whole, {}).withFuture);
  CHECK(agc.withFuture);

  c10d::AllreduceOptions sync;
  sync.asyncOp = false;
  sync.timeout = std::chrono::milliseconds(1234);
  const Op ar = Op::allreduce({piece}, sync);
  CHECK_FALSE(ar.asyncOp);
  CHECK(ar.timeout == std::chrono::milliseconds(1234));
  CHECK_FALSE(ar.asReduceScatter.has_value());
}

TEST_CASE("a raw route is the backend's rank, size and timeout; its helpers are one-tensor ops",
          "[routes]") {
  auto backend = c10::make_intrusive<RecordingBackend>();
  xcomm::RawRoute route(backend);
  CHECK(route.rank() == 1);
  CHECK(route.size() == 2);
  CHECK(route.name() == "recording");
  // A backend without options: c10d's default.
  CHECK(route.timeout() == std::chrono::minutes(30));
  route.setTimeout(std::chrono::milliseconds(250));
  CHECK(route.timeout() == std::chrono::milliseconds(250));
  CHECK(backend->timeout_ == std::chrono::milliseconds(250));

  const at::Tensor t = at::ones({4});
  const at::Tensor out = at::zeros({8});
  route.allreduce(t, {});
  route.allgather(out, t, {});
  route.alltoall(out, t, {});
  REQUIRE(backend->calls.size() == 3);
  CHECK(backend->calls[0].name == "allreduce");
  CHECK(backend->calls[0].first.is_same(t));
  CHECK(backend->calls[1].name == "_allgather_base");
  CHECK(backend->calls[2].name == "alltoall_base");
  CHECK(backend->calls[2].splits.empty());  // even pieces
}
