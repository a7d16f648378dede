// Exact top-k on the GPU: a radix select of the k-th largest magnitude, then
// one ordered pass that packs the selected entries.
//
// The selection is TopKCodec's on the CPU, exactly: every entry whose
// magnitude key (float bits without the sign; NaN above Inf) is above the
// k-th largest key, then the entries equal to it by lowest index, packed as
// [k int32 indices, ascending | k float32 values]. The k-th key is found
// three bits-fields at a time (bits 30..21, 20..10, 9..0) with block-shared
// histograms; each block owns one contiguous range of the bucket, so the
// final pass can number the kept entries in index order from per-block
// counts, with no sort.
#include <cub/block/block_scan.cuh>

#include "compress/cuda/CudaCodecs.hpp"
#include "compress/cuda/CudaLaunch.cuh"

namespace xcomm {
namespace cuda {
namespace {

constexpr int kMaxBlocks = 1024;  // the plan kernel scans one entry per thread
constexpr int kBins = 2048;
constexpr int kUnroll = 4;

// The radix levels: which key bits each one histograms.
constexpr int kLevels = 3;
__host__ __device__ constexpr int levelShift(int level) {
  return level == 0 ? 21 : (level == 1 ? 10 : 0);
}
__host__ __device__ constexpr int levelBits(int level) {
  return level == 0 ? 10 : (level == 1 ? 11 : 10);
}

// Device-side state of one selection.
struct Select {
  uint32_t hist[kBins];
  uint32_t prefix;              // the k-th key's bits found so far (after the last level: the key)
  int64_t need;                 // how many of the entries matching `prefix` are still to take
  uint32_t kept[kMaxBlocks];    // per block: entries above the key
  uint32_t ties[kMaxBlocks];    // per block: entries equal to it
  uint32_t take[kMaxBlocks];    // per block: how many of its ties are taken
  uint32_t offset[kMaxBlocks];  // per block: where its entries start in the payload
};

struct Range {
  int64_t lo, hi;
};
__device__ inline Range blockRange(int64_t n, int64_t per) {
  const int64_t lo = blockIdx.x * per;
  return {lo, min(n, lo + per)};
}

// a = src + residual, stored into residual (when both are given), and the
// histogram of level 0 over every entry.
__global__ void prepareKernel(const float* src, float* res, int64_t n, int64_t per, int64_t k,
                              Select* sel) {
  __shared__ uint32_t hist[kBins];
  if (blockIdx.x == 0 && threadIdx.x == 0) sel->need = k;
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) hist[b] = 0;
  __syncthreads();
  const Range r = blockRange(n, per);
  for (int64_t base = r.lo; base < r.hi; base += static_cast<int64_t>(blockDim.x) * kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(u) * blockDim.x;
      if (i < r.hi) {
        v[u] = src != nullptr ? src[i] : res[i];
        if (src != nullptr && res != nullptr) v[u] = __fadd_rn(v[u], res[i]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(u) * blockDim.x;
      if (i < r.hi) {
        if (src != nullptr && res != nullptr) res[i] = v[u];
        atomicAdd(&hist[magnitudeKey(v[u]) >> levelShift(0)], 1u);
      }
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
    if (hist[b] != 0) atomicAdd(&sel->hist[b], hist[b]);
  }
}

// Histogram of `level` over the entries whose higher bits match the prefix.
__global__ void histKernel(const float* vals, int64_t n, int64_t per, int level, Select* sel) {
  __shared__ uint32_t hist[kBins];
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) hist[b] = 0;
  __syncthreads();
  const int above = levelShift(level) + levelBits(level);
  const uint32_t prefix = sel->prefix;
  const uint32_t mask = (1u << levelBits(level)) - 1u;
  const Range r = blockRange(n, per);
  for (int64_t base = r.lo; base < r.hi; base += static_cast<int64_t>(blockDim.x) * kUnroll) {
    uint32_t key[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(u) * blockDim.x;
      key[u] = i < r.hi ? magnitudeKey(vals[i]) : 0xffffffffu;  // never matches: bit 31
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if ((key[u] >> above) == prefix) atomicAdd(&hist[(key[u] >> levelShift(level)) & mask], 1u);
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
    if (hist[b] != 0) atomicAdd(&sel->hist[b], hist[b]);
  }
}

// One block of kBins / 2 threads: the bin that holds the need-th largest
// entry; appends it to the prefix, takes the bins above it off `need`, and
// clears the histogram for the next level.
__global__ void pickKernel(int level, Select* sel) {
  using Scan = cub::BlockScan<uint32_t, kBins / 2>;
  __shared__ typename Scan::TempStorage temp;
  const int bins = 1 << levelBits(level);
  // Thread t holds bins (bins-1-2t, bins-2-2t): descending, so an inclusive
  // scan counts the entries at or above each bin.
  const int hiBin = bins - 1 - 2 * static_cast<int>(threadIdx.x), loBin = hiBin - 1;
  const uint32_t cHi = hiBin >= 0 ? sel->hist[hiBin] : 0u;
  const uint32_t cLo = loBin >= 0 ? sel->hist[loBin] : 0u;
  uint32_t before = 0;
  Scan(temp).ExclusiveSum(cHi + cLo, before);
  const int64_t need = sel->need;
  __syncthreads();
  int64_t atOrAbove = static_cast<int64_t>(before) + cHi;
  if (hiBin >= 0 && before < need && atOrAbove >= need) {
    sel->prefix = (sel->prefix << levelBits(level)) | static_cast<uint32_t>(hiBin);
    sel->need = need - before;
  } else if (loBin >= 0 && atOrAbove < need && atOrAbove + cLo >= need) {
    sel->prefix = (sel->prefix << levelBits(level)) | static_cast<uint32_t>(loBin);
    sel->need = need - atOrAbove;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) sel->hist[b] = 0;
}

// Per block: entries above the k-th key, and entries equal to it.
__global__ void countKernel(const float* vals, int64_t n, int64_t per, Select* sel) {
  const uint32_t key = sel->prefix;
  uint32_t kept = 0, ties = 0;
  const Range r = blockRange(n, per);
  for (int64_t i = r.lo + threadIdx.x; i < r.hi; i += blockDim.x) {
    const uint32_t k = magnitudeKey(vals[i]);
    kept += k > key;
    ties += k == key;
  }
  using Reduce = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  uint32_t totalKept = 0, totalTies = 0, ignored = 0;
  Reduce(temp).ExclusiveSum(kept, ignored, totalKept);
  __syncthreads();
  Reduce(temp).ExclusiveSum(ties, ignored, totalTies);
  if (threadIdx.x == 0) {
    sel->kept[blockIdx.x] = totalKept;
    sel->ties[blockIdx.x] = totalTies;
  }
}

// One block of kMaxBlocks threads: ties go to the lowest blocks first; each
// block's entries start after all earlier blocks' entries.
__global__ void planKernel(int blocks, Select* sel) {
  using Scan = cub::BlockScan<uint32_t, kMaxBlocks>;
  __shared__ typename Scan::TempStorage temp;
  const int b = threadIdx.x;
  const uint32_t ties = b < blocks ? sel->ties[b] : 0u;
  uint32_t tiesBefore = 0;
  Scan(temp).ExclusiveSum(ties, tiesBefore);
  __syncthreads();
  const int64_t left = sel->need - static_cast<int64_t>(tiesBefore);
  const uint32_t take = static_cast<uint32_t>(left <= 0 ? 0 : (left < ties ? left : ties));
  const uint32_t mine = (b < blocks ? sel->kept[b] : 0u) + take;
  uint32_t offset = 0;
  Scan(temp).ExclusiveSum(mine, offset);
  if (b < blocks) {
    sel->take[b] = take;
    sel->offset[b] = offset;
  }
}

// Per block, in index order: packs the kept entries at the block's offset
// and zeroes them in the residual.
__global__ void writeKernel(const float* vals, float* res, int64_t n, int64_t per, Select* sel,
                            int32_t* outIdx, float* outVal) {
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  const uint32_t key = sel->prefix;
  const uint32_t take = sel->take[blockIdx.x];
  uint32_t at = sel->offset[blockIdx.x];
  uint32_t tiesSeen = 0;
  const Range r = blockRange(n, per);
  for (int64_t base = r.lo; base < r.hi; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const float v = i < r.hi ? vals[i] : 0.f;
    const uint32_t k = i < r.hi ? magnitudeKey(v) : 0u;
    const uint32_t tie = i < r.hi && k == key;
    uint32_t tieRank = 0, tileTies = 0;
    Scan(temp).ExclusiveSum(tie, tieRank, tileTies);
    __syncthreads();
    const uint32_t keep = i < r.hi && (k > key || (tie && tiesSeen + tieRank < take));
    uint32_t slot = 0, tileKept = 0;
    Scan(temp).ExclusiveSum(keep, slot, tileKept);
    __syncthreads();
    if (keep) {
      outIdx[at + slot] = static_cast<int32_t>(i);
      outVal[at + slot] = v;
      if (res != nullptr) res[i] = 0.f;
    }
    at += tileKept;
    tiesSeen += tileTies;
  }
}

// out[idx] += val for one rank's pairs (indices distinct within a rank).
__global__ void scatterAddKernel(const int32_t* idx, const float* val, int64_t k, int64_t n,
                                 float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < k;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t p = idx[i];
    if (p < 0 || p >= n) __trap();  // a corrupt payload: fail the stream, never write outside
    out[p] = __fadd_rn(out[p], val[i]);
  }
}

// Divides each touched entry once: a pair divides unless a later rank holds
// the same index (each rank's indices ascend, so a binary search finds it).
__global__ void divideKernel(const uint8_t* rows, int64_t rowBytes, int world, int64_t k,
                             float divisor, float* out) {
  const int64_t total = static_cast<int64_t>(world) * k;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(t / k);
    const int32_t p = reinterpret_cast<const int32_t*>(rows + r * rowBytes)[t - r * k];
    bool later = false;
    for (int q = r + 1; q < world && !later; ++q) {
      const int32_t* list = reinterpret_cast<const int32_t*>(rows + q * rowBytes);
      int64_t lo = 0, hi = k;
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (list[mid] < p)
          lo = mid + 1;
        else
          hi = mid;
      }
      later = lo < k && list[lo] == p;
    }
    if (!later) out[p] = __fdiv_rn(out[p], divisor);
  }
}

}  // namespace

