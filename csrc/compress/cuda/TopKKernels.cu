// Exact top-k on the GPU: a radix select of the k-th largest magnitude, then
// one ordered pass that packs the selected entries.
//
// The selection is TopKCodec's on the CPU, exactly: every entry whose
// magnitude key (float bits without the sign; NaN above Inf) is above the
// k-th largest key, then the entries equal to it by lowest index, packed as
// [k int32 indices, ascending | k float32 values]. The k-th key is found in
// two passes: the pass that adds the residual also histograms bits 30..20;
// a second pass histograms the other 20 bits of the entries in the chosen
// bin (a 1024-bin coarse histogram in shared memory, a 2^20-bin fine one in
// global memory, touched by those few entries only). Each warp owns one
// contiguous range of the bucket, so the last pass numbers the kept entries
// in index order from per-warp counts (warp scans, no sort, no block
// barrier). Every pass moves 4 consecutive entries per lane (float4s).
#include <cstddef>

#include <cub/block/block_scan.cuh>

#include "compress/cuda/CudaCodecs.hpp"
#include "compress/cuda/CudaLaunch.cuh"

namespace xcomm {
namespace cuda {
namespace {

constexpr int kWarps = kThreads / 32;
constexpr int kMaxBlocks = 1024;
constexpr int kMaxWarps = kMaxBlocks * kWarps;  // the plan kernel scans 8 per thread
constexpr int kUnroll = 4;                      // loads in flight per lane
constexpr int kTopBins = 2048;                  // bits 30..20
constexpr int kCoarseBins = 1024;               // bits 19..10
constexpr int kFineBins = 1 << 20;              // bits 19..0

// Device-side state of one selection (zeroed before each).
struct Select {
  uint32_t top[kTopBins];
  uint32_t coarse[kCoarseBins];
  uint32_t prefix;             // the k-th key's bits found so far (in the end: the key)
  int64_t need;                // how many of the entries matching `prefix` are still to take
  uint32_t kept[kMaxWarps];    // per warp: entries above the key
  uint32_t ties[kMaxWarps];    // per warp: entries equal to it
  uint32_t take[kMaxWarps];    // per warp: how many of its ties are taken
  uint32_t offset[kMaxWarps];  // per warp: where its entries start in the payload
  uint32_t fine[kFineBins];
};

struct Range {
  int64_t lo, hi;
};
// The calling warp's range: warps own consecutive stretches of `per` entries.
__device__ inline Range warpRange(int64_t n, int64_t per) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t lo = w * per;
  return {lo, min(n, lo + per)};
}

__device__ inline int lane() {
  return static_cast<int>(threadIdx.x % 32);
}

// hist[bin] += 1 for every lane with `valid`, one atomic per distinct bin of
// the warp (gradients crowd into few exponents). All 32 lanes call it.
__device__ inline void countInto(uint32_t* hist, uint32_t bin, bool valid) {
  const unsigned peers = __match_any_sync(0xffffffffu, valid ? bin : 0xffffffffu);
  if (valid && lane() == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
}

__device__ inline void clearShared(uint32_t* hist, int bins) {
  for (int b = threadIdx.x; b < bins; b += blockDim.x) hist[b] = 0;
  __syncthreads();
}
__device__ inline void flushShared(const uint32_t* hist, uint32_t* global, int bins) {
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += blockDim.x) {
    if (hist[b] != 0) atomicAdd(&global[b], hist[b]);
  }
}

// Each lane takes 4 consecutive entries at a time (a float4 where the
// pointers allow): base + u * 128 + lane * 4 + 0..3 for u < kUnroll.
constexpr int64_t kStep = 32 * 4 * kUnroll;

__device__ inline int64_t quadAt(int64_t base, int u) {
  return base + u * 128 + lane() * 4;
}

// Entries i..i+3 below hi (the rest read as 0).
template <bool kVec>
__device__ inline float4 loadQuad(const float* p, int64_t i, int64_t hi) {
  if (kVec && i + 4 <= hi) return *reinterpret_cast<const float4*>(p + i);
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (i < hi) v.x = p[i];
  if (i + 1 < hi) v.y = p[i + 1];
  if (i + 2 < hi) v.z = p[i + 2];
  if (i + 3 < hi) v.w = p[i + 3];
  return v;
}
template <bool kVec>
__device__ inline void storeQuad(float* p, int64_t i, int64_t hi, float4 v) {
  if (kVec && i + 4 <= hi) {
    *reinterpret_cast<float4*>(p + i) = v;
    return;
  }
  if (i < hi) p[i] = v.x;
  if (i + 1 < hi) p[i + 1] = v.y;
  if (i + 2 < hi) p[i + 2] = v.z;
  if (i + 3 < hi) p[i + 3] = v.w;
}
__device__ inline float component(const float4& v, int j) {
  return j == 0 ? v.x : (j == 1 ? v.y : (j == 2 ? v.z : v.w));
}

// a = src + residual, stored into residual (when both are given), and the
// histogram of bits 30..20 over every entry.
template <bool kVec>
__global__ void prepareKernel(const float* src, float* res, int64_t n, int64_t per, int64_t k,
                              Select* sel) {
  __shared__ uint32_t hist[kTopBins];
  if (blockIdx.x == 0 && threadIdx.x == 0) sel->need = k;
  clearShared(hist, kTopBins);
  const Range r = warpRange(n, per);
  for (int64_t base = r.lo; base < r.hi; base += kStep) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      v[u] = loadQuad<kVec>(src != nullptr ? src : res, quadAt(base, u), r.hi);
    }
    if (src != nullptr && res != nullptr) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float4 e = loadQuad<kVec>(res, quadAt(base, u), r.hi);
        v[u] = make_float4(__fadd_rn(v[u].x, e.x), __fadd_rn(v[u].y, e.y), __fadd_rn(v[u].z, e.z),
                           __fadd_rn(v[u].w, e.w));
        storeQuad<kVec>(res, quadAt(base, u), r.hi, v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        countInto(hist, magnitudeKey(component(v[u], j)) >> 20, quadAt(base, u) + j < r.hi);
      }
    }
  }
  flushShared(hist, sel->top, kTopBins);
}

