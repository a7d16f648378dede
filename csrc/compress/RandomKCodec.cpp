#include "compress/RandomKCodec.hpp"

#include <algorithm>
#include <cmath>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "compress/cuda/CudaCodecs.hpp"
#include "compress/kernels/CodecKernels.hpp"

namespace xcomm {
namespace {

// SplitMix64: decorrelates the seeds of neighbouring (key, step) pairs.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

constexpr int64_t kGrain = 1 << 16;

bool isDenseFloat(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu();
}

// A GPU bucket the CUDA kernels take, with its positions on the same device.
bool onCudaKernels(const at::Tensor& t, const at::Tensor& positions) {
  return t.is_cuda() && cuda::codecsBuilt() && positions.device() == t.device() &&
         positions.is_contiguous();
}

void checkPositions(const at::Tensor& positions, int64_t numel) {
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.dim() == 1,
                    "xcomm: random-k positions must be a 1-D int64 tensor");
  // On a GPU the range check would wait for the device; the positions come
  // from positions() for this bucket's size (a size mismatch is caught by
  // the caller's numel checks).
  if (positions.numel() > 0 && !positions.is_cuda()) {
    TORCH_CHECK_VALUE(
        positions.min().item<int64_t>() >= 0 && positions.max().item<int64_t>() < numel,
        "xcomm: a random-k position lies outside the bucket of ", numel, " elements");
  }
}

}  // namespace

RandomKCodec::RandomKCodec(uint64_t seed, bool errorFeedback)
    : seed_(seed), useFeedback_(errorFeedback) {}

at::Tensor RandomKCodec::positions(int64_t key, int64_t step, int64_t numel, double density,
                                   at::Device device) const {
  TORCH_CHECK_VALUE(density > 0.0 && density <= 1.0,
                    "xcomm: random-k density must be in (0, 1], got ", density);
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);
  if (numel == 0) return at::empty({0}, options);
  if (density >= 1.0) return at::arange(numel, options);
  // Stratified: k = ceil(density * numel) strata of (nearly) equal width and
  // one position drawn in each, from integer hashing only, so every rank and
  // every CPU draws the same positions, in ascending order, at k draws'
  // cost rather than numel's.
  const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(density * numel)));
  const uint64_t base =
      mix(seed_ ^ mix(static_cast<uint64_t>(key) ^ mix(static_cast<uint64_t>(step))));
  if (device.is_cuda() && cuda::codecsBuilt() && numel < (int64_t{1} << 31)) {
    at::Tensor pos = at::empty({k}, options);
    cuda::randomkPositions(base, numel, pos);
    return pos;
  }
  at::Tensor pos = at::empty({k}, at::kLong);
  int64_t* out = pos.data_ptr<int64_t>();
  const unsigned __int128 n = static_cast<uint64_t>(numel);
  at::parallel_for(0, k, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto lo = static_cast<int64_t>(n * static_cast<uint64_t>(i) / static_cast<uint64_t>(k));
      const auto hi =
          static_cast<int64_t>(n * static_cast<uint64_t>(i + 1) / static_cast<uint64_t>(k));
      const uint64_t width = static_cast<uint64_t>(hi - lo);
      out[i] = lo + static_cast<int64_t>(mix(base + static_cast<uint64_t>(i)) % width);
    }
  });
  return device.is_cpu() ? pos : pos.to(device);
}

at::Tensor RandomKCodec::encode(int64_t key, const at::Tensor& flat, const at::Tensor& positions) {
  return encode(key, flat, positions, useFeedback_ ? &feedback_ : nullptr);
}

