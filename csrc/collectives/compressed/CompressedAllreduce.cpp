#include "collectives/compressed/CompressedAllreduce.hpp"

#include <algorithm>
#include <cctype>
#include <chrono>

#include <c10/util/Exception.h>

#include "collectives/compressed/AutoCompression.hpp"
#include "collectives/gloo/DirectExchange.hpp"
#include "common/CurrentStream.hpp"
#include "common/ErrorText.hpp"
#include "common/LinkBytes.hpp"
#include "compress/cuda/CudaCodecs.hpp"

namespace xcomm {
namespace {

bool isMean(const c10d::AllreduceOptions& opts) {
  return opts.reduceOp.op_ == c10d::ReduceOp::AVG;
}

// The int8 chain's collectives on the CPU: point-to-point messages on the
// compressed route (the check's Gloo group, or one of their own), because
// Gloo's own collectives fill a rate-limited link only about half
// (collectives/gloo/DirectExchange.hpp). Their tag is one the checked route
// never posts (it uses 1-3). Each waits on the calling thread (the
// compression worker) until one deadline for the whole allreduce.
constexpr int kInt8Tag = 4;
class DirectCollectives : public ChainCollectives {
 public:
  DirectCollectives(InnerRoute& route, int size, std::chrono::milliseconds limit)
      : route_(route),
        direct_(route, kInt8Tag),
        size_(size),
        limit_(limit),
        deadline_(std::chrono::steady_clock::now() + limit) {}

  int64_t size() const override { return size_; }
  FuturePtr allreduce(at::Tensor& tensor) override {
    // The allreduce's own wait gets what is left of the deadline, so the
    // whole chain fails at one timeout, not at one per collective.
    c10d::AllreduceOptions sum;
    sum.timeout = std::max(std::chrono::milliseconds(1),
                           std::chrono::duration_cast<std::chrono::milliseconds>(
                               deadline_ - std::chrono::steady_clock::now()));
    route_.allreduce(tensor, sum)->wait();
    return completed();
  }
  FuturePtr alltoall(at::Tensor& output, at::Tensor& input) override {
    const std::vector<int64_t> rowBytes(size_, input.size(1));
    DirectExchange::waitAll(direct_.postAlltoall(output, input, rowBytes, rowBytes),
                            "all_reduce (int8, all-to-all)", "rank", deadline_, limit_);
    return completed();
  }
  FuturePtr allgather(at::Tensor& output, at::Tensor& input) override {
    DirectExchange::waitAll(direct_.postAllgather(output, input), "all_reduce (int8, all-gather)",
                            "rank", deadline_, limit_);
    return completed();
  }

 private:
  static FuturePtr completed() {
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
    done->markCompleted(c10::IValue());
    return done;
  }

