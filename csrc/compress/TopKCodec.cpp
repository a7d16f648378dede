#include "compress/TopKCodec.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "compress/cuda/CudaCodecs.hpp"
#include "compress/kernels/CodecKernels.hpp"

namespace xcomm {
namespace {

// Elements per scan block. Blocks are fixed (not per thread), and their
// candidates are joined in block order, so the result is the same for any
// number of threads.
constexpr int64_t kScanBlock = 1 << 16;

// A CPU bucket the fused scan takes (float16 and bfloat16 widened).
bool onCpuScan(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  return t.is_contiguous() && t.device().is_cpu() &&
         (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
          dtype == at::kBFloat16);
}

bool isDenseFloat(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu();
}

// A float32 GPU bucket the CUDA kernels take.
bool onCudaKernels(const at::Tensor& t) {
  return t.is_cuda() && cuda::codecsBuilt() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

// The scan's loops per element type. float32 runs the vectorized kernels;
// float64 (rare in gradients) plain loops with the same contract: keep
// (i, a) when the magnitude key of a = src[i] (+ residual[i], stored back)
// is above the threshold, count the entries equal to it.
template <typename T>
struct ScanOps;

template <>
struct ScanOps<float> {
  using Key = uint32_t;
  static Key key(float x) { return kernels::magnitudeKey(x); }
  static int64_t scan(const float* src, float* residual, int64_t lo, int64_t hi, Key threshold,
                      int32_t* indices, float* values, int64_t cap, int64_t* ties) {
    return kernels::codecKernels().topkScan(src, residual, lo, hi, threshold, indices, values, cap,
                                            ties);
  }
  static int64_t ties(const float* values, int64_t lo, int64_t hi, Key k, int32_t* indices,
                      int64_t cap) {
    return kernels::codecKernels().topkTies(values, lo, hi, k, indices, cap);
  }
  static void addInto(const float* src, float* acc, int64_t n) {
    kernels::codecKernels().addInto(src, acc, 0, n);
  }
};

template <>
struct ScanOps<double> {
  using Key = uint64_t;
  // Bits of |x|: ordered as the magnitudes, NaN above Inf (as for float).
  static Key key(double x) {
    uint64_t bits;
    static_assert(sizeof(bits) == sizeof(x), "double is 64 bits");
    std::memcpy(&bits, &x, sizeof(bits));
    return bits & 0x7fffffffffffffffull;
  }
  template <bool kAdd>
  static int64_t scanRange(const double* src, double* r, int64_t lo, int64_t hi, Key threshold,
                           int32_t* indices, double* values, int64_t cap, int64_t* ties) {
    int64_t count = 0, tied = 0;
    for (int64_t i = lo; i < hi; ++i) {
      double a = src[i];
      if constexpr (kAdd) {
        a = a + r[i];
        r[i] = a;
      }
      const Key k = key(a);
      if (k > threshold) {
        if (count < cap) {
          indices[count] = static_cast<int32_t>(i);
          values[count] = a;
        }
        ++count;
      }
      tied += k == threshold;
    }
    *ties = tied;
    return count;
  }
  static int64_t scan(const double* src, double* residual, int64_t lo, int64_t hi, Key threshold,
                      int32_t* indices, double* values, int64_t cap, int64_t* ties) {
    return residual ? scanRange<true>(src, residual, lo, hi, threshold, indices, values, cap, ties)
                    : scanRange<false>(src, nullptr, lo, hi, threshold, indices, values, cap, ties);
  }
  static int64_t ties(const double* values, int64_t lo, int64_t hi, Key k, int32_t* indices,
                      int64_t cap) {
    int64_t count = 0;
    for (int64_t i = lo; i < hi && count < cap; ++i) {
      if (key(values[i]) == k) indices[count++] = static_cast<int32_t>(i);
    }
    return count;
  }
  static void addInto(const double* src, double* acc, int64_t n) {
    for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + src[i];
  }
};

// Runs the scan kernel over [0, n) in blocks and leaves the (index, value)
// pairs above the threshold in `out`, in index order, and each block's count
// of entries equal to it in scratch.ties; returns how many were above.
// Each block writes into its own stretch of the scratch, sized from `expect`
// (how many should pass in all) with a margin; a block that overflows is
// rescanned read-only into a buffer of its own.
template <typename T>
int64_t scanAll(const T* src, T* residual, int64_t n, typename ScanOps<T>::Key threshold,
                int64_t expect, TopKScratchOf<T>& scratch, TopKCandidatesOf<T>& out,
                TopKSelection& stats) {
  const int64_t blocks = (n + kScanBlock - 1) / kScanBlock;
  const int64_t blockCap = std::min<int64_t>(kScanBlock, 2 * expect * kScanBlock / n + 256);
  scratch.indices.resize(std::max<size_t>(scratch.indices.size(), blocks * blockCap));
  scratch.values.resize(std::max<size_t>(scratch.values.size(), blocks * blockCap));
  scratch.counts.assign(blocks, 0);
  scratch.ties.assign(blocks, 0);
  std::vector<TopKCandidatesOf<T>> overflow(blocks);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kScanBlock, hi = std::min(n, lo + kScanBlock);
      int64_t count =
          ScanOps<T>::scan(src, residual, lo, hi, threshold, scratch.indices.data() + b * blockCap,
                           scratch.values.data() + b * blockCap, blockCap, &scratch.ties[b]);
      if (count > blockCap) {  // the values are final now (in residual, if any): rescan
        overflow[b].indices.resize(count);
        overflow[b].values.resize(count);
        int64_t ties = 0;
        ScanOps<T>::scan(residual ? residual : src, nullptr, lo, hi, threshold,
                         overflow[b].indices.data(), overflow[b].values.data(), count, &ties);
      }
      scratch.counts[b] = count;
    }
  });
  int64_t total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    total += scratch.counts[b];
    if (scratch.counts[b] > blockCap) {
      stats.reread += std::min(n, (b + 1) * kScanBlock) - b * kScanBlock;
    }
  }
  out.indices.resize(total);
  out.values.resize(total);
  int64_t at = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t c = scratch.counts[b];
    const bool spilled = c > blockCap;
    const int32_t* idx =
        spilled ? overflow[b].indices.data() : scratch.indices.data() + b * blockCap;
    const T* val = spilled ? overflow[b].values.data() : scratch.values.data() + b * blockCap;
    std::copy(idx, idx + c, out.indices.begin() + at);
    std::copy(val, val + c, out.values.begin() + at);
    at += c;
  }
  stats.candidates += total;
  return total;
}

