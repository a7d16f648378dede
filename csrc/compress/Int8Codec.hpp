#pragma once
// int8 quantization with one float32 scale per chunk of elements.
//
// Used as a compressed reduce-scatter then allgather: each rank quantizes its
// buffer in `world` shards and sends shard j to rank j (alltoall); rank j sums
// the shards it received in float32 (in rank order) and quantizes the sum;
// an allgather gives everyone every reduced shard. Each rank sends about
// 2 (world-1)/world bytes per element, as a ring allreduce of int8 would.
//
// A packed shard is [int8 values (shardElems) | float32 scales (chunks)].
// A chunk holding NaN or Inf decodes to NaN, so a non-finite gradient stays
// visible (as an uncompressed allreduce would leave it) instead of vanishing.
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>

#include "common/Compression.hpp"
#include "compress/ErrorFeedback.hpp"

namespace xcomm {

class Int8Codec {
 public:
  explicit Int8Codec(int64_t chunkElems = kDefaultInt8ChunkElems);

  int64_t chunkElems() const { return chunkElems_; }
  // Elements per shard: numel split over `world`, rounded up to whole chunks.
  int64_t shardElems(int64_t numel, int world) const;
  // Bytes of one packed shard of `elems` elements.
  int64_t packedBytes(int64_t elems) const;

  // Quantizes `flat` (any floating dtype) as `world` shards: uint8 [world, packedBytes].
  at::Tensor packShards(const at::Tensor& flat, int world) const;
  // packShards of flat + the residual of `key`, leaving in that residual what
  // the packed shards do not carry: error feedback and quantization in one
  // pass over the bucket (float32; other dtypes take the unfused route).
  at::Tensor packShardsWithFeedback(const at::Tensor& flat, int world, ErrorFeedback& feedback,
                                    int64_t key) const;
  // Elements of one packed row when `numel` is cut into `rows` equal rows:
  // numel / rows rounded up to whole chunks (ValueError if it does not divide).
  int64_t rowElems(int64_t numel, int rows) const;
  // Quantizes `flat` cut into `rows` equal rows of numel / rows elements
  // (a reduce-scatter's input, whose shard boundaries the caller fixes), one
  // packed row each, padded to whole chunks: uint8 [rows, packedBytes(rowElems)].
  // With `feedback`, the residual of `key` is added first and keeps what the
  // rows do not carry (one pass, as packShardsWithFeedback). reduceShards with
  // rowElems then sums a row's versions from every rank.
  at::Tensor packRows(const at::Tensor& flat, int rows, ErrorFeedback* feedback, int64_t key) const;
  // Dequantizes and sums the world's versions of one shard, uint8 [world, packedBytes],
  // into float32 [shardElems], in rank order (so every run gives the same bits).
  at::Tensor reduceShards(const at::Tensor& received, int64_t shardElems) const;
  // reduceShards, divided by `divisor`, then pack: the reduce-scatter's
  // second half in one pass.
  at::Tensor reduceAndPack(const at::Tensor& received, int64_t shardElems, double divisor) const;
  // Quantizes one float32 shard: uint8 [packedBytes].
  at::Tensor pack(const at::Tensor& shard) const;
  // Dequantizes the world's packed shards, uint8 [world, packedBytes], into
  // `out` (flat, any floating dtype; its numel may be less than world * shard).
  void unpackAll(const at::Tensor& gathered, int64_t shardElems, at::Tensor& out) const;

  // Quantize then dequantize, for error feedback and tests: what the peers see.
  at::Tensor roundTrip(const at::Tensor& flat) const;

 private:
  // Quantizes `world` shards of `n` source elements into `out` (uint8
  // [world, packedBytes]); src null: the values are in `residual`. stride 0:
  // packShards' shards; otherwise packRows' rows of `stride` elements.
  void quantizeShards(const float* src, float* residual, int64_t n, int world, int64_t stride,
                      at::Tensor& out) const;
  at::Tensor reduceRows(const at::Tensor& received, int64_t shard, double divisor, bool pack) const;

  // A byte buffer of `bytes` that nobody else holds: a step's payloads reuse
  // the last step's memory instead of faulting in fresh pages (which several
  // threads then contend for in the kernel).
  at::Tensor takeBuffer(int64_t bytes) const;

  int64_t chunkElems_;
  struct BufferPool {
    std::mutex mu;
    std::vector<at::Tensor> buffers;
  };
  std::shared_ptr<BufferPool> pool_ = std::make_shared<BufferPool>();
};

}  // namespace xcomm