void topkEncode(const at::Tensor& src, const at::Tensor& residual, int64_t k,
                const at::Tensor& packed) {
  TORCH_CHECK(src.defined() || residual.defined(), "xcomm: top-k encode needs a source");
  const at::Tensor& any = src.defined() ? src : residual;
  for (const at::Tensor* t : {&src, &residual}) {
    if (!t->defined()) continue;
    checkDevice(*t, "the top-k input");
    TORCH_CHECK(t->scalar_type() == at::kFloat, "xcomm: the top-k input must be float32");
  }
  checkDevice(packed, "the top-k payload");
  const int64_t n = any.numel();
  TORCH_CHECK(k >= 1 && k <= n && packed.numel() == k * 8,
              "xcomm: top-k payload does not hold k = ", k, " pairs of ", n, " elements");
  c10::cuda::CUDAGuard guard(any.device());
  const auto stream = streamFor(any);
  // Blocks own contiguous ranges of whole tiles.
  const int64_t tiles = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(std::min<int64_t>(kMaxBlocks, (tiles + 3) / 4));
  const int64_t per = ((tiles + blocks - 1) / blocks) * kThreads;
  at::Tensor state =
      at::empty({static_cast<int64_t>(sizeof(Select))}, any.options().dtype(at::kByte));
  auto* sel = reinterpret_cast<Select*>(state.data_ptr<uint8_t>());
  C10_CUDA_CHECK(cudaMemsetAsync(sel, 0, sizeof(Select), stream));
  const float* s = src.defined() ? src.data_ptr<float>() : nullptr;
  float* res = residual.defined() ? residual.data_ptr<float>() : nullptr;
  prepareKernel<<<blocks, kThreads, 0, stream>>>(s, res, n, per, k, sel);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const float* vals = res != nullptr ? res : s;
  for (int level = 0; level < kLevels; ++level) {
    if (level > 0) {
      histKernel<<<blocks, kThreads, 0, stream>>>(vals, n, per, level, sel);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    pickKernel<<<1, kBins / 2, 0, stream>>>(level, sel);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  countKernel<<<blocks, kThreads, 0, stream>>>(vals, n, per, sel);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  planKernel<<<1, kMaxBlocks, 0, stream>>>(blocks, sel);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto* base = packed.data_ptr<uint8_t>();
  writeKernel<<<blocks, kThreads, 0, stream>>>(vals, res, n, per, sel,
                                               reinterpret_cast<int32_t*>(base),
                                               reinterpret_cast<float*>(base + 4 * k));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The state is freed to torch's caching allocator on this stream: reused
  // only by work queued after these kernels.
}

void topkDecode(const at::Tensor& rows, int64_t k, float divisor, const at::Tensor& out) {
  checkDevice(rows, "the top-k payloads");
  checkDevice(out, "the top-k output");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "xcomm: the top-k output must be float32");
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == 8 * k,
              "xcomm: top-k payloads have the wrong shape");
  const int64_t n = out.numel();
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  const auto stream = streamFor(out);
  C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr<float>(), 0, n * sizeof(float), stream));
  const int world = static_cast<int>(rows.size(0));
  if (k == 0 || world == 0) return;
  const auto* base = rows.data_ptr<uint8_t>();
  const int64_t rowBytes = rows.size(1);
  const unsigned blocks = blocksFor(k, kThreads) > 4096 ? 4096 : blocksFor(k, kThreads);
  for (int r = 0; r < world; ++r) {  // rank order: the same bits on every rank
    const uint8_t* row = base + r * rowBytes;
    scatterAddKernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const int32_t*>(row),
                                                      reinterpret_cast<const float*>(row + 4 * k),
                                                      k, n, out.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (divisor != 1.f) {
    const unsigned dblocks =
        blocksFor(world * k, kThreads) > 4096 ? 4096 : blocksFor(world * k, kThreads);
    divideKernel<<<dblocks, kThreads, 0, stream>>>(base, rowBytes, world, k, divisor,
                                                   out.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace cuda
}  // namespace xcomm
