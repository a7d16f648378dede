#include "backend/StoreRoute.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "backend/TensorLists.hpp"
#include "backend/XcommWork.hpp"
#include "collectives/store/FlatCollectives.hpp"

namespace xcomm {
namespace {

// `n`-element slices of flat `t`, one per rank.
std::vector<at::Tensor> slicesPerRank(const at::Tensor& t, int size, int64_t n) {
  std::vector<at::Tensor> slices;
  for (int r = 0; r < size; ++r) slices.push_back(t.view({-1}).narrow(0, r * n, n));
  return slices;
}

// A flat tensor's rows for each rank: `splits`, or even ones when empty.
std::vector<at::Tensor> rowsPerRank(const at::Tensor& t, const std::vector<int64_t>& splits,
                                    int size) {
  if (!splits.empty()) return t.split_with_sizes(splits);
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  return t.split_with_sizes(std::vector<int64_t>(size, rows / size));
}

std::string part(const std::string& channel, size_t i) {
  return channel + "." + std::to_string(i);
}

}  // namespace

StoreRoute::StoreRoute(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout)
    : InnerRoute(rank, size),
      transport_(c10::make_intrusive<c10d::PrefixStore>("xcomm/store", store), rank, size),
      timeoutMs_(timeout.count()) {}

StoreRoute::~StoreRoute() {
  shutdown();
}

void StoreRoute::shutdown() {
  collectives_.shutdown();
  receives_.shutdown();
}

std::string StoreRoute::nextChannel() {
  std::lock_guard<std::mutex> lock(seqMutex_);
  return "c" + std::to_string(collectiveSeq_++);
}

std::string StoreRoute::p2pChannel(int src, int dst, int tag, uint64_t n) const {
  return "p" + std::to_string(src) + "-" + std::to_string(dst) + "." + std::to_string(tag) + "." +
         std::to_string(n);
}

c10::intrusive_ptr<c10d::Work> StoreRoute::run(Op op) {
  // The channel is drawn on the caller's thread: ranks call collectives in
  // one order, so the n-th op has channel n on every rank.
  const std::string channel = nextChannel();
  const auto limit = op.timeout == c10d::kUnsetTimeout ? timeout() : op.timeout;
  auto work = c10::make_intrusive<FutureWork>(rank_, op.type, profilingTitle("store:", op.title),
                                              c10::IValue(op.result), tensorListType());
  collectives_.submit(finishing(work, [this, op = std::move(op), channel, limit]() mutable {
    runFlat(op, channel, limit);
    return -1;
  }));
  return work;
}

void StoreRoute::runFlat(Op& op, const std::string& ch, std::chrono::milliseconds limit) {
  const auto redOp = op.reduceOp.op_;
  const int root = static_cast<int>(op.root);
  switch (op.kind) {
    case OpKind::kBroadcast:
      for (size_t i = 0; i < op.inputs.size(); ++i)
        flat::broadcast(transport_, part(ch, i), op.inputs[i], root, limit);
      return;
    case OpKind::kAllreduce:
    case OpKind::kAllreduceCoalesced:
      for (size_t i = 0; i < op.inputs.size(); ++i)
        flat::allreduce(transport_, part(ch, i), op.inputs[i], redOp, limit);
      return;
    case OpKind::kReduce:
      flat::reduce(transport_, ch, op.inputs[0], root, redOp, limit);
      return;
    case OpKind::kAllgather:
      for (size_t i = 0; i < op.inputs.size(); ++i)
        flat::allgather(transport_, part(ch, i), op.inputs[i], op.outputLists[i], limit);
      return;
    case OpKind::kAllgatherCoalesced:
      // c10d's lists are per rank here (outputLists[r][i]); the algorithm's per input.
      for (size_t i = 0; i < op.inputs.size(); ++i) {
        std::vector<at::Tensor> fromRanks;
        for (const auto& ofRank : op.outputLists) fromRanks.push_back(ofRank[i]);
        flat::allgather(transport_, part(ch, i), op.inputs[i], fromRanks, limit);
      }
      return;
    case OpKind::kAllgatherBase:
    case OpKind::kAllgatherIntoTensorCoalesced:
      for (size_t i = 0; i < op.inputs.size(); ++i) {
        auto slices = slicesPerRank(op.outputs[i], size_, op.inputs[i].numel());
        flat::allgather(transport_, part(ch, i), op.inputs[i].view({-1}), slices, limit);
      }
      return;
    case OpKind::kGather: {
      std::vector<at::Tensor> rootOutputs;
      if (!op.outputLists.empty()) rootOutputs = op.outputLists[0];
      flat::gather(transport_, ch, op.inputs[0], rootOutputs, root, limit);
      return;
    }
    case OpKind::kScatter: {
      std::vector<at::Tensor> rootInputs;
      if (!op.inputLists.empty()) rootInputs = op.inputLists[0];
      flat::scatter(transport_, ch, op.outputs[0], rootInputs, root, limit);
      return;
    }
    case OpKind::kReduceScatter:
      for (size_t i = 0; i < op.outputs.size(); ++i)
        flat::reduceScatter(transport_, part(ch, i), op.outputs[i], op.inputLists[i], redOp, limit);
      return;
    case OpKind::kReduceScatterBase:
    case OpKind::kReduceScatterTensorCoalesced:
      for (size_t i = 0; i < op.outputs.size(); ++i) {
        at::Tensor out = op.outputs[i].view({-1});
        flat::reduceScatter(transport_, part(ch, i), out,
                            slicesPerRank(op.inputs[i], size_, out.numel()), redOp, limit);
      }
      return;
    case OpKind::kAlltoallBase: {
      auto outputs = rowsPerRank(op.outputs[0], op.outputSplits, size_);
      auto inputs = rowsPerRank(op.inputs[0], op.inputSplits, size_);
      flat::alltoall(transport_, ch, outputs, inputs, limit);
      return;
    }
    case OpKind::kAlltoall:
      flat::alltoall(transport_, ch, op.outputs, op.inputs, limit);
      return;
    case OpKind::kBarrier:
      flat::barrier(transport_, ch, limit);
      return;
  }
  TORCH_CHECK(false, "xcomm's store route has no algorithm for ", op.title);
}

c10::intrusive_ptr<c10d::Work> StoreRoute::send(std::vector<at::Tensor>& tensors, int dstRank,
                                                int tag) {
  uint64_t n;
  {
    std::lock_guard<std::mutex> lock(seqMutex_);
    n = sent_[{dstRank, tag}]++;
  }
  const at::Tensor& t = tensors[0];
  // A store write does not wait for the receiver, so a send completes at once.
  transport_.send(dstRank, p2pChannel(rank_, dstRank, tag, n), t.data_ptr(),
                  t.numel() * t.element_size());
  auto work = c10::make_intrusive<FutureWork>(rank_, c10d::OpType::SEND, "store:send",
                                              c10::IValue(tensors), tensorListType());
  work->markSucceeded();
  return work;
}

c10::intrusive_ptr<c10d::Work> StoreRoute::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                int tag) {
  auto work = c10::make_intrusive<FutureWork>(rank_, c10d::OpType::RECV, "store:recv",
                                              c10::IValue(tensors), tensorListType());
  receives_.submit(finishing(work, [this, tensors, srcRank, tag]() mutable {
    at::Tensor& t = tensors[0];
    const uint64_t n = received_[{srcRank, tag}]++;
    transport_.recv(srcRank, p2pChannel(srcRank, rank_, tag, n), t.data_ptr(),
                    t.numel() * t.element_size(), timeout());
    return srcRank;
  }));
  return work;
}

c10::intrusive_ptr<c10d::Work> StoreRoute::recvAnysource(std::vector<at::Tensor>& tensors,
                                                         int tag) {
  auto work =
      c10::make_intrusive<FutureWork>(rank_, c10d::OpType::RECVANYSOURCE, "store:recv_any_source",
                                      c10::IValue(tensors), tensorListType());
  receives_.submit(finishing(work, [this, tensors, tag]() mutable {
    at::Tensor& t = tensors[0];
    std::vector<int> sources;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) sources.push_back(r);
    const int src = transport_.recvAny(
        sources,
        [&](int s) {
          return p2pChannel(s, rank_, tag, received_[{s, tag}]);
        },
        t.data_ptr(), t.numel() * t.element_size(), timeout());
    received_[{src, tag}]++;
    return src;
  }));
  return work;
}

void StoreRoute::monitoredBarrier(const c10d::BarrierOptions& /*opts*/, bool /*waitAllRanks*/) {
  TORCH_CHECK(false, "Backend ", name(),
              " does not support monitoredBarrier, only GLOO supports monitored barrier.");
}

}  // namespace xcomm
