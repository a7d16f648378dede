#pragma once
// StoreRoute: xcomm's flat collectives (collectives/store/) over a
// c10d::Store, as the inner route of a C++-only program's group, where Gloo
// stands in a Python one. It needs nothing but the store.
//
// XcommBackend checks and stages every call before it gets here, so tensors
// are contiguous CPU tensors of matching sizes. Collectives run in their
// order on one worker; receives wait on another, so a pending recv never
// blocks a collective. A send is a store write and completes at once.
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "runtime/OrderedRunner.hpp"
#include "runtime/Route.hpp"
#include "transport/StoreTransport.hpp"

namespace xcomm {

class StoreRoute : public InnerRoute {
 public:
  StoreRoute(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
             std::chrono::milliseconds timeout);
  ~StoreRoute() override;

  std::string name() const override { return "xcomm-store"; }
  c10::intrusive_ptr<c10d::Work> run(Op op) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  // Gloo's alone: refused with c10d's "not supported" error.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  void setTimeout(std::chrono::milliseconds timeout) override { timeoutMs_ = timeout.count(); }
  std::chrono::milliseconds timeout() const override {
    return std::chrono::milliseconds(timeoutMs_.load());
  }
  void shutdown() override;
  void abort() override { shutdown(); }

 private:
  // Runs `op`'s algorithm on this thread; `channel` names it in the store.
  void runFlat(Op& op, const std::string& channel, std::chrono::milliseconds limit);
  std::string nextChannel();
  std::string p2pChannel(int src, int dst, int tag, uint64_t n) const;

  StoreTransport transport_;
  std::atomic<int64_t> timeoutMs_;
  std::mutex seqMutex_;
  uint64_t collectiveSeq_ = 0;
  std::map<std::pair<int, int>, uint64_t> sent_;      // (dst, tag) -> messages sent
  std::map<std::pair<int, int>, uint64_t> received_;  // (src, tag) -> messages received
  OrderedRunner collectives_{"xcomm collective queue", OrderedRunner::CallerThread::kNever};
  OrderedRunner receives_{"xcomm receive queue", OrderedRunner::CallerThread::kNever};
};

}  // namespace xcomm
