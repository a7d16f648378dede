#include "compress/Int8Codec.hpp"

#include <cmath>
#include <cstring>
#include <limits>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

namespace xcomm {
namespace {

int64_t ceilDiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

constexpr int64_t kGrain = 16;  // chunks per parallel task

}  // namespace

Int8Codec::Int8Codec(int64_t chunkElems) : chunkElems_(chunkElems) {
  TORCH_CHECK_VALUE(chunkElems_ > 0, "xcomm: int8 chunk size must be positive, got ", chunkElems_);
}

int64_t Int8Codec::shardElems(int64_t numel, int world) const {
  return ceilDiv(ceilDiv(numel, world), chunkElems_) * chunkElems_;
}

int64_t Int8Codec::packedBytes(int64_t elems) const {
  return elems + static_cast<int64_t>(sizeof(float)) * ceilDiv(elems, chunkElems_);
}

void Int8Codec::quantize(const float* src, int64_t n, int8_t* dst, float* scales) const {
  const int64_t chunks = ceilDiv(n, chunkElems_);
  at::parallel_for(0, chunks, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * chunkElems_;
      const int64_t hi = std::min(n, lo + chunkElems_);
      float absmax = 0.f;
      bool finite = true;
      for (int64_t i = lo; i < hi; ++i) {
        const float a = std::fabs(src[i]);
        finite &= std::isfinite(a);
        absmax = a > absmax ? a : absmax;
      }
      if (!finite) {
        scales[c] = std::numeric_limits<float>::quiet_NaN();
        std::memset(dst + lo, 0, hi - lo);
        continue;
      }
      const float scale = absmax > 0.f ? absmax / 127.f : 1.f;
      const float inv = 1.f / scale;
      scales[c] = scale;
      for (int64_t i = lo; i < hi; ++i) {
        dst[i] = static_cast<int8_t>(std::nearbyint(src[i] * inv));
      }
    }
  });
}

void Int8Codec::dequantize(const int8_t* src, const float* scales, int64_t n, float* dst,
                           bool accumulate) const {
  const int64_t chunks = ceilDiv(n, chunkElems_);
  at::parallel_for(0, chunks, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * chunkElems_;
      const int64_t hi = std::min(n, lo + chunkElems_);
      const float scale = scales[c];
      if (accumulate) {
        for (int64_t i = lo; i < hi; ++i) dst[i] += static_cast<float>(src[i]) * scale;
      } else {
        for (int64_t i = lo; i < hi; ++i) dst[i] = static_cast<float>(src[i]) * scale;
      }
    }
  });
}

at::Tensor Int8Codec::packShards(const at::Tensor& flat, int world) const {
  TORCH_CHECK_TYPE(at::isFloatingType(flat.scalar_type()),
                   "xcomm: int8 compression needs a floating-point tensor");
  const int64_t n = flat.numel();
  const int64_t shard = shardElems(n, world);
  const int64_t bytes = packedBytes(shard);
  // Zero padding past numel quantizes to zero and costs nothing in the sum.
  at::Tensor padded = at::zeros({world * shard}, flat.options().dtype(at::kFloat).device(at::kCPU));
  padded.narrow(0, 0, n).copy_(flat.reshape({-1}));
  at::Tensor out = at::empty({world, bytes}, at::TensorOptions().dtype(at::kByte));
  const float* src = padded.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int j = 0; j < world; ++j) {
    uint8_t* row = dst + j * bytes;
    quantize(src + j * shard, shard, reinterpret_cast<int8_t*>(row),
             reinterpret_cast<float*>(row + shard));
  }
  return out;
}

at::Tensor Int8Codec::reduceShards(const at::Tensor& received, int64_t shard) const {
  TORCH_CHECK_VALUE(received.dim() == 2 && received.size(1) == packedBytes(shard),
                    "xcomm: int8 payload has the wrong size");
  at::Tensor packed = received.contiguous();
  at::Tensor sum = at::zeros({shard}, at::kFloat);
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const int64_t bytes = packed.size(1);
  for (int64_t r = 0; r < packed.size(0); ++r) {  // rank order: same bits everywhere
    const uint8_t* row = src + r * bytes;
    dequantize(reinterpret_cast<const int8_t*>(row), reinterpret_cast<const float*>(row + shard),
               shard, sum.data_ptr<float>(), /*accumulate=*/true);
  }
  return sum;
}

at::Tensor Int8Codec::pack(const at::Tensor& shard) const {
  at::Tensor src = shard.to(at::kFloat).contiguous();
  const int64_t n = src.numel();
  at::Tensor out = at::empty({packedBytes(n)}, at::kByte);
  uint8_t* dst = out.data_ptr<uint8_t>();
  quantize(src.data_ptr<float>(), n, reinterpret_cast<int8_t*>(dst),
           reinterpret_cast<float*>(dst + n));
  return out;
}

void Int8Codec::unpackAll(const at::Tensor& gathered, int64_t shard, at::Tensor& out) const {
  if (out.numel() == 0) {
    return;
  }
  at::Tensor packed = gathered.contiguous().view({-1, packedBytes(shard)});
  const int64_t world = packed.size(0);
  TORCH_CHECK_VALUE(out.numel() <= world * shard, "xcomm: int8 output larger than the payload");
  at::Tensor full = at::empty({world * shard}, at::kFloat);
  const uint8_t* src = packed.data_ptr<uint8_t>();
  for (int64_t r = 0; r < world; ++r) {
    const uint8_t* row = src + r * packed.size(1);
    dequantize(reinterpret_cast<const int8_t*>(row), reinterpret_cast<const float*>(row + shard),
               shard, full.data_ptr<float>() + r * shard, /*accumulate=*/false);
  }
  out.view({-1}).copy_(full.narrow(0, 0, out.numel()));
}

at::Tensor Int8Codec::roundTrip(const at::Tensor& flat) const {
  at::Tensor packed = pack(flat.reshape({-1}));
  at::Tensor out = at::empty({flat.numel()}, flat.options().device(at::kCPU));
  unpackAll(packed.view({1, -1}), flat.numel(), out);
  return out.view(flat.sizes());
}

}  // namespace xcomm
