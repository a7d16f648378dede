#include "compress/RandomKCodec.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

namespace xcomm {
namespace {

// SplitMix64: decorrelates the seeds of neighbouring (key, step) pairs.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

RandomKCodec::RandomKCodec(uint64_t seed, bool errorFeedback)
    : seed_(seed), useFeedback_(errorFeedback) {}

at::Tensor RandomKCodec::positions(int64_t key, int64_t step, int64_t numel, double density) const {
  TORCH_CHECK_VALUE(density > 0.0 && density <= 1.0,
                    "xcomm: random-k density must be in (0, 1], got ", density);
  if (numel == 0) return at::empty({0}, at::kLong);
  if (density >= 1.0) return at::arange(numel, at::kLong);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(
      mix(seed_ ^ mix(static_cast<uint64_t>(key) ^ mix(static_cast<uint64_t>(step)))));
  at::Tensor keep = at::rand({numel}, gen, at::kFloat) < density;
  at::Tensor pos = at::nonzero(keep).view({-1});
  if (pos.numel() == 0) {  // tiny buckets: keep one position rather than none
    pos = at::randint(numel, {1}, gen, at::kLong);
  }
  return pos;
}

at::Tensor RandomKCodec::encode(int64_t key, const at::Tensor& flat, const at::Tensor& positions) {
  TORCH_CHECK_TYPE(at::isFloatingType(flat.scalar_type()),
                   "xcomm: random-k needs a floating-point tensor");
  at::Tensor input = flat.reshape({-1}).to(at::kCPU);
  at::Tensor acc = useFeedback_ ? feedback_.compensate(key, input) : input;
  at::Tensor values = acc.index_select(0, positions);
  if (useFeedback_) {
    acc.index_fill_(0, positions, 0);
    feedback_.store(key, acc);
  }
  return values;
}

void RandomKCodec::decode(const at::Tensor& reduced, const at::Tensor& positions, at::Tensor& out,
                          double divisor) const {
  at::Tensor flat = at::zeros({out.numel()}, out.options().device(at::kCPU));
  flat.index_copy_(0, positions, reduced.to(flat.dtype()).to(at::kCPU));
  if (divisor != 1.0) flat.div_(divisor);
  out.view({-1}).copy_(flat);
}

}  // namespace xcomm
