// Exact top-k on the GPU: a radix select of the k-th largest magnitude, then
// one ordered pass that packs the selected entries.
//
// The selection is TopKCodec's on the CPU, exactly: every entry whose
// magnitude key (float bits without the sign; NaN above Inf) is above the
// k-th largest key, then the entries equal to it by lowest index, packed as
// [k int32 indices, ascending | k float32 values]. The k-th key is found 11
// + 10 + 10 bits at a time: a histogram of bits 30..20, then of the other 20
// bits of the entries in the chosen bin (a 1024-bin coarse histogram in
// shared memory, a 2^20-bin fine one in global memory, touched by those few
// entries only). The chosen entries are then marked in two bitmaps (above
// the k-th key; equal to it), with a count per tile of 32768 entries, and
// the pack walks the bitmaps: each block takes one tile, starts after the
// counts of the tiles before it, and numbers its entries in index order with
// a block scan (no sort, no pass that plans the offsets).
//
// Two ways to the first histogram:
// - radix (small buckets, or k above n / 8): the pass that adds the
//   residual histograms every entry; the refine and mark passes read the
//   bucket again. Four kernels and a memset.
// - sampled (the default on large buckets at low density): a strided sample
//   of the entries (32K of them) sets a threshold safely below the k-th
//   magnitude; the pass that adds the residual appends every entry at or
//   above it to a candidate list (a few k entries, spread over 64 sub-lists
//   so their counters do not contend) and histograms the candidates; refine
//   and mark then walk the candidates only. The k largest magnitudes are all
//   at or above the threshold whenever at least k candidates were found, so
//   the result is the same bits. When the sample misled (fewer than k
//   candidates, or a sub-list overflowed), one more kernel histograms every
//   entry and the passes after it select over every entry instead: decided
//   on the device, so the host never waits. Six kernels and a memset.
//
// The sampled path is the default where it applies; XCOMM_TOPK_SELECT=radix
// turns it off. Both are checked bit for bit against the CPU codec on a GPU
// (tests/gpu/test_cuda_codecs.py runs both) and on the emulated GPU
// (tests/cuda_emulation/test_emulated_topk.cpp).
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <limits>

#include <cub/block/block_scan.cuh>

#include "compress/cuda/CudaCodecs.hpp"
#include "compress/cuda/CudaLaunch.cuh"

namespace xcomm {
namespace cuda {
namespace {

constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;              // loads in flight per lane
constexpr int kTopBins = 2048;          // bits 30..20
constexpr int kCoarseBins = 1024;       // bits 19..10
constexpr int kFineBins = 1 << 20;      // bits 19..0
constexpr int kSamples = 32768;         // the sampled path's sample size
constexpr int kSubLists = 64;           // candidate sub-lists (counters apart)
constexpr int kPackWordsPerThread = 4;  // bitmap words per thread of the pack (a uint4)
constexpr int64_t kTileWords = static_cast<int64_t>(kThreads) * kPackWordsPerThread;
constexpr int kTileShift = 15;  // a tile: 32768 entries, one pack block
static_assert(kTileWords * 32 == (int64_t{1} << kTileShift), "a tile is one pack block");

// Device-side state of one selection (zeroed before each).
struct Select {
  uint32_t top[kTopBins];     // sampled: the candidates' histogram of bits 30..20
  uint32_t allTop[kTopBins];  // every entry's (radix, or the candidates fell short)
  uint32_t coarse[kCoarseBins];
  uint32_t everyEntry;  // 1: select over every entry, not the candidates
  uint32_t prefix;      // the top bin of the k-th key (refine)
  int64_t need;         // how many entries of that bin are still to take (refine)
  int64_t kthNeed;      // how many entries equal to the k-th key to take (mark)
  // The sampled path.
  uint32_t sampleTop[kTopBins];   // the sample's histogram of bits 30..20
  uint32_t count[kSubLists][32];  // entries appended per sub-list (one per 128-byte line)
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

// One step of a lane's entries (4 x kUnroll, below hi) of a = src +
// residual, stored back into the residual; of whichever is given alone.
template <bool kVec>
__device__ inline void loadStep(const float* src, float* res, int64_t base, int64_t hi,
                                float4 (&v)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    v[u] = loadQuad<kVec>(src != nullptr ? src : res, quadAt(base, u), hi);
  }
  if (src == nullptr || res == nullptr) return;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const float4 e = loadQuad<kVec>(res, quadAt(base, u), hi);
    v[u] = make_float4(__fadd_rn(v[u].x, e.x), __fadd_rn(v[u].y, e.y), __fadd_rn(v[u].z, e.z),
                       __fadd_rn(v[u].w, e.w));
    storeQuad<kVec>(res, quadAt(base, u), hi, v[u]);
  }
}

// The radix path's first pass: a = src + residual, stored into residual
// (when both are given), and the histogram of bits 30..20 over every entry.
template <bool kVec>
__global__ void prepareKernel(const float* src, float* res, int64_t n, int64_t per, Select* sel) {
  __shared__ uint32_t hist[kTopBins];
  if (blockIdx.x == 0 && threadIdx.x == 0) sel->everyEntry = 1;
  clearShared(hist, kTopBins);
  const Range r = warpRange(n, per);
  for (int64_t base = r.lo; base < r.hi; base += kStep) {
    float4 v[kUnroll];
    loadStep<kVec>(src, res, base, r.hi, v);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        countInto(hist, magnitudeKey(component(v[u], j)) >> 20, quadAt(base, u) + j < r.hi);
      }
    }
  }
  flushShared(hist, sel->allTop, kTopBins);
}