// For the entries in the chosen top bin: the coarse and fine histograms of
// their other 20 bits.
template <bool kVec>
__global__ void refineKernel(const float* vals, int64_t n, int64_t per, Select* sel) {
  __shared__ uint32_t hist[kCoarseBins];
  clearShared(hist, kCoarseBins);
  const uint32_t top = sel->prefix;
  const Range r = warpRange(n, per);
  for (int64_t base = r.lo; base < r.hi; base += kStep) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = loadQuad<kVec>(vals, quadAt(base, u), r.hi);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t key = magnitudeKey(component(v[u], j));
        const bool in = quadAt(base, u) + j < r.hi && (key >> 20) == top;
        if (__any_sync(0xffffffffu, in)) {
          countInto(hist, (key >> 10) & (kCoarseBins - 1), in);
          if (in) atomicAdd(&sel->fine[key & (kFineBins - 1)], 1u);
        }
      }
    }
  }
  flushShared(hist, sel->coarse, kCoarseBins);
}

// One block of 1024 threads: in hist[0, 2^bits), the bin that holds the
// need-th largest entry; appends it to the prefix and takes the entries in
// the bins above it off `need`.
__global__ void pickKernel(const uint32_t* hist, int bits, Select* sel) {
  using Scan = cub::BlockScan<uint32_t, 1024>;
  __shared__ typename Scan::TempStorage temp;
  const int bins = 1 << bits;
  // Thread t holds bins (bins-1-2t, bins-2-2t): descending, so an exclusive
  // scan counts the entries in the bins above each.
  const int hiBin = bins - 1 - 2 * static_cast<int>(threadIdx.x), loBin = hiBin - 1;
  const uint32_t cHi = hiBin >= 0 ? hist[hiBin] : 0u;
  const uint32_t cLo = loBin >= 0 ? hist[loBin] : 0u;
  uint32_t before = 0;
  Scan(temp).ExclusiveSum(cHi + cLo, before);
  const int64_t need = sel->need;
  __syncthreads();
  const int64_t atOrAbove = static_cast<int64_t>(before) + cHi;
  if (hiBin >= 0 && before < need && atOrAbove >= need) {
    sel->prefix = (sel->prefix << bits) | static_cast<uint32_t>(hiBin);
    sel->need = need - before;
  } else if (loBin >= 0 && atOrAbove < need && atOrAbove + cLo >= need) {
    sel->prefix = (sel->prefix << bits) | static_cast<uint32_t>(loBin);
    sel->need = need - atOrAbove;
  }
}

