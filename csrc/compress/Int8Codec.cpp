#include "compress/Int8Codec.hpp"

#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "compress/cuda/CudaCodecs.hpp"
#include "compress/kernels/CodecKernels.hpp"

namespace xcomm {
namespace {

int64_t ceilDiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Elements per parallel task: large enough that a task outweighs its start.
constexpr int64_t kGrainElems = 1 << 16;

int64_t grainChunks(int64_t chunkElems) {
  return std::max<int64_t>(1, kGrainElems / chunkElems);
}

bool isDenseFloat(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu();
}

// A bucket the CUDA kernels take: on a GPU, in a build that has them.
bool onCudaKernels(const at::Tensor& t) {
  return t.is_cuda() && cuda::codecsBuilt();
}

// `t` flat, float32 and contiguous, on its own device.
at::Tensor denseFloat(const at::Tensor& t) {
  return t.reshape({-1}).to(at::kFloat).contiguous();
}

// Runs fn(shard j, chunks [c0, c1) of it, element offset, valid elements) over
// the chunks of `world` shards of `shard` elements each (`n` real elements in
// all, shard j starting at element j * stride) in one parallel loop; a task
// may span two shards. stride < shard pads each shard's last chunk.
template <typename Fn>
void forEachShardChunks(int64_t n, int world, int64_t shard, int64_t stride, int64_t chunkElems,
                        Fn fn) {
  const int64_t perShard = ceilDiv(shard, chunkElems);
  at::parallel_for(0, world * perShard, grainChunks(chunkElems), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end;) {
      const int64_t j = g / perShard;
      const int64_t c0 = g - j * perShard;
      const int64_t c1 = std::min(perShard, c0 + (end - g));
      const int64_t offset = j * stride;
      fn(j, c0, c1, offset, std::clamp<int64_t>(n - offset, 0, stride));
      g += c1 - c0;
    }
  });
}

}  // namespace

at::Tensor Int8Codec::takeBuffer(int64_t bytes) const {
  constexpr size_t kMaxPooled = 8;
  std::lock_guard<std::mutex> lock(pool_->mu);
  auto& buffers = pool_->buffers;
  for (auto& b : buffers) {
    // Only the pool holds it (no tensor, view or in-flight collective).
    if (b.numel() == bytes && b.use_count() == 1 && b.storage().use_count() == 1) {
      return b.view({bytes});
    }
  }
  at::Tensor fresh = at::empty({bytes}, at::kByte);
  if (buffers.size() >= kMaxPooled) {
    buffers.erase(buffers.begin());
  }
  buffers.push_back(fresh);
  return fresh.view({bytes});
}

Int8Codec::Int8Codec(int64_t chunkElems) : chunkElems_(chunkElems) {
  TORCH_CHECK_VALUE(chunkElems_ > 0, "xcomm: int8 chunk size must be positive, got ", chunkElems_);
}

int64_t Int8Codec::shardElems(int64_t numel, int world) const {
  return ceilDiv(ceilDiv(numel, world), chunkElems_) * chunkElems_;
}

int64_t Int8Codec::packedBytes(int64_t elems) const {
  return elems + static_cast<int64_t>(sizeof(float)) * ceilDiv(elems, chunkElems_);
}

int64_t Int8Codec::rowElems(int64_t numel, int rows) const {
  TORCH_CHECK_VALUE(rows > 0 && numel % rows == 0, "xcomm: int8 rows need a numel (", numel,
                    ") that splits evenly into ", rows, " rows");
  return ceilDiv(numel / rows, chunkElems_) * chunkElems_;
}

void Int8Codec::quantizeShards(const float* src, float* residual, int64_t n, int world,
                               int64_t stride, at::Tensor& out) const {
  const int64_t shard = stride == 0 ? shardElems(n, world) : rowElems(n, world);
  if (stride == 0) {
    stride = shard;
  }
  const int64_t bytes = out.size(1);
  uint8_t* dst = out.data_ptr<uint8_t>();
  const auto& k = kernels::codecKernels();
  forEachShardChunks(n, world, shard, stride, chunkElems_,
                     [&](int64_t j, int64_t c0, int64_t c1, int64_t offset, int64_t valid) {
                       uint8_t* row = dst + j * bytes;
                       k.int8Encode(src ? src + offset : nullptr,
                                    residual ? residual + offset : nullptr, valid, shard,
                                    chunkElems_, c0, c1, reinterpret_cast<int8_t*>(row),
                                    reinterpret_cast<float*>(row + shard));
                     });
}