// The sampled path's candidate lists, and how many blocks of a pass walk
// them: about 8 list slots per thread, which for few candidates is fewer
// blocks than the passes over the bucket launch (those beyond return at
// once; they are there for the fallback).
struct Candidates {
  uint2* list;  // kSubLists sub-lists of subCap (index, key) pairs
  uint32_t subCap;
  int blocks;
};

// Calls fn(index, key, valid) on all 32 lanes of every warp, for every
// candidate or (all) for every entry of the bucket.
template <bool kVec, typename Fn>
__device__ inline void forEachEntry(bool all, const float* vals, int64_t n, int64_t per,
                                    const Select* sel, const Candidates& cands, Fn&& fn) {
  if (all) {
    const Range r = warpRange(n, per);
    for (int64_t base = r.lo; base < r.hi; base += kStep) {
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = loadQuad<kVec>(vals, quadAt(base, u), r.hi);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t i = quadAt(base, u) + j;
          fn(i, magnitudeKey(component(v[u], j)), i < r.hi);
        }
      }
    }
    return;
  }
  const uint32_t subCap = cands.subCap;
  const int64_t slots = static_cast<int64_t>(kSubLists) * subCap;
  const int64_t warps = static_cast<int64_t>(cands.blocks) * kWarps;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  for (int64_t g0 = w * 32; g0 < slots; g0 += warps * 32) {
    const int64_t g = g0 + lane();
    bool valid = false;
    uint2 c = make_uint2(0u, 0u);
    if (g < slots) {
      const int64_t list = g / subCap;
      const uint32_t at = static_cast<uint32_t>(g - list * subCap);
      valid = at < sel->count[list][0];
      if (valid) c = cands.list[g];
    }
    fn(static_cast<int64_t>(c.x), c.y, valid);
  }
}

