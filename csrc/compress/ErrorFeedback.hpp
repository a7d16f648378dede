#pragma once
// Error feedback (a.k.a. residual accumulation): what a lossy codec did not
// send this step is added to the next step's input, so no gradient is lost,
// only delayed. One residual per bucket key.
#include <cstdint>
#include <map>

#include <ATen/ATen.h>

namespace xcomm {

class ErrorFeedback {
 public:
  // input + the residual stored for `key` (a new tensor; `input` is kept).
  at::Tensor compensate(int64_t key, const at::Tensor& input) const;
  // Stores what was not sent: `residual` becomes the key's residual.
  void store(int64_t key, at::Tensor residual) { residuals_[key] = std::move(residual); }
  void clear() { residuals_.clear(); }

  // Checkpointing: the residuals by key; load replaces them all.
  const std::map<int64_t, at::Tensor>& state() const { return residuals_; }
  void load(std::map<int64_t, at::Tensor> state) { residuals_ = std::move(state); }

 private:
  std::map<int64_t, at::Tensor> residuals_;
};

}  // namespace xcomm
