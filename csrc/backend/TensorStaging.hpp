#pragma once
// Contiguous stand-ins for the caller's tensors.
//
// Inner backends read and write tensors as flat memory: handed a strided view,
// Gloo silently reduces the wrong elements. Staging gives them contiguous
// buffers and remembers which results must be copied back afterwards.
#include <functional>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace xcomm {

class TensorStaging {
 public:
  // A tensor the op only reads.
  at::Tensor in(const at::Tensor& t);
  // A tensor the op reads and overwrites (allreduce, broadcast, ...).
  at::Tensor inOut(const at::Tensor& t);
  // A tensor the op only writes.
  at::Tensor out(const at::Tensor& t);

  std::vector<at::Tensor> in(const std::vector<at::Tensor>& ts);
  std::vector<at::Tensor> inOut(const std::vector<at::Tensor>& ts);
  std::vector<at::Tensor> out(const std::vector<at::Tensor>& ts);
  std::vector<std::vector<at::Tensor>> out(const std::vector<std::vector<at::Tensor>>& ts);

  // A step that writes a result back some other way (MinMaxLowering's
  // decoding), run by copyBack() after the copies.
  void afterwards(std::function<void()> step) { steps_.push_back(std::move(step)); }

  bool empty() const { return copies_.empty() && steps_.empty(); }

  // Copies every staged result into the caller's tensor, then runs the
  // steps; empty when there is nothing to do.
  std::function<void()> copyBack() const;

 private:
  static bool needsStaging(const at::Tensor& t);
  std::vector<std::pair<at::Tensor, at::Tensor>> copies_;  // (caller's, staged)
  std::vector<std::function<void()>> steps_;
};

}  // namespace xcomm
