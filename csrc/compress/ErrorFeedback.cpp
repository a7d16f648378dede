#include "compress/ErrorFeedback.hpp"

#include <c10/util/Exception.h>

#include "compress/cuda/CudaCodecs.hpp"

namespace xcomm {

namespace {

void checkSize(int64_t key, const at::Tensor& residual, const at::Tensor& input) {
  TORCH_CHECK(residual.numel() == input.numel(), "xcomm: the error-feedback residual of bucket ",
              key, " has ", residual.numel(), " elements but the bucket now has ", input.numel(),
              "; buckets changed after error feedback started (start compression after DDP "
              "rebuilt its buckets, i.e. at iteration 2 or later)");
}

// Where a bucket's float32 accumulator lives: beside a GPU bucket when the
// CUDA kernels can update it there, else in host memory for the CPU kernels.
at::Device accumulatorDevice(const at::Tensor& input) {
  return input.is_cuda() && cuda::codecsBuilt() ? input.device() : at::Device(at::kCPU);
}

}  // namespace

at::Tensor ErrorFeedback::accumulator(int64_t key, const at::Tensor& input, bool* seeded) {
  auto it = residuals_.find(key);
  if (it != residuals_.end()) {
    checkSize(key, it->second, input);
    if (it->second.scalar_type() == at::kFloat && it->second.is_contiguous() &&
        it->second.device() == accumulatorDevice(input)) {
      *seeded = false;
      return it->second;
    }
  }
  at::Tensor start =
      it == residuals_.end()
          ? input.reshape({-1}).to(accumulatorDevice(input), at::kFloat, false, true)
          : compensate(key, input).reshape({-1}).to(accumulatorDevice(input), at::kFloat);
  start = start.contiguous();
  residuals_[key] = start;
  *seeded = true;
  return start;
}

at::Tensor ErrorFeedback::compensate(int64_t key, const at::Tensor& input) const {
  auto it = residuals_.find(key);
  if (it == residuals_.end()) {
    return input.clone();
  }
  checkSize(key, it->second, input);
  return input + it->second.view(input.sizes()).to(input.device(), input.dtype());
}

}  // namespace xcomm
