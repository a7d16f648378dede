// PowerSGD's orthonormalization on the GPU: Gram-Schmidt of a rows x rank
// matrix (row-major) in one thread block, instead of the ~6 ATen ops per
// column (each a kernel launch and a host-side dispatch) that torch's hook
// and xcomm's ATen route spend. Same steps as torch's hook: each column is
// divided by (its norm + eps), then its projection is taken out of every
// later column, the dot products all taken before any subtraction.
// Reductions run in a fixed order, so every rank computes the same bits.
#include <cmath>

#include "compress/cuda/CudaCodecs.hpp"
#include "compress/cuda/CudaLaunch.cuh"

namespace xcomm {
namespace cuda {
namespace {

constexpr int kGsThreads = 1024;
constexpr int kMaxRank = 64;  // dot products kept in shared memory per column

template <typename T>
__device__ T blockSum(T v, T* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : T(0);
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__global__ void gramSchmidtKernel(T* x, int64_t rows, int rank, T eps) {
  __shared__ T shared[32];
  __shared__ T dots[kMaxRank];
  for (int i = 0; i < rank; ++i) {
    T s = 0;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const T v = x[r * rank + i];
      s += v * v;
    }
    const T norm = sqrt(blockSum(s, shared)) + eps;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) x[r * rank + i] /= norm;
    __syncthreads();
    for (int j = i + 1; j < rank; ++j) {
      T d = 0;
      for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
        d += x[r * rank + i] * x[r * rank + j];
      d = blockSum(d, shared);
      if (threadIdx.x == 0) dots[j] = d;
    }
    __syncthreads();
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const T c = x[r * rank + i];
      for (int j = i + 1; j < rank; ++j) x[r * rank + j] -= dots[j] * c;
    }
    __syncthreads();
  }
}

}  // namespace

bool gramSchmidt(const at::Tensor& x, double eps) {
  if (!x.is_cuda() || !x.is_contiguous() || x.dim() != 2 || x.size(1) > kMaxRank ||
      (x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble)) {
    return false;
  }
  if (x.numel() == 0) return true;
  c10::cuda::CUDAGuard guard(x.device());
  const auto stream = streamFor(x);
  const auto rank = static_cast<int>(x.size(1));
  if (x.scalar_type() == at::kFloat) {
    gramSchmidtKernel<float><<<1, kGsThreads, 0, stream>>>(x.data_ptr<float>(), x.size(0), rank,
                                                           static_cast<float>(eps));
  } else {
    gramSchmidtKernel<double>
        <<<1, kGsThreads, 0, stream>>>(x.data_ptr<double>(), x.size(0), rank, eps);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

}  // namespace cuda
}  // namespace xcomm
