#include "backend/ShmRoute.hpp"

#include <c10/util/Exception.h>

#include "backend/TensorLists.hpp"
#include "backend/XcommWork.hpp"
#include "collectives/shm/ShmCollectives.hpp"

namespace xcomm {
namespace {

using Clock = std::chrono::steady_clock;
using RedOp = c10d::ReduceOp::RedOpType;

// The profiler's name of the route's part of an op: "shm:<op>" for what
// shared memory runs, "shm:gloo:<op>" for the agreement plus Gloo's op.
const char* routeTitle(OpKind kind, bool viaGloo) {
#define XCOMM_SHM_TITLE(name) return viaGloo ? "shm:gloo:" name : "shm:" name
  switch (kind) {
    case OpKind::kBroadcast:
      XCOMM_SHM_TITLE("broadcast");
    case OpKind::kAllreduce:
      XCOMM_SHM_TITLE("all_reduce");
    case OpKind::kAllreduceCoalesced:
      XCOMM_SHM_TITLE("all_reduce_coalesced");
    case OpKind::kReduce:
      XCOMM_SHM_TITLE("reduce");
    case OpKind::kAllgather:
      XCOMM_SHM_TITLE("all_gather");
    case OpKind::kAllgatherBase:
      XCOMM_SHM_TITLE("all_gather_into_tensor");
    case OpKind::kAllgatherIntoTensorCoalesced:
      XCOMM_SHM_TITLE("all_gather_into_tensor_coalesced");
    case OpKind::kAllgatherCoalesced:
      XCOMM_SHM_TITLE("all_gather_coalesced");
    case OpKind::kGather:
      XCOMM_SHM_TITLE("gather");
    case OpKind::kScatter:
      XCOMM_SHM_TITLE("scatter");
    case OpKind::kReduceScatter:
      XCOMM_SHM_TITLE("reduce_scatter");
    case OpKind::kReduceScatterBase:
      XCOMM_SHM_TITLE("reduce_scatter_tensor");
    case OpKind::kReduceScatterTensorCoalesced:
      XCOMM_SHM_TITLE("reduce_scatter_tensor_coalesced");
    case OpKind::kAlltoallBase:
      XCOMM_SHM_TITLE("all_to_all_single");
    case OpKind::kAlltoall:
      XCOMM_SHM_TITLE("all_to_all");
    case OpKind::kBarrier:
      XCOMM_SHM_TITLE("barrier");
  }
#undef XCOMM_SHM_TITLE
  return viaGloo ? "shm:gloo:op" : "shm:op";
}

// The rows of `t` (dim 0) that go to or come from each rank, as views:
// `splits` rows each, or an equal share when `splits` is empty. Empty when
// `t` has no rows to split or the splits do not describe it (the fallback
// then raises its own error).
std::vector<at::Tensor> splitRows(const at::Tensor& t, const std::vector<int64_t>& splits,
                                  int size) {
  if (t.dim() == 0) return {};
  std::vector<at::Tensor> pieces;
  int64_t offset = 0;
  for (int r = 0; r < size; ++r) {
    int64_t rows = 0;
    if (splits.empty()) {
      if (t.size(0) % size != 0) return {};
      rows = t.size(0) / size;
    } else {
      if (static_cast<int>(splits.size()) != size || splits[r] < 0) return {};
      rows = splits[r];
    }
    if (offset + rows > t.size(0)) return {};
    pieces.push_back(t.narrow(0, offset, rows));
    offset += rows;
  }
  if (offset != t.size(0)) return {};
  return pieces;
}

// Whether `size` inputs and outputs all have the shape of inputs[0].
bool sameShapes(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                int size) {
  if (static_cast<int>(inputs.size()) != size || static_cast<int>(outputs.size()) != size) {
    return false;
  }
  for (int r = 0; r < size; ++r) {
    if (inputs[r].sizes() != inputs[0].sizes() || outputs[r].sizes() != inputs[0].sizes()) {
      return false;
    }
  }
  return true;
}

// The shared-memory agreement's descriptor of an op the fallback runs: what
// the checked route compares too (op, dtype, reduce op, root, bytes); an
// all-to-all's sizes may differ between ranks, so only its op and dtype.
ShmTransport::Descriptor fallbackCall(const Op& op) {
  const bool reduction = op.kind == OpKind::kAllreduce || op.kind == OpKind::kAllreduceCoalesced ||
                         op.kind == OpKind::kReduce || op.kind == OpKind::kReduceScatter ||
                         op.kind == OpKind::kReduceScatterBase ||
                         op.kind == OpKind::kReduceScatterTensorCoalesced;
  const bool alltoall = op.kind == OpKind::kAlltoallBase || op.kind == OpKind::kAlltoall;
  // What the op's caller contributes: the outputs of a scatter or reduce-scatter.
  const bool byOutputs = op.kind == OpKind::kScatter || op.kind == OpKind::kReduceScatter ||
                         op.kind == OpKind::kReduceScatterBase ||
                         op.kind == OpKind::kReduceScatterTensorCoalesced;
  const auto& tensors = byOutputs ? op.outputs : op.inputs;
  const c10d::ReduceOp none;
  const auto& reduceOp = reduction ? op.reduceOp : none;
  const int redOp = reduction ? static_cast<int>(op.reduceOp.op_) : 0;
  const int root = op.root >= 0 ? static_cast<int>(op.root) : 0;
  return {shm::detail::describe(shm::detail::OpCode::kFallback, dtypeOf(tensors, reduceOp), redOp,
                                root, static_cast<int>(op.type)),
          alltoall ? 0 : denseBytes(tensors, reduceOp)};
}

}  // namespace

ShmRouteBase::ShmRouteBase(std::unique_ptr<ShmTransport> transport, int rank, int size,
                           std::shared_ptr<Route> fallback, std::chrono::milliseconds timeout,
                           Config config)
    : Route(rank, size),
      transport_(std::move(transport)),
      fallback_(std::move(fallback)),
      timeoutMs_(timeout.count()),
      config_(config) {
  TORCH_CHECK(transport_ && fallback_, "xcomm shm: a transport and a fallback route are required");
  TORCH_CHECK(fallback_->rank() == rank_ && fallback_->size() == size_,
              "xcomm shm: the fallback route's rank/size differ from the group's");
}

ShmRouteBase::~ShmRouteBase() = default;

void ShmRouteBase::setTimeout(std::chrono::milliseconds timeout) {
  timeoutMs_ = timeout.count();
  fallback_->setTimeout(timeout);
}

void ShmRouteBase::shutdown() {
  runner_.shutdown();
  transport_->depart();  // after this rank's own ops: peers waiting for more fail at once
  fallback_->shutdown();
}

void ShmRouteBase::abort() {
  transport_->requestAbort();  // a wait in progress fails within one sleep slice
  transport_->depart();        // and the peers' waits for this rank at once
  runner_.stop();              // not joined: it may be in a Gloo fallback op
  fallback_->abort();
}

bool ShmRouteBase::plainCpu(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    if (!t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous()) return false;
  }
  return true;
}

