#include "backend/ShmCpuBackend.hpp"

#include <optional>

#include <c10/util/Exception.h>

#include "backend/TensorLists.hpp"
#include "backend/XcommWork.hpp"
#include "collectives/shm/ShmCollectives.hpp"
#include "common/ErrorText.hpp"

namespace xcomm {
namespace {

using Clock = std::chrono::steady_clock;
using RedOp = c10d::ReduceOp::RedOpType;

bool plainCpu(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    if (!t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous()) return false;
  }
  return true;
}

// The rows of `t` (dim 0) that go to or come from each rank, as views:
// `splits` rows each, or an equal share when `splits` is empty. Empty when
// `t` has no rows to split or the splits do not describe it (the fallback
// then raises its own error).
std::vector<at::Tensor> splitRows(const at::Tensor& t, const std::vector<int64_t>& splits,
                                  int size) {
  if (t.dim() == 0) return {};
  std::vector<at::Tensor> pieces;
  int64_t offset = 0;
  for (int r = 0; r < size; ++r) {
    int64_t rows = 0;
    if (splits.empty()) {
      if (t.size(0) % size != 0) return {};
      rows = t.size(0) / size;
    } else {
      if (static_cast<int>(splits.size()) != size || splits[r] < 0) return {};
      rows = splits[r];
    }
    if (offset + rows > t.size(0)) return {};
    pieces.push_back(t.narrow(0, offset, rows));
    offset += rows;
  }
  if (offset != t.size(0)) return {};
  return pieces;
}

// Whether `size` inputs and outputs all have the shape of inputs[0].
bool sameShapes(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                int size) {
  if (static_cast<int>(inputs.size()) != size || static_cast<int>(outputs.size()) != size) {
    return false;
  }
  for (int r = 0; r < size; ++r) {
    if (inputs[r].sizes() != inputs[0].sizes() || outputs[r].sizes() != inputs[0].sizes()) {
      return false;
    }
  }
  return true;
}

int redOpOf(const c10d::ReduceOp& op) {
  return static_cast<int>(op.op_);
}

}  // namespace

c10::intrusive_ptr<ShmCpuBackend> ShmCpuBackend::tryCreate(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> fallback, Config config,
    std::string* whyNot) {
  TORCH_CHECK(fallback, "xcomm shm: a fallback backend is required");
  auto transport = ShmTransport::create(store, rank, size, config.transport, whyNot);
  if (!transport) return {};
  return c10::make_intrusive<ShmCpuBackend>(std::move(transport), std::move(fallback), timeout,
                                            config);
}

c10::intrusive_ptr<ShmCpuBackend> ShmCpuBackend::tryCreateHierarchical(
    const c10::intrusive_ptr<c10d::Store>& localStore, int localRank, int localSize, int rank,
    int size, int hosts, std::chrono::milliseconds timeout,
    c10::intrusive_ptr<c10d::Backend> fallback, c10::intrusive_ptr<c10d::Backend> leaders,
    c10::intrusive_ptr<c10d::Backend> leaderChecks, Config config, std::string* whyNot) {
  TORCH_CHECK(fallback, "xcomm shm: a fallback backend is required");
  TORCH_CHECK((localRank == 0) == static_cast<bool>(leaders),
              "xcomm shm: the leaders' backend is needed on local rank 0 and only there");
  TORCH_CHECK(hosts >= 1 && (!leaders || leaders->getSize() == hosts),
              "xcomm shm: the leaders' backend must span one rank per host (", hosts, " hosts)");
  TORCH_CHECK(!leaderChecks || leaders, "xcomm shm: leader checks need the leaders' backend");
  config.leaderCompression.validate();
  auto transport = ShmTransport::create(localStore, localRank, localSize, config.transport, whyNot);
  if (!transport) return {};
  return c10::make_intrusive<ShmCpuBackend>(std::move(transport), rank, size, hosts,
                                            std::move(fallback), std::move(leaders),
                                            std::move(leaderChecks), timeout, config);
}

ShmCpuBackend::ShmCpuBackend(std::unique_ptr<ShmTransport> transport,
                             c10::intrusive_ptr<c10d::Backend> fallback,
                             std::chrono::milliseconds timeout, Config config)
    : ShmCpuBackend(std::move(transport), -1, -1, 1, std::move(fallback), {}, {}, timeout, config) {
}

