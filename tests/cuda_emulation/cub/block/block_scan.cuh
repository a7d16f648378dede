#pragma once
// cub::BlockScan for the emulated GPU (CudaEmulation.hpp): the exclusive sums
// the kernels use, over a 1-D block, with the same results as cub's (integer
// sums do not depend on the order of additions).
#include "CudaEmulation.hpp"

namespace cub {

template <typename T, int kBlockThreads>
class BlockScan {
 public:
  struct TempStorage {
    T totals[kBlockThreads];
  };

  explicit BlockScan(TempStorage& storage) : storage_(storage) {}

  void ExclusiveSum(T input, T& output) {
    T in[1] = {input};
    T out[1];
    ExclusiveSum(in, out);
    output = out[0];
  }

  // With the block's total in `aggregate` (every thread gets it).
  void ExclusiveSum(T input, T& output, T& aggregate) {
    T in[1] = {input};
    T out[1];
    ExclusiveSum(in, out, aggregate);
    output = out[0];
  }

  template <int kItems>
  void ExclusiveSum(const T (&input)[kItems], T (&output)[kItems]) {
    T aggregate;
    ExclusiveSum(input, output, aggregate);
  }

  template <int kItems>
  void ExclusiveSum(const T (&input)[kItems], T (&output)[kItems], T& aggregate) {
    const int t = static_cast<int>(threadIdx.x);
    T mine = T(0);
    for (int i = 0; i < kItems; ++i) mine += input[i];
    storage_.totals[t] = mine;
    __syncthreads();
    T running = T(0);
    aggregate = T(0);
    for (int u = 0; u < static_cast<int>(blockDim.x); ++u) {
      if (u == t) running = aggregate;
      aggregate += storage_.totals[u];
    }
    __syncthreads();  // every thread has read the totals before they may be reused
    for (int i = 0; i < kItems; ++i) {
      output[i] = running;
      running += input[i];
    }
  }

 private:
  TempStorage& storage_;
};

}  // namespace cub