bool ShmRouteBase::reducible(const std::vector<at::Tensor>& tensors, RedOp op) {
  if (!plainCpu(tensors)) return false;
  for (const auto& t : tensors) {
    if (!shm::supports(t.scalar_type(), op)) return false;
  }
  return true;
}

c10::intrusive_ptr<c10d::Work> ShmRouteBase::submit(const Op& op,
                                                    std::function<void(Clock::time_point)> body,
                                                    bool countAsShm) {
  const auto limit =
      op.timeout == c10d::kUnsetTimeout ? std::chrono::milliseconds(timeoutMs_.load()) : op.timeout;
  const char* name = routeTitle(op.kind, /*viaGloo=*/!countAsShm);
  c10::IValue result(op.result);
  c10::intrusive_ptr<FutureWork> work;
  if (op.withFuture) {
    work =
        c10::make_intrusive<FutureWork>(rank_, op.type, name, std::move(result), tensorListType());
  } else {
    work = c10::make_intrusive<FuturelessWork>(rank_, op.type, name, std::move(result),
                                               tensorListType());
  }
  runner_.submit(finishing(work,
                           [this, body = std::move(body), limit, countAsShm] {
                             body(Clock::now() + limit);
                             if (countAsShm) shmOps_++;
                             return -1;
                           }),
                 /*synchronous=*/!op.asyncOp);
  return work;
}

