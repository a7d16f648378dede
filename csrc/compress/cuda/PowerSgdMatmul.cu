// PowerSGD's two products on the GPU: P = M Q and Q = M^T P, where M is a
// gradient matrix (rows x cols, 16 MB for a 2048 x 2048 layer) and P, Q have
// `rank` columns (1 to 32). cuBLAS runs these skinny shapes with its general
// tiles: on the H200 each took 17-45 us for a 2048 x 2048 matrix that one
// read at memory speed takes about 5 us to stream. Here each product reads M
// once, coalesced, and sums in a fixed order, so every rank computes the same
// bits (in float for float matrices, double for double, as cuBLAS does).
//
// P = M Q: one warp per row of M. Lane l takes the row's entries l, l + 32,
// ... (four consecutive ones at a time where the row allows 16-byte loads),
// multiplies each by its row of Q (small, cached), and the warp adds its
// lanes' partial sums with a butterfly.
//
// Q = M^T P: threads across M's columns, blocks over stretches of rows; each
// block writes its stretch's partial sums, and a second kernel adds the
// stretches in order. Where `finite` (a 0-dim bool on the device: P was
// finite) is false, Q keeps its old value, PowerSGD's warm start.
//
// Used where XCOMM_POWERSGD_MATMUL=xcomm, until a GPU run has checked them
// against cuBLAS; the ATen route (at::mm) otherwise.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "compress/cuda/CudaCodecs.hpp"
#include "compress/cuda/CudaLaunch.cuh"

namespace xcomm {
namespace cuda {
namespace {

constexpr int kMaxProductRank = 32;
// Rows per block stretch of M^T P: long enough that the partial sums (splits
// x cols x rank) stay a small fraction of M's bytes.
constexpr int64_t kMinRowsPerSplit = 64;
// Threads the M^T P pass aims for (about 16 warps per SM on an H100/H200).
constexpr int64_t kTargetThreads = int64_t{1} << 17;

bool productsWanted() {
  const char* which = std::getenv("XCOMM_POWERSGD_MATMUL");
  return which != nullptr && std::strcmp(which, "xcomm") == 0;
}

// acc[c] += v * qRow[c] for the first `rank` of R accumulators.
template <typename T, int R>
__device__ inline void fmaRow(T (&acc)[R], T v, const T* qRow, int rank) {
#pragma unroll
  for (int c = 0; c < R; ++c) {
    if (c < rank) acc[c] += v * qRow[c];
  }
}

// P = M Q, one warp per row; kVec: the row's entries read as float4s.
template <typename T, int R, bool kVec>
__global__ void projectKernel(const T* m, int64_t rows, int64_t cols, const T* q, int rank, T* p) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= rows) return;  // the same for every lane of the warp
  const T* mr = m + row * cols;
  T acc[R];
#pragma unroll
  for (int c = 0; c < R; ++c) acc[c] = T(0);
  if constexpr (kVec) {
    const auto* mv = reinterpret_cast<const float4*>(mr);
    const int64_t quads = cols / 4;
#pragma unroll 4
    for (int64_t x = lane; x < quads; x += 32) {
      const float4 v = mv[x];
      const T* qr = q + 4 * x * rank;
      fmaRow<T, R>(acc, v.x, qr, rank);
      fmaRow<T, R>(acc, v.y, qr + rank, rank);
      fmaRow<T, R>(acc, v.z, qr + 2 * rank, rank);
      fmaRow<T, R>(acc, v.w, qr + 3 * rank, rank);
    }
  } else {
#pragma unroll 4
    for (int64_t j = lane; j < cols; j += 32) fmaRow<T, R>(acc, mr[j], q + j * rank, rank);
  }
#pragma unroll
  for (int c = 0; c < R; ++c) {
    for (int o = 16; o > 0; o >>= 1) acc[c] += __shfl_xor_sync(0xffffffffu, acc[c], o);
  }
  if (lane == 0) {
#pragma unroll
    for (int c = 0; c < R; ++c) {
      if (c < rank) p[row * rank + c] = acc[c];
    }
  }
}

// Partial sums of M^T P over one stretch of rows (blockIdx.y), one column
// per thread: partial[split][col][c].
template <typename T, int R>
__global__ void projectBackPartialKernel(const T* m, int64_t rows, int64_t cols, const T* p,
                                         int rank, int64_t rowsPerSplit, T* partial) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const int64_t split = blockIdx.y;
  const int64_t lo = split * rowsPerSplit, hi = min(rows, lo + rowsPerSplit);
  T acc[R];
#pragma unroll
  for (int c = 0; c < R; ++c) acc[c] = T(0);
#pragma unroll 8
  for (int64_t i = lo; i < hi; ++i) fmaRow<T, R>(acc, m[i * cols + col], p + i * rank, rank);
  T* out = partial + (split * cols + col) * rank;
#pragma unroll
  for (int c = 0; c < R; ++c) {
    if (c < rank) out[c] = acc[c];
  }
}

