#pragma once
// Random-k sparsification with error feedback.
//
// All ranks draw the same random subset of positions from a shared seed, the
// bucket key and the step, so the selected values line up across ranks and a
// plain (dense) allreduce of them is exact: no indices on the wire.
#include <cstdint>
#include <map>

#include <ATen/ATen.h>

#include "compress/ErrorFeedback.hpp"

namespace xcomm {

class RandomKCodec {
 public:
  RandomKCodec(uint64_t seed, bool errorFeedback);

  // The positions kept for (key, step): k = ceil(density * numel) (at least
  // one), one drawn in each of k equal strata, ascending; identical on every
  // rank (and CPU) with the same seed.
  // On `device`: drawn there (a GPU draws them with its own kernel).
  at::Tensor positions(int64_t key, int64_t step, int64_t numel, double density,
                       at::Device device = at::kCPU) const;

  // The selected values of `flat` (+ residual), to be allreduced. Updates the
  // residual of `key`.
  at::Tensor encode(int64_t key, const at::Tensor& flat, const at::Tensor& positions);
  // The same with residuals kept in `feedback` (the caller's store, shared
  // with other codecs), or none when it is null; the codec's own is unused.
  at::Tensor encode(int64_t key, const at::Tensor& flat, const at::Tensor& positions,
                    ErrorFeedback* feedback);
  // Writes the reduced values, divided by `divisor`, into `out` (zero elsewhere).
  void decode(const at::Tensor& reduced, const at::Tensor& positions, at::Tensor& out,
              double divisor) const;

  ErrorFeedback& errorFeedback() { return feedback_; }
  uint64_t seed() const { return seed_; }

 private:
  uint64_t seed_;
  bool useFeedback_;
  ErrorFeedback feedback_;
};

}  // namespace xcomm