std::shared_ptr<ShmRoute> ShmRoute::tryCreate(ShmTransport::Setup& setup,
                                              std::chrono::milliseconds timeout,
                                              std::shared_ptr<Route> fallback, Config config,
                                              std::string* whyNot) {
  TORCH_CHECK(fallback, "xcomm shm: a fallback route is required");
  auto transport = setup.finish(whyNot);
  if (!transport) return {};
  return std::make_shared<ShmRoute>(std::move(transport), std::move(fallback), timeout, config);
}

ShmRoute::ShmRoute(std::unique_ptr<ShmTransport> transport, std::shared_ptr<Route> fallback,
                   std::chrono::milliseconds timeout, Config config)
    : ShmRouteBase(std::move(transport), fallback ? fallback->rank() : 0,
                   fallback ? fallback->size() : 0, fallback, timeout, config) {
  TORCH_CHECK(transport_->size() == size_ && transport_->rank() == rank_,
              "xcomm shm: a single-host route's segment must span the group");
}

c10::intrusive_ptr<c10d::Work> ShmRoute::viaFallback(Op op) {
  const ShmTransport::Descriptor call = fallbackCall(op);
  // The fallback's work is waited for on the worker: it keeps the group's
  // issue order, and these ops (reduce, gather, scatter, dtypes without a
  // kernel here) are not the ones worth overlapping with the next.
  auto body = [this, call, op](Clock::time_point deadline) mutable {
    shm::agree(*transport_, call, deadline, op.title);
    auto work = fallback_->run(std::move(op));
    if (!work) return;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    work->wait(std::max(left, std::chrono::milliseconds(1)));
  };
  Op shown = op;
  shown.withFuture = true;
  return submit(shown, std::move(body), /*countAsShm=*/false);
}

c10::intrusive_ptr<c10d::Work> ShmRoute::agree(const Op& op) {
  const ShmTransport::Descriptor call = fallbackCall(op);
  Op shown = op;
  shown.asyncOp = true;
  shown.withFuture = true;
  return submit(
      shown,
      [this, call, title = op.title](Clock::time_point deadline) {
        shm::agree(*transport_, call, deadline, title);
      },
      /*countAsShm=*/false);
}