// The indices of the first `need` entries of values[0, n) whose key is
// `key`, ascending, into `out`: only blocks the scan counted ties in are
// read, each only up to the last tie taken.
template <typename T>
void collectTies(const T* values, int64_t n, typename ScanOps<T>::Key key, int64_t need,
                 const TopKScratchOf<T>& scratch, std::vector<int32_t>& out, TopKSelection& stats) {
  out.resize(need);
  int64_t got = 0;
  for (size_t b = 0; b < scratch.ties.size() && got < need; ++b) {
    if (scratch.ties[b] == 0) continue;
    const int64_t lo = static_cast<int64_t>(b) * kScanBlock, hi = std::min(n, lo + kScanBlock);
    const int64_t want = need - got;
    const int64_t c = ScanOps<T>::ties(values, lo, hi, key, out.data() + got, want);
    stats.reread += c == want ? out[got + c - 1] + 1 - lo : hi - lo;
    got += c;
  }
  TORCH_CHECK(got == need, "xcomm: internal error: top-k found ", got, " of ", need, " ties");
}

// The key of the k-th largest magnitude among `keys` (k <= keys.size()).
template <typename Key>
Key kthLargestKey(std::vector<Key> keys, int64_t k) {
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<Key>());
  return keys[k - 1];
}

// The sampled threshold key: usually a little under k entries' magnitude.
template <typename T>
typename ScanOps<T>::Key sampleThreshold(at::Generator& generator, int64_t sampleSize, const T* src,
                                         const T* residual, int64_t n, int64_t k) {
  // The same draws as the unfused selection, so resumed runs sample alike.
  at::Tensor idx = at::randint(n, {sampleSize}, generator, at::kLong);
  const int64_t* pick = idx.data_ptr<int64_t>();
  std::vector<typename ScanOps<T>::Key> keys(sampleSize);
  for (int64_t i = 0; i < sampleSize; ++i) {
    const T a = residual ? src[pick[i]] + residual[pick[i]] : src[pick[i]];
    keys[i] = ScanOps<T>::key(a);
  }
  // Below the target quantile, so that nearly always at least k pass: 1.5 k
  // expected; with 4096 samples at 1% density, fewer than k pass about once
  // in 10^4 steps (then the exact route runs; the answer is the same).
  const double keep = std::min(1.0, 1.5 * static_cast<double>(k) / n);
  const int64_t rank = std::max<int64_t>(1, static_cast<int64_t>(keep * sampleSize));
  return kthLargestKey(std::move(keys), rank);
}

}  // namespace

