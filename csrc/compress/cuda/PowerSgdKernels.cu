// PowerSGD's orthonormalization on the GPU: Gram-Schmidt of rows x rank
// matrices (row-major), one thread block per matrix and every matrix of a
// bucket in one launch, instead of the ~6 ATen ops per column (each a kernel
// launch and a host-side dispatch) that torch's hook and xcomm's ATen route
// spend. Same steps as torch's hook: each column is divided by (its norm +
// eps), then its projection is taken out of every later column, the dot
// products all taken before any subtraction. Reductions run in a fixed
// order, so every rank computes the same bits.
//
// Where the matrix fits (rank <= 16; float: up to 8192 rows at rank 4), each
// thread holds its rows in registers: the matrix is read once and written
// once, and a column costs one block reduction of all its dot products
// (with the raw column: dot(x_i / n, x_j) = dot(x_i, x_j) / n). The same
// pass tells whether the matrix was finite, which PowerSGD asks of P.
// Larger matrices take a kernel that works in global memory.
//
// And the last phase, decompression with error feedback, as one pass over
// the matrix: read M, write the residual and the approximation, where the
// ATen route runs a matmul, a subtraction, two selects and two copies
// (six launches and about thirteen passes over the matrix). And the
// uncompressed tensors after their allreduce, one kernel where the ATen
// route runs eight ops (a division, two gathers, a test, a subtraction, a
// select and two scatters): the hook's step costs host time per op.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include <ATen/ops/isfinite.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "compress/cuda/CudaCodecs.hpp"
#include "compress/cuda/CudaLaunch.cuh"

