#pragma once
// Small helpers over the tensor lists c10d ops take, shared by the CPU
// inner backends.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/AgreedCall.hpp"

namespace xcomm {

// The lists' tensors, in order, as one list.
inline std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> flat;
  for (const auto& list : lists) flat.insert(flat.end(), list.begin(), list.end());
  return flat;
}

// What every rank must agree on for an op's tensors: the first tensor's
// dtype (Undefined for an empty list) and the bytes of the dense ones (a
// sparse tensor's size legitimately differs between ranks, so it counts as
// 0). With a reduce op, the caller's, where it was lowered to other tensors
// (common/AgreedCall.hpp); every descriptor of a call reads them here.
inline at::ScalarType dtypeOf(const std::vector<at::Tensor>& ts,
                              const c10d::ReduceOp& op = c10d::ReduceOp()) {
  return ts.empty() ? at::ScalarType::Undefined : agreedDtype(ts[0].scalar_type(), op);
}

inline uint64_t denseBytes(const std::vector<at::Tensor>& ts,
                           const c10d::ReduceOp& op = c10d::ReduceOp()) {
  uint64_t bytes = 0;
  for (const auto& t : ts) bytes += agreedBytes(t, op);
  return bytes;
}

// The pieces of `whole` along dim 0, one per rank, shaped like `piece` (what
// Gloo's future holds for the flat allgather). concatOf(whole, piece) holds.
inline std::vector<at::Tensor> piecesPerRank(const at::Tensor& whole, const at::Tensor& piece,
                                             int size) {
  const int64_t rows = piece.size(0);
  std::vector<at::Tensor> pieces;
  for (int r = 0; r < size; ++r) pieces.push_back(whole.narrow(0, r * rows, rows));
  return pieces;
}

// Whether `whole` is `size` pieces shaped like `piece`, concatenated along
// dim 0: the only layout Gloo accepts for the flat allgather/reduce_scatter.
// Anything else goes to Gloo, which raises its own error.
inline bool concatOf(const at::Tensor& whole, const at::Tensor& piece, int size) {
  if (whole.dim() == 0 || piece.dim() == 0 || whole.size(0) != piece.size(0) * size) return false;
  return whole.sizes().slice(1) == piece.sizes().slice(1);
}

}  // namespace xcomm
