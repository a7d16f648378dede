// PowerSGD's two products on the GPU: P = M Q and Q = M^T P, where M is a
// gradient matrix (rows x cols, 16 MB for a 2048 x 2048 layer) and P, Q have
// `rank` columns (1 to 32). cuBLAS runs these skinny shapes with its general
// tiles: on the H200 each took 17-45 us for a 2048 x 2048 matrix that one
// read at memory speed takes about 5 us to stream. Here each product reads M
// once, coalesced, and sums in a fixed order, so every rank computes the same
// bits (in float for float matrices, double for double, as cuBLAS does).
//
// P = M Q: a block per 8 rows of M (fewer above rank 8), its threads across
// the columns (up to 4 each per step); Q's rows are staged in shared
// memory, transposed, once per block and step, and serve all the block's
// rows (see projectKernel).
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

// The shape of P = M Q's blocks for rank width R.
template <typename T, int R>
struct ProjectShape {
  // Rows of M per block: Q's values, read once per step, serve them all;
  // kRows x R accumulators per thread stay at most 64 registers.
  static constexpr int kRows = R <= 8 ? 8 : 64 / R;
  // Columns per thread per step: at small ranks each thread keeps more of M
  // in flight (kCols x kRows loads) where registers allow.
  static constexpr int kCols = R <= 2 ? 4 : (R <= 4 ? 2 : 1);
  // Threads per block: fewer where the staged Q would pass 40 KB of shared
  // memory (double, rank 32).
  static constexpr int kBlock = sizeof(T) * R * kCols * 256 > 40 * 1024 ? 128 : 256;
  // Columns per step, and the row pitch of the transposed Q: kTile plus
  // 32 / R entries puts the staging's writes (R consecutive values of a Q
  // row per R lanes) in 32 different banks.
  static constexpr int kTile = kCols * kBlock;
  static constexpr int kPitch = kTile + 32 / R;
  static constexpr int kWarps = kBlock / 32;
};

// P = M Q. A block takes kRows rows of M, and its threads walk those rows'
// columns together, kCols columns per thread per step (t, t + kBlock, ...),
// so every read of M is coalesced whatever its alignment. Each step the
// block first copies the Q rows of its kTile columns into shared memory,
// transposed (a coalesced read of contiguous Q), and each thread then takes
// its columns' `rank` values from there, conflict-free, for all kRows rows:
// Q comes from L2 once per kRows rows, where one warp per row read it once
// per row, and no warp reads Q scattered across cache lines. A step's loads
// of M are issued before its barriers, so they are in flight while Q is
// staged. Sums in a fixed order: a thread's columns, the warp's butterfly,
// the warps in turn.
template <typename T, int R>
__global__ void __launch_bounds__(ProjectShape<T, R>::kBlock)
    projectKernel(const T* m, int64_t rows, int64_t cols, const T* q, int rank, T* p) {
  using S = ProjectShape<T, R>;
  __shared__ T qs[R][S::kPitch];
  __shared__ T sums[S::kWarps][S::kRows * R];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * S::kRows;
  const int height = static_cast<int>(min(static_cast<int64_t>(S::kRows), rows - row0));
  const int t = static_cast<int>(threadIdx.x);
  const bool fullRank = rank == R;  // index Q with shifts, not divisions
  T acc[S::kRows][R];
#pragma unroll
  for (int r = 0; r < S::kRows; ++r) {
#pragma unroll
    for (int c = 0; c < R; ++c) acc[r][c] = T(0);
  }
  for (int64_t j0 = 0; j0 < cols; j0 += S::kTile) {
    const int width = static_cast<int>(min(static_cast<int64_t>(S::kTile), cols - j0));
    const T* mj = m + row0 * cols + j0 + t;
    T v[S::kCols][S::kRows];
#pragma unroll
    for (int k = 0; k < S::kCols; ++k) {
      const bool in = t + k * S::kBlock < width;
#pragma unroll
      for (int r = 0; r < S::kRows; ++r) {
        v[k][r] = in && r < height ? mj[r * cols + k * S::kBlock] : T(0);
      }
    }
    const T* tile = q + j0 * rank;
    const int count = width * rank;
    __syncthreads();  // the previous step is done with qs
    for (int e = t; e < count; e += S::kBlock) {
      const int c = fullRank ? e % R : e % rank;
      const int j = fullRank ? e / R : e / rank;
      qs[c][j] = tile[e];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < S::kCols; ++k) {
      const int j = t + k * S::kBlock;
      if (j >= width) break;
#pragma unroll
      for (int c = 0; c < R; ++c) {
        if (c < rank) {
          const T qv = qs[c][j];
#pragma unroll
          for (int r = 0; r < S::kRows; ++r) acc[r][c] += v[k][r] * qv;
        }
      }
    }
  }
  const int warp = t / 32, lane = t % 32;
#pragma unroll
  for (int r = 0; r < S::kRows; ++r) {
#pragma unroll
    for (int c = 0; c < R; ++c) {
      T s = acc[r][c];
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) sums[warp][r * R + c] = s;
    }
  }
  __syncthreads();
  for (int i = t; i < height * R; i += S::kBlock) {
    const int r = i / R, c = i % R;
    if (c >= rank) continue;
    T s = sums[0][i];
#pragma unroll
    for (int w = 1; w < S::kWarps; ++w) s += sums[w][i];
    p[(row0 + r) * rank + c] = s;
  }
}

// Rows of M whose loads a thread of Q = M^T P issues before using any:
// enough of M in flight per SM (a 2048 x 2048 matrix runs about 16 warps
// per SM).
constexpr int kBackBatch = 16;

// Partial sums of M^T P over one stretch of rows (blockIdx.y), one column
// per thread, rows added in order: partial[split][col][c].
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
  int64_t i = lo;
  for (; i + kBackBatch <= hi; i += kBackBatch) {
    T v[kBackBatch];
#pragma unroll
    for (int b = 0; b < kBackBatch; ++b) v[b] = m[(i + b) * cols + col];
#pragma unroll
    for (int b = 0; b < kBackBatch; ++b) fmaRow<T, R>(acc, v[b], p + (i + b) * rank, rank);
  }
  for (; i < hi; ++i) fmaRow<T, R>(acc, m[i * cols + col], p + i * rank, rank);
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
  using S = ProjectShape<T, R>;
  const int64_t rows = m.size(0), cols = m.size(1);
  projectKernel<T, R><<<blocksFor(rows, S::kRows), S::kBlock, 0, streamFor(m)>>>(
      m.data_ptr<T>(), rows, cols, q.data_ptr<T>(), static_cast<int>(q.size(1)), p.data_ptr<T>());
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