ShmCpuBackend::ShmCpuBackend(std::unique_ptr<ShmTransport> transport, int rank, int size, int hosts,
                             c10::intrusive_ptr<c10d::Backend> fallback,
                             c10::intrusive_ptr<c10d::Backend> leaders,
                             c10::intrusive_ptr<c10d::Backend> leaderChecks,
                             std::chrono::milliseconds timeout, Config config)
    : Backend(rank < 0 ? transport->rank() : rank, size < 0 ? transport->size() : size),
      transport_(std::move(transport)),
      fallback_(std::move(fallback)),
      leaders_(std::move(leaders)),
      hierarchical_(transport_->size() != size_),
      timeoutMs_(timeout.count()),
      config_(config) {
  TORCH_CHECK(fallback_->getRank() == rank_ && fallback_->getSize() == size_,
              "xcomm shm: the fallback backend's rank/size differ from the group's");
  if (hierarchical_ && config_.leaderCompression.method != Compression::kNone) {
    leaderCompression_ = std::make_unique<CompressedAllreduce>(config_.leaderCompression, hosts);
  }
  if (leaders_ && leaderChecks) {
    checkedLeaders_ = c10::make_intrusive<CheckedCpuBackend>(leaders_, std::move(leaderChecks),
                                                             timeout, config_.leaderCarryBytes,
                                                             "host", config_.leaderDirectExchange);
  }
}

void ShmCpuBackend::allreduceOne(at::Tensor& tensor, const c10d::ReduceOp& reduceOp,
                                 Clock::time_point deadline) {
  if (!hierarchical_) {
    shm::allreduce(*transport_, tensor, reduceOp, deadline, config_.smallAllreduceBytes);
    return;
  }
  const RedOp op = reduceOp.op_;
  // AVG: sum everywhere, divide once by the group size. The op keeps what it
  // records (the caller's dtype, which the leaders agree on).
  c10d::AllreduceOptions leaderOpts;
  leaderOpts.reduceOp = reduceOp;
  if (op == RedOp::AVG) leaderOpts.reduceOp.op_ = RedOp::SUM;
  // The same decision on every rank: it depends on the tensor's dtype, size and op only.
  const bool compress = leaderCompression_ && leaderCompression_->applies({tensor}, leaderOpts);
  shm::allreduce(*transport_, tensor, leaderOpts.reduceOp, deadline, config_.smallAllreduceBytes);
  std::optional<shm::RootError> failed;
  if (leaders_) {
    try {
      leaderStep(tensor, op, compress, leaderOpts, deadline);
    } catch (const c10::ValueError& e) {
      failed = shm::RootError{leaderError(e), true};
    } catch (const std::exception& e) {
      failed = shm::RootError{leaderError(e), false};
    }
  }
  // A failed step's error goes to the host's ranks in place of the sum.
  shm::broadcast(*transport_, tensor, /*root=*/0, deadline, failed ? &*failed : nullptr);
  if (op == RedOp::AVG && !compress) tensor.div_(size_);
}

std::string ShmCpuBackend::leaderError(const std::exception& e) const {
  return c10::str("xcomm: all_reduce's step between hosts failed on this host's leader (rank ",
                  rank_, "): ", messageOf(e));
}

void ShmCpuBackend::leaderStep(at::Tensor& tensor, RedOp op, bool compress,
                               c10d::AllreduceOptions leaderOpts, Clock::time_point deadline) {
  // A tenth of what is left (at most 2 s) stays for handing an error to the
  // host: the other ranks wait for it in the broadcast until the deadline.
  const auto left = deadline - Clock::now();
  const auto reserve = std::min<Clock::duration>(left / 10, std::chrono::seconds(2));
  leaderOpts.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::max(left - reserve, Clock::duration(std::chrono::milliseconds(1))));
  std::vector<at::Tensor> one{tensor};
  if (!compress) {
    // Checked (and carried, when small) where the leaders check each other.
    c10d::Backend& ops =
        checkedLeaders_ ? static_cast<c10d::Backend&>(*checkedLeaders_) : *leaders_;
    ops.allreduce(one, leaderOpts)->wait();
    return;
  }
  // The compressed step's own collectives run unchecked on the leaders'
  // Gloo, which only this backend's (ordered) ops use: int8's two and
  // auto's link probes. The call they make up is agreed on first.
  if (checkedLeaders_) checkedLeaders_->agreeOnAllreduce(one, leaderOpts)->wait();
  // Divide before compressing: the low-precision sum then cannot overflow
  // where the mean does not.
  if (op == RedOp::AVG) tensor.div_(size_);
  leaderCompression_->run(*leaders_, tensor, leaderOpts);
}