// In hist[0, kBins), counted from the top bin down: the bin that holds the
// need-th largest entry, and how many of that bin's entries are still
// needed. Block-wide, kBlock threads (every thread gets the answer); bin 0
// and `need` when the histogram holds fewer than `need` entries.
template <int kBlock, int kBins>
struct BinPick {
  static_assert(kBins % kBlock == 0, "whole bins per thread");
  static constexpr int kPer = kBins / kBlock;
  using Scan = cub::BlockScan<uint32_t, kBlock>;
  struct Storage {
    typename Scan::TempStorage scan;
    uint32_t bin;
    int64_t left;
  };
  __device__ static void run(Storage& st, const uint32_t* hist, int64_t need, uint32_t* bin,
                             int64_t* left) {
    // Thread t holds bins kBins-1-t*kPer down to kBins-(t+1)*kPer: descending,
    // so an exclusive scan counts the entries in the bins above each.
    const int hi = kBins - 1 - static_cast<int>(threadIdx.x) * kPer;
    uint32_t c[kPer];
    uint32_t mine = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      c[j] = hist[hi - j];
      mine += c[j];
    }
    if (threadIdx.x == 0) {
      st.bin = 0;
      st.left = need;
    }
    uint32_t before = 0;
    Scan(st.scan).ExclusiveSum(mine, before);
    __syncthreads();
    int64_t above = before;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (above < need && above + c[j] >= need) {  // one thread, one bin
        st.bin = static_cast<uint32_t>(hi - j);
        st.left = need - above;
      }
      above += c[j];
    }
    __syncthreads();
    *bin = st.bin;
    *left = st.left;
    __syncthreads();  // st may be reused
  }
};

// For the entries in the top bin that holds the k-th largest key (picked
// here, by every block alike, from the top histogram; block 0 records it):
// the coarse and fine histograms of their other 20 bits. Over every entry
// (the radix path, or the sampled path's fallback), or over the candidates.
template <bool kVec>
__global__ void refineKernel(const float* vals, int64_t n, int64_t per, int64_t k, Select* sel,
                             Candidates cands) {
  __shared__ uint32_t hist[kCoarseBins];
  __shared__ typename BinPick<kThreads, kTopBins>::Storage pick;
  const bool all = sel->everyEntry != 0;
  if (!all && static_cast<int>(blockIdx.x) >= cands.blocks) return;  // the whole block
  uint32_t top = 0;
  int64_t need = 0;
  BinPick<kThreads, kTopBins>::run(pick, all ? sel->allTop : sel->top, k, &top, &need);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    sel->prefix = top;
    sel->need = need;
  }
  clearShared(hist, kCoarseBins);
  forEachEntry<kVec>(all, vals, n, per, sel, cands, [&](int64_t, uint32_t key, bool valid) {
    const bool in = valid && (key >> 20) == top;
    if (__any_sync(0xffffffffu, in)) {
      countInto(hist, (key >> 10) & (kCoarseBins - 1), in);
      if (in) atomicAdd(&sel->fine[key & (kFineBins - 1)], 1u);
    }
  });
  flushShared(hist, sel->coarse, kCoarseBins);
}

// Marks the domain's entries above the k-th key in `above` and those equal
// to it in `equal` (one bit per entry of the bucket), and counts both per
// tile: tileCounts[0, tiles) above, tileCounts[tiles, 2 tiles) equal. Every
// block first finishes the k-th key, alike, from refine's histograms: the
// coarse bin (bits 19..10) under the chosen top bin, then the fine bin (bits
// 9..0) under it; block 0 records how many of the entries equal to it to
// take (the pack needs only that: the bitmaps hold the rest).
template <bool kVec>
__global__ void markKernel(const float* vals, int64_t n, int64_t per, Select* sel, Candidates cands,
                           uint32_t* above, uint32_t* equal, uint32_t* tileCounts, int64_t tiles) {
  const bool all = sel->everyEntry != 0;
  if (!all && static_cast<int>(blockIdx.x) >= cands.blocks) return;  // the whole block
  __shared__ typename BinPick<kThreads, kCoarseBins>::Storage pick;
  __shared__ uint32_t fine[kCoarseBins];
  uint32_t coarse = 0, bin = 0;
  int64_t need = 0;
  BinPick<kThreads, kCoarseBins>::run(pick, sel->coarse, sel->need, &coarse, &need);
  for (int b = threadIdx.x; b < kCoarseBins; b += blockDim.x) {
    fine[b] = sel->fine[(coarse << 10) | static_cast<uint32_t>(b)];
  }
  __syncthreads();
  BinPick<kThreads, kCoarseBins>::run(pick, fine, need, &bin, &need);
  const uint32_t kth = (((sel->prefix << 10) | coarse) << 10) | bin;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    sel->kthNeed = need;
  }
  forEachEntry<kVec>(all, vals, n, per, sel, cands, [&](int64_t i, uint32_t key, bool valid) {
    const bool marked = valid && key >= kth;
    if (!__any_sync(0xffffffffu, marked)) return;
    const bool isAbove = marked && key > kth;
    if (marked) atomicOr((isAbove ? above : equal) + (i >> 5), 1u << (i & 31));
    // One atomic per tile the warp touched.
    const uint32_t tile = marked ? static_cast<uint32_t>(i >> kTileShift) : 0xffffffffu;
    const unsigned peers = __match_any_sync(0xffffffffu, tile);
    const unsigned ups = __ballot_sync(0xffffffffu, isAbove);
    if (marked && lane() == __ffs(peers) - 1) {
      const auto a = static_cast<uint32_t>(__popc(peers & ups));
      const auto e = static_cast<uint32_t>(__popc(peers)) - a;
      if (a != 0u) atomicAdd(&tileCounts[tile], a);
      if (e != 0u) atomicAdd(&tileCounts[tiles + tile], e);
    }
  });
}

