#include "collectives/compressed/CompressedReduceScatter.hpp"

#include <cctype>

#include <c10/util/Exception.h>

#include "common/CurrentStream.hpp"
#include "common/LinkBytes.hpp"
#include "compress/cuda/CudaCodecs.hpp"

namespace xcomm {

CompressedReduceScatter::CompressedReduceScatter(CompressionConfig config, int size,
                                                 std::shared_ptr<CompressionCounters> counters)
    : config_(config),
      size_(size),
      int8_(std::make_shared<Int8Codec>(config.int8ChunkElems)),
      counters_(std::move(counters)) {
  config_.validate();
  TORCH_CHECK(counters_, "xcomm: CompressedReduceScatter needs its group's counters");
  // none and auto never compress a reduce-scatter (applies() is false), so
  // they have no rows.
  if (config_.method != Compression::kNone && config_.method != Compression::kAuto) {
    rows_.emplace(config_.method, size, int8_);
  }
  statsName_ = "REDUCE_SCATTER_";
  for (const char* c = compressionName(config_.method); *c; ++c) {
    statsName_ += static_cast<char>(std::toupper(static_cast<unsigned char>(*c)));
  }
}

bool CompressedReduceScatter::applies(const at::Tensor& input,
                                      const c10d::ReduceScatterOptions& opts) const {
  // auto chooses per allreduce only: its reduce-scatters go uncompressed.
  if (config_.method == Compression::kNone || config_.method == Compression::kAuto || size_ < 2) {
    return false;
  }
  const auto op = opts.reduceOp.op_;
  const bool eligible = input.layout() == at::kStrided &&
                        (input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble) &&
                        (op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::AVG) &&
                        input.numel() > 0 &&
                        input.numel() * input.element_size() >= config_.minBytes;
  if (!eligible || input.device().is_cpu()) return eligible;
  // A CUDA input takes the casts (ATen ops and NCCL's all-to-all) and, where
  // xcomm's CUDA kernels are built, int8's row codec on the device.
  if (!input.is_cuda()) return false;
  if (isCast(config_.method) || cuda::codecsBuilt()) return true;
  TORCH_WARN_ONCE(
      "xcomm: int8 reduce-scatter compression needs xcomm built with its CUDA kernels (a CUDA "
      "toolkit at build time); CUDA tensors are reduce-scattered uncompressed by NCCL.");
  return false;
}

int64_t CompressedReduceScatter::payloadBytes(const at::Tensor& input) const {
  if (config_.method == Compression::kInt8) {
    return size_ * int8_->packedBytes(int8_->rowElems(input.numel(), size_));
  }
  return input.numel() * 2;  // fp16 / bf16
}

c10::intrusive_ptr<c10d::Work> CompressedReduceScatter::start(
    Route& transport, const at::Tensor& output, const at::Tensor& input,
    const c10d::ReduceScatterOptions& opts, std::function<void()>& finalize) {
  TORCH_INTERNAL_ASSERT(rows_, "xcomm: a reduce-scatter started that applies() turns away");
  const bool mean = opts.reduceOp.op_ == c10d::ReduceOp::AVG;
  at::Tensor wire = rows_->encode(input);
  at::Tensor received = at::empty_like(wire);
  c10d::AllToAllOptions a2a;  // equal splits along dim 0: row j to rank j
  a2a.timeout = opts.timeout;
  auto work = transport.alltoall(received, wire, a2a);
  counters_->calls++;
  counters_->linkBytesBefore += alltoallBytes<int64_t>(input.numel() * input.element_size(), size_);
  counters_->linkBytesSent += rows_->sentBytes(wire);
  finalize = [rows = *rows_, output, received, wire, mean]() mutable {
    rows.reduceInto(received, output, mean);
    usedOnCurrentStream({received, wire});
  };
  return work;
}

}  // namespace xcomm
