#include "compress/TopKCodec.hpp"

#include <cmath>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

namespace xcomm {

TopKCodec::TopKCodec(bool approximate, bool errorFeedback, int64_t sampleSize, uint64_t seed)
    : approximate_(approximate),
      useFeedback_(errorFeedback),
      sampleSize_(sampleSize),
      generator_(at::make_generator<at::CPUGeneratorImpl>(seed)) {
  TORCH_CHECK_VALUE(sampleSize_ > 0, "xcomm: top-k sample size must be positive");
}

int64_t TopKCodec::kFor(int64_t numel, double density) {
  TORCH_CHECK_VALUE(density > 0.0 && density <= 1.0, "xcomm: top-k density must be in (0, 1], got ",
                    density);
  if (numel == 0) return 0;
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(density * numel)));
}

int64_t TopKCodec::packedBytes(int64_t k, at::ScalarType dtype) {
  return k * (static_cast<int64_t>(sizeof(int32_t)) + c10::elementSize(dtype));
}

at::Tensor TopKCodec::select(const at::Tensor& magnitudes, int64_t k) {
  const int64_t n = magnitudes.numel();
  if (k >= n) {
    return at::arange(n, at::kLong);
  }
  if (!approximate_ || n <= 4 * sampleSize_) {
    return std::get<1>(at::topk(magnitudes, k, /*dim=*/0, /*largest=*/true, /*sorted=*/false));
  }
  // Threshold from a sample, a little below the target quantile so that
  // usually more than k pass; the exact top-k then runs on those few.
  at::Tensor idx = at::randint(n, {sampleSize_}, generator_, at::kLong);
  at::Tensor sample = magnitudes.index_select(0, idx);
  const double keep = std::min(1.0, 2.0 * static_cast<double>(k) / n);
  const int64_t rank = std::max<int64_t>(1, static_cast<int64_t>(keep * sampleSize_));
  const double threshold =
      std::get<0>(at::topk(sample, rank, 0, true, true)).select(0, rank - 1).item<double>();
  at::Tensor candidates = at::nonzero(magnitudes >= threshold).view({-1});
  if (candidates.numel() < k) {  // the sample overestimated: fall back to exact
    return std::get<1>(at::topk(magnitudes, k, 0, true, false));
  }
  at::Tensor sub = magnitudes.index_select(0, candidates);
  return candidates.index_select(0, std::get<1>(at::topk(sub, k, 0, true, false)));
}

at::Tensor TopKCodec::encode(int64_t key, const at::Tensor& flat, int64_t k) {
  const auto dtype = flat.scalar_type();
  TORCH_CHECK_TYPE(at::isFloatingType(dtype), "xcomm: top-k needs a floating-point tensor");
  at::Tensor input = flat.reshape({-1}).to(at::kCPU);
  at::Tensor acc = useFeedback_ ? feedback_.compensate(key, input) : input;
  k = std::min<int64_t>(k, acc.numel());
  // NaN magnitudes compare as largest in topk, so a NaN is sent, not buried in the residual.
  at::Tensor indices = select(acc.abs().to(at::kFloat), k);
  at::Tensor values = acc.index_select(0, indices);
  if (useFeedback_) {
    at::Tensor residual = acc.clone();
    residual.index_fill_(0, indices, 0);
    feedback_.store(key, residual);
  }
  const int64_t idxBytes = k * static_cast<int64_t>(sizeof(int32_t));
  at::Tensor packed = at::empty({packedBytes(k, dtype)}, at::kByte);
  packed.narrow(0, 0, idxBytes).view(at::kInt).copy_(indices);
  packed.narrow(0, idxBytes, packed.numel() - idxBytes).view(dtype).copy_(values);
  return packed;
}

void TopKCodec::decode(const at::Tensor& gathered, int64_t k, at::Tensor& out,
                       double divisor) const {
  const auto dtype = out.scalar_type();
  at::Tensor rows = gathered.contiguous().view({-1, packedBytes(k, dtype)});
  const int64_t idxBytes = k * static_cast<int64_t>(sizeof(int32_t));
  at::Tensor flat = at::zeros({out.numel()}, out.options().device(at::kCPU));
  for (int64_t r = 0; r < rows.size(0); ++r) {  // rank order: same bits on every rank
    at::Tensor row = rows.select(0, r);
    at::Tensor indices = row.narrow(0, 0, idxBytes).view(at::kInt).to(at::kLong);
    at::Tensor values = row.narrow(0, idxBytes, row.numel() - idxBytes).view(dtype);
    TORCH_CHECK(indices.numel() == 0 || (indices.min().item<int64_t>() >= 0 &&
                                         indices.max().item<int64_t>() < out.numel()),
                "xcomm: top-k payload of rank ", r, " holds an index outside the bucket");
    flat.index_add_(0, indices, values);
  }
  if (divisor != 1.0) flat.div_(divisor);
  out.view({-1}).copy_(flat);
}

}  // namespace xcomm