// One block per tile of the bitmaps: packs the entries above the k-th key
// and the first kthNeed entries equal to it (over the whole bucket, in
// index order) at their place in the payload, in index order, and zeroes
// them in the residual. A tile starts after the entries of the tiles before
// it (their counts, summed by the block: 512 tiles for a 64 MiB bucket,
// 8192 for 1 GiB); a thread's 4 words after the block's earlier threads' (a
// block scan).
__global__ void packKernel(const uint32_t* above, const uint32_t* equal, const uint32_t* tileCounts,
                           int64_t tiles, const Select* sel, const float* vals, float* res,
                           int32_t* outIdx, float* outVal) {
  // Counts travel as (above << 32) | equal: each fits 31 bits.
  using Scan = cub::BlockScan<unsigned long long, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int64_t tile = blockIdx.x;
  unsigned long long earlier = 0;
  for (int64_t t = threadIdx.x; t < tile; t += blockDim.x) {
    earlier += (static_cast<unsigned long long>(tileCounts[t]) << 32) | tileCounts[tiles + t];
  }
  unsigned long long unused = 0, beforeTile = 0;
  Scan(scan).ExclusiveSum(earlier, unused, beforeTile);
  __syncthreads();  // the scan's storage is reused
  const int64_t x0 = tile * kTileWords + static_cast<int64_t>(threadIdx.x) * kPackWordsPerThread;
  // The bitmaps are padded to whole tiles: 16-byte loads, never past the end.
  const uint4 up4 = *reinterpret_cast<const uint4*>(above + x0);
  const uint4 eq4 = *reinterpret_cast<const uint4*>(equal + x0);
  const uint32_t up[4] = {up4.x, up4.y, up4.z, up4.w};
  const uint32_t eq[4] = {eq4.x, eq4.y, eq4.z, eq4.w};
  unsigned long long mine = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    mine += (static_cast<unsigned long long>(__popc(up[j])) << 32) |
            static_cast<unsigned long long>(__popc(eq[j]));
  }
  unsigned long long before = 0;
  Scan(scan).ExclusiveSum(mine, before);
  before += beforeTile;
  auto kept = static_cast<int64_t>(before >> 32);
  auto ties = static_cast<int64_t>(before & 0xffffffffu);
  const int64_t need = sel->kthNeed;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    // This word's ties are the next ones in index order: take its lowest
    // bits while ties remain to be taken.
    uint32_t chosen = up[j];
    uint32_t e = eq[j];
    for (int64_t left = need - ties; e != 0u && left > 0; --left) {
      const uint32_t lowest = e & (~e + 1u);
      chosen |= lowest;
      e ^= lowest;
    }
    int64_t slot = kept + min(ties, need);
    while (chosen != 0u) {
      const int bit = __ffs(chosen) - 1;
      const int64_t i = (x0 + j) * 32 + bit;
      outIdx[slot] = static_cast<int32_t>(i);
      outVal[slot] = vals[i];
      if (res != nullptr) res[i] = 0.f;
      ++slot;
      chosen &= chosen - 1u;
    }
    kept += __popc(up[j]);
    ties += __popc(eq[j]);
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