at::Tensor Int8Codec::packShards(const at::Tensor& flat, int world) const {
  TORCH_CHECK_TYPE(at::isFloatingType(flat.scalar_type()),
                   "xcomm: int8 compression needs a floating-point tensor");
  TORCH_CHECK_VALUE(world > 0, "xcomm: int8 needs a positive world size, got ", world);
  const int64_t n = flat.numel();
  const int64_t shard = shardElems(n, world);
  if (onCudaKernels(flat)) {
    at::Tensor out = at::empty({world, packedBytes(shard)}, flat.options().dtype(at::kByte));
    cuda::int8Encode(denseFloat(flat), at::Tensor(), n, world, shard, shard, chunkElems_, out);
    return out;
  }
  at::Tensor src = flat.reshape({-1}).to(at::kCPU, at::kFloat).contiguous();
  at::Tensor out = at::empty({world, packedBytes(shard)}, at::kByte);
  quantizeShards(src.data_ptr<float>(), nullptr, n, world, 0, out);
  return out;
}

at::Tensor Int8Codec::packShardsWithFeedback(const at::Tensor& flat, int world,
                                             ErrorFeedback& feedback, int64_t key) const {
  TORCH_CHECK_TYPE(at::isFloatingType(flat.scalar_type()),
                   "xcomm: int8 compression needs a floating-point tensor");
  if (onCudaKernels(flat) && flat.scalar_type() == at::kFloat && flat.is_contiguous()) {
    const int64_t n = flat.numel(), shard = shardElems(n, world);
    bool seeded = false;
    at::Tensor residual = feedback.accumulator(key, flat, &seeded);
    at::Tensor out = at::empty({world, packedBytes(shard)}, flat.options().dtype(at::kByte));
    cuda::int8Encode(seeded ? at::Tensor() : flat.view({-1}), residual, n, world, shard, shard,
                     chunkElems_, out);
    return out;
  }
  if (!isDenseFloat(flat)) {  // the unfused route keeps the residual in the bucket's dtype
    at::Tensor acc = feedback.compensate(key, flat.reshape({-1}));
    at::Tensor packed = packShards(acc, world);
    at::Tensor sent = at::empty_like(acc);
    unpackAll(packed, shardElems(acc.numel(), world), sent);
    feedback.store(key, acc.sub_(sent));
    return packed;
  }
  const int64_t n = flat.numel();
  bool seeded = false;
  at::Tensor residual = feedback.accumulator(key, flat, &seeded);
  const int64_t rowBytes = packedBytes(shardElems(n, world));
  at::Tensor out = takeBuffer(world * rowBytes).view({world, rowBytes});
  quantizeShards(seeded ? nullptr : flat.data_ptr<float>(), residual.data_ptr<float>(), n, world, 0,
                 out);
  return out;
}

at::Tensor Int8Codec::packRows(const at::Tensor& flat, int rows, ErrorFeedback* feedback,
                               int64_t key) const {
  TORCH_CHECK_TYPE(at::isFloatingType(flat.scalar_type()),
                   "xcomm: int8 compression needs a floating-point tensor");
  const int64_t n = flat.numel();
  const int64_t rowBytes = packedBytes(rowElems(n, rows));
  if (onCudaKernels(flat)) {
    at::Tensor src = denseFloat(flat);
    at::Tensor out = at::empty({rows, rowBytes}, flat.options().dtype(at::kByte));
    bool seeded = false;
    at::Tensor residual = feedback ? feedback->accumulator(key, src, &seeded) : at::Tensor();
    cuda::int8Encode(seeded ? at::Tensor() : src, residual, n, rows, n / rows, rowElems(n, rows),
                     chunkElems_, out);
    return out;
  }
  at::Tensor src = flat.reshape({-1}).to(at::kCPU, at::kFloat).contiguous();
  at::Tensor out = takeBuffer(rows * rowBytes).view({rows, rowBytes});
  if (feedback == nullptr) {
    quantizeShards(src.data_ptr<float>(), nullptr, n, rows, n / rows, out);
    return out;
  }
  bool seeded = false;
  at::Tensor residual = feedback->accumulator(key, src, &seeded);
  quantizeShards(seeded ? nullptr : src.data_ptr<float>(), residual.data_ptr<float>(), n, rows,
                 n / rows, out);
  return out;
}