TopKCodec::TopKCodec(bool approximate, bool errorFeedback, int64_t sampleSize, uint64_t seed)
    : approximate_(approximate),
      useFeedback_(errorFeedback),
      sampleSize_(sampleSize),
      generator_(at::make_generator<at::CPUGeneratorImpl>(seed)) {
  TORCH_CHECK_VALUE(sampleSize_ > 0, "xcomm: top-k sample size must be positive");
}

int64_t TopKCodec::kFor(int64_t numel, double density) {
  TORCH_CHECK_VALUE(density > 0.0 && density <= 1.0, "xcomm: top-k density must be in (0, 1], got ",
                    density);
  if (numel == 0) return 0;
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(density * numel)));
}

int64_t TopKCodec::packedBytes(int64_t k, at::ScalarType dtype) {
  return k * (static_cast<int64_t>(sizeof(int32_t)) + c10::elementSize(dtype));
}

at::Tensor TopKCodec::select(const at::Tensor& magnitudes, int64_t k) {
  const int64_t n = magnitudes.numel();
  if (k >= n) {
    return at::arange(n, magnitudes.options().dtype(at::kLong));
  }
  if (!approximate_ || n <= 4 * sampleSize_) {
    return std::get<1>(at::topk(magnitudes, k, /*dim=*/0, /*largest=*/true, /*sorted=*/false));
  }
  // Threshold from a sample, a little below the target quantile so that
  // usually more than k pass; the exact top-k then runs on those few.
  at::Tensor idx = at::randint(n, {sampleSize_}, generator_, at::kLong).to(magnitudes.device());
  at::Tensor sample = magnitudes.index_select(0, idx);
  const double keep = std::min(1.0, 2.0 * static_cast<double>(k) / n);
  const int64_t rank = std::max<int64_t>(1, static_cast<int64_t>(keep * sampleSize_));
  const double threshold =
      std::get<0>(at::topk(sample, rank, 0, true, true)).select(0, rank - 1).item<double>();
  at::Tensor candidates = at::nonzero(magnitudes >= threshold).view({-1});
  if (candidates.numel() < k) {  // the sample overestimated: fall back to exact
    return std::get<1>(at::topk(magnitudes, k, 0, true, false));
  }
  at::Tensor sub = magnitudes.index_select(0, candidates);
  return candidates.index_select(0, std::get<1>(at::topk(sub, k, 0, true, false)));
}

at::Tensor TopKCodec::encode(int64_t key, const at::Tensor& flat, int64_t k) {
  return encode(key, flat, k, useFeedback_ ? &feedback_ : nullptr);
}