// The decode: each block owns a tile of the output, sums into it in shared
// memory every rank's pairs that fall there, in rank order, divides the
// touched entries once, and writes the tile whole (zeros included): one
// pass over the output instead of a memset, a scatter per rank and a
// division pass. Where each rank's pairs for a tile begin is read from a
// table one small kernel makes first (a block searching the lists itself
// spent its time in dependent loads and barriers: the decode took 74 us
// of a 64 MiB bucket on an H200, where writing it takes about 20).
constexpr int kDecodeTile = 4096;
constexpr int kDecodeThreads = 256;

// starts[r * (tiles + 1) + t]: the first position in rank r's ascending list
// whose index is in tile t or later (k where none is); t = tiles gives k.
// One thread per pair: the pair at j starts every tile after its
// predecessor's, up to its own; the last pair also ends the list. A corrupt
// payload (an index outside the output, or out of order) fails the stream.
__global__ void tileStartsKernel(const uint8_t* rows, int64_t rowBytes, int world, int64_t k,
                                 int64_t n, int64_t tiles, int32_t* starts) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= world * k) return;
  const int64_t r = g / k, j = g % k;
  const auto* idx = reinterpret_cast<const int32_t*>(rows + r * rowBytes);
  const int32_t p = idx[j];
  if (p < 0 || p >= n || (j > 0 && idx[j - 1] >= p)) __trap();
  int32_t* mine = starts + r * (tiles + 1);
  const int64_t tile = p / kDecodeTile;
  const int64_t after = j == 0 ? -1 : idx[j - 1] / kDecodeTile;
  for (int64_t t = after + 1; t <= tile; ++t) mine[t] = static_cast<int32_t>(j);
  if (j == k - 1) {
    for (int64_t t = tile + 1; t <= tiles; ++t) mine[t] = static_cast<int32_t>(k);
  }
}

// rows: `world` payloads of [k int32 indices ascending | k float32 values].
__global__ void decodeKernel(const uint8_t* rows, int64_t rowBytes, int world, int64_t k, int64_t n,
                             const int32_t* starts, int64_t tiles, float divisor, float* out) {
  __shared__ float tile[kDecodeTile];
  __shared__ uint32_t touched[kDecodeTile / 32];
  const int t = static_cast<int>(threadIdx.x);
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kDecodeTile;
  const int64_t hi = min(n, lo + kDecodeTile);
  for (int i = t; i < kDecodeTile; i += blockDim.x) tile[i] = 0.f;
  for (int i = t; i < kDecodeTile / 32; i += blockDim.x) touched[i] = 0u;
  __syncthreads();
  for (int r = 0; r < world; ++r) {  // rank order: the same bits on every rank
    const auto* idx = reinterpret_cast<const int32_t*>(rows + r * rowBytes);
    const auto* val = reinterpret_cast<const float*>(rows + r * rowBytes + 4 * k);
    const int32_t* mine = starts + r * (tiles + 1);
    const int64_t begin = mine[blockIdx.x], end = mine[blockIdx.x + 1];
    for (int64_t j = begin + t; j < end; j += blockDim.x) {
      const auto p = static_cast<int>(idx[j] - lo);  // distinct within a rank
      tile[p] = __fadd_rn(tile[p], val[j]);
      atomicOr(&touched[p >> 5], 1u << (p & 31));  // a word's bits: several threads
    }
    __syncthreads();
  }
  for (int64_t i = t; i < hi - lo; i += blockDim.x) {
    float v = tile[i];
    if (divisor != 1.f && (touched[i >> 5] >> (i & 31) & 1u) != 0u) v = __fdiv_rn(v, divisor);
    out[lo + i] = v;
  }
}

// ---------------------------------------------------------------------------
// The sampled path

