#include "backend/InputChecks.hpp"

#include <numeric>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "collectives/reduce/ReduceKernels.hpp"

namespace xcomm::checks {
namespace {

bool deviceSupported(const at::Device& d) {
#ifdef XCOMM_WITH_CUDA
  return d.is_cpu() || d.is_cuda();
#else
  return d.is_cpu();
#endif
}

const char* supportedDevices() {
#ifdef XCOMM_WITH_CUDA
  return "cpu (through Gloo) and cuda (through NCCL)";
#else
  return "cpu only: this xcomm build has no CUDA support (torch has no CUDA)";
#endif
}

void oneTensor(const char* op, const at::Tensor& t, const char* what, size_t index) {
  TORCH_CHECK_VALUE(t.defined(), "xcomm.", op, ": ", what, " ", index, " is an undefined tensor");
  TORCH_CHECK_VALUE(deviceSupported(t.device()), "xcomm.", op, ": ", what, " ", index,
                    " is on device '", t.device().str(), "', which xcomm does not support; ",
                    "supported: ", supportedDevices());
}

}  // namespace

void tensorList(const char* op, const std::vector<at::Tensor>& ts, const char* what) {
  TORCH_CHECK_VALUE(!ts.empty(), "xcomm.", op, ": the ", what, " list is empty; pass one tensor");
  for (size_t i = 0; i < ts.size(); ++i) {
    oneTensor(op, ts[i], what, i);
    if (i > 0) {
      TORCH_CHECK_VALUE(ts[i].device() == ts[0].device(), "xcomm.", op, ": ", what, " ", i,
                        " is on ", ts[i].device().str(), " but ", what, " 0 is on ",
                        ts[0].device().str(), "; all tensors of one call must share a device");
      TORCH_CHECK_TYPE(ts[i].scalar_type() == ts[0].scalar_type(), "xcomm.", op, ": ", what, " ", i,
                       " has dtype ", dtypeName(ts[i].scalar_type()), " but ", what, " 0 has ",
                       dtypeName(ts[0].scalar_type()),
                       "; all tensors of one call must share a dtype");
    }
  }
}

void tensorListOfLists(const char* op, const std::vector<std::vector<at::Tensor>>& ts,
                       const char* what) {
  TORCH_CHECK_VALUE(!ts.empty(), "xcomm.", op, ": the ", what, " list is empty");
  for (const auto& list : ts) {
    tensorList(op, list, what);
  }
}

void sameDeviceAndDtype(const char* op, const at::Tensor& a, const at::Tensor& b, const char* whatA,
                        const char* whatB) {
  TORCH_CHECK_VALUE(a.device() == b.device(), "xcomm.", op, ": the ", whatA, " is on ",
                    a.device().str(), " but the ", whatB, " is on ", b.device().str());
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "xcomm.", op, ": the ", whatA, " has dtype ",
                   dtypeName(a.scalar_type()), " but the ", whatB, " has ",
                   dtypeName(b.scalar_type()));
}

void rank(const char* op, int64_t r, int size, const char* what) {
  TORCH_CHECK_VALUE(r >= 0 && r < size, "xcomm.", op, ": ", what, " rank ", r,
                    " is out of range for a group of size ", size, " (valid: 0 to ", size - 1, ")");
}

void reduceOp(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType dtype) {
  const auto type = reduceOp.op_;
  if (reduceOpSupports(type, dtype)) {
    return;
  }
  const bool bitwise =
      type == c10d::ReduceOp::BAND || type == c10d::ReduceOp::BOR || type == c10d::ReduceOp::BXOR;
  TORCH_CHECK_TYPE(false, "xcomm.", op, ": ReduceOp.", reduceOpName(type),
                   " is not defined for dtype ", dtypeName(dtype),
                   bitwise ? "; bitwise ops need an integer or bool dtype"
                           : "; this op needs a floating-point dtype (use SUM on integers)");
}

void listForEveryRank(const char* op, const std::vector<at::Tensor>& list, int size, int64_t numel,
                      const char* what) {
  TORCH_CHECK_VALUE(static_cast<int>(list.size()) == size, "xcomm.", op, ": the ", what,
                    " list has ", list.size(), " tensors but the group has ", size,
                    " ranks; pass one tensor per rank");
  for (size_t i = 0; i < list.size(); ++i) {
    TORCH_CHECK_VALUE(list[i].numel() == numel, "xcomm.", op, ": ", what, " tensor ", i, " has ",
                      list[i].numel(), " elements but the op moves ", numel,
                      " per rank; every tensor must have the size of the input");
  }
}

void allgatherBase(const at::Tensor& output, const at::Tensor& input, int size) {
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size,
                    "xcomm.all_gather_into_tensor: the output tensor has ", output.numel(),
                    " elements but must have input size x world size = ", input.numel(), " x ",
                    size, " = ", input.numel() * size);
}

void reduceScatterBase(const at::Tensor& output, const at::Tensor& input, int size) {
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size,
                    "xcomm.reduce_scatter_tensor: the input tensor has ", input.numel(),
                    " elements but must have output size x world size = ", output.numel(), " x ",
                    size, " = ", output.numel() * size);
}

void splits(const char* op, const std::vector<int64_t>& splits, const at::Tensor& t, int size,
            const char* what) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(rows % size == 0, "xcomm.", op, ": the ", what, " tensor has ", rows,
                      " rows in dim 0, which do not split evenly over ", size,
                      " ranks; pass split sizes");
    return;
  }
  TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == size, "xcomm.", op, ": ", what,
                    " split sizes have ", splits.size(), " entries but the group has ", size,
                    " ranks");
  for (size_t i = 0; i < splits.size(); ++i) {
    TORCH_CHECK_VALUE(splits[i] >= 0, "xcomm.", op, ": ", what, " split size ", i, " is ",
                      splits[i], "; split sizes must not be negative");
  }
  const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  TORCH_CHECK_VALUE(total == rows, "xcomm.", op, ": ", what, " split sizes sum to ", total,
                    " but the ", what, " tensor has ", rows, " rows in dim 0");
}

}  // namespace xcomm::checks