c10::intrusive_ptr<c10d::Work> ShmRoute::run(Op op) {
  const auto& in = op.inputs;
  const auto& out = op.outputs;
  switch (op.kind) {
    case OpKind::kBroadcast: {
      if (!plainCpu(in)) break;
      const int root = static_cast<int>(op.root);
      return submit(op, [this, tensors = in, root](Clock::time_point deadline) mutable {
        for (auto& t : tensors) shm::broadcast(*transport_, t, root, deadline);
      });
    }
    case OpKind::kAllreduce:
    case OpKind::kAllreduceCoalesced: {
      if (!reducible(in, op.reduceOp.op_)) break;
      return submit(
          op, [this, tensors = in, reduceOp = op.reduceOp](Clock::time_point deadline) mutable {
            for (auto& t : tensors) {
              shm::allreduce(*transport_, t, reduceOp, deadline, config_.smallAllreduceBytes);
            }
          });
    }
    case OpKind::kAllgather: {
      if (!plainCpu(in) || !plainCpu(op.result)) break;
      return submit(
          op, [this, outputs = op.outputLists, inputs = in](Clock::time_point deadline) mutable {
            for (size_t i = 0; i < inputs.size(); ++i) {
              shm::allgather(*transport_, inputs[i], outputs[i], deadline);
            }
          });
    }
    case OpKind::kAllgatherBase:
    case OpKind::kAllgatherIntoTensorCoalesced: {
      bool concat = in.size() == out.size();
      for (size_t i = 0; concat && i < in.size(); ++i) concat = concatOf(out[i], in[i], size_);
      if (!concat || !plainCpu(in) || !plainCpu(out)) break;
      std::vector<std::vector<at::Tensor>> lists;
      for (size_t i = 0; i < in.size(); ++i) lists.push_back(piecesPerRank(out[i], in[i], size_));
      return submit(op, [this, lists, inputs = in](Clock::time_point deadline) mutable {
        for (size_t i = 0; i < inputs.size(); ++i) {
          shm::allgather(*transport_, inputs[i], lists[i], deadline);
        }
      });
    }
    case OpKind::kReduceScatter: {
      if (!reducible(out, op.reduceOp.op_) || !plainCpu(flatten(op.inputLists))) break;
      return submit(op, [this, outputs = out, inputs = op.inputLists,
                         reduceOp = op.reduceOp](Clock::time_point deadline) mutable {
        for (size_t i = 0; i < outputs.size(); ++i) {
          shm::reduceScatter(*transport_, outputs[i], inputs[i], reduceOp, deadline);
        }
      });
    }
    case OpKind::kReduceScatterBase:
    case OpKind::kReduceScatterTensorCoalesced: {
      bool concat = in.size() == out.size();
      for (size_t i = 0; concat && i < in.size(); ++i) concat = concatOf(in[i], out[i], size_);
      if (!concat || !reducible(out, op.reduceOp.op_) || !plainCpu(in)) break;
      std::vector<std::vector<at::Tensor>> lists;
      for (size_t i = 0; i < out.size(); ++i) lists.push_back(piecesPerRank(in[i], out[i], size_));
      return submit(op, [this, outputs = out, lists,
                         reduceOp = op.reduceOp](Clock::time_point deadline) mutable {
        for (size_t i = 0; i < outputs.size(); ++i) {
          shm::reduceScatter(*transport_, outputs[i], lists[i], reduceOp, deadline);
        }
      });
    }
    case OpKind::kAlltoallBase: {
      auto sends = splitRows(in[0], op.inputSplits, size_);
      auto recvs = splitRows(out[0], op.outputSplits, size_);
      if (!plainCpu({out[0], in[0]}) || sends.empty() || recvs.empty() ||
          !shm::alltoallFits(*transport_)) {
        break;
      }
      return submit(op, [this, sends, recvs](Clock::time_point deadline) mutable {
        shm::alltoall(*transport_, sends, recvs, deadline, "all_to_all_single");
      });
    }
    case OpKind::kAlltoall: {
      // Gloo takes the list form with one shape throughout and raises
      // otherwise; so does xcomm, on every group shape (uneven pieces:
      // all_to_all_single).
      if (!plainCpu(in) || !plainCpu(out) || !sameShapes(in, out, size_) ||
          !shm::alltoallFits(*transport_)) {
        break;
      }
      return submit(op, [this, outputs = out, inputs = in](Clock::time_point deadline) mutable {
        shm::alltoall(*transport_, inputs, outputs, deadline, "all_to_all");
      });
    }
    case OpKind::kBarrier:
      return submit(op,
                    [this](Clock::time_point deadline) { shm::barrier(*transport_, deadline); });
    case OpKind::kReduce:
    case OpKind::kAllgatherCoalesced:
    case OpKind::kGather:
    case OpKind::kScatter:
      break;
  }
  return viaFallback(std::move(op));
}

}  // namespace xcomm
