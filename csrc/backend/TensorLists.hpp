#pragma once
// Small helpers over the tensor lists c10d ops take, shared by the CPU
// inner backends.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace xcomm {

// The lists' tensors, in order, as one list.
inline std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> flat;
  for (const auto& list : lists) flat.insert(flat.end(), list.begin(), list.end());
  return flat;
}

// The first tensor's dtype (Undefined for an empty list). With denseBytes,
// what every rank must agree on for an op.
inline at::ScalarType dtypeOf(const std::vector<at::Tensor>& ts) {
  return ts.empty() ? at::ScalarType::Undefined : ts[0].scalar_type();
}

// Bytes of the dense tensors; a sparse tensor's size legitimately differs
// between ranks, so it counts as 0 where ranks compare sizes.
inline uint64_t denseBytes(const std::vector<at::Tensor>& ts) {
  uint64_t bytes = 0;
  for (const auto& t : ts) {
    if (t.layout() == at::kStrided) bytes += t.numel() * t.element_size();
  }
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