at::Tensor Int8Codec::reduceRows(const at::Tensor& received, int64_t shard, double divisor,
                                 bool pack) const {
  TORCH_CHECK_VALUE(
      received.dim() == 2 && received.size(1) == packedBytes(shard) && shard % chunkElems_ == 0,
      "xcomm: int8 payload has the wrong size");
  at::Tensor packed = received.contiguous();
  if (onCudaKernels(packed)) {
    at::Tensor out = pack ? at::empty({packedBytes(shard)}, packed.options())
                          : at::empty({shard}, packed.options().dtype(at::kFloat));
    cuda::int8Reduce(packed, shard, chunkElems_, static_cast<float>(divisor),
                     pack ? at::Tensor() : out, pack ? out : at::Tensor());
    return out;
  }
  const int64_t chunks = shard / chunkElems_;
  at::Tensor out = pack ? takeBuffer(packedBytes(shard)) : at::empty({shard}, at::kFloat);
  const uint8_t* rows = packed.data_ptr<uint8_t>();
  const int64_t rowBytes = packed.size(1);
  const int world = static_cast<int>(packed.size(0));
  const float div = static_cast<float>(divisor);
  const auto& k = kernels::codecKernels();
  at::parallel_for(0, chunks, grainChunks(chunkElems_), [&](int64_t c0, int64_t c1) {
    std::vector<float> scratch(chunkElems_);
    if (pack) {
      uint8_t* dst = out.data_ptr<uint8_t>();
      k.int8ReduceShard(rows, rowBytes, world, shard, chunkElems_, c0, c1, div, nullptr,
                        reinterpret_cast<int8_t*>(dst), reinterpret_cast<float*>(dst + shard),
                        scratch.data());
    } else {
      k.int8ReduceShard(rows, rowBytes, world, shard, chunkElems_, c0, c1, div,
                        out.data_ptr<float>(), nullptr, nullptr, scratch.data());
    }
  });
  return out;
}

at::Tensor Int8Codec::reduceShards(const at::Tensor& received, int64_t shard) const {
  return reduceRows(received, shard, 1.0, /*pack=*/false);
}

at::Tensor Int8Codec::reduceAndPack(const at::Tensor& received, int64_t shard,
                                    double divisor) const {
  return reduceRows(received, shard, divisor, /*pack=*/true);
}

at::Tensor Int8Codec::pack(const at::Tensor& shard) const {
  if (onCudaKernels(shard)) {
    at::Tensor src = denseFloat(shard);
    const int64_t n = src.numel();
    at::Tensor out = at::empty({1, packedBytes(n)}, src.options().dtype(at::kByte));
    cuda::int8Encode(src, at::Tensor(), n, 1, n, n, chunkElems_, out);
    return out.view({-1});
  }
  at::Tensor src = shard.reshape({-1}).to(at::kCPU, at::kFloat).contiguous();
  const int64_t n = src.numel();
  // One "shard" of n elements: packShards' layout with world 1, without padding.
  at::Tensor out = at::empty({packedBytes(n)}, at::kByte);
  uint8_t* dst = out.data_ptr<uint8_t>();
  const float* in = src.data_ptr<float>();
  const auto& k = kernels::codecKernels();
  at::parallel_for(
      0, ceilDiv(n, chunkElems_), grainChunks(chunkElems_), [&](int64_t c0, int64_t c1) {
        k.int8Encode(in, nullptr, n, n, chunkElems_, c0, c1, reinterpret_cast<int8_t*>(dst),
                     reinterpret_cast<float*>(dst + n));
      });
  return out;
}

void Int8Codec::unpackAll(const at::Tensor& gathered, int64_t shard, at::Tensor& out) const {
  if (out.numel() == 0) {
    return;
  }
  at::Tensor packed = gathered.contiguous().view({-1, packedBytes(shard)});
  const int64_t world = packed.size(0);
  const int64_t n = out.numel();
  TORCH_CHECK_VALUE(n <= world * shard, "xcomm: int8 output larger than the payload");
  if (onCudaKernels(packed)) {
    TORCH_CHECK_VALUE(out.device() == packed.device(), "xcomm: int8 output on ", out.device(),
                      " but the payload on ", packed.device());
    const bool dense = out.scalar_type() == at::kFloat && out.is_contiguous();
    at::Tensor full = dense ? out.view({-1}) : at::empty({n}, packed.options().dtype(at::kFloat));
    cuda::int8Decode(packed, shard, chunkElems_, n, full);
    if (!dense) out.view({-1}).copy_(full);
    return;
  }
  const bool direct = isDenseFloat(out);
  at::Tensor full = direct ? out.view({-1}) : at::empty({n}, at::kFloat);
  float* dst = full.data_ptr<float>();
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const int64_t bytes = packed.size(1);
  const auto& k = kernels::codecKernels();
  forEachShardChunks(n, static_cast<int>(world), shard, shard, chunkElems_,
                     [&](int64_t j, int64_t c0, int64_t c1, int64_t offset, int64_t valid) {
                       if (valid == 0) return;
                       const uint8_t* row = src + j * bytes;
                       k.int8Decode(reinterpret_cast<const int8_t*>(row),
                                    reinterpret_cast<const float*>(row + shard), valid, chunkElems_,
                                    c0, c1, dst + offset);
                     });
  if (!direct) {
    out.view({-1}).copy_(full);
  }
}

at::Tensor Int8Codec::roundTrip(const at::Tensor& flat) const {
  at::Tensor packed = pack(flat.reshape({-1}));
  at::Tensor out = at::empty({flat.numel()}, flat.options().device(at::kCPU));
  unpackAll(packed.view({1, -1}), flat.numel(), out);
  return out.view(flat.sizes());
}

}  // namespace xcomm