// The histogram of bits 30..20 of `samples` entries spread evenly over the
// bucket (a = src + residual, as the add pass will compute it).
__global__ void sampleKernel(const float* src, const float* res, int64_t n, int samples,
                             Select* sel) {
  __shared__ uint32_t hist[kTopBins];
  clearShared(hist, kTopBins);
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool valid = j < samples;
  uint32_t key = 0;
  if (valid) {
    const int64_t i = j * n / samples + n / samples / 2;  // < n
    float a = src != nullptr ? src[i] : res[i];
    if (src != nullptr && res != nullptr) a = __fadd_rn(a, res[i]);
    key = magnitudeKey(a);
  }
  countInto(hist, key >> 20, valid);
  flushShared(hist, sel->sampleTop, kTopBins);
}

// a = src + residual, stored into residual (when both are given), as in
// prepareKernel; every entry whose key is at or above the threshold is
// appended to a sub-list as (index, key), and counted in the histogram of
// the candidates' bits 30..20. One atomic per warp per step on the
// sub-lists' counters, on a sub-list that changes from step to step and
// warp to warp.
//
// The threshold, which every block computes alike from the sample's
// histogram: the lower edge of the top bin at which the sample holds its
// expected share of the top k plus four standard deviations and 8; 0
// (every entry a candidate) when the sample never gets there.
template <bool kVec>
__global__ void addSelectKernel(const float* src, float* res, int64_t n, int64_t per, int64_t k,
                                int samples, Select* sel, uint2* cand, uint32_t subCap) {
  __shared__ typename BinPick<kThreads, kTopBins>::Storage pick;
  __shared__ uint32_t hist[kTopBins];
  const double expected = static_cast<double>(samples) * static_cast<double>(k) / n;
  const auto want = static_cast<int64_t>(ceil(expected + 4.0 * sqrt(expected) + 8.0));
  uint32_t bin = 0;
  int64_t unused = 0;
  BinPick<kThreads, kTopBins>::run(pick, sel->sampleTop, want, &bin, &unused);
  const uint32_t threshold = bin << 20;
  clearShared(hist, kTopBins);
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const Range r = warpRange(n, per);
  int64_t iteration = 0;
  for (int64_t base = r.lo; base < r.hi; base += kStep, ++iteration) {
    float4 v[kUnroll];
    loadStep<kVec>(src, res, base, r.hi, v);
    uint32_t mine = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mine += quadAt(base, u) + j < r.hi && magnitudeKey(component(v[u], j)) >= threshold;
      }
    }
    uint32_t total = 0;
    uint32_t at = lanePrefix(mine, &total);
    if (total == 0) continue;
    const int list = static_cast<int>((w + 17 * iteration) % kSubLists);
    uint32_t first = 0;
    if (lane() == 0) first = atomicAdd(&sel->count[list][0], total);
    at += __shfl_sync(0xffffffffu, first, 0);
    uint2* out = cand + static_cast<int64_t>(list) * subCap;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t i = quadAt(base, u) + j;
        const uint32_t key = magnitudeKey(component(v[u], j));
        if (i < r.hi && key >= threshold) {
          atomicAdd(&hist[key >> 20], 1u);
          if (at < subCap) out[at] = make_uint2(static_cast<uint32_t>(i), key);
          ++at;
        }
      }
    }
  }
  flushShared(hist, sel->top, kTopBins);
}

// Whether the candidates hold the top k: at least k of them, none lost to
// a full sub-list. Every block reads the same counts, so all agree.
__device__ inline bool candidatesFellShort(const Select* sel, int64_t k, uint32_t subCap) {
  int64_t total = 0;
  bool overflow = false;
  for (int l = 0; l < kSubLists; ++l) {
    const uint32_t c = sel->count[l][0];
    overflow |= c > subCap;
    total += c;
  }
  return overflow || total < k;
}

