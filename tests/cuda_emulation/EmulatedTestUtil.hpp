#pragma once
// Inputs and comparisons shared by the emulated-GPU tests.
#include <cstdint>
#include <cstring>
#include <string>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace emutest {

inline at::Tensor randn(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({n}, gen, at::TensorOptions().dtype(at::kFloat));
}

// Gradient-like values: magnitudes spread over a few decades, as layers of
// different scale give.
inline at::Tensor layered(int64_t n, uint64_t seed) {
  at::Tensor x = randn(n, seed);
  const int64_t part = (n + 3) / 4;
  for (int64_t p = 0; p < 4; ++p) {
    const int64_t lo = p * part, len = std::min(n, lo + part) - lo;
    if (len > 0) x.narrow(0, lo, len).mul_(std::pow(10.0, -p));
  }
  return x;
}

// Few distinct magnitudes: many ties at the k-th one.
inline at::Tensor crowded(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor levels = at::randint(0, 6, {n}, gen, at::kLong).to(at::kFloat);
  at::Tensor sign = at::randint(0, 2, {n}, gen, at::kLong).to(at::kFloat).mul_(2).sub_(1);
  return levels.mul_(0.25).mul_(sign);
}

// Bitwise equality, NaNs included (float comparison would say NaN != NaN).
inline bool sameBits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.numel() != b.numel()) return false;
  at::Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size()) == 0;
}

// First index where two float tensors' bits differ, or -1.
inline int64_t firstDifference(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.contiguous().view(at::kInt), y = b.contiguous().view(at::kInt);
  const int32_t* p = x.data_ptr<int32_t>();
  const int32_t* q = y.data_ptr<int32_t>();
  for (int64_t i = 0; i < std::min(x.numel(), y.numel()); ++i) {
    if (p[i] != q[i]) return i;
  }
  return x.numel() == y.numel() ? -1 : std::min(x.numel(), y.numel());
}

}  // namespace emutest