std::vector<int64_t> TopKCodec::splitK(const at::Tensor& flat, const std::vector<int64_t>& segments,
                                       int64_t k) {
  const int64_t n = flat.numel();
  int64_t covered = 0;
  for (int64_t size : segments) {
    TORCH_CHECK_VALUE(size >= 0, "xcomm: top-k per tensor: a segment size is negative (", size,
                      ")");
    covered += size;
  }
  TORCH_CHECK_VALUE(covered == n, "xcomm: top-k per tensor: the segment sizes sum to ", covered,
                    " but the bucket has ", n, " elements");
  TORCH_CHECK_VALUE(k >= 0, "xcomm: top-k needs k >= 0, got ", k);
  k = std::min(k, n);
  const size_t parts = segments.size();
  std::vector<int64_t> ks(parts, 0);
  if (parts == 0 || k == 0) return ks;
  if (parts == 1) {  // one tensor takes all of k: nothing to count
    ks[0] = k;
    return ks;
  }
  // Each segment's non-zero entries, counted on the device in one batch.
  std::vector<at::Tensor> counts;
  counts.reserve(parts);
  at::Tensor input = flat.reshape({-1});
  int64_t offset = 0;
  for (int64_t size : segments) {
    counts.push_back(at::count_nonzero(input.narrow(0, offset, size)));
    offset += size;
  }
  at::Tensor nonzero = at::stack(counts).to(at::kCPU, at::kLong).contiguous();
  const int64_t* nz = nonzero.data_ptr<int64_t>();
  std::vector<double> weight(parts);
  double total = 0.0;
  for (size_t i = 0; i < parts; ++i) total += static_cast<double>(nz[i]);
  for (size_t i = 0; i < parts; ++i) {
    // No non-zero entry anywhere: by size, as a dense bucket would be.
    weight[i] = total > 0.0 ? static_cast<double>(nz[i]) : static_cast<double>(segments[i]);
  }
  const double sum = total > 0.0 ? total : static_cast<double>(n);
  // Largest remainders: the floor of each quota, then one more to those with
  // the largest fractions (ties to the earlier segment), never past a size.
  std::vector<double> fraction(parts);
  int64_t given = 0;
  for (size_t i = 0; i < parts; ++i) {
    const double quota = static_cast<double>(k) * weight[i] / sum;
    ks[i] = std::min(static_cast<int64_t>(std::floor(quota)), segments[i]);
    fraction[i] = quota - std::floor(quota);
    given += ks[i];
  }
  std::vector<size_t> order(parts);
  for (size_t i = 0; i < parts; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return fraction[a] > fraction[b]; });
  for (size_t i : order) {
    if (given == k) break;
    if (ks[i] < segments[i] && fraction[i] > 0.0) {
      ++ks[i];
      ++given;
    }
  }
  // What the caps left over goes, in order, to segments with room.
  for (size_t i = 0; i < parts && given < k; ++i) {
    const int64_t more = std::min(segments[i] - ks[i], k - given);
    ks[i] += more;
    given += more;
  }
  return ks;
}

at::Tensor TopKCodec::encode(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb) {
  return encode(key, flat, k, fb, {});
}

at::Tensor TopKCodec::encode(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb,
                             const std::vector<int64_t>& segments) {
  TORCH_CHECK_TYPE(at::isFloatingType(flat.scalar_type()),
                   "xcomm: top-k needs a floating-point tensor");
  TORCH_CHECK_VALUE(k >= 0, "xcomm: top-k needs k >= 0, got ", k);
  TORCH_CHECK_VALUE(flat.numel() <= std::numeric_limits<int32_t>::max(),
                    "xcomm: top-k indices are int32; a bucket of ", flat.numel(),
                    " elements is too large (use smaller DDP buckets)");
  Parts parts;
  if (!segments.empty()) {
    const std::vector<int64_t> ks = splitK(flat, segments, k);
    if (segments.size() > 1) {
      parts.reserve(segments.size());
      for (size_t i = 0; i < segments.size(); ++i) parts.emplace_back(segments[i], ks[i]);
    }
  }
  selection_ = TopKSelection{};
  if (onCpuScan(flat) && flat.numel() > 0) {
    selection_.route = TopKRoute::kScan;
    switch (flat.scalar_type()) {
      case at::kFloat:
        return encodeFloat(key, flat, k, fb, parts);
      case at::kDouble:
        return encodeDouble(key, flat, k, fb, parts);
      default:
        return encodeHalf(key, flat, k, fb, parts);
    }
  }
  // The CUDA kernels select over a whole bucket; per tensor runs at::topk.
  if (onCudaKernels(flat) && flat.numel() > 0 && parts.empty()) {
    selection_.route = TopKRoute::kCuda;
    return encodeCuda(key, flat, k, fb);
  }
  if (flat.numel() > 0) selection_.route = TopKRoute::kTorch;
  return encodeGeneric(key, flat, k, fb, parts);
}

