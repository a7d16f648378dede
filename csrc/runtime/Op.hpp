#pragma once
// Op: one collective as a Route (runtime/Route.hpp) sees it.
//
// c10d hands a backend its collectives in 16 list-shaped signatures.
// XcommBackend converts each call into an Op once, after its input checks and
// staging, with the factory of the same name below; every route then reads
// the one Op type: what it has an algorithm for (shared memory, a check's
// carried message, point-to-point messages) it runs itself, and the rest it
// hands to `issue`, which runs the op on a whole c10d backend (Gloo, NCCL,
// xcomm's store backend) in the caller's own shape. The algorithms under
// collectives/ use the one-tensor helpers of Route instead.
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace xcomm {

// c10d::OpType names both coalesced forms COALESCED; a route needs them apart.
enum class OpKind {
  kBroadcast,
  kAllreduce,
  kAllreduceCoalesced,
  kReduce,
  kAllgather,
  kAllgatherBase,
  kAllgatherIntoTensorCoalesced,
  kAllgatherCoalesced,
  kGather,
  kScatter,
  kReduceScatter,
  kReduceScatterBase,
  kReduceScatterTensorCoalesced,
  kAlltoallBase,
  kAlltoall,
  kBarrier,
};

struct Op {
  using Call = std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&, Op&)>;

  OpKind kind = OpKind::kBarrier;
  c10d::OpType type = c10d::OpType::UNKNOWN;  // what works and the profiler report
  const char* title = "";                     // c10d's name for it, in errors: "all_reduce"
  // The tensors, in c10d's shapes:
  // - broadcast, allreduce(_coalesced), reduce: `inputs`, in place;
  // - allgather, allgather_coalesced, gather: `inputs` into `outputLists`;
  // - scatter, reduce_scatter: `inputLists` into `outputs`;
  // - the flat and tensor-coalesced forms and both all-to-alls: `inputs`
  //   into `outputs` (one of each for the flat forms).
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> outputs;
  std::vector<std::vector<at::Tensor>> inputLists;
  std::vector<std::vector<at::Tensor>> outputLists;
  std::vector<int64_t> inputSplits;                         // all_to_all_single (empty: even)
  std::vector<int64_t> outputSplits;                        // all_to_all_single (empty: even)
  c10d::ReduceOp reduceOp;                                  // reductions
  int64_t root = -1;                                        // broadcast, reduce, gather, scatter
  int64_t rootTensor = 0;                                   // broadcast, reduce
  std::chrono::milliseconds timeout = c10d::kUnsetTimeout;  // unset: the route's
  bool asyncOp = true;
  // What a work of the op holds as its result, as Gloo's does.
  std::vector<at::Tensor> result;
  // Gloo's reduce-scatters have no future; neither do a route's.
  bool withFuture = true;
  // An all_to_all_single that is how a reduce_scatter_tensor under this
  // reduce op runs (collectives/gloo/AlltoallReduceScatter): a route that
  // checks the ranks' calls checks it as that reduce-scatter, so it and a
  // real all_to_all_single disagree instead of trading rows.
  std::optional<c10d::ReduceOp::RedOpType> asReduceScatter;
  // The c10d call the factory describes, with the caller's options, on this
  // Op's own lists (issue() passes them).
  Call call;

  // The op on a whole c10d backend, in the caller's shape.
  c10::intrusive_ptr<c10d::Work> issue(c10d::Backend& backend) { return call(backend, *this); }

  static Op broadcast(std::vector<at::Tensor> tensors, const c10d::BroadcastOptions& opts);
  static Op allreduce(std::vector<at::Tensor> tensors, const c10d::AllreduceOptions& opts);
  static Op allreduceCoalesced(std::vector<at::Tensor> tensors,
                               const c10d::AllreduceCoalescedOptions& opts);
  static Op reduce(std::vector<at::Tensor> tensors, const c10d::ReduceOptions& opts);
  static Op allgather(std::vector<std::vector<at::Tensor>> outputs, std::vector<at::Tensor> inputs,
                      const c10d::AllgatherOptions& opts);
  static Op allgatherBase(at::Tensor output, at::Tensor input, const c10d::AllgatherOptions& opts);
  static Op allgatherIntoTensorCoalesced(std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> inputs,
                                         const c10d::AllgatherOptions& opts);
  static Op allgatherCoalesced(std::vector<std::vector<at::Tensor>> outputs,
                               std::vector<at::Tensor> inputs, const c10d::AllgatherOptions& opts);
  static Op gather(std::vector<std::vector<at::Tensor>> outputs, std::vector<at::Tensor> inputs,
                   const c10d::GatherOptions& opts);
  static Op scatter(std::vector<at::Tensor> outputs, std::vector<std::vector<at::Tensor>> inputs,
                    const c10d::ScatterOptions& opts);
  static Op reduceScatter(std::vector<at::Tensor> outputs,
                          std::vector<std::vector<at::Tensor>> inputs,
                          const c10d::ReduceScatterOptions& opts);
  static Op reduceScatterBase(at::Tensor output, at::Tensor input,
                              const c10d::ReduceScatterOptions& opts);
  static Op reduceScatterTensorCoalesced(std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> inputs,
                                         const c10d::ReduceScatterOptions& opts);
  static Op alltoallBase(at::Tensor output, at::Tensor input, std::vector<int64_t> outputSplits,
                         std::vector<int64_t> inputSplits, const c10d::AllToAllOptions& opts);
  static Op alltoall(std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
                     const c10d::AllToAllOptions& opts);
  static Op barrier(const c10d::BarrierOptions& opts);
};

}  // namespace xcomm