  InnerRoute& route_;
  DirectExchange direct_;
  int size_;
  std::chrono::milliseconds limit_;
  std::chrono::steady_clock::time_point deadline_;
};

}  // namespace

CompressedAllreduce::CompressedAllreduce(CompressionConfig config, int size)
    : config_(config), size_(size), int8_(std::make_shared<Int8Codec>(config.int8ChunkElems)) {
  config_.validate();
  statsName_ = "ALLREDUCE_";
  for (const char* c = compressionName(config_.method); *c; ++c) {
    statsName_ += static_cast<char>(std::toupper(static_cast<unsigned char>(*c)));
  }
  if (config_.method == Compression::kAuto) {
    auto_ = std::make_unique<AutoCompression>(size, config_);
  }
}

CompressedAllreduce::~CompressedAllreduce() = default;

bool CompressedAllreduce::applies(const std::vector<at::Tensor>& tensors,
                                  const c10d::AllreduceOptions& opts) const {
  if (config_.method == Compression::kNone || tensors.size() != 1 || size_ < 2) {
    return false;
  }
  const auto& t = tensors[0];
  const auto op = opts.reduceOp.op_;
  const bool eligible = t.layout() == at::kStrided &&
                        (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble) &&
                        (op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::AVG) &&
                        t.numel() * t.element_size() >= config_.minBytes && t.numel() > 0;
  if (!eligible || t.device().is_cpu()) return eligible;
  if (!t.is_cuda()) return false;
  // On a GPU: the casts are ATen ops plus NCCL's own low-precision SUM; int8
  // runs xcomm's CUDA kernels between two NCCL collectives.
  if (isCast(config_.method)) return true;
  if (config_.method == Compression::kInt8 && cuda::codecsBuilt()) return true;
  TORCH_WARN_ONCE("xcomm: ", compressionName(config_.method), " allreduce compression ",
                  config_.method == Compression::kAuto
                      ? "chooses for CPU tensors only"
                      : "needs xcomm built with its CUDA kernels (a CUDA toolkit at build time)",
                  "; CUDA tensors are reduced uncompressed by NCCL. "
                  "Options(compression=\"bf16\") compresses them.");
  return false;
}

int64_t CompressedAllreduce::payloadBytes(const at::Tensor& tensor) const {
  return payloadBytes(tensor, config_.method);
}

int64_t CompressedAllreduce::payloadBytes(const at::Tensor& tensor, Compression method) const {
  switch (method) {
    case Compression::kInt8:
      return size_ * int8_->packedBytes(int8_->shardElems(tensor.numel(), size_));
    case Compression::kFp16:
    case Compression::kBf16:
      return tensor.numel() * 2;
    default:  // none; auto, not known before it chose
      return tensor.numel() * tensor.element_size();
  }
}

c10::intrusive_ptr<c10d::Work> CompressedAllreduce::start(Route& transport,
                                                          const at::Tensor& tensor,
                                                          const c10d::AllreduceOptions& opts,
                                                          std::function<void()>& finalize) {
  TORCH_INTERNAL_ASSERT(issuesOnCaller(tensor), "xcomm: ", compressionName(config_.method),
                        " allreduce of this tensor runs on the compression worker");
  if (config_.method == Compression::kInt8) return startInt8(transport, tensor, opts, finalize);
  return startCast(transport, tensor, opts, finalize, config_.method);
}

void CompressedAllreduce::count(const at::Tensor& tensor, int64_t sentBytes) {
  counters_->calls++;
  counters_->linkBytesBefore +=
      ringAllreduceBytes<int64_t>(tensor.numel() * tensor.element_size(), size_);
  counters_->linkBytesSent += sentBytes;
}

c10::intrusive_ptr<c10d::Work> CompressedAllreduce::startCast(Route& transport,
                                                              const at::Tensor& tensor,
                                                              const c10d::AllreduceOptions& opts,
                                                              std::function<void()>& finalize,
                                                              Compression method) {
  const auto low = method == Compression::kFp16 ? at::kHalf : at::kBFloat16;
  at::Tensor scaled = isMean(opts) ? tensor.div(size_) : tensor;
  std::vector<at::Tensor> wire{scaled.to(low).contiguous()};
  c10d::AllreduceOptions sumOpts = opts;
  sumOpts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  auto work = transport.allreduce(wire[0], sumOpts);
  count(tensor, ringAllreduceBytes<int64_t>(wire[0].numel() * wire[0].element_size(), size_));
  finalize = [tensor, low = wire[0]]() mutable {
    tensor.copy_(low);
    usedOnCurrentStream({low});
  };
  return work;
}

Compression CompressedAllreduce::run(InnerRoute& transport, const at::Tensor& tensor,
                                     const c10d::AllreduceOptions& opts) {
  const Compression method =
      auto_ ? auto_->choose(transport, tensor.numel(), tensor.element_size(), opts.timeout)
            : config_.method;
  const auto started = std::chrono::steady_clock::now();
  switch (method) {
    case Compression::kInt8:
      runInt8(transport, tensor, opts);
      break;
    case Compression::kFp16:
    case Compression::kBf16: {
      std::function<void()> finalize;
      startCast(transport, tensor, opts, finalize, method)->wait();
      finalize();
      break;
    }
    default: {  // none: Gloo has no AVG, so a SUM, then the division
      at::Tensor flat = tensor.is_contiguous() ? tensor : tensor.contiguous();
      c10d::AllreduceOptions sum = opts;
      sum.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
      transport.allreduce(flat, sum)->wait();
      if (isMean(opts)) flat.div_(size_);
      if (!tensor.is_contiguous()) tensor.copy_(flat);
      count(tensor, ringAllreduceBytes<int64_t>(tensor.numel() * tensor.element_size(), size_));
    }
  }
  if (auto_) {
    auto_->observed(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  }
  return method;
}

c10::intrusive_ptr<c10d::Work> CompressedAllreduce::startInt8(Route& transport,
                                                              const at::Tensor& tensor,
                                                              const c10d::AllreduceOptions& opts,
                                                              std::function<void()>& finalize) {
  at::Tensor flat = tensor.is_contiguous() ? tensor.view({-1}) : tensor.contiguous().view({-1});
  const int64_t shard = int8_->shardElems(flat.numel(), size_);
  at::Tensor packed = int8_->packShards(flat, size_);  // [size, bytes per shard]
  at::Tensor received = at::empty_like(packed);
  c10d::AllToAllOptions a2a;
  a2a.timeout = opts.timeout;
  // For CUDA tensors this makes the current stream wait for NCCL's, and
  // returns at once (CPU tensors take runInt8's messages instead).
  transport.alltoall(received, packed, a2a)->wait();

  // float32 sum in rank order, the mean's division, quantization: one pass.
  at::Tensor mine = int8_->reduceAndPack(received, shard, isMean(opts) ? size_ : 1);
  at::Tensor gathered = at::empty({size_ * mine.numel()}, mine.options());
  c10d::AllgatherOptions ag;
  ag.timeout = opts.timeout;
  auto work = transport.allgather(gathered, mine, ag);
  count(tensor, (size_ - 1) * (packed.size(1) + mine.numel()));
  finalize = [codec = int8_, gathered, mine, shard, flat, tensor]() mutable {
    codec->unpackAll(gathered, shard, flat);
    if (!tensor.is_contiguous()) tensor.copy_(flat.view(tensor.sizes()));
    usedOnCurrentStream({gathered, mine, flat});
  };
  return work;
}

void CompressedAllreduce::runInt8(InnerRoute& transport, const at::Tensor& tensor,
                                  const c10d::AllreduceOptions& opts) {
  if (!tensor.device().is_cpu()) {
    std::function<void()> finalize;
    startInt8(transport, tensor, opts, finalize)->wait();
    finalize();
    return;
  }
  if (!int8Failed_.empty()) {
    C10_THROW_ERROR(
        DistBackendError,
        c10::str("xcomm: an earlier int8 all_reduce of this group failed (", int8Failed_,
                 "); its messages may be left half-exchanged, so the group's later "
                 "int8 all_reduces cannot go on: abort or shrink the group, or "
                 "create a new one"));
  }
  const auto limit = opts.timeout != c10d::kUnsetTimeout ? opts.timeout : transport.timeout();
  at::Tensor flat = tensor.is_contiguous() ? tensor.view({-1}) : tensor.contiguous().view({-1});
  at::Tensor packed = int8_->packShards(flat, size_);  // [size, bytes per shard]
  // The collectives wait here, so the chain has run to its end on return.
  // Each call is a chain of its own (no turns: this thread orders them).
  auto done = Int8Allreduce()
                  .start(int8_, std::make_shared<DirectCollectives>(transport, size_, limit), flat,
                         flat, /*index=*/{}, packed, isMean(opts) ? size_ : 1)
                  .result;
  TORCH_INTERNAL_ASSERT(done->completed(), "xcomm: the int8 chain returned before its end");
  if (done->hasError()) {
    try {
      std::rethrow_exception(done->exception_ptr());
    } catch (const std::exception& e) {
      int8Failed_ = messageOf(e);
      throw;
    }
  }
  count(tensor, 2 * (size_ - 1) * packed.size(1));  // the all-to-all and the all-gather
  if (!tensor.is_contiguous()) tensor.copy_(flat.view(tensor.sizes()));
}

}  // namespace xcomm