template <typename T>
void TopKCodec::selectParts(const T* src, T* res, bool seeded, int64_t n, int64_t k,
                            const Parts& parts, int32_t* outIdx, T* outVal,
                            TopKScratchOf<T>& scratch, TopKCandidatesOf<T>& cand) {
  if (parts.empty()) {
    selectScan<T>(src, res, seeded, n, k, outIdx, outVal, scratch, cand);
    return;
  }
  int64_t offset = 0, taken = 0;
  for (const auto& [size, partK] : parts) {
    selectScan<T>(src + offset, res != nullptr ? res + offset : nullptr, seeded, size, partK,
                  outIdx + taken, outVal + taken, scratch, cand);
    for (int64_t j = taken; j < taken + partK; ++j) outIdx[j] += static_cast<int32_t>(offset);
    offset += size;
    taken += partK;
  }
}

template <typename T>
void TopKCodec::selectScan(const T* src, T* res, bool seeded, int64_t n, int64_t k, int32_t* outIdx,
                           T* outVal, TopKScratchOf<T>& scratch, TopKCandidatesOf<T>& cand) {
  using Key = typename ScanOps<T>::Key;
  const T* acc = (res != nullptr) ? res : src;  // the values, once the scan has run
  cand.indices.clear();                         // reused memory; no candidates yet
  cand.values.clear();
  bool scanned = false, selected = false;
  Key t = 0;         // the threshold of the last scan: cand holds the keys above it
  int64_t tied = 0;  // and this many entries are equal to it
  if (k > 0 && k < n && n > 4 * sampleSize_) {
    t = sampleThreshold<T>(generator_, sampleSize_, seeded ? res : src, seeded ? nullptr : res, n,
                           k);
    scanAll<T>(seeded ? res : src, seeded ? nullptr : res, n, t, 3 * k / 2, scratch, cand,
               selection_);
    scanned = true;
    for (int64_t c : scratch.ties) tied += c;
    // Fewer than k at or above the sampled key: it overshot (rare; the
    // exact route below gives the same answer).
    selected = static_cast<int64_t>(cand.indices.size()) + tied >= k;
  }
  if (k > 0 && !selected) {
    if (!scanned && (res != nullptr) && !seeded) {
      ScanOps<T>::addInto(src, res, n);  // residual += input
    }
    if (k == n) {  // everything is sent, in index order
      for (int64_t i = 0; i < n; ++i) {
        outIdx[i] = static_cast<int32_t>(i);
        outVal[i] = acc[i];
      }
      if (res != nullptr) std::fill(res, res + n, T(0));
      return;
    }
    selection_.exact = true;
    std::vector<Key> keys(n);
    at::parallel_for(0, n, kScanBlock, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) keys[i] = ScanOps<T>::key(acc[i]);
    });
    t = kthLargestKey(std::move(keys), k);
    scanAll<T>(acc, nullptr, n, t, k, scratch, cand, selection_);
  } else if (k == 0 && (res != nullptr) && !seeded) {
    ScanOps<T>::addInto(src, res, n);
  }
  const int64_t m = static_cast<int64_t>(cand.indices.size());
  if (m >= k) {
    // Trim the candidates (index order, all above t) to exactly k: every key
    // above the k-th, then ties at it by lowest index.
    std::vector<Key> keys(m);
    for (int64_t i = 0; i < m; ++i) keys[i] = ScanOps<T>::key(cand.values[i]);
    const Key kth = k > 0 ? kthLargestKey(keys, k) : 0;
    int64_t above = 0;
    for (Key key : keys) above += key > kth;
    int64_t ties = k - above;
    int64_t j = 0;
    for (int64_t i = 0; i < m && j < k; ++i) {
      // Branch-free, as in the scan: write, then advance when kept.
      const bool tie = keys[i] == kth && ties > 0;
      const bool take = keys[i] > kth || tie;
      ties -= tie;
      outIdx[j] = cand.indices[i];
      outVal[j] = cand.values[i];
      j += take;
    }
    TORCH_CHECK(j == k, "xcomm: internal error: top-k selected ", j, " of ", k);
  } else {
    // t is the k-th key: every candidate goes, and the k - m entries equal
    // to t of lowest index, merged in index order.
    collectTies<T>(acc, n, t, k - m, scratch, tieIndices_, selection_);
    int64_t a = 0, b = 0;
    for (int64_t j = 0; j < k; ++j) {
      const bool fromCand = b == k - m || (a < m && cand.indices[a] < tieIndices_[b]);
      const int32_t i = fromCand ? cand.indices[a++] : tieIndices_[b++];
      outIdx[j] = i;
      outVal[j] = acc[i];
    }
  }
  if (res != nullptr) {
    for (int64_t i = 0; i < k; ++i) res[outIdx[i]] = T(0);  // sent: nothing left behind
  }
}

