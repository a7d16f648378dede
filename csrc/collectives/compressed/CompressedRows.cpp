#include "collectives/compressed/CompressedRows.hpp"

#include <c10/util/Exception.h>

#include "common/LinkBytes.hpp"
#include "common/Methods.hpp"

namespace xcomm {

CompressedRows::CompressedRows(Compression method, int size, std::shared_ptr<const Int8Codec> int8)
    : method_(method), size_(size), int8_(std::move(int8)) {
  TORCH_CHECK_VALUE(method_ == Compression::kInt8 || isCast(method_),
                    "xcomm: a compressed reduce-scatter is one of ",
                    methodChoices(kFsdpSurface, /*lossyOnly=*/true), ", not ",
                    compressionName(method_));
  TORCH_CHECK_VALUE(size_ >= 1, "xcomm: a compressed reduce-scatter needs a group size >= 1");
  TORCH_CHECK(method_ != Compression::kInt8 || int8_, "xcomm: int8 rows need an Int8Codec");
}

at::Tensor CompressedRows::encode(const at::Tensor& input, ErrorFeedback* feedback,
                                  int64_t key) const {
  TORCH_CHECK_VALUE(input.numel() % size_ == 0, "xcomm: a reduce-scatter's input of ",
                    input.numel(), " elements does not cut into ", size_, " equal rows");
  if (method_ == Compression::kInt8) return int8_->packRows(input, size_, feedback, key);
  const auto low = method_ == Compression::kFp16 ? at::kHalf : at::kBFloat16;
  at::Tensor rows = input.reshape({size_, input.numel() / size_});
  if (!feedback) return rows.to(low).contiguous();
  // The residual is kept in float32 (float64 for a float64 input).
  const auto wide = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor wanted = feedback->compensate(key, rows.to(wide));
  at::Tensor wire = wanted.to(low).contiguous();
  feedback->store(key, (wanted - wire.to(wide)).reshape({-1}));  // flat, as int8's
  return wire;
}

void CompressedRows::reduceInto(const at::Tensor& received, const at::Tensor& output,
                                bool mean) const {
  at::Tensor total;
  if (method_ == Compression::kInt8) {
    const int64_t rowElems = output.numel();
    total = int8_->reduceShards(received, int8_->rowElems(rowElems * size_, size_))
                .narrow(0, 0, rowElems);
  } else {
    const auto wide = output.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    total = received[0].to(wide);
    for (int j = 1; j < size_; ++j) total.add_(received[j]);
  }
  if (mean) total.div_(size_);
  output.copy_(total.view(output.sizes()));
}

int64_t CompressedRows::sentBytes(const at::Tensor& wire) const {
  return alltoallBytes<int64_t>(wire.numel() * wire.element_size(), size_);
}

}  // namespace xcomm