// pickKernel over the fine bins under the chosen coarse bin.
__global__ void pickFineKernel(Select* sel) {
  // The coarse pick left prefix = top << 10 | coarse; its fine bins follow.
  const uint32_t coarse = sel->prefix & (kCoarseBins - 1);
  __shared__ uint32_t hist[kCoarseBins];
  for (int b = threadIdx.x; b < kCoarseBins; b += blockDim.x) {
    hist[b] = sel->fine[(coarse << 10) | static_cast<uint32_t>(b)];
  }
  __syncthreads();
  using Scan = cub::BlockScan<uint32_t, 1024>;
  __shared__ typename Scan::TempStorage temp;
  const int hiBin = kCoarseBins - 1 - 2 * static_cast<int>(threadIdx.x), loBin = hiBin - 1;
  const uint32_t cHi = hiBin >= 0 ? hist[hiBin] : 0u;
  const uint32_t cLo = loBin >= 0 ? hist[loBin] : 0u;
  uint32_t before = 0;
  Scan(temp).ExclusiveSum(cHi + cLo, before);
  const int64_t need = sel->need;
  __syncthreads();
  const int64_t atOrAbove = static_cast<int64_t>(before) + cHi;
  if (hiBin >= 0 && before < need && atOrAbove >= need) {
    sel->prefix = (sel->prefix << 10) | static_cast<uint32_t>(hiBin);
    sel->need = need - before;
  } else if (loBin >= 0 && atOrAbove < need && atOrAbove + cLo >= need) {
    sel->prefix = (sel->prefix << 10) | static_cast<uint32_t>(loBin);
    sel->need = need - atOrAbove;
  }
}

// Per warp: entries above the k-th key, and entries equal to it.
template <bool kVec>
__global__ void countKernel(const float* vals, int64_t n, int64_t per, Select* sel) {
  const uint32_t key = sel->prefix;
  uint32_t kept = 0, ties = 0;
  const Range r = warpRange(n, per);
  for (int64_t base = r.lo; base < r.hi; base += kStep) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = loadQuad<kVec>(vals, quadAt(base, u), r.hi);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t k = magnitudeKey(component(v[u], j));
        const bool valid = quadAt(base, u) + j < r.hi;
        kept += valid && k > key;
        ties += valid && k == key;
      }
    }
  }
  kept = __reduce_add_sync(0xffffffffu, kept);
  ties = __reduce_add_sync(0xffffffffu, ties);
  if (lane() == 0) {
    const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
    sel->kept[w] = kept;
    sel->ties[w] = ties;
  }
}

// One block of 1024 threads, 8 warps' counts each: ties go to the lowest
// warps first; each warp's entries start after all earlier warps' entries.
__global__ void planKernel(int warps, Select* sel) {
  constexpr int kPer = kMaxWarps / 1024;
  using Scan = cub::BlockScan<uint32_t, 1024>;
  __shared__ typename Scan::TempStorage temp;
  uint32_t ties[kPer], before[kPer], mine[kPer], offset[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int w = static_cast<int>(threadIdx.x) * kPer + j;
    ties[j] = w < warps ? sel->ties[w] : 0u;
  }
  Scan(temp).ExclusiveSum(ties, before);
  __syncthreads();
  const int64_t need = sel->need;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int w = static_cast<int>(threadIdx.x) * kPer + j;
    const int64_t left = need - static_cast<int64_t>(before[j]);
    const uint32_t take = static_cast<uint32_t>(left <= 0 ? 0 : (left < ties[j] ? left : ties[j]));
    mine[j] = (w < warps ? sel->kept[w] : 0u) + take;
    if (w < warps) sel->take[w] = take;
  }
  Scan(temp).ExclusiveSum(mine, offset);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int w = static_cast<int>(threadIdx.x) * kPer + j;
    if (w < warps) sel->offset[w] = offset[j];
  }
}

// Exclusive prefix sum over the warp's lanes, and the warp's total.
__device__ inline uint32_t lanePrefix(uint32_t v, uint32_t* total) {
  uint32_t incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane() >= o) incl += up;
  }
  *total = __shfl_sync(0xffffffffu, incl, 31);
  return incl - v;
}