at::Tensor TopKCodec::encodeFloat(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb,
                                  const Parts& parts) {
  const int64_t n = flat.numel();
  k = std::min<int64_t>(k, n);
  at::Tensor residual;
  bool seeded = false;
  if (fb != nullptr) residual = fb->accumulator(key, flat, &seeded);
  float* res = (fb != nullptr) ? residual.data_ptr<float>() : nullptr;
  const int64_t idxBytes = k * static_cast<int64_t>(sizeof(int32_t));
  at::Tensor packed = at::empty({packedBytes(k, at::kFloat)}, at::kByte);
  int32_t* outIdx = reinterpret_cast<int32_t*>(packed.data_ptr<uint8_t>());
  float* outVal = reinterpret_cast<float*>(packed.data_ptr<uint8_t>() + idxBytes);
  selectParts<float>(flat.data_ptr<float>(), res, seeded, n, k, parts, outIdx, outVal, scratch_,
                     candidates_);
  return packed;
}

at::Tensor TopKCodec::encodeDouble(int64_t key, const at::Tensor& flat, int64_t k,
                                   ErrorFeedback* fb, const Parts& parts) {
  const int64_t n = flat.numel();
  k = std::min<int64_t>(k, n);
  // The residual stays float64 (as the at::topk route kept it), updated in
  // place; a first step, or one of another dtype, starts it as input + residual.
  at::Tensor residual;
  bool seeded = false;
  if (fb != nullptr) {
    residual = fb->find(key);
    if (!residual.defined() || residual.scalar_type() != at::kDouble || !residual.is_contiguous() ||
        !residual.device().is_cpu() || residual.numel() != n) {
      residual = fb->compensate(key, flat.reshape({-1})).reshape({-1}).contiguous();
      fb->store(key, residual);
      seeded = true;
    }
  }
  double* res = (fb != nullptr) ? residual.data_ptr<double>() : nullptr;
  const int64_t idxBytes = k * static_cast<int64_t>(sizeof(int32_t));
  at::Tensor packed = at::empty({packedBytes(k, at::kDouble)}, at::kByte);
  int32_t* outIdx = reinterpret_cast<int32_t*>(packed.data_ptr<uint8_t>());
  // After k int32 indices the values sit 8-byte aligned only for even k:
  // selected into aligned memory, then copied in.
  values64_.resize(k);
  selectParts<double>(flat.data_ptr<double>(), res, seeded, n, k, parts, outIdx, values64_.data(),
                      scratch64_, candidates64_);
  std::memcpy(packed.data_ptr<uint8_t>() + idxBytes, values64_.data(), k * sizeof(double));
  return packed;
}

at::Tensor TopKCodec::encodeHalf(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb,
                                 const Parts& parts) {
  const auto dtype = flat.scalar_type();
  const int64_t n = flat.numel();
  k = std::min<int64_t>(k, n);
  at::Tensor input = flat.reshape({-1});
  // input + residual in the bucket's dtype, rounded as the at::topk route
  // rounded it (ATen's add: each sum in float32, rounded once), into the
  // residual itself when it is one of this dtype.
  at::Tensor acc = input;
  if (fb != nullptr) {
    at::Tensor residual = fb->find(key);
    if (residual.defined() && residual.scalar_type() == dtype && residual.is_contiguous() &&
        residual.device().is_cpu() && residual.dim() == 1 && residual.numel() == n) {
      acc = residual.add_(input);
    } else {
      acc = fb->compensate(key, input).reshape({-1}).contiguous();
      fb->store(key, acc);
    }
  }
  // Widening is exact, so the float32 keys order the values as their own
  // bits would; one caveat: a signalling NaN may come out quiet, so NaNs
  // among themselves are ordered by their quiet payload (all still rank
  // above Inf and are sent first).
  widened_.resize(n);
  at::from_blob(widened_.data(), {n}, at::kFloat).copy_(acc);
  widenedValues_.resize(k);
  const int64_t idxBytes = k * static_cast<int64_t>(sizeof(int32_t));
  at::Tensor packed = at::empty({packedBytes(k, dtype)}, at::kByte);
  int32_t* outIdx = reinterpret_cast<int32_t*>(packed.data_ptr<uint8_t>());
  selectParts<float>(widened_.data(), nullptr, false, n, k, parts, outIdx, widenedValues_.data(),
                     scratch_, candidates_);
  // The values sent are the bucket's own (2-byte) elements, copied as bits.
  const uint16_t* accBits = reinterpret_cast<const uint16_t*>(acc.data_ptr());
  uint16_t* outVal = reinterpret_cast<uint16_t*>(packed.data_ptr<uint8_t>() + idxBytes);
  for (int64_t i = 0; i < k; ++i) outVal[i] = accBits[outIdx[i]];
  if (fb != nullptr) {
    uint16_t* resBits = reinterpret_cast<uint16_t*>(acc.data_ptr());
    for (int64_t i = 0; i < k; ++i) resBits[outIdx[i]] = 0;  // +0 in both formats
  }
  return packed;
}