ShmCpuBackend::~ShmCpuBackend() = default;

void ShmCpuBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeoutMs_ = timeout.count();
  fallback_->setTimeout(timeout);
  if (checkedLeaders_) {
    checkedLeaders_->setTimeout(timeout);  // leaders_ too
  } else if (leaders_) {
    leaders_->setTimeout(timeout);
  }
}

void ShmCpuBackend::shutdown() {
  runner_.shutdown();
  transport_->depart();  // after this rank's own ops: peers waiting for more fail at once
  fallback_->shutdown();
  if (checkedLeaders_) {
    checkedLeaders_->shutdown();  // leaders_ too
  } else if (leaders_) {
    leaders_->shutdown();
  }
}

void ShmCpuBackend::abort() {
  transport_->requestAbort();  // a wait in progress fails within one sleep slice
  transport_->depart();        // and the peers' waits for this rank at once
  runner_.stop();              // not joined: it may be in a Gloo fallback op
  fallback_->abort();
  if (checkedLeaders_) {
    checkedLeaders_->abort();  // leaders_ too
  } else if (leaders_) {
    leaders_->abort();
  }
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::submit(c10d::OpType type, const char* title,
                                                     std::vector<at::Tensor> outputs, bool asyncOp,
                                                     std::chrono::milliseconds timeout,
                                                     std::function<void(Clock::time_point)> body,
                                                     bool withFuture, bool countAsShm) {
  const auto limit =
      timeout == c10d::kUnsetTimeout ? std::chrono::milliseconds(timeoutMs_.load()) : timeout;
  c10::IValue result(std::move(outputs));
  c10::intrusive_ptr<FutureWork> work;
  if (withFuture) {
    work = c10::make_intrusive<FutureWork>(rank_, type, title, std::move(result), tensorListType());
  } else {
    work = c10::make_intrusive<FuturelessWork>(rank_, type, title, std::move(result),
                                               tensorListType());
  }
  runner_.submit(finishing(work,
                           [this, body = std::move(body), limit, countAsShm] {
                             body(Clock::now() + limit);
                             if (countAsShm) shmOps_++;
                             return -1;
                           }),
                 /*synchronous=*/!asyncOp);
  return work;
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::viaFallback(
    c10d::OpType type, const char* title, std::vector<at::Tensor> outputs, bool asyncOp,
    std::chrono::milliseconds timeout, at::ScalarType dtype, int redOp, int root, uint64_t bytes,
    std::function<c10::intrusive_ptr<c10d::Work>()> issue) {
  if (!flat()) return issue();  // the transport covers this host's ranks only
  const ShmTransport::Descriptor call{shm::detail::describe(shm::detail::OpCode::kFallback, dtype,
                                                            redOp, root, static_cast<int>(type)),
                                      bytes};
  // The fallback's work is waited for on the worker: it keeps the group's
  // issue order, and these ops (reduce, gather, scatter, dtypes without a
  // kernel here) are not the ones worth overlapping with the next.
  return submit(
      type, title, std::move(outputs), asyncOp, timeout,
      [this, call, title, issue = std::move(issue)](Clock::time_point deadline) {
        shm::agree(*transport_, call, deadline, title);
        auto work = issue();
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        work->wait(std::max(left, std::chrono::milliseconds(1)));
      },
      /*withFuture=*/true, /*countAsShm=*/false);
}

bool ShmCpuBackend::reducible(const std::vector<at::Tensor>& tensors, RedOp op) const {
  if (!plainCpu(tensors)) return false;
  for (const auto& t : tensors) {
    if (!shm::supports(t.scalar_type(), op)) return false;
  }
  return true;
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                        const c10d::BroadcastOptions& opts) {
  if (!flat() || !plainCpu(tensors)) {
    return viaFallback(
        c10d::OpType::BROADCAST, "shm:gloo:broadcast", tensors, opts.asyncOp, opts.timeout,
        dtypeOf(tensors), 0, static_cast<int>(opts.rootRank), denseBytes(tensors),
        [this, tensors, opts]() mutable { return fallback_->broadcast(tensors, opts); });
  }
  const int root = static_cast<int>(opts.rootRank);
  return submit(c10d::OpType::BROADCAST, "shm:broadcast", tensors, opts.asyncOp, opts.timeout,
                [this, tensors, root](Clock::time_point deadline) mutable {
                  for (auto& t : tensors) shm::broadcast(*transport_, t, root, deadline);
                });
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::AllreduceOptions& opts) {
  const auto op = opts.reduceOp.op_;
  if (!reducible(tensors, op)) {
    return viaFallback(c10d::OpType::ALLREDUCE, "shm:gloo:all_reduce", tensors, opts.asyncOp,
                       opts.timeout, dtypeOf(tensors, opts.reduceOp), redOpOf(opts.reduceOp), 0,
                       denseBytes(tensors, opts.reduceOp), [this, tensors, opts]() mutable {
                         return fallback_->allreduce(tensors, opts);
                       });
  }
  return submit(c10d::OpType::ALLREDUCE, "shm:all_reduce", tensors, opts.asyncOp, opts.timeout,
                [this, tensors, reduceOp = opts.reduceOp](Clock::time_point deadline) mutable {
                  for (auto& t : tensors) allreduceOne(t, reduceOp, deadline);
                });
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const auto op = opts.reduceOp.op_;
  if (!reducible(tensors, op)) {
    return viaFallback(
        c10d::OpType::ALLREDUCE_COALESCED, "shm:gloo:all_reduce_coalesced", tensors, opts.asyncOp,
        opts.timeout, dtypeOf(tensors, opts.reduceOp), redOpOf(opts.reduceOp), 0,
        denseBytes(tensors, opts.reduceOp),
        [this, tensors, opts]() mutable { return fallback_->allreduce_coalesced(tensors, opts); });
  }
  return submit(c10d::OpType::ALLREDUCE_COALESCED, "shm:all_reduce_coalesced", tensors,
                opts.asyncOp, opts.timeout,
                [this, tensors, reduceOp = opts.reduceOp](Clock::time_point deadline) mutable {
                  for (auto& t : tensors) allreduceOne(t, reduceOp, deadline);
                });
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto flatOutputs = flatten(outputs);
  if (!flat() || !plainCpu(inputs) || !plainCpu(flatOutputs)) {
    return viaFallback(c10d::OpType::ALLGATHER, "shm:gloo:all_gather", flatOutputs, opts.asyncOp,
                       opts.timeout, dtypeOf(inputs), 0, 0, denseBytes(inputs),
                       [this, outputs, inputs, opts]() mutable {
                         return fallback_->allgather(outputs, inputs, opts);
                       });
  }
  return submit(c10d::OpType::ALLGATHER, "shm:all_gather", flatOutputs, opts.asyncOp, opts.timeout,
                [this, outputs, inputs](Clock::time_point deadline) mutable {
                  for (size_t i = 0; i < inputs.size(); ++i)
                    shm::allgather(*transport_, inputs[i], outputs[i], deadline);
                });
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                              const c10d::AllgatherOptions& opts) {
  if (!flat() || !plainCpu({output, input}) || !concatOf(output, input, size_)) {
    return viaFallback(c10d::OpType::_ALLGATHER_BASE, "shm:gloo:_allgather_base", {output},
                       opts.asyncOp, opts.timeout, input.scalar_type(), 0, 0, denseBytes({input}),
                       [this, output, input, opts]() mutable {
                         return fallback_->_allgather_base(output, input, opts);
                       });
  }
  std::vector<std::vector<at::Tensor>> outputs{piecesPerRank(output, input, size_)};
  std::vector<at::Tensor> inputs{input};
  return allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  bool concat = true;
  for (size_t i = 0; i < inputs.size() && i < outputs.size(); ++i) {
    concat = concat && concatOf(outputs[i], inputs[i], size_);
  }
  if (!flat() || !concat || !plainCpu(outputs) || !plainCpu(inputs)) {
    return viaFallback(c10d::OpType::COALESCED, "shm:gloo:allgather_into_tensor_coalesced", outputs,
                       opts.asyncOp, opts.timeout, dtypeOf(inputs), 0, 0, denseBytes(inputs),
                       [this, outputs, inputs, opts]() mutable {
                         return fallback_->allgather_into_tensor_coalesced(outputs, inputs, opts);
                       });
  }
  std::vector<std::vector<at::Tensor>> lists;
  for (size_t i = 0; i < inputs.size(); ++i) {
    lists.push_back(piecesPerRank(outputs[i], inputs[i], size_));
  }
  return submit(c10d::OpType::COALESCED, "shm:all_gather_into_tensor_coalesced", outputs,
                opts.asyncOp, opts.timeout,
                [this, lists, inputs](Clock::time_point deadline) mutable {
                  for (size_t i = 0; i < inputs.size(); ++i)
                    shm::allgather(*transport_, inputs[i], lists[i], deadline);
                });
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const auto op = opts.reduceOp.op_;
  if (!flat() || !reducible(outputs, op) || !plainCpu(flatten(inputs))) {
    return viaFallback(c10d::OpType::REDUCE_SCATTER, "shm:gloo:reduce_scatter", outputs,
                       opts.asyncOp, opts.timeout, dtypeOf(outputs, opts.reduceOp),
                       redOpOf(opts.reduceOp), 0, denseBytes(outputs, opts.reduceOp),
                       [this, outputs, inputs, opts]() mutable {
                         return fallback_->reduce_scatter(outputs, inputs, opts);
                       });
  }
  return submit(
      c10d::OpType::REDUCE_SCATTER, "shm:reduce_scatter", outputs, opts.asyncOp, opts.timeout,
      [this, outputs, inputs, reduceOp = opts.reduceOp](Clock::time_point deadline) mutable {
        for (size_t i = 0; i < outputs.size(); ++i)
          shm::reduceScatter(*transport_, outputs[i], inputs[i], reduceOp, deadline);
      },
      /*withFuture=*/false);
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  if (!flat() || !reducible({output, input}, opts.reduceOp.op_) ||
      !concatOf(input, output, size_)) {
    return viaFallback(c10d::OpType::_REDUCE_SCATTER_BASE, "shm:gloo:_reduce_scatter_base",
                       {output}, opts.asyncOp, opts.timeout, dtypeOf({output}, opts.reduceOp),
                       redOpOf(opts.reduceOp), 0, denseBytes({output}, opts.reduceOp),
                       [this, output, input, opts]() mutable {
                         return fallback_->_reduce_scatter_base(output, input, opts);
                       });
  }
  std::vector<at::Tensor> outputs{output};
  std::vector<std::vector<at::Tensor>> inputs{piecesPerRank(input, output, size_)};
  return reduce_scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const auto op = opts.reduceOp.op_;
  bool concat = true;
  for (size_t i = 0; i < inputs.size() && i < outputs.size(); ++i) {
    concat = concat && concatOf(inputs[i], outputs[i], size_);
  }
  if (!flat() || !concat || !reducible(outputs, op) || !plainCpu(inputs)) {
    return viaFallback(c10d::OpType::COALESCED, "shm:gloo:reduce_scatter_tensor_coalesced", outputs,
                       opts.asyncOp, opts.timeout, dtypeOf(outputs, opts.reduceOp),
                       redOpOf(opts.reduceOp), 0, denseBytes(outputs, opts.reduceOp),
                       [this, outputs, inputs, opts]() mutable {
                         return fallback_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
                       });
  }
  std::vector<std::vector<at::Tensor>> lists;
  for (size_t i = 0; i < outputs.size(); ++i) {
    lists.push_back(piecesPerRank(inputs[i], outputs[i], size_));
  }
  return submit(
      c10d::OpType::COALESCED, "shm:reduce_scatter_tensor_coalesced", outputs, opts.asyncOp,
      opts.timeout,
      [this, outputs, lists, reduceOp = opts.reduceOp](Clock::time_point deadline) mutable {
        for (size_t i = 0; i < outputs.size(); ++i)
          shm::reduceScatter(*transport_, outputs[i], lists[i], reduceOp, deadline);
      },
      /*withFuture=*/false);
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::barrier(const c10d::BarrierOptions& opts) {
  if (!flat()) return fallback_->barrier(opts);
  return submit(c10d::OpType::BARRIER, "shm:barrier", {}, opts.asyncOp, opts.timeout,
                [this](Clock::time_point deadline) { shm::barrier(*transport_, deadline); });
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::agreeOnAllreduce(
    const std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(flat(), "xcomm shm: agreeOnAllreduce needs a single-host group");
  // As a fallback op that runs nothing: an allreduce over shared memory has
  // another descriptor, so it and this one disagree.
  const ShmTransport::Descriptor call{
      shm::detail::describe(shm::detail::OpCode::kFallback, dtypeOf(tensors, opts.reduceOp),
                            redOpOf(opts.reduceOp), 0, static_cast<int>(c10d::OpType::ALLREDUCE)),
      denseBytes(tensors, opts.reduceOp)};
  return submit(
      c10d::OpType::ALLREDUCE, "shm:agree:all_reduce", tensors, /*asyncOp=*/true, opts.timeout,
      [this, call](Clock::time_point deadline) {
        shm::agree(*transport_, call, deadline, "all_reduce");
      },
      /*withFuture=*/true, /*countAsShm=*/false);
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return viaFallback(c10d::OpType::ALLGATHER_COALESCED, "shm:gloo:all_gather_coalesced",
                     flatten(outputs), opts.asyncOp, opts.timeout, dtypeOf(inputs), 0, 0,
                     denseBytes(inputs), [this, outputs, inputs, opts]() mutable {
                       return fallback_->allgather_coalesced(outputs, inputs, opts);
                     });
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::reduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::ReduceOptions& opts) {
  return viaFallback(c10d::OpType::REDUCE, "shm:gloo:reduce", tensors, opts.asyncOp, opts.timeout,
                     dtypeOf(tensors, opts.reduceOp), redOpOf(opts.reduceOp),
                     static_cast<int>(opts.rootRank), denseBytes(tensors, opts.reduceOp),
                     [this, tensors, opts]() mutable { return fallback_->reduce(tensors, opts); });
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::GatherOptions& opts) {
  return viaFallback(
      c10d::OpType::GATHER, "shm:gloo:gather", flatten(outputs), opts.asyncOp, opts.timeout,
      dtypeOf(inputs), 0, static_cast<int>(opts.rootRank), denseBytes(inputs),
      [this, outputs, inputs, opts]() mutable { return fallback_->gather(outputs, inputs, opts); });
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::scatter(std::vector<at::Tensor>& outputs,
                                                      std::vector<std::vector<at::Tensor>>& inputs,
                                                      const c10d::ScatterOptions& opts) {
  return viaFallback(c10d::OpType::SCATTER, "shm:gloo:scatter", outputs, opts.asyncOp, opts.timeout,
                     dtypeOf(outputs), 0, static_cast<int>(opts.rootRank), denseBytes(outputs),
                     [this, outputs, inputs, opts]() mutable {
                       return fallback_->scatter(outputs, inputs, opts);
                     });
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                            std::vector<int64_t>& outputSplits,
                                                            std::vector<int64_t>& inputSplits,
                                                            const c10d::AllToAllOptions& opts) {
  auto sends = splitRows(input, inputSplits, size_);
  auto recvs = splitRows(output, outputSplits, size_);
  if (!flat() || !plainCpu({output, input}) || sends.empty() || recvs.empty() ||
      !shm::alltoallFits(*transport_)) {
    // Sizes may differ between ranks (uneven splits): only the op and dtype must agree.
    return viaFallback(c10d::OpType::ALLTOALL_BASE, "shm:gloo:all_to_all_single", {output},
                       opts.asyncOp, opts.timeout, input.scalar_type(), 0, 0, 0,
                       [this, output, input, outputSplits, inputSplits, opts]() mutable {
                         return fallback_->alltoall_base(output, input, outputSplits, inputSplits,
                                                         opts);
                       });
  }
  return submit(c10d::OpType::ALLTOALL_BASE, "shm:all_to_all_single", {output}, opts.asyncOp,
                opts.timeout, [this, sends, recvs](Clock::time_point deadline) mutable {
                  shm::alltoall(*transport_, sends, recvs, deadline, "all_to_all_single");
                });
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllToAllOptions& opts) {
  if (!flat() || !plainCpu(inputs) || !plainCpu(outputs) || !sameShapes(inputs, outputs, size_) ||
      !shm::alltoallFits(*transport_)) {
    // Gloo takes the list form with one shape throughout and raises otherwise;
    // so does xcomm, on every group shape (uneven pieces: all_to_all_single).
    return viaFallback(c10d::OpType::ALLTOALL, "shm:gloo:all_to_all", outputs, opts.asyncOp,
                       opts.timeout, dtypeOf(inputs), 0, 0, 0,
                       [this, outputs, inputs, opts]() mutable {
                         return fallback_->alltoall(outputs, inputs, opts);
                       });
  }
  return submit(c10d::OpType::ALLTOALL, "shm:all_to_all", outputs, opts.asyncOp, opts.timeout,
                [this, outputs, inputs](Clock::time_point deadline) mutable {
                  shm::alltoall(*transport_, inputs, outputs, deadline, "all_to_all");
                });
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::send(std::vector<at::Tensor>& tensors, int dstRank,
                                                   int tag) {
  return fallback_->send(tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                   int tag) {
  return fallback_->recv(tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> ShmCpuBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                            int tag) {
  return fallback_->recvAnysource(tensors, tag);
}

}  // namespace xcomm
