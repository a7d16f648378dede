#pragma once
// Bytes one rank puts on its link in each collective's usual algorithm: the
// one formula that the compression stats count with and that the cost model
// of compression="auto" predicts with (python/xcomm/hooks/stats.py is its
// Python face, for the hooks).
#include <cstdint>

namespace xcomm {

// A ring allreduce of `bytes` over `size` ranks: 2 (size-1)/size of them
// (reduce-scatter, then all-gather). Integer bytes round down as the
// Python stats do; a double gives the cost model's exact share.
template <typename Bytes>
constexpr Bytes ringAllreduceBytes(Bytes bytes, int size) {
  return size > 1 ? Bytes(2) * (size - 1) * bytes / size : Bytes(0);
}

// An all-to-all of a `bytes` send buffer: all but this rank's own piece.
template <typename Bytes>
constexpr Bytes alltoallBytes(Bytes bytes, int size) {
  return size > 1 ? Bytes(size - 1) * bytes / size : Bytes(0);
}

}  // namespace xcomm
