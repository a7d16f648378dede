#include "backend/StoreCpuBackend.hpp"

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

}  // namespace

StoreCpuBackend::StoreCpuBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 std::chrono::milliseconds timeout)
    : Backend(rank, size),
      transport_(c10::make_intrusive<c10d::PrefixStore>("xcomm/store", store), rank, size),
      timeout_(timeout) {}

StoreCpuBackend::~StoreCpuBackend() {
  shutdown();
}

void StoreCpuBackend::shutdown() {
  collectives_.shutdown();
  p2p_.shutdown();
}

std::string StoreCpuBackend::nextChannel() {
  std::lock_guard<std::mutex> lock(seqMutex_);
  return "c" + std::to_string(collectiveSeq_++);
}

std::chrono::milliseconds StoreCpuBackend::timeoutOf(std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? timeout_ : requested;
}

std::string StoreCpuBackend::p2pChannel(int src, int dst, int tag, uint64_t n) const {
  return "p" + std::to_string(src) + "-" + std::to_string(dst) + "." + std::to_string(tag) + "." +
         std::to_string(n);
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::enqueue(OrderedRunner& runner, c10d::OpType type,
                                                        const char* title,
                                                        std::vector<at::Tensor> outputs,
                                                        Body body) {
  auto work = c10::make_intrusive<FutureWork>(rank_, type, title, c10::IValue(std::move(outputs)),
                                              tensorListType());
  runner.submit(finishing(work, std::move(body)));
  return work;
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  auto ch = nextChannel();
  auto timeout = timeoutOf(opts.timeout);
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(collectives_, c10d::OpType::BROADCAST, "store:broadcast", tensors,
                 [this, ch, tensors, root, timeout]() mutable {
                   for (size_t i = 0; i < tensors.size(); ++i)
                     flat::broadcast(transport_, ch + "." + std::to_string(i), tensors[i], root,
                                     timeout);
                   return -1;
                 });
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  auto ch = nextChannel();
  auto timeout = timeoutOf(opts.timeout);
  const auto op = opts.reduceOp.op_;
  return enqueue(collectives_, c10d::OpType::ALLREDUCE, "store:all_reduce", tensors,
                 [this, ch, tensors, op, timeout]() mutable {
                   for (size_t i = 0; i < tensors.size(); ++i)
                     flat::allreduce(transport_, ch + "." + std::to_string(i), tensors[i], op,
                                     timeout);
                   return -1;
                 });
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  auto ch = nextChannel();
  auto timeout = timeoutOf(opts.timeout);
  const auto op = opts.reduceOp.op_;
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(collectives_, c10d::OpType::REDUCE, "store:reduce", tensors,
                 [this, ch, tensors, root, op, timeout]() mutable {
                   flat::reduce(transport_, ch, tensors[0], root, op, timeout);
                   return -1;
                 });
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto ch = nextChannel();
  auto timeout = timeoutOf(opts.timeout);
  return enqueue(collectives_, c10d::OpType::ALLGATHER, "store:all_gather", flatten(outputs),
                 [this, ch, outputs, inputs, timeout]() mutable {
                   for (size_t i = 0; i < inputs.size(); ++i)
                     flat::allgather(transport_, ch + "." + std::to_string(i), inputs[i],
                                     outputs[i], timeout);
                   return -1;
                 });
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  std::vector<std::vector<at::Tensor>> outputs{slicesPerRank(output, size_, input.numel())};
  std::vector<at::Tensor> inputs{input.view({-1})};
  return allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  auto ch = nextChannel();
  auto timeout = timeoutOf(opts.timeout);
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> rootOutputs = outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
  return enqueue(collectives_, c10d::OpType::GATHER, "store:gather", rootOutputs,
                 [this, ch, rootOutputs, inputs, root, timeout]() mutable {
                   flat::gather(transport_, ch, inputs[0], rootOutputs, root, timeout);
                   return -1;
                 });
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  auto ch = nextChannel();
  auto timeout = timeoutOf(opts.timeout);
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> rootInputs = inputs.empty() ? std::vector<at::Tensor>{} : inputs[0];
  return enqueue(collectives_, c10d::OpType::SCATTER, "store:scatter", outputs,
                 [this, ch, outputs, rootInputs, root, timeout]() mutable {
                   flat::scatter(transport_, ch, outputs[0], rootInputs, root, timeout);
                   return -1;
                 });
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  auto ch = nextChannel();
  auto timeout = timeoutOf(opts.timeout);
  const auto op = opts.reduceOp.op_;
  return enqueue(collectives_, c10d::OpType::REDUCE_SCATTER, "store:reduce_scatter", outputs,
                 [this, ch, outputs, inputs, op, timeout]() mutable {
                   for (size_t i = 0; i < outputs.size(); ++i)
                     flat::reduceScatter(transport_, ch + "." + std::to_string(i), outputs[i],
                                         inputs[i], op, timeout);
                   return -1;
                 });
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outputs{output.view({-1})};
  std::vector<std::vector<at::Tensor>> inputs{slicesPerRank(input, size_, output.numel())};
  return reduce_scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& outputSplits,
                                                              std::vector<int64_t>& inputSplits,
                                                              const c10d::AllToAllOptions& opts) {
  auto rowsOf = [this](const at::Tensor& t, const std::vector<int64_t>& splits) {
    return splits.empty() ? std::vector<int64_t>(size_, (t.dim() == 0 ? 1 : t.size(0)) / size_)
                          : splits;
  };
  std::vector<at::Tensor> outputs = output.split_with_sizes(rowsOf(output, outputSplits));
  std::vector<at::Tensor> inputs = input.split_with_sizes(rowsOf(input, inputSplits));
  return alltoall(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  auto ch = nextChannel();
  auto timeout = timeoutOf(opts.timeout);
  return enqueue(collectives_, c10d::OpType::ALLTOALL, "store:all_to_all", outputs,
                 [this, ch, outputs, inputs, timeout]() mutable {
                   flat::alltoall(transport_, ch, outputs, inputs, timeout);
                   return -1;
                 });
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::send(std::vector<at::Tensor>& tensors, int dstRank,
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

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                     int tag) {
  return enqueue(p2p_, c10d::OpType::RECV, "store:recv", tensors,
                 [this, tensors, srcRank, tag]() mutable {
                   at::Tensor& t = tensors[0];
                   const uint64_t n = received_[{srcRank, tag}]++;
                   transport_.recv(srcRank, p2pChannel(srcRank, rank_, tag, n), t.data_ptr(),
                                   t.numel() * t.element_size(), timeout_);
                   return srcRank;
                 });
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                              int tag) {
  return enqueue(p2p_, c10d::OpType::RECVANYSOURCE, "store:recv_any_source", tensors,
                 [this, tensors, tag]() mutable {
                   at::Tensor& t = tensors[0];
                   std::vector<int> sources;
                   for (int r = 0; r < size_; ++r)
                     if (r != rank_) sources.push_back(r);
                   const int src = transport_.recvAny(
                       sources,
                       [&](int s) {
                         return p2pChannel(s, rank_, tag, received_[{s, tag}]);
                       },
                       t.data_ptr(), t.numel() * t.element_size(), timeout_);
                   received_[{src, tag}]++;
                   return src;
                 });
}

c10::intrusive_ptr<c10d::Work> StoreCpuBackend::barrier(const c10d::BarrierOptions& opts) {
  auto ch = nextChannel();
  auto timeout = timeoutOf(opts.timeout);
  return enqueue(collectives_, c10d::OpType::BARRIER, "store:barrier", {}, [this, ch, timeout]() {
    flat::barrier(transport_, ch, timeout);
    return -1;
  });
}

}  // namespace xcomm