// The sampled path's fallback: where the candidates fell short, records that
// the selection runs over every entry and histograms bits 30..20 over every
// entry; otherwise every block returns at once.
template <bool kVec>
__global__ void fallbackTopKernel(const float* vals, int64_t n, int64_t per, int64_t k, Select* sel,
                                  uint32_t subCap) {
  __shared__ uint32_t hist[kTopBins];
  __shared__ bool fellShort;
  if (threadIdx.x == 0) {
    fellShort = candidatesFellShort(sel, k, subCap);
    if (blockIdx.x == 0 && fellShort) sel->everyEntry = 1;
  }
  __syncthreads();
  if (!fellShort) return;  // the whole block
  clearShared(hist, kTopBins);
  forEachEntry<kVec>(true, vals, n, per, sel, Candidates{},
                     [&](int64_t, uint32_t key, bool valid) { countInto(hist, key >> 20, valid); });
  flushShared(hist, sel->allTop, kTopBins);
}

// The sampled path, unless XCOMM_TOPK_SELECT=radix: it pays where the
// bucket is large and k a small share of it.
bool sampledPathFor(int64_t n, int64_t k) {
  const char* select = std::getenv("XCOMM_TOPK_SELECT");
  if (select != nullptr && std::strcmp(select, "radix") == 0) return false;
  return n >= (int64_t{1} << 16) && k * 8 <= n;
}

// What the passes over the bucket (or its candidates) work on.
struct Passes {
  const float* src;
  float* res;
  const float* vals;  // the accumulated entries: res, or src without a residual
  int64_t n, per, k;
  int samples;
  Select* sel;
  Candidates cands;
  uint32_t *above, *equal, *tileCounts;
  int64_t tiles;
  int blocks;
  cudaStream_t stream;
};

