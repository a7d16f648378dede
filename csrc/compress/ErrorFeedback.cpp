#include "compress/ErrorFeedback.hpp"

#include <c10/util/Exception.h>

namespace xcomm {

at::Tensor ErrorFeedback::compensate(int64_t key, const at::Tensor& input) const {
  auto it = residuals_.find(key);
  if (it == residuals_.end()) {
    return input.clone();
  }
  TORCH_CHECK(it->second.numel() == input.numel(), "xcomm: the error-feedback residual of bucket ",
              key, " has ", it->second.numel(), " elements but the bucket now has ", input.numel(),
              "; buckets changed after error feedback started (start compression after DDP "
              "rebuilt its buckets, i.e. at iteration 2 or later)");
  return input + it->second.view(input.sizes()).to(input.dtype());
}

}  // namespace xcomm