at::Tensor RandomKCodec::encode(int64_t key, const at::Tensor& flat, const at::Tensor& positions,
                                ErrorFeedback* fb) {
  TORCH_CHECK_TYPE(at::isFloatingType(flat.scalar_type()),
                   "xcomm: random-k needs a floating-point tensor");
  checkPositions(positions, flat.numel());
  if (onCudaKernels(flat, positions) && flat.scalar_type() == at::kFloat && flat.is_contiguous()) {
    at::Tensor values = at::empty({positions.numel()}, flat.options());
    if (fb == nullptr) {
      cuda::gatherPositions(flat.view({-1}), positions, values, /*zero=*/false);
      return values;
    }
    bool seeded = false;
    at::Tensor residual = fb->accumulator(key, flat, &seeded);
    if (!seeded) cuda::addInto(flat.view({-1}), residual);
    cuda::gatherPositions(residual, positions, values, /*zero=*/true);
    return values;
  }
  if (isDenseFloat(flat) && positions.is_contiguous()) {
    // One pass adds the input into the residual; then the k kept values are
    // read out of it and zeroed there.
    const int64_t n = flat.numel(), k = positions.numel();
    const int64_t* pos = positions.data_ptr<int64_t>();
    at::Tensor values = at::empty({k}, at::kFloat);
    float* val = values.data_ptr<float>();
    if (fb == nullptr) {
      const float* src = flat.data_ptr<float>();
      for (int64_t i = 0; i < k; ++i) val[i] = src[pos[i]];
      return values;
    }
    bool seeded = false;
    at::Tensor residual = fb->accumulator(key, flat, &seeded);
    float* res = residual.data_ptr<float>();
    if (!seeded) {
      const float* src = flat.data_ptr<float>();
      const auto& kern = kernels::codecKernels();
      at::parallel_for(0, n, kGrain,
                       [&](int64_t lo, int64_t hi) { kern.addInto(src, res, lo, hi); });
    }
    for (int64_t i = 0; i < k; ++i) {
      val[i] = res[pos[i]];
      res[pos[i]] = 0.f;
    }
    return values;
  }
  at::Tensor input = flat.reshape({-1}).to(positions.device());
  at::Tensor acc = (fb != nullptr) ? fb->compensate(key, input) : input;
  at::Tensor values = acc.index_select(0, positions);
  if ((fb != nullptr)) {
    acc.index_fill_(0, positions, 0);
    fb->store(key, acc);
  }
  return values;
}

void RandomKCodec::decode(const at::Tensor& reduced, const at::Tensor& positions, at::Tensor& out,
                          double divisor) const {
  checkPositions(positions, out.numel());
  TORCH_CHECK_VALUE(reduced.numel() == positions.numel(), "xcomm: random-k got ", reduced.numel(),
                    " reduced values for ", positions.numel(), " positions");
  if (onCudaKernels(out, positions)) {
    const bool dense = out.scalar_type() == at::kFloat && out.is_contiguous();
    at::Tensor full =
        dense ? out.view({-1}) : at::empty({out.numel()}, out.options().dtype(at::kFloat));
    cuda::scatterPositions(reduced.reshape({-1}).to(out.device(), at::kFloat).contiguous(),
                           positions, static_cast<float>(divisor), full);
    if (!dense) out.view({-1}).copy_(full);
    return;
  }
  if (isDenseFloat(out) && positions.is_contiguous()) {
    at::Tensor values = reduced.reshape({-1}).to(at::kCPU, at::kFloat).contiguous();
    const float* val = values.data_ptr<float>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    float* dst = out.data_ptr<float>();
    const int64_t n = out.numel();
    at::parallel_for(0, n, kGrain,
                     [&](int64_t lo, int64_t hi) { std::fill(dst + lo, dst + hi, 0.f); });
    const float d = static_cast<float>(divisor);
    for (int64_t i = 0; i < positions.numel(); ++i) {
      dst[pos[i]] = divisor != 1.0 ? val[i] / d : val[i];
    }
    return;
  }
  at::Tensor flat = at::zeros({out.numel()}, out.options().device(positions.device()));
  flat.index_copy_(0, positions, reduced.to(positions.device(), flat.scalar_type()));
  if (divisor != 1.0) flat.div_(divisor);
  out.view({-1}).copy_(flat);
}

}  // namespace xcomm
