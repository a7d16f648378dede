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
  // The residual of `key` as a float32 accumulator for the fused codecs:
  // they add the input into it and leave what was not sent. When `key` has
  // no residual yet (or one of another dtype), it starts as a float32 copy of
  // `input` and `*seeded` is set: the input is already added.
  at::Tensor accumulator(int64_t key, const at::Tensor& input, bool* seeded);
  // Stores what was not sent: `residual` becomes the key's residual.
  void store(int64_t key, at::Tensor residual) { residuals_[key] = std::move(residual); }
  void clear() { residuals_.clear(); }
  // The live residual of `key` (updated in place by the codecs), or an
  // undefined tensor when there is none.
  at::Tensor find(int64_t key) const {
    auto it = residuals_.find(key);
    return it == residuals_.end() ? at::Tensor() : it->second;
  }
  void erase(int64_t key) { residuals_.erase(key); }

  // Checkpointing: the residuals by key; load replaces them all. The fused
  // codecs update residuals in place, so copy what must outlive a step.
  const std::map<int64_t, at::Tensor>& state() const { return residuals_; }
  void load(std::map<int64_t, at::Tensor> state) { residuals_ = std::move(state); }

 private:
  std::map<int64_t, at::Tensor> residuals_;
};

}  // namespace xcomm