at::Tensor TopKCodec::encodeCuda(int64_t key, const at::Tensor& flat, int64_t k,
                                 ErrorFeedback* fb) {
  k = std::min<int64_t>(k, flat.numel());
  at::Tensor packed = at::empty({packedBytes(k, at::kFloat)}, flat.options().dtype(at::kByte));
  at::Tensor src = flat.view({-1});
  at::Tensor residual;
  if (fb != nullptr) {
    bool seeded = false;
    residual = fb->accumulator(key, flat, &seeded);
    if (seeded) src = at::Tensor();  // the input is in the residual already
  }
  if (k > 0) {
    cuda::topkEncode(src, residual, k, packed);
  } else if (src.defined() && residual.defined()) {
    cuda::addInto(src, residual);  // nothing sent: all of it stays behind
  }
  return packed;
}

at::Tensor TopKCodec::encodeGeneric(int64_t key, const at::Tensor& flat, int64_t k,
                                    ErrorFeedback* fb, const Parts& parts) {
  const auto dtype = flat.scalar_type();
  at::Tensor input = flat.reshape({-1});
  at::Tensor acc = (fb != nullptr) ? fb->compensate(key, input) : input;
  k = std::min<int64_t>(k, acc.numel());
  // NaN magnitudes compare as largest in topk, so a NaN is sent, not buried in the residual.
  at::Tensor magnitudes = acc.abs().to(at::kFloat);
  at::Tensor indices;
  if (parts.empty()) {
    indices = select(magnitudes, k);
  } else {
    std::vector<at::Tensor> chosen;
    int64_t offset = 0;
    for (const auto& [size, partK] : parts) {
      if (partK > 0) chosen.push_back(select(magnitudes.narrow(0, offset, size), partK) + offset);
      offset += size;
    }
    // Ascending, as every other route packs them: the CUDA decode finds
    // where each rank's pairs for a tile begin by that order.
    indices = chosen.empty() ? at::empty({0}, magnitudes.options().dtype(at::kLong))
                             : std::get<0>(at::sort(at::cat(chosen)));
  }
  at::Tensor values = acc.index_select(0, indices);
  if ((fb != nullptr)) {
    at::Tensor residual = acc.clone();
    residual.index_fill_(0, indices, 0);
    fb->store(key, residual);
  }
  const int64_t idxBytes = k * static_cast<int64_t>(sizeof(int32_t));
  at::Tensor packed = at::empty({packedBytes(k, dtype)}, input.options().dtype(at::kByte));
  packed.narrow(0, 0, idxBytes).view(at::kInt).copy_(indices);
  packed.narrow(0, idxBytes, packed.numel() - idxBytes).view(dtype).copy_(values);
  return packed;
}

