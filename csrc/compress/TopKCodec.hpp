#pragma once
// Top-k sparsification with error feedback.
//
// Each rank keeps the k largest-magnitude entries of (gradient + residual)
// and remembers the rest as the next residual. Ranks pick different indices,
// so payloads are exchanged with an allgather, packed compactly as
// [k int32 indices | k values in the gradient's dtype] per rank.
//
// Selection is exact (a full top-k) or approximate: a magnitude threshold is
// estimated from a random sample of the input (as in DGC), entries above it
// are kept, and a top-k over those few trims the set to exactly k.
#include <cstdint>

#include <ATen/ATen.h>

#include "compress/ErrorFeedback.hpp"

namespace xcomm {

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
  // Sums every rank's payload, uint8 [world, packedBytes], into `out`
  // (zeroed first), in rank order, then divides by `divisor`.
  void decode(const at::Tensor& gathered, int64_t k, at::Tensor& out, double divisor) const;

  ErrorFeedback& errorFeedback() { return feedback_; }
  bool hasErrorFeedback() const { return useFeedback_; }
  // The sampling generator's state, so a resumed run samples the same.
  at::Tensor rngState() const { return generator_.get_state(); }
  void setRngState(const at::Tensor& state) { generator_.set_state(state); }

 private:
  at::Tensor select(const at::Tensor& magnitudes, int64_t k);

  bool approximate_;
  bool useFeedback_;
  int64_t sampleSize_;
  at::Generator generator_;
  ErrorFeedback feedback_;
};

}  // namespace xcomm
