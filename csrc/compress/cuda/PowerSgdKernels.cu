// PowerSGD's orthonormalization on the GPU: Gram-Schmidt of a rows x rank
// matrix (row-major) in one thread block, instead of the ~6 ATen ops per
// column (each a kernel launch and a host-side dispatch) that torch's hook
// and xcomm's ATen route spend. Same steps as torch's hook: each column is
// divided by (its norm + eps), then its projection is taken out of every
// later column, the dot products all taken before any subtraction.
// Reductions run in a fixed order, so every rank computes the same bits.
//
// And the last phase, decompression with error feedback, as one pass over
// the matrix: read M, write the residual and the approximation, where the
// ATen route runs a matmul, a subtraction, two selects and two copies
// (six launches and about thirteen passes over the matrix).
#include <algorithm>
#include <cmath>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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

// Sums in float for the 16-bit types, as cuBLAS accumulates their matmuls.
template <typename T>
struct Accum {
  using type = float;
};
template <>
struct Accum<double> {
  using type = double;
};

// One block per row at a time (grid-stride over rows), its threads across
// the columns: M and the residual are read and written coalesced; the row's
// P entries are the same for every thread, Q's rows are small and cached.
template <typename T>
__global__ void reconstructKernel(T* m, T* err, const T* p, const T* q, const bool* finite,
                                  int64_t rows, int64_t cols, int rank) {
  using A = typename Accum<T>::type;
  const bool ok = *finite;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T* row = m + r * cols;
    if (!ok) {
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        row[c] = static_cast<T>(__int_as_float(0x7fc00000));  // the quiet NaN
      }
      continue;
    }
    const T* pr = p + r * rank;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const T* qc = q + c * rank;
      A d = 0;
      for (int k = 0; k < rank; ++k) d += static_cast<A>(pr[k]) * static_cast<A>(qc[k]);
      const T approx = static_cast<T>(d);
      if (err != nullptr) {
        err[r * cols + c] = static_cast<T>(static_cast<A>(row[c]) - static_cast<A>(approx));
      }
      row[c] = approx;
    }
  }
}

template <typename T>
void launchReconstruct(const at::Tensor& m, const at::Tensor& err, const at::Tensor& p,
                       const at::Tensor& q, const at::Tensor& finite) {
  const int64_t rows = m.size(0), cols = m.size(1);
  int threads = 32;
  while (threads < kThreads && threads < cols) threads *= 2;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(rows, 65535LL * 4));
  reconstructKernel<T><<<blocks, threads, 0, streamFor(m)>>>(
      m.data_ptr<T>(), err.defined() ? err.data_ptr<T>() : nullptr, p.data_ptr<T>(),
      q.data_ptr<T>(), finite.data_ptr<bool>(), rows, cols, static_cast<int>(p.size(1)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool powersgdReconstruct(const at::Tensor& m, const at::Tensor& err, const at::Tensor& p,
                         const at::Tensor& q, const at::Tensor& finite) {
  const auto dtype = m.scalar_type();
  const auto same = [&](const at::Tensor& t) {
    return onKernelDevice(t) && t.device() == m.device() && t.is_contiguous() &&
           t.scalar_type() == dtype;
  };
  if (!same(m) || m.dim() != 2 || !same(p) || !same(q) || (err.defined() && !same(err)) ||
      p.dim() != 2 || q.dim() != 2 || p.size(0) != m.size(0) || q.size(0) != m.size(1) ||
      p.size(1) != q.size(1) || (err.defined() && !err.sizes().equals(m.sizes())) ||
      !onKernelDevice(finite) || finite.device() != m.device() ||
      finite.scalar_type() != at::kBool || finite.numel() != 1) {
    return false;
  }
  if (m.numel() == 0) return true;
  DeviceGuard guard(m.device());
  switch (dtype) {
    case at::kFloat:
      launchReconstruct<float>(m, err, p, q, finite);
      return true;
    case at::kDouble:
      launchReconstruct<double>(m, err, p, q, finite);
      return true;
    case at::kHalf:
      launchReconstruct<c10::Half>(m, err, p, q, finite);
      return true;
    case at::kBFloat16:
      launchReconstruct<c10::BFloat16>(m, err, p, q, finite);
      return true;
    default:
      return false;
  }
}

bool gramSchmidt(const at::Tensor& x, double eps) {
  if (!onKernelDevice(x) || !x.is_contiguous() || x.dim() != 2 || x.size(1) > kMaxRank ||
      (x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble)) {
    return false;
  }
  if (x.numel() == 0) return true;
  DeviceGuard guard(x.device());
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