// The first histogram (of the candidates, sampled; of every entry when they
// fell short, or radix), then the k-th key and the marks over the
// candidates or every entry; kVec: float4 loads.
template <bool kVec>
void selectPasses(bool sampled, const Passes& p) {
  if (sampled) {
    sampleKernel<<<(p.samples + 1023) / 1024, 1024, 0, p.stream>>>(p.src, p.res, p.n, p.samples,
                                                                   p.sel);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    addSelectKernel<kVec><<<p.blocks, kThreads, 0, p.stream>>>(
        p.src, p.res, p.n, p.per, p.k, p.samples, p.sel, p.cands.list, p.cands.subCap);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    fallbackTopKernel<kVec>
        <<<p.blocks, kThreads, 0, p.stream>>>(p.vals, p.n, p.per, p.k, p.sel, p.cands.subCap);
  } else {
    prepareKernel<kVec><<<p.blocks, kThreads, 0, p.stream>>>(p.src, p.res, p.n, p.per, p.sel);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  refineKernel<kVec><<<p.blocks, kThreads, 0, p.stream>>>(p.vals, p.n, p.per, p.k, p.sel, p.cands);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  markKernel<kVec><<<p.blocks, kThreads, 0, p.stream>>>(p.vals, p.n, p.per, p.sel, p.cands, p.above,
                                                        p.equal, p.tileCounts, p.tiles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(),
              "xcomm: top-k indices are int32; a bucket holds at most 2^31 - 1 elements, got ", n);
  DeviceGuard guard(any.device());
  const auto stream = streamFor(any);
  const bool sampled = sampledPathFor(n, k);
  // Passes over the bucket: warps own contiguous ranges of whole steps, in
  // one wave of the first pass's blocks (the later passes' prologues are no
  // heavier).
  const int64_t steps = (n + kStep - 1) / kStep;
  const int wave = sampled ? residentBlocks(addSelectKernel<true>, kThreads, any.device())
                           : residentBlocks(prepareKernel<true>, kThreads, any.device());
  const int64_t wanted = std::min<int64_t>(static_cast<int64_t>(wave) * kWarps, steps);
  const int blocks = static_cast<int>((wanted + kWarps - 1) / kWarps);
  const int64_t warps = static_cast<int64_t>(blocks) * kWarps;
  const int64_t per = ((steps + warps - 1) / warps) * kStep;
  const float* s = src.defined() ? src.data_ptr<float>() : nullptr;
  float* res = residual.defined() ? residual.data_ptr<float>() : nullptr;
  const float* vals = res != nullptr ? res : s;
  // float4 loads where every pointer is 16-byte aligned (fresh buffers are).
  const bool vec = (reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(res)) % 16 == 0;
  auto* base = packed.data_ptr<uint8_t>();
  auto* outIdx = reinterpret_cast<int32_t*>(base);
  auto* outVal = reinterpret_cast<float*>(base + 4 * k);

  // One allocation: [Select | above | equal | tile counts] zeroed, then the
  // candidates (sampled path only).
  const int64_t tiles = (n + (int64_t{1} << kTileShift) - 1) >> kTileShift;
  const int64_t words = tiles * kTileWords;  // padded to whole tiles
  const int samples = static_cast<int>(std::min<int64_t>(kSamples, n / 8));
  // Room for 3k + 8192 candidates, and half as much again for an uneven spread.
  const int64_t cap = std::min<int64_t>(n, 3 * k + 8192);
  const auto subCap =
      sampled ? static_cast<uint32_t>((3 * cap / 2 + kSubLists - 1) / kSubLists + 64) : 0u;
  constexpr int64_t kAlign = 256;
  const auto aligned = [](int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; };
  const int64_t selBytes = aligned(static_cast<int64_t>(sizeof(Select)));
  const int64_t mapBytes = aligned(words * 4);
  const int64_t countBytes = aligned(tiles * 2 * 4);
  const int64_t zeroed = selBytes + 2 * mapBytes + countBytes;
  const int64_t candBytes = static_cast<int64_t>(kSubLists) * subCap * 8;
  at::Tensor state = at::empty({zeroed + candBytes}, any.options().dtype(at::kByte));
  uint8_t* bytes = state.data_ptr<uint8_t>();
  auto* sel = reinterpret_cast<Select*>(bytes);
  auto* above = reinterpret_cast<uint32_t*>(bytes + selBytes);
  auto* equal = reinterpret_cast<uint32_t*>(bytes + selBytes + mapBytes);
  auto* tileCounts = reinterpret_cast<uint32_t*>(bytes + selBytes + 2 * mapBytes);
  auto* cand = sampled ? reinterpret_cast<uint2*>(bytes + zeroed) : nullptr;
  C10_CUDA_CHECK(cudaMemsetAsync(bytes, 0, zeroed, stream));

  // About 8 candidate slots per thread of the candidate passes.
  const int64_t slots = static_cast<int64_t>(kSubLists) * subCap;
  const int candBlocks =
      static_cast<int>(std::clamp<int64_t>((slots + 8 * kThreads - 1) / (8 * kThreads), 1, blocks));
  const Passes passes{s,       res,    vals,
                      n,       per,    k,
                      samples, sel,    Candidates{cand, subCap, candBlocks},
                      above,   equal,  tileCounts,
                      tiles,   blocks, stream};
  if (vec) {
    selectPasses<true>(sampled, passes);
  } else {
    selectPasses<false>(sampled, passes);
  }
  packKernel<<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(above, equal, tileCounts, tiles,
                                                                    sel, vals, res, outIdx, outVal);
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
  DeviceGuard guard(out.device());
  const auto world = static_cast<int>(k == 0 ? 0 : rows.size(0));
  const int64_t tiles = (n + kDecodeTile - 1) / kDecodeTile;
  const auto stream = streamFor(out);
  // Back to torch's caching allocator on this stream once the decode is queued:
  // reused only by work queued after it.
  at::Tensor starts =
      at::empty({std::max<int64_t>(world, 1) * (tiles + 1)}, out.options().dtype(at::kInt));
  if (world > 0) {
    const int64_t pairs = world * k;
    tileStartsKernel<<<static_cast<unsigned>((pairs + kThreads - 1) / kThreads), kThreads, 0,
                       stream>>>(rows.data_ptr<uint8_t>(), rows.size(1), world, k, n, tiles,
                                 starts.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  decodeKernel<<<static_cast<unsigned>(tiles), kDecodeThreads, 0, stream>>>(
      rows.data_ptr<uint8_t>(), rows.size(1), world, k, n, starts.data_ptr<int32_t>(), tiles,
      divisor, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace xcomm
