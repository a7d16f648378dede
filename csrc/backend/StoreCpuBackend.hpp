#pragma once
// A CPU c10d::Backend running xcomm's flat collectives over StoreTransport.
//
// It is the CPU transport of xcomm's C++-only path: it needs nothing but a
// c10d::Store. XcommBackend checks and stages every call before it gets here,
// so tensors are contiguous CPU tensors of matching sizes.
#include <map>
#include <mutex>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "runtime/OrderedRunner.hpp"
#include "transport/StoreTransport.hpp"

namespace xcomm {

class StoreCpuBackend : public c10d::Backend {
 public:
  StoreCpuBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  std::chrono::milliseconds timeout);
  ~StoreCpuBackend() override;

  const std::string getBackendName() const override { return "xcomm-store"; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  void shutdown() override;
  void abort() override { shutdown(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

 private:
  using Body = std::function<int()>;  // returns the source rank, or -1

  // Runs `body` on `runner` and returns the work that reports it.
  c10::intrusive_ptr<c10d::Work> enqueue(OrderedRunner& runner, c10d::OpType type,
                                         const char* title, std::vector<at::Tensor> outputs,
                                         Body body);
  std::string nextChannel();
  std::chrono::milliseconds timeoutOf(std::chrono::milliseconds requested) const;
  std::string p2pChannel(int src, int dst, int tag, uint64_t n) const;

  StoreTransport transport_;
  std::chrono::milliseconds timeout_;
  std::mutex seqMutex_;
  uint64_t collectiveSeq_ = 0;
  std::map<std::pair<int, int>, uint64_t> sent_;      // (dst, tag) -> messages sent
  std::map<std::pair<int, int>, uint64_t> received_;  // (src, tag) -> messages received
  OrderedRunner collectives_{"xcomm collective queue", OrderedRunner::CallerThread::kNever};
  // So a pending recv never blocks a collective.
  OrderedRunner p2p_{"xcomm receive queue", OrderedRunner::CallerThread::kNever};
};

}  // namespace xcomm
