#include "collectives/gloo/AlltoallReduceScatter.hpp"

#include <vector>

#include "collectives/reduce/ReduceKernels.hpp"
#include "collectives/reduce/VectorReduce.hpp"

namespace xcomm {

bool AlltoallReduceScatter::applies(const at::Tensor& output, const at::Tensor& input,
                                    const c10d::ReduceScatterOptions& opts) const {
  const auto op = opts.reduceOp.op_;
  const bool elementwise = op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::AVG ||
                           op == c10d::ReduceOp::MAX || op == c10d::ReduceOp::MIN ||
                           op == c10d::ReduceOp::PRODUCT;
  // The input must be the outputs laid end to end along dim 0, as Gloo
  // insists (it refuses other shapes; so does xcomm, by leaving them to it).
  const bool concat = input.dim() > 0 && output.dim() > 0 &&
                      input.size(0) == output.size(0) * size_ &&
                      input.sizes().slice(1) == output.sizes().slice(1);
  return size_ > 1 && elementwise && concat && input.device().is_cpu() &&
         input.layout() == at::kStrided && input.is_contiguous() && output.is_contiguous() &&
         input.numel() > 0 && vectorReduceSupports(input.scalar_type()) &&
         reduceOpSupports(op, input.scalar_type());
}

c10::intrusive_ptr<c10d::Work> AlltoallReduceScatter::start(Route& transport,
                                                            const at::Tensor& output,
                                                            const at::Tensor& input,
                                                            const c10d::ReduceScatterOptions& opts,
                                                            std::function<void()>& finalize) const {
  const int64_t rowElems = input.numel() / size_;
  at::Tensor rows = input.view({size_, rowElems});
  at::Tensor received = at::empty_like(rows);
  c10d::AllToAllOptions a2a;  // equal splits along dim 0: row j to rank j
  a2a.timeout = opts.timeout;
  const auto op = opts.reduceOp.op_;
  Op alltoall = Op::alltoallBase(received, rows, {}, {}, a2a);
  alltoall.asReduceScatter = op;
  auto work = transport.run(std::move(alltoall));
  finalize = [output = at::Tensor(output), received, rows, rowElems, op, size = size_]() mutable {
    std::vector<const void*> srcs;
    srcs.reserve(size);
    for (int j = 0; j < size; ++j) srcs.push_back(received[j].data_ptr());
    reduceBuffers(output.data_ptr(), srcs.data(), size, rowElems, output.scalar_type(), op);
    finishReduction(output, op, size);
  };
  return work;
}

}  // namespace xcomm
