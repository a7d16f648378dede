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
// `approximate` is kept for the API: it only decided, before the fused pass
// existed, whether small buckets used the sample.
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "compress/ErrorFeedback.hpp"

namespace xcomm {

// Candidates of one selection, and the per-block scratch they are collected
// in; kept by the codec so a step reuses the last step's memory.
struct TopKCandidates {
  std::vector<int32_t> indices;
  std::vector<float> values;
};
struct TopKScratch {
  std::vector<int32_t> indices;
  std::vector<float> values;
  std::vector<int64_t> counts;
  std::vector<int64_t> ties;  // per block: entries equal to the threshold
};

// What the last float32 CPU selection did, beyond its one fused pass over
// the bucket (for tests and benchmarks: the work must not grow with how many
// entries share a magnitude).
struct TopKSelection {
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

  // Selects k entries of `flat` (+ the bucket's residual) and packs them:
  // uint8 [packedBytes]. Updates the residual of `key`.
  at::Tensor encode(int64_t key, const at::Tensor& flat, int64_t k);
  // The same with residuals kept in `feedback` (the caller's store, shared
  // with other codecs), or none when it is null; the codec's own is unused.
  at::Tensor encode(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* feedback);
  // Sums every rank's payload, uint8 [world, packedBytes], into `out`
  // (zeroed first), in rank order, then divides by `divisor`.
  void decode(const at::Tensor& gathered, int64_t k, at::Tensor& out, double divisor) const;

  ErrorFeedback& errorFeedback() { return feedback_; }
  bool hasErrorFeedback() const { return useFeedback_; }
  // The sampling generator's state, so a resumed run samples the same.
  at::Tensor rngState() const { return generator_.get_state(); }
  // The last float32 CPU encode's selection work.
  const TopKSelection& lastSelection() const { return selection_; }
  void setRngState(const at::Tensor& state) { generator_.set_state(state); }

 private:
  at::Tensor select(const at::Tensor& magnitudes, int64_t k);
  at::Tensor encodeGeneric(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb);
  at::Tensor encodeFloat(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb);
  // A float32 GPU bucket: compress/cuda/TopKKernels.cu, same selection.
  at::Tensor encodeCuda(int64_t key, const at::Tensor& flat, int64_t k, ErrorFeedback* fb);
  // The sampled threshold key: usually a little under k entries' magnitude.
  uint32_t sampleThreshold(const float* src, const float* residual, int64_t n, int64_t k);

  bool approximate_;
  bool useFeedback_;
  int64_t sampleSize_;
  at::Generator generator_;
  ErrorFeedback feedback_;
  TopKScratch scratch_;
  TopKCandidates candidates_;
  std::vector<int32_t> tieIndices_;
  TopKSelection selection_;
};

}  // namespace xcomm