void TopKCodec::decode(const at::Tensor& gathered, int64_t k, at::Tensor& out,
                       double divisor) const {
  const auto dtype = out.scalar_type();
  at::Tensor rows = gathered.contiguous().view({-1, packedBytes(k, dtype)});
  const int64_t idxBytes = k * static_cast<int64_t>(sizeof(int32_t));
  if (onCudaKernels(out) && rows.is_cuda()) {
    at::Tensor flat = out.view({-1});
    cuda::topkDecode(rows, k, static_cast<float>(divisor), flat);
    return;
  }
  if (isDenseFloat(out)) {
    // Zero, scatter-add every rank's pairs in rank order, divide: the
    // unfused route's arithmetic, without its temporaries.
    const int64_t n = out.numel();
    float* dst = out.data_ptr<float>();
    const uint8_t* base = rows.data_ptr<uint8_t>();
    const int64_t rowBytes = rows.size(1);
    for (int64_t r = 0; r < rows.size(0); ++r) {
      const int32_t* idx = reinterpret_cast<const int32_t*>(base + r * rowBytes);
      for (int64_t i = 0; i < k; ++i) {
        TORCH_CHECK(idx[i] >= 0 && idx[i] < n, "xcomm: top-k payload of rank ", r,
                    " holds an index outside the bucket");
      }
    }
    at::parallel_for(0, n, kScanBlock,
                     [&](int64_t lo, int64_t hi) { std::fill(dst + lo, dst + hi, 0.f); });
    for (int64_t r = 0; r < rows.size(0); ++r) {  // rank order: same bits on every rank
      const int32_t* idx = reinterpret_cast<const int32_t*>(base + r * rowBytes);
      const float* val = reinterpret_cast<const float*>(base + r * rowBytes + idxBytes);
      for (int64_t i = 0; i < k; ++i) dst[idx[i]] += val[i];
    }
    if (divisor != 1.0) {
      // Only touched entries can be nonzero (0 / d is +0 again): divide each
      // once, walking the ranks' ascending index lists merged. Payloads whose
      // indices are not ascending take the full pass.
      const float d = static_cast<float>(divisor);
      const int64_t world = rows.size(0);
      bool ascending = true;
      std::vector<const int32_t*> lists(world);
      for (int64_t r = 0; r < world; ++r) {
        lists[r] = reinterpret_cast<const int32_t*>(base + r * rowBytes);
        for (int64_t i = 1; i < k && ascending; ++i) ascending = lists[r][i - 1] < lists[r][i];
      }
      if (ascending && world <= 64) {
        std::vector<int64_t> at(world, 0);
        int64_t last = -1;
        while (true) {
          int64_t best = -1;
          for (int64_t r = 0; r < world; ++r) {
            if (at[r] < k && (best < 0 || lists[r][at[r]] < lists[best][at[best]])) best = r;
          }
          if (best < 0) break;
          const int32_t i = lists[best][at[best]++];
          if (i != last) {
            dst[i] = dst[i] / d;
            last = i;
          }
        }
      } else {
        const auto& kern = kernels::codecKernels();
        at::parallel_for(0, n, kScanBlock,
                         [&](int64_t lo, int64_t hi) { kern.divideInto(dst, dst, d, lo, hi); });
      }
    }
    return;
  }
  at::Tensor flat = at::zeros({out.numel()}, out.options().device(rows.device()));
  for (int64_t r = 0; r < rows.size(0); ++r) {  // rank order: same bits on every rank
    at::Tensor row = rows.select(0, r);
    // A row is k * (4 + element size) bytes: with an odd k, the rows after
    // the first of a 2-byte dtype start off 4-byte alignment, and float64
    // values (after k int32) off 8-byte alignment; such slices are copied.
    at::Tensor rawIdx = row.narrow(0, 0, idxBytes);
    if (rawIdx.storage_offset() % 4 != 0) rawIdx = rawIdx.clone();
    at::Tensor indices = rawIdx.view(at::kInt).to(at::kLong);
    at::Tensor raw = row.narrow(0, idxBytes, row.numel() - idxBytes);
    if (raw.storage_offset() % c10::elementSize(dtype) != 0) raw = raw.clone();
    at::Tensor values = raw.view(dtype);
    // On a GPU, index_add_ checks the range itself (reading it here would wait for the device).
    TORCH_CHECK(
        indices.numel() == 0 || rows.is_cuda() ||
            (indices.min().item<int64_t>() >= 0 && indices.max().item<int64_t>() < out.numel()),
        "xcomm: top-k payload of rank ", r, " holds an index outside the bucket");
    flat.index_add_(0, indices, values);
  }
  if (divisor != 1.0) flat.div_(divisor);
  out.view({-1}).copy_(flat);
}

}  // namespace xcomm