// q[i] = the stretches' partial sums in order, where P was finite.
template <typename T>
__global__ void projectBackSumKernel(const T* partial, int64_t splits, int64_t n,
                                     const bool* finite, T* q) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n || !*finite) return;
  T s = partial[i];
  for (int64_t k = 1; k < splits; ++k) s += partial[k * n + i];
  q[i] = s;
}

template <typename T, int R>
void launchProject(const at::Tensor& p, const at::Tensor& m, const at::Tensor& q) {
  const int64_t rows = m.size(0), cols = m.size(1);
  const int rank = static_cast<int>(q.size(1));
  const unsigned blocks = blocksFor(rows * 32, kThreads);
  const auto stream = streamFor(m);
  if constexpr (std::is_same_v<T, float>) {
    if (cols % 4 == 0 && reinterpret_cast<uintptr_t>(m.data_ptr()) % 16 == 0) {
      projectKernel<T, R, true><<<blocks, kThreads, 0, stream>>>(
          m.data_ptr<T>(), rows, cols, q.data_ptr<T>(), rank, p.data_ptr<T>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
  }
  projectKernel<T, R, false><<<blocks, kThreads, 0, stream>>>(
      m.data_ptr<T>(), rows, cols, q.data_ptr<T>(), rank, p.data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int R>
void launchProjectBack(const at::Tensor& q, const at::Tensor& m, const at::Tensor& p,
                       const at::Tensor& finite) {
  const int64_t rows = m.size(0), cols = m.size(1);
  const int rank = static_cast<int>(q.size(1));
  const int64_t wanted = std::max<int64_t>(1, kTargetThreads / cols);
  const int64_t splits =
      std::clamp<int64_t>(rows / kMinRowsPerSplit, 1, std::min<int64_t>(wanted, 65535));
  const int64_t rowsPerSplit = (rows + splits - 1) / splits;
  at::Tensor partial = at::empty({splits * cols * rank}, q.options());
  const auto stream = streamFor(m);
  const dim3 grid(blocksFor(cols, kThreads), static_cast<unsigned>(splits));
  projectBackPartialKernel<T, R><<<grid, kThreads, 0, stream>>>(
      m.data_ptr<T>(), rows, cols, p.data_ptr<T>(), rank, rowsPerSplit, partial.data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t n = cols * rank;
  projectBackSumKernel<T><<<blocksFor(n, kThreads), kThreads, 0, stream>>>(
      partial.data_ptr<T>(), splits, n, finite.data_ptr<bool>(), q.data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// m: a contiguous rows x cols matrix (of the bucket); rowsSide (rows x
// rank) and colsSide (cols x rank): contiguous, m's dtype and device.
bool productApplies(const at::Tensor& m, const at::Tensor& rowsSide, const at::Tensor& colsSide) {
  const auto dtype = m.scalar_type();
  const auto same = [&](const at::Tensor& t) {
    return onKernelDevice(t) && t.device() == m.device() && t.scalar_type() == dtype &&
           t.dim() == 2;
  };
  return same(m) && same(rowsSide) && same(colsSide) && m.is_contiguous() &&
         rowsSide.is_contiguous() && colsSide.is_contiguous() &&
         (dtype == at::kFloat || dtype == at::kDouble) && rowsSide.size(0) == m.size(0) &&
         colsSide.size(0) == m.size(1) && rowsSide.size(1) == colsSide.size(1) &&
         colsSide.size(1) >= 1 && colsSide.size(1) <= kMaxProductRank;
}

}  // namespace

bool powersgdProject(const at::Tensor& p, const at::Tensor& m, const at::Tensor& q) {
  if (!productsWanted() || !productApplies(m, p, q)) return false;
  if (m.numel() == 0) {
    p.zero_();
    return true;
  }
  DeviceGuard guard(m.device());
  withPowerOfTwo<32>(q.size(1), [&](auto r) {
    if (m.scalar_type() == at::kFloat) {
      launchProject<float, decltype(r)::value>(p, m, q);
    } else {
      launchProject<double, decltype(r)::value>(p, m, q);
    }
  });
  return true;
}

bool powersgdProjectBack(const at::Tensor& q, const at::Tensor& m, const at::Tensor& p,
                         const at::Tensor& finite) {
  if (!productsWanted() || !productApplies(m, p, q) || !onKernelDevice(finite) ||
      finite.device() != m.device() || finite.scalar_type() != at::kBool || finite.numel() != 1) {
    return false;
  }
  if (m.numel() == 0) return false;  // the ATen route's where() handles the empty case
  DeviceGuard guard(m.device());
  withPowerOfTwo<32>(q.size(1), [&](auto r) {
    if (m.scalar_type() == at::kFloat) {
      launchProjectBack<float, decltype(r)::value>(q, m, p, finite);
    } else {
      launchProjectBack<double, decltype(r)::value>(q, m, p, finite);
    }
  });
  return true;
}

}  // namespace cuda
}  // namespace xcomm