namespace xcomm {
namespace cuda {
namespace {

constexpr int kGsThreads = 1024;
constexpr int kMaxRank = 64;  // dot products kept in shared memory per column

// One launch's matrices, passed by value (kernel parameters).
constexpr int kGsBatch = 32;
struct GsMatrix {
  void* x;
  int64_t rows;
  int rank;
  bool* finite;  // where to say whether x was finite, or null
};
struct GsBatch {
  GsMatrix m[kGsBatch];
};

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

// Gram-Schmidt with the matrix in registers: thread t holds rows t, t +
// blockDim, ... (kRows of them) and R columns (the first `rank` used).
template <typename T, int R, int kRows>
__global__ void __launch_bounds__(1024) gramSchmidtRegsKernel(GsBatch batch, T eps) {
  const GsMatrix& mat = batch.m[blockIdx.x];
  T* x = static_cast<T*>(mat.x);
  const int64_t rows = mat.rows;
  const int rank = mat.rank;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int warps = static_cast<int>(blockDim.x / 32);
  T v[kRows][R];
  bool finite = true;
#pragma unroll
  for (int a = 0; a < kRows; ++a) {
    const int64_t r = static_cast<int64_t>(a) * blockDim.x + tid;
#pragma unroll
    for (int c = 0; c < R; ++c) {
      v[a][c] = r < rows && c < rank ? x[r * rank + c] : T(0);
      finite = finite && isfinite(v[a][c]);
    }
  }
  if (mat.finite != nullptr) {
    const int all = __syncthreads_and(finite);
    if (tid == 0) *mat.finite = all != 0;
  }
  __shared__ T partial[2][32][R];  // per warp; by column parity, so one barrier a column
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (i >= rank) break;
#pragma unroll
    for (int j = i; j < R; ++j) {
      if (j >= rank) break;
      T d = T(0);
#pragma unroll
      for (int a = 0; a < kRows; ++a) d += v[a][i] * v[a][j];
      for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      if (lane == 0) partial[i & 1][warp][j] = d;
    }
    __syncthreads();
    T total[R];
#pragma unroll
    for (int j = i; j < R; ++j) {
      if (j >= rank) break;
      total[j] = T(0);
      for (int w = 0; w < warps; ++w) total[j] += partial[i & 1][w][j];
    }
    const T norm = sqrt(total[i]) + eps;
#pragma unroll
    for (int a = 0; a < kRows; ++a) v[a][i] /= norm;
#pragma unroll
    for (int j = i + 1; j < R; ++j) {
      if (j >= rank) break;
      const T dot = total[j] / norm;
#pragma unroll
      for (int a = 0; a < kRows; ++a) v[a][j] -= dot * v[a][i];
    }
  }
#pragma unroll
  for (int a = 0; a < kRows; ++a) {
    const int64_t r = static_cast<int64_t>(a) * blockDim.x + tid;
#pragma unroll
    for (int c = 0; c < R; ++c) {
      if (r < rows && c < rank) x[r * rank + c] = v[a][c];
    }
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

// The uncompressed tensors after their allreduce, one thread per entry
// (grid-stride): the average as ATen's division by a scalar computes it on a
// GPU (times the reciprocal, in float for the 16-bit types), the residual
// where the average is finite, then the average into the bucket.
template <typename T>
__global__ void unpackUncompressedKernel(T* buffer, T* error, const T* wire, const int64_t* index,
                                         int64_t n, typename Accum<T>::type inverse) {
  using A = typename Accum<T>::type;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = index[i];
    const T avg = static_cast<T>(static_cast<A>(wire[i]) * inverse);
    if (error != nullptr && isfinite(static_cast<A>(avg))) {
      error[j] = static_cast<T>(static_cast<A>(buffer[j]) - static_cast<A>(avg));
    }
    buffer[j] = avg;
  }
}

template <typename T>
void launchUnpackUncompressed(const at::Tensor& buffer, const at::Tensor& error,
                              const at::Tensor& wire, const at::Tensor& index, int64_t worldSize) {
  using A = typename Accum<T>::type;
  const int64_t n = index.numel();
  const A inverse = A(1) / static_cast<A>(worldSize);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(blocksFor(n, kThreads), 65535));
  unpackUncompressedKernel<T><<<blocks, kThreads, 0, streamFor(buffer)>>>(
      buffer.data_ptr<T>(), error.defined() ? error.data_ptr<T>() : nullptr, wire.data_ptr<T>(),
      index.data_ptr<int64_t>(), n, inverse);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls fn(T{}) for the element type T of `dtype` (float, double, half,
// bfloat16) and returns true; false for any other dtype.
template <typename Fn>
bool withPowerSgdType(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat:
      fn(float{});
      return true;
    case at::kDouble:
      fn(double{});
      return true;
    case at::kHalf:
      fn(c10::Half{});
      return true;
    case at::kBFloat16:
      fn(c10::BFloat16{});
      return true;
    default:
      return false;
  }
}

}  // namespace

bool powersgdUnpackUncompressed(const at::Tensor& buffer, const at::Tensor& error,
                                const at::Tensor& wire, const at::Tensor& index,
                                int64_t worldSize) {
  const auto dtype = buffer.scalar_type();
  const auto same = [&](const at::Tensor& t) {
    return onKernelDevice(t) && t.device() == buffer.device() && t.is_contiguous() && t.dim() == 1;
  };
  if (!same(buffer) || !same(wire) || !same(index) || (error.defined() && !same(error)) ||
      wire.scalar_type() != dtype || (error.defined() && error.scalar_type() != dtype) ||
      index.scalar_type() != at::kLong || wire.numel() < index.numel() ||
      (error.defined() && error.numel() != buffer.numel()) || worldSize < 1) {
    return false;
  }
  if (index.numel() == 0) return true;
  DeviceGuard guard(buffer.device());
  return withPowerSgdType(dtype, [&](auto zero) {
    launchUnpackUncompressed<decltype(zero)>(buffer, error, wire, index, worldSize);
  });
}

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
  return withPowerSgdType(
      dtype, [&](auto zero) { launchReconstruct<decltype(zero)>(m, err, p, q, finite); });
}

namespace {

// Rows per thread of the register kernel for rank R: about 32 floats or 16
// doubles a thread, so 1024 threads' values fit their 64 registers each.
template <typename T>
constexpr int rowsPerThread(int r) {
  const int values = sizeof(T) == 4 ? 32 : 16;
  return std::max(1, std::min(8, values / r));
}

template <typename T, int R>
void launchGramSchmidtRegs(const std::vector<at::Tensor>& xs, size_t first, size_t count,
                           double eps, bool* finite, cudaStream_t stream) {
  constexpr int kRows = rowsPerThread<T>(R);
  GsBatch batch{};
  int64_t maxRows = 0;
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& x = xs[first + i];
    batch.m[i] = {x.data_ptr(), x.size(0), static_cast<int>(x.size(1)),
                  finite != nullptr ? finite + first + i : nullptr};
    maxRows = std::max(maxRows, x.size(0));
  }
  const int64_t perThread = (maxRows + kRows - 1) / kRows;
  const int threads = static_cast<int>(std::clamp<int64_t>((perThread + 31) / 32 * 32, 32, 1024));
  gramSchmidtRegsKernel<T, R, kRows>
      <<<static_cast<unsigned>(count), threads, 0, stream>>>(batch, static_cast<T>(eps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

constexpr int64_t kRegsMaxRank = 16;

// The register kernel's compile-time rank for x: its rank rounded up to a
// power of two.
int64_t registerRank(const at::Tensor& x) {
  int64_t r = 1;
  while (r < x.size(1)) r *= 2;
  return r;
}

bool fitsRegisters(const at::Tensor& x) {
  const int64_t rank = x.size(1);
  const int64_t r = registerRank(x);
  const int perThread = x.scalar_type() == at::kDouble ? rowsPerThread<double>(static_cast<int>(r))
                                                       : rowsPerThread<float>(static_cast<int>(r));
  return rank <= kRegsMaxRank && x.size(0) <= int64_t{1024} * perThread;
}

}  // namespace

bool gramSchmidtBatch(const std::vector<at::Tensor>& xs, double eps, const at::Tensor& finite) {
  if (xs.empty()) return true;
  const at::Tensor& x0 = xs.front();
  const auto dtype = x0.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return false;
  for (const auto& x : xs) {
    if (!onKernelDevice(x) || x.device() != x0.device() || !x.is_contiguous() || x.dim() != 2 ||
        x.scalar_type() != dtype || x.size(1) > kMaxRank) {
      return false;
    }
  }
  if (finite.defined() && (!onKernelDevice(finite) || finite.device() != x0.device() ||
                           finite.scalar_type() != at::kBool || !finite.is_contiguous() ||
                           finite.numel() != static_cast<int64_t>(xs.size()))) {
    return false;
  }
  DeviceGuard guard(x0.device());
  const auto stream = streamFor(x0);
  bool* flags = finite.defined() ? finite.data_ptr<bool>() : nullptr;
  // Runs of matrices with the same register shape share a launch.
  size_t i = 0;
  while (i < xs.size()) {
    const at::Tensor& x = xs[i];
    if (x.numel() == 0 || !fitsRegisters(x)) {
      if (x.numel() > 0) {
        if (flags != nullptr) {
          at::Tensor flag = finite.narrow(0, static_cast<int64_t>(i), 1).view({});
          flag.copy_(at::isfinite(x).all());
        }
        const auto rank = static_cast<int>(x.size(1));
        if (dtype == at::kFloat) {
          gramSchmidtKernel<float><<<1, kGsThreads, 0, stream>>>(x.data_ptr<float>(), x.size(0),
                                                                 rank, static_cast<float>(eps));
        } else {
          gramSchmidtKernel<double>
              <<<1, kGsThreads, 0, stream>>>(x.data_ptr<double>(), x.size(0), rank, eps);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      } else if (flags != nullptr) {
        finite.narrow(0, static_cast<int64_t>(i), 1).fill_(true);
      }
      ++i;
      continue;
    }
    const int64_t r = registerRank(x);
    size_t count = 1;
    while (i + count < xs.size() && count < static_cast<size_t>(kGsBatch)) {
      const at::Tensor& y = xs[i + count];
      if (y.numel() == 0 || !fitsRegisters(y) || registerRank(y) != r) break;
      ++count;
    }
    withPowerOfTwo<16>(r, [&](auto rank) {
      if (dtype == at::kFloat) {
        launchGramSchmidtRegs<float, decltype(rank)::value>(xs, i, count, eps, flags, stream);
      } else {
        launchGramSchmidtRegs<double, decltype(rank)::value>(xs, i, count, eps, flags, stream);
      }
    });
    i += count;
  }
  return true;
}

bool gramSchmidt(const at::Tensor& x, double eps) {
  return gramSchmidtBatch({x}, eps, at::Tensor());
}

}  // namespace cuda
}  // namespace xcomm
