#pragma once
// Top-k sparsification with error feedback.
//
// Each rank keeps the k largest-magnitude entries of (gradient + residual)
// and remembers the rest as the next residual. Ranks pick different indices,
// so payloads are exchanged with an allgather, packed compactly as
// [k int32 indices | k values in the gradient's dtype] per rank.
//
// Selection always yields the exact top-k by magnitude (ties: the lower
// index wins; NaN ranks above Inf, so it is sent rather than buried). For
// float32 buckets it takes one fused pass: a magnitude threshold is
// estimated from a random sample (as in DGC), the pass adds the residual,
// collects the entries above it and counts those equal to it, and a
// selection over those few trims the set to exactly k. When the threshold
// is itself the k-th magnitude (a gradient of mostly exact zeros, or of
// equal values), the entries equal to it are taken by lowest index from
// the blocks that hold them, reading no further than the last one taken.
// A sample that overshoots costs a second pass, never a different answer.
//
// Other CPU buckets take the same route. float64 runs it on its own 64-bit
// magnitude keys (bits of |x| order doubles as they order floats), so it is
// the exact top-k of the doubles: not the float32 route on rounded values,
// which would merge magnitudes one float apart and send Inf for |x| above
// FLT_MAX. float16 and bfloat16 widen (input + residual, added in the
// bucket's dtype as before) into float32 scratch, which is exact, and run the
// float32 selection on it: the same set as the float32 route on the upcast
// values. Their residual stays in the bucket's dtype.
// `approximate` is kept for the API: it only decided, before the fused pass
// existed, whether small buckets used the sample.
//
// Per tensor: given the sizes of the tensors a bucket is laid out from
// (`segments`), the k entries are split between them in proportion to each
// one's non-zero entries in this step's input (largest remainders, capped at
// a tensor's size) and each selects its own top k_i. A dense tensor then
// sends the same share of itself as every other dense one (DGC's layer-wise
// selection); a mostly zero embedding table sends the same share of its
// non-zero rows' entries, rather than losing them all to a dense layer whose
// entries are larger. The payload is the same k pairs, indices bucket-wide
// and ascending, so decoding is unchanged.
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "compress/ErrorFeedback.hpp"

namespace xcomm {

// Candidates of one selection, and the per-block scratch they are collected
// in; kept by the codec so a step reuses the last step's memory.
template <typename T>
struct TopKCandidatesOf {
  std::vector<int32_t> indices;
  std::vector<T> values;
};
template <typename T>
struct TopKScratchOf {
  std::vector<int32_t> indices;
  std::vector<T> values;
  std::vector<int64_t> counts;
  std::vector<int64_t> ties;  // per block: entries equal to the threshold
};
using TopKCandidates = TopKCandidatesOf<float>;
using TopKScratch = TopKScratchOf<float>;

// Which code selected the last encode's entries.
enum class TopKRoute {
  kNone,   // nothing encoded yet, or an empty bucket
  kScan,   // the fused CPU scan (float32, float64, or float16/bfloat16 widened)
  kCuda,   // the CUDA kernels (a float32 GPU bucket)
  kTorch,  // at::topk on magnitudes (any other bucket)
};

// What the last CPU selection did, beyond its one fused pass over the bucket
// (for tests and benchmarks: the work must not grow with how many entries
// share a magnitude, and the route says the scan ran at all).
struct TopKSelection {
  TopKRoute route = TopKRoute::kNone;
  int64_t candidates = 0;  // (index, value) pairs the scans collected
  int64_t reread = 0;      // elements read again: overflowing blocks, ties taken
  bool exact = false;      // the full selection over every element ran
};

class TopKCodec {
 public:
  TopKCodec(bool approximate, bool errorFeedback, int64_t sampleSize = 4096, uint64_t seed = 0);

