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

bool isDenseFloat(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu();
}

// A float32 GPU bucket the CUDA kernels take.
bool onCudaKernels(const at::Tensor& t) {
  return t.is_cuda() && cuda::codecsBuilt() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

// Runs the scan kernel over [0, n) in blocks and leaves the (index, value)
// pairs above the threshold in `out`, in index order, and each block's count
// of entries equal to it in scratch.ties; returns how many were above.
// Each block writes into its own stretch of the scratch, sized from `expect`
// (how many should pass in all) with a margin; a block that overflows is
// rescanned read-only into a buffer of its own.
int64_t scanAll(const float* src, float* residual, int64_t n, uint32_t threshold, int64_t expect,
                TopKScratch& scratch, TopKCandidates& out, TopKSelection& stats) {
  const auto& kern = kernels::codecKernels();
  const int64_t blocks = (n + kScanBlock - 1) / kScanBlock;
  const int64_t blockCap = std::min<int64_t>(kScanBlock, 2 * expect * kScanBlock / n + 256);
  scratch.indices.resize(std::max<size_t>(scratch.indices.size(), blocks * blockCap));
  scratch.values.resize(std::max<size_t>(scratch.values.size(), blocks * blockCap));
  scratch.counts.assign(blocks, 0);
  scratch.ties.assign(blocks, 0);
  std::vector<TopKCandidates> overflow(blocks);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kScanBlock, hi = std::min(n, lo + kScanBlock);
      int64_t count =
          kern.topkScan(src, residual, lo, hi, threshold, scratch.indices.data() + b * blockCap,
                        scratch.values.data() + b * blockCap, blockCap, &scratch.ties[b]);
      if (count > blockCap) {  // the values are final now (in residual, if any): rescan
        overflow[b].indices.resize(count);
        overflow[b].values.resize(count);
        int64_t ties = 0;
        kern.topkScan(residual ? residual : src, nullptr, lo, hi, threshold,
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
    const float* val = spilled ? overflow[b].values.data() : scratch.values.data() + b * blockCap;
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
void collectTies(const float* values, int64_t n, uint32_t key, int64_t need,
                 const TopKScratch& scratch, std::vector<int32_t>& out, TopKSelection& stats) {
  const auto& kern = kernels::codecKernels();
  out.resize(need);
  int64_t got = 0;
  for (size_t b = 0; b < scratch.ties.size() && got < need; ++b) {
    if (scratch.ties[b] == 0) continue;
    const int64_t lo = static_cast<int64_t>(b) * kScanBlock, hi = std::min(n, lo + kScanBlock);
    const int64_t want = need - got;
    const int64_t c = kern.topkTies(values, lo, hi, key, out.data() + got, want);
    stats.reread += c == want ? out[got + c - 1] + 1 - lo : hi - lo;
    got += c;
  }
  TORCH_CHECK(got == need, "xcomm: internal error: top-k found ", got, " of ", need, " ties");
}

// The key of the k-th largest magnitude among `keys` (k <= keys.size()).
uint32_t kthLargestKey(std::vector<uint32_t> keys, int64_t k) {
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
  return keys[k - 1];
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

at::Tensor TopKCodec::encode(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb) {
  TORCH_CHECK_TYPE(at::isFloatingType(flat.scalar_type()),
                   "xcomm: top-k needs a floating-point tensor");
  TORCH_CHECK_VALUE(k >= 0, "xcomm: top-k needs k >= 0, got ", k);
  TORCH_CHECK_VALUE(flat.numel() <= std::numeric_limits<int32_t>::max(),
                    "xcomm: top-k indices are int32; a bucket of ", flat.numel(),
                    " elements is too large (use smaller DDP buckets)");
  if (isDenseFloat(flat) && flat.numel() > 0) {
    return encodeFloat(key, flat, k, fb);
  }
  if (onCudaKernels(flat) && flat.numel() > 0) {
    return encodeCuda(key, flat, k, fb);
  }
  return encodeGeneric(key, flat, k, fb);
}

uint32_t TopKCodec::sampleThreshold(const float* src, const float* residual, int64_t n, int64_t k) {
  // The same draws as the unfused selection, so resumed runs sample alike.
  at::Tensor idx = at::randint(n, {sampleSize_}, generator_, at::kLong);
  const int64_t* pick = idx.data_ptr<int64_t>();
  std::vector<uint32_t> keys(sampleSize_);
  for (int64_t i = 0; i < sampleSize_; ++i) {
    const float a = residual ? src[pick[i]] + residual[pick[i]] : src[pick[i]];
    keys[i] = kernels::magnitudeKey(a);
  }
  // Below the target quantile, so that nearly always at least k pass: 1.5 k
  // expected; with 4096 samples at 1% density, fewer than k pass about once
  // in 10^4 steps (then the exact route runs; the answer is the same).
  const double keep = std::min(1.0, 1.5 * static_cast<double>(k) / n);
  const int64_t rank = std::max<int64_t>(1, static_cast<int64_t>(keep * sampleSize_));
  return kthLargestKey(std::move(keys), rank);
}

at::Tensor TopKCodec::encodeFloat(int64_t key, const at::Tensor& flat, int64_t k,
                                  ErrorFeedback* fb) {
  const int64_t n = flat.numel();
  k = std::min<int64_t>(k, n);
  selection_ = TopKSelection{};
  const float* src = flat.data_ptr<float>();
  at::Tensor residual;
  bool seeded = false;
  if ((fb != nullptr)) {
    residual = fb->accumulator(key, flat, &seeded);
  }
  float* res = (fb != nullptr) ? residual.data_ptr<float>() : nullptr;
  const float* acc = (fb != nullptr) ? res : src;  // the values, once the scan has run
  TopKCandidates& cand = candidates_;              // reused memory; no candidates yet
  cand.indices.clear();
  cand.values.clear();
  const int64_t idxBytes = k * static_cast<int64_t>(sizeof(int32_t));
  at::Tensor packed = at::empty({packedBytes(k, at::kFloat)}, at::kByte);
  int32_t* outIdx = reinterpret_cast<int32_t*>(packed.data_ptr<uint8_t>());
  float* outVal = reinterpret_cast<float*>(packed.data_ptr<uint8_t>() + idxBytes);
  bool scanned = false, selected = false;
  uint32_t t = 0;    // the threshold of the last scan: cand holds the keys above it
  int64_t tied = 0;  // and this many entries are equal to it
  if (k > 0 && k < n && n > 4 * sampleSize_) {
    t = sampleThreshold(seeded ? res : src, seeded ? nullptr : res, n, k);
    scanAll(seeded ? res : src, seeded ? nullptr : res, n, t, 3 * k / 2, scratch_, cand,
            selection_);
    scanned = true;
    for (int64_t c : scratch_.ties) tied += c;
    // Fewer than k at or above the sampled key: it overshot (rare; the
    // exact route below gives the same answer).
    selected = static_cast<int64_t>(cand.indices.size()) + tied >= k;
  }
  if (k > 0 && !selected) {
    if (!scanned && (fb != nullptr) && !seeded) {
      kernels::codecKernels().addInto(src, res, 0, n);  // residual += input
    }
    if (k == n) {  // everything is sent, in index order
      for (int64_t i = 0; i < n; ++i) {
        outIdx[i] = static_cast<int32_t>(i);
        outVal[i] = acc[i];
      }
      if ((fb != nullptr)) std::fill(res, res + n, 0.f);
      return packed;
    }
    selection_.exact = true;
    std::vector<uint32_t> keys(n);
    at::parallel_for(0, n, kScanBlock, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) keys[i] = kernels::magnitudeKey(acc[i]);
    });
    t = kthLargestKey(std::move(keys), k);
    scanAll(acc, nullptr, n, t, k, scratch_, cand, selection_);
  } else if (k == 0 && (fb != nullptr) && !seeded) {
    kernels::codecKernels().addInto(src, res, 0, n);
  }
  const int64_t m = static_cast<int64_t>(cand.indices.size());
  if (m >= k) {
    // Trim the candidates (index order, all above t) to exactly k: every key
    // above the k-th, then ties at it by lowest index.
    std::vector<uint32_t> keys(m);
    for (int64_t i = 0; i < m; ++i) keys[i] = kernels::magnitudeKey(cand.values[i]);
    const uint32_t kth = k > 0 ? kthLargestKey(keys, k) : 0;
    int64_t above = 0;
    for (uint32_t key32 : keys) above += key32 > kth;
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
    collectTies(acc, n, t, k - m, scratch_, tieIndices_, selection_);
    int64_t a = 0, b = 0;
    for (int64_t j = 0; j < k; ++j) {
      const bool fromCand = b == k - m || (a < m && cand.indices[a] < tieIndices_[b]);
      const int32_t i = fromCand ? cand.indices[a++] : tieIndices_[b++];
      outIdx[j] = i;
      outVal[j] = acc[i];
    }
  }
  if ((fb != nullptr)) {
    for (int64_t i = 0; i < k; ++i) res[outIdx[i]] = 0.f;  // sent: nothing left behind
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
                                    ErrorFeedback* fb) {
  const auto dtype = flat.scalar_type();
  at::Tensor input = flat.reshape({-1});
  at::Tensor acc = (fb != nullptr) ? fb->compensate(key, input) : input;
  k = std::min<int64_t>(k, acc.numel());
  // NaN magnitudes compare as largest in topk, so a NaN is sent, not buried in the residual.
  at::Tensor indices = select(acc.abs().to(at::kFloat), k);
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
    at::Tensor indices = row.narrow(0, 0, idxBytes).view(at::kInt).to(at::kLong);
    at::Tensor values = row.narrow(0, idxBytes, row.numel() - idxBytes).view(dtype);
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
