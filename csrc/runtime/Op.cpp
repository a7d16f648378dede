#include "runtime/Op.hpp"

#include <utility>

namespace xcomm {
namespace {

std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> all;
  for (const auto& list : lists) all.insert(all.end(), list.begin(), list.end());
  return all;
}

// The flat allgather's result as Gloo's future holds it: each rank's piece
// of `output` (rows shaped like `input`), or `output` itself where it is not
// such a concatenation (Gloo then raises its own error).
std::vector<at::Tensor> piecesOf(const at::Tensor& output, const at::Tensor& input) {
  if (output.dim() == 0 || input.dim() == 0 || input.size(0) == 0 ||
      output.size(0) % input.size(0) != 0 || output.sizes().slice(1) != input.sizes().slice(1)) {
    return {output};
  }
  std::vector<at::Tensor> pieces;
  const int64_t rows = input.size(0);
  for (int64_t at = 0; at < output.size(0); at += rows)
    pieces.push_back(output.narrow(0, at, rows));
  return pieces;
}

Op made(OpKind kind, c10d::OpType type, const char* title, std::chrono::milliseconds timeout,
        bool asyncOp) {
  Op op;
  op.kind = kind;
  op.type = type;
  op.title = title;
  op.timeout = timeout;
  op.asyncOp = asyncOp;
  return op;
}

}  // namespace

// Each factory moves the caller's lists into the Op; its `call` keeps the
// options only and hands the Op's own lists to the c10d call (which takes
// them by non-const reference), so a list is held once.

Op Op::broadcast(std::vector<at::Tensor> tensors, const c10d::BroadcastOptions& opts) {
  Op op =
      made(OpKind::kBroadcast, c10d::OpType::BROADCAST, "broadcast", opts.timeout, opts.asyncOp);
  op.result = tensors;
  op.inputs = std::move(tensors);
  op.root = opts.rootRank;
  op.rootTensor = opts.rootTensor;
  op.call = [opts](c10d::Backend& b, Op& self) { return b.broadcast(self.inputs, opts); };
  return op;
}

Op Op::allreduce(std::vector<at::Tensor> tensors, const c10d::AllreduceOptions& opts) {
  Op op =
      made(OpKind::kAllreduce, c10d::OpType::ALLREDUCE, "all_reduce", opts.timeout, opts.asyncOp);
  op.result = tensors;
  op.inputs = std::move(tensors);
  op.reduceOp = opts.reduceOp;
  op.call = [opts](c10d::Backend& b, Op& self) { return b.allreduce(self.inputs, opts); };
  return op;
}

Op Op::allreduceCoalesced(std::vector<at::Tensor> tensors,
                          const c10d::AllreduceCoalescedOptions& opts) {
  Op op = made(OpKind::kAllreduceCoalesced, c10d::OpType::ALLREDUCE_COALESCED,
               "all_reduce_coalesced", opts.timeout, opts.asyncOp);
  op.result = tensors;
  op.inputs = std::move(tensors);
  op.reduceOp = opts.reduceOp;
  op.call = [opts](c10d::Backend& b, Op& self) { return b.allreduce_coalesced(self.inputs, opts); };
  return op;
}

Op Op::reduce(std::vector<at::Tensor> tensors, const c10d::ReduceOptions& opts) {
  Op op = made(OpKind::kReduce, c10d::OpType::REDUCE, "reduce", opts.timeout, opts.asyncOp);
  op.result = tensors;
  op.inputs = std::move(tensors);
  op.reduceOp = opts.reduceOp;
  op.root = opts.rootRank;
  op.rootTensor = opts.rootTensor;
  op.call = [opts](c10d::Backend& b, Op& self) { return b.reduce(self.inputs, opts); };
  return op;
}

Op Op::allgather(std::vector<std::vector<at::Tensor>> outputs, std::vector<at::Tensor> inputs,
                 const c10d::AllgatherOptions& opts) {
  Op op =
      made(OpKind::kAllgather, c10d::OpType::ALLGATHER, "all_gather", opts.timeout, opts.asyncOp);
  op.result = flat(outputs);
  op.inputs = std::move(inputs);
  op.outputLists = std::move(outputs);
  op.call = [opts](c10d::Backend& b, Op& self) {
    return b.allgather(self.outputLists, self.inputs, opts);
  };
  return op;
}

Op Op::allgatherBase(at::Tensor output, at::Tensor input, const c10d::AllgatherOptions& opts) {
  Op op = made(OpKind::kAllgatherBase, c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor",
               opts.timeout, opts.asyncOp);
  op.inputs = {input};
  op.outputs = {output};
  op.result = piecesOf(output, input);
  op.call = [opts](c10d::Backend& b, Op& self) {
    return b._allgather_base(self.outputs[0], self.inputs[0], opts);
  };
  return op;
}

Op Op::allgatherIntoTensorCoalesced(std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
                                    const c10d::AllgatherOptions& opts) {
  Op op = made(OpKind::kAllgatherIntoTensorCoalesced, c10d::OpType::COALESCED,
               "all_gather_into_tensor_coalesced", opts.timeout, opts.asyncOp);
  op.result = outputs;
  op.inputs = std::move(inputs);
  op.outputs = std::move(outputs);
  op.call = [opts](c10d::Backend& b, Op& self) {
    return b.allgather_into_tensor_coalesced(self.outputs, self.inputs, opts);
  };
  return op;
}