// Per warp, in index order: packs the kept entries at the warp's offset and
// zeroes them in the residual. A lane's 4 entries precede the next lane's.
template <bool kVec>
__global__ void writeKernel(const float* vals, float* res, int64_t n, int64_t per, Select* sel,
                            int32_t* outIdx, float* outVal) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const uint32_t key = sel->prefix;
  const uint32_t take = sel->take[w];
  uint32_t at = sel->offset[w];
  uint32_t tiesSeen = 0;
  const Range r = warpRange(n, per);
  for (int64_t base = r.lo; base < r.hi; base += kStep) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = loadQuad<kVec>(vals, quadAt(base, u), r.hi);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // u before u + 1: index order
      const int64_t i0 = quadAt(base, u);
      uint32_t keys[4];
      uint32_t tiesHere = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        keys[j] = i0 + j < r.hi ? magnitudeKey(component(v[u], j)) : 0u;
        tiesHere += i0 + j < r.hi && keys[j] == key;
      }
      uint32_t tieTotal = 0;
      uint32_t tieRank = tiesSeen + lanePrefix(tiesHere, &tieTotal);
      bool keep[4];
      uint32_t keptHere = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool valid = i0 + j < r.hi;
        const bool tie = valid && keys[j] == key;
        keep[j] = valid && (keys[j] > key || (tie && tieRank < take));
        tieRank += tie;
        keptHere += keep[j];
      }
      uint32_t keptTotal = 0;
      uint32_t slot = at + lanePrefix(keptHere, &keptTotal);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (!keep[j]) continue;
        outIdx[slot] = static_cast<int32_t>(i0 + j);
        outVal[slot] = component(v[u], j);
        ++slot;
        if (res != nullptr) res[i0 + j] = 0.f;
      }
      at += keptTotal;
      tiesSeen += tieTotal;
    }
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
  // Warps own contiguous ranges of whole steps.
  const int64_t steps = (n + kStep - 1) / kStep;
  const int64_t wanted = std::min<int64_t>(kMaxWarps, steps);
  const int blocks = static_cast<int>((wanted + kWarps - 1) / kWarps);
  const int warps = blocks * kWarps;
  const int64_t per = ((steps + warps - 1) / warps) * kStep;
  at::Tensor state =
      at::empty({static_cast<int64_t>(sizeof(Select))}, any.options().dtype(at::kByte));
  auto* sel = reinterpret_cast<Select*>(state.data_ptr<uint8_t>());
  C10_CUDA_CHECK(cudaMemsetAsync(sel, 0, sizeof(Select), stream));
  const float* s = src.defined() ? src.data_ptr<float>() : nullptr;
  float* res = residual.defined() ? residual.data_ptr<float>() : nullptr;
  const float* vals = res != nullptr ? res : s;
  // float4 loads where every pointer is 16-byte aligned (fresh buffers are).
  const bool vec = (reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(res)) % 16 == 0;
  if (vec) {
    prepareKernel<true><<<blocks, kThreads, 0, stream>>>(s, res, n, per, k, sel);
  } else {
    prepareKernel<false><<<blocks, kThreads, 0, stream>>>(s, res, n, per, k, sel);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto* stateBytes = state.data_ptr<uint8_t>();
  const auto* top = reinterpret_cast<const uint32_t*>(stateBytes + offsetof(Select, top));
  const auto* coarse = reinterpret_cast<const uint32_t*>(stateBytes + offsetof(Select, coarse));
  pickKernel<<<1, 1024, 0, stream>>>(top, 11, sel);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (vec) {
    refineKernel<true><<<blocks, kThreads, 0, stream>>>(vals, n, per, sel);
  } else {
    refineKernel<false><<<blocks, kThreads, 0, stream>>>(vals, n, per, sel);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  pickKernel<<<1, 1024, 0, stream>>>(coarse, 10, sel);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  pickFineKernel<<<1, 1024, 0, stream>>>(sel);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (vec) {
    countKernel<true><<<blocks, kThreads, 0, stream>>>(vals, n, per, sel);
  } else {
    countKernel<false><<<blocks, kThreads, 0, stream>>>(vals, n, per, sel);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  planKernel<<<1, 1024, 0, stream>>>(warps, sel);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto* base = packed.data_ptr<uint8_t>();
  auto* outIdx = reinterpret_cast<int32_t*>(base);
  auto* outVal = reinterpret_cast<float*>(base + 4 * k);
  if (vec) {
    writeKernel<true><<<blocks, kThreads, 0, stream>>>(vals, res, n, per, sel, outIdx, outVal);
  } else {
    writeKernel<false><<<blocks, kThreads, 0, stream>>>(vals, res, n, per, sel, outIdx, outVal);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The state goes back to torch's caching allocator on this stream: reused
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