  // k for `numel` elements at `density` in (0, 1]: at least one element.
  static int64_t kFor(int64_t numel, double density);
  // Bytes of one rank's packed payload.
  static int64_t packedBytes(int64_t k, at::ScalarType dtype);
  // k split between the consecutive `segments` of `flat` (sizes summing to
  // its numel) in proportion to each one's non-zero entries (by size when
  // there are none), each at most its size; the parts sum to min(k, numel).
  static std::vector<int64_t> splitK(const at::Tensor& flat, const std::vector<int64_t>& segments,
                                     int64_t k);

  // Selects k entries of `flat` (+ the bucket's residual) and packs them:
  // uint8 [packedBytes]. Updates the residual of `key`.
  at::Tensor encode(int64_t key, const at::Tensor& flat, int64_t k);
  // The same with residuals kept in `feedback` (the caller's store, shared
  // with other codecs), or none when it is null; the codec's own is unused.
  at::Tensor encode(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* feedback);
  // Per tensor: k split over `segments` by splitK, each selecting its own
  // share; empty `segments` is the bucket-wide selection above.
  at::Tensor encode(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* feedback,
                    const std::vector<int64_t>& segments);
  // Sums every rank's payload, uint8 [world, packedBytes], into `out`
  // (zeroed first), in rank order, then divides by `divisor`.
  void decode(const at::Tensor& gathered, int64_t k, at::Tensor& out, double divisor) const;

  ErrorFeedback& errorFeedback() { return feedback_; }
  bool hasErrorFeedback() const { return useFeedback_; }
  // The sampling generator's state, so a resumed run samples the same.
  at::Tensor rngState() const { return generator_.get_state(); }
  // The last encode's route and, for the CPU scan, its selection work.
  const TopKSelection& lastSelection() const { return selection_; }
  void setRngState(const at::Tensor& state) { generator_.set_state(state); }

 private:
  at::Tensor select(const at::Tensor& magnitudes, int64_t k);
  // `parts` is the per-tensor split: (segment size, its k) in bucket order,
  // or empty for one bucket-wide selection.
  using Parts = std::vector<std::pair<int64_t, int64_t>>;
  at::Tensor encodeGeneric(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb,
                           const Parts& parts);
  at::Tensor encodeFloat(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb,
                         const Parts& parts);
  at::Tensor encodeDouble(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb,
                          const Parts& parts);
  // float16 / bfloat16: widened into float32 scratch, then the float32 scan.
  at::Tensor encodeHalf(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb,
                        const Parts& parts);
  // A float32 GPU bucket: compress/cuda/TopKKernels.cu, same selection.
  at::Tensor encodeCuda(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb);
  // The fused selection on n values of type T (float or double): src, plus
  // res when given (seeded: res holds the sum already), leaving the sum in
  // res with the sent entries zeroed; writes k ascending indices and their
  // values.
  template <typename T>
  void selectScan(const T* src, T* res, bool seeded, int64_t n, int64_t k, int32_t* outIdx,
                  T* outVal, TopKScratchOf<T>& scratch, TopKCandidatesOf<T>& cand);
  // selectScan over the whole bucket, or part by part (`parts`), the
  // indices shifted to bucket-wide ones.
  template <typename T>
  void selectParts(const T* src, T* res, bool seeded, int64_t n, int64_t k, const Parts& parts,
                   int32_t* outIdx, T* outVal, TopKScratchOf<T>& scratch,
                   TopKCandidatesOf<T>& cand);

  bool approximate_;
  bool useFeedback_;
  int64_t sampleSize_;
  at::Generator generator_;
  ErrorFeedback feedback_;
  TopKScratch scratch_;
  TopKCandidates candidates_;
  TopKScratchOf<double> scratch64_;
  TopKCandidatesOf<double> candidates64_;
  std::vector<float> widened_;  // a float16 / bfloat16 bucket as float32
  std::vector<float> widenedValues_;
  std::vector<double> values64_;
  std::vector<int32_t> tieIndices_;
  TopKSelection selection_;
};

}  // namespace xcomm