Op Op::allgatherCoalesced(std::vector<std::vector<at::Tensor>> outputs,
                          std::vector<at::Tensor> inputs, const c10d::AllgatherOptions& opts) {
  Op op = made(OpKind::kAllgatherCoalesced, c10d::OpType::ALLGATHER_COALESCED,
               "all_gather_coalesced", opts.timeout, opts.asyncOp);
  op.result = flat(outputs);
  op.inputs = std::move(inputs);
  op.outputLists = std::move(outputs);
  op.call = [opts](c10d::Backend& b, Op& self) {
    return b.allgather_coalesced(self.outputLists, self.inputs, opts);
  };
  return op;
}

Op Op::gather(std::vector<std::vector<at::Tensor>> outputs, std::vector<at::Tensor> inputs,
              const c10d::GatherOptions& opts) {
  Op op = made(OpKind::kGather, c10d::OpType::GATHER, "gather", opts.timeout, opts.asyncOp);
  op.result = flat(outputs);
  op.inputs = std::move(inputs);
  op.outputLists = std::move(outputs);
  op.root = opts.rootRank;
  op.call = [opts](c10d::Backend& b, Op& self) {
    return b.gather(self.outputLists, self.inputs, opts);
  };
  return op;
}

Op Op::scatter(std::vector<at::Tensor> outputs, std::vector<std::vector<at::Tensor>> inputs,
               const c10d::ScatterOptions& opts) {
  Op op = made(OpKind::kScatter, c10d::OpType::SCATTER, "scatter", opts.timeout, opts.asyncOp);
  op.result = outputs;
  op.inputLists = std::move(inputs);
  op.outputs = std::move(outputs);
  op.root = opts.rootRank;
  op.call = [opts](c10d::Backend& b, Op& self) {
    return b.scatter(self.outputs, self.inputLists, opts);
  };
  return op;
}

Op Op::reduceScatter(std::vector<at::Tensor> outputs, std::vector<std::vector<at::Tensor>> inputs,
                     const c10d::ReduceScatterOptions& opts) {
  Op op = made(OpKind::kReduceScatter, c10d::OpType::REDUCE_SCATTER, "reduce_scatter", opts.timeout,
               opts.asyncOp);
  op.result = outputs;
  op.inputLists = std::move(inputs);
  op.outputs = std::move(outputs);
  op.reduceOp = opts.reduceOp;
  op.withFuture = false;
  op.call = [opts](c10d::Backend& b, Op& self) {
    return b.reduce_scatter(self.outputs, self.inputLists, opts);
  };
  return op;
}

Op Op::reduceScatterBase(at::Tensor output, at::Tensor input,
                         const c10d::ReduceScatterOptions& opts) {
  Op op = made(OpKind::kReduceScatterBase, c10d::OpType::_REDUCE_SCATTER_BASE,
               "reduce_scatter_tensor", opts.timeout, opts.asyncOp);
  op.inputs = {input};
  op.outputs = {output};
  op.result = {output};
  op.reduceOp = opts.reduceOp;
  op.withFuture = false;
  op.call = [opts](c10d::Backend& b, Op& self) {
    return b._reduce_scatter_base(self.outputs[0], self.inputs[0], opts);
  };
  return op;
}

Op Op::reduceScatterTensorCoalesced(std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
                                    const c10d::ReduceScatterOptions& opts) {
  Op op = made(OpKind::kReduceScatterTensorCoalesced, c10d::OpType::COALESCED,
               "reduce_scatter_tensor_coalesced", opts.timeout, opts.asyncOp);
  op.result = outputs;
  op.inputs = std::move(inputs);
  op.outputs = std::move(outputs);
  op.reduceOp = opts.reduceOp;
  op.withFuture = false;
  op.call = [opts](c10d::Backend& b, Op& self) {
    return b.reduce_scatter_tensor_coalesced(self.outputs, self.inputs, opts);
  };
  return op;
}

Op Op::alltoallBase(at::Tensor output, at::Tensor input, std::vector<int64_t> outputSplits,
                    std::vector<int64_t> inputSplits, const c10d::AllToAllOptions& opts) {
  Op op = made(OpKind::kAlltoallBase, c10d::OpType::ALLTOALL_BASE, "all_to_all_single",
               opts.timeout, opts.asyncOp);
  op.inputs = {input};
  op.outputs = {output};
  op.result = {output};
  op.inputSplits = std::move(inputSplits);
  op.outputSplits = std::move(outputSplits);
  op.call = [opts](c10d::Backend& b, Op& self) {
    return b.alltoall_base(self.outputs[0], self.inputs[0], self.outputSplits, self.inputSplits,
                           opts);
  };
  return op;
}

Op Op::alltoall(std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
                const c10d::AllToAllOptions& opts) {
  Op op = made(OpKind::kAlltoall, c10d::OpType::ALLTOALL, "all_to_all", opts.timeout, opts.asyncOp);
  op.result = outputs;
  op.inputs = std::move(inputs);
  op.outputs = std::move(outputs);
  op.call = [opts](c10d::Backend& b, Op& self) {
    return b.alltoall(self.outputs, self.inputs, opts);
  };
  return op;
}

Op Op::barrier(const c10d::BarrierOptions& opts) {
  Op op = made(OpKind::kBarrier, c10d::OpType::BARRIER, "barrier", opts.timeout, opts.asyncOp);
  op.call = [opts](c10d::Backend& b, Op&) { return b.barrier(opts); };
  return op;
}

}  // namespace xcomm
