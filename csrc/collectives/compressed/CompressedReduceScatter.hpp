#pragma once
// reduce_scatter_tensor with fewer bytes on the wire, for groups made with
// xcomm.Options(compression=...): FSDP2's gradient reduce-scatter on such a
// group is compressed without a hook.
//
// Each rank's input is `size` equal rows (row j is what rank j keeps). The
// rows are encoded (fp16/bf16: cast; int8: Int8Codec::packRows, one float32
// scale per chunk, each row padded to whole chunks), one all-to-all delivers
// row j of every rank to rank j, and rank j sums the decoded rows in the
// input's precision in rank order (divided by `size` under AVG). The sum
// itself is exact, unlike a reduce-scatter run in the low precision; every
// shard is reduced on its one owner. Stateless, like CompressedAllreduce.
//
// CompressedRows (its own file) is that arithmetic, whoever issues the
// all-to-all: the backend (CompressedReduceScatter::start, on the input's
// route) and FSDP2's state (xcomm.hooks.compress_reduce_scatter, on its
// process group, with error feedback and auto's per-call method).
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "collectives/compressed/CompressedAllreduce.hpp"
#include "collectives/compressed/CompressedRows.hpp"
#include "compress/ErrorFeedback.hpp"
#include "compress/Int8Codec.hpp"
#include "runtime/Route.hpp"

namespace xcomm {

class CompressedReduceScatter {
 public:
  CompressedReduceScatter(CompressionConfig config, int size,
                          std::shared_ptr<CompressionCounters> counters);

  // Its row in xcomm.stats(), e.g. REDUCE_SCATTER_INT8.
  const std::string& statsName() const { return statsName_; }

  // Whether this reduce-scatter is compressed: a float32/float64 input of at
  // least minBytes under SUM or AVG, in a group of 2 or more; on the CPU, or
  // on a GPU for the casts and (where xcomm's CUDA kernels are built) int8.
  bool applies(const at::Tensor& input, const c10d::ReduceScatterOptions& opts) const;
  // The bytes this rank hands to the all-to-all.
  int64_t payloadBytes(const at::Tensor& input) const;

  // Encodes the rows and issues the all-to-all on `transport`; `finalize`
  // (run once it succeeded) reduces the received rows into `output`.
  c10::intrusive_ptr<c10d::Work> start(Route& transport, const at::Tensor& output,
                                       const at::Tensor& input,
                                       const c10d::ReduceScatterOptions& opts,
                                       std::function<void()>& finalize);

 private:
  CompressionConfig config_;
  std::string statsName_;
  int size_;
  std::shared_ptr<const Int8Codec> int8_;
  std::optional<CompressedRows> rows_;  // absent for none and auto
  std::shared_ptr<CompressionCounters> counters_;
};

}  // namespace xcomm
