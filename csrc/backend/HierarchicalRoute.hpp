#pragma once
// HierarchicalRoute: the CPU route of a group spanning hosts with several
// ranks per host.
//
// The segment covers this host's ranks only. Allreduce runs as a
// shared-memory allreduce inside the host, an allreduce among one leader per
// host (local rank 0) on the leaders' route, and a shared-memory broadcast
// from the leader: only the leaders' traffic crosses hosts, N bytes per host
// instead of a flat ring's 2(p-1)/p N per rank. Each host's ranks agree over
// shared memory; the leaders agree with each other through a CheckedRoute
// (small sums ride in that check), and a leader whose step failed (hosts
// that disagree, a host that never came) hands its error to its host's
// ranks in the broadcast, so every rank raises it and the host stays in step.
// With a leaders' compression the leaders' step alone is compressed (fp16/
// bf16 cast or int8, collectives/compressed/CompressedAllreduce): the bytes
// that cross hosts shrink 2-4x more while the sums inside a host stay exact.
// Every other op goes to the fallback route over the whole group (checked Gloo).
#include <memory>
#include <string>

#include "backend/CheckedRoute.hpp"
#include "backend/ShmRoute.hpp"
#include "collectives/compressed/CompressedAllreduce.hpp"

namespace xcomm {

class HierarchicalRoute final : public ShmRouteBase {
 public:
  // How the leaders' step runs.
  struct Leaders {
    // The leaders' Gloo (local rank 0 only; null elsewhere).
    std::shared_ptr<InnerRoute> gloo;
    // A group of the same ranks for the leaders' rank-agreement check (null:
    // the leaders do not check each other).
    std::shared_ptr<InnerRoute> checks;
    // Bytes per leader a sum may carry in the check (CheckedRoute's carryBytes).
    int64_t carryBytes = 0;
    // Whether the leaders' check may send large all-to-alls and all-gathers
    // as messages.
    bool directExchange = true;
    CompressionConfig compression;
  };

  // `rank`/`size` are the group's, `localRank`/`localSize` this host's;
  // `hosts` is the number of hosts (leaders). Collective over this host's
  // ranks: null on every one of them when the segment cannot be set up
  // (`whyNot` says why).
  static std::shared_ptr<HierarchicalRoute> tryCreate(
      const c10::intrusive_ptr<c10d::Store>& localStore, int localRank, int localSize, int rank,
      int size, int hosts, std::chrono::milliseconds timeout, std::shared_ptr<Route> fallback,
      Leaders leaders, Config config, std::string* whyNot = nullptr);
  HierarchicalRoute(std::unique_ptr<ShmTransport> transport, int rank, int size, int hosts,
                    std::shared_ptr<Route> fallback, Leaders leaders,
                    std::chrono::milliseconds timeout, Config config);
  ~HierarchicalRoute() override;

  c10::intrusive_ptr<c10d::Work> run(Op op) override;
  c10::intrusive_ptr<c10d::Work> agree(const Op& op) override { return fallback_->agree(op); }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  void abort() override;

  // Leaders' steps carried by their check (a checked leader); -1 elsewhere.
  int64_t leaderCarriedOps() const {
    return checkedLeaders_ ? static_cast<int64_t>(checkedLeaders_->carriedOps()) : -1;
  }
  // The leaders' compression (one configured), else null.
  const CompressedAllreduce* leaderCompression() const { return leaderCompression_.get(); }

 private:
  void allreduceOne(at::Tensor& tensor, const c10d::ReduceOp& op, Clock::time_point deadline);
  // A leader's allreduce with the other hosts' leaders (checked where they
  // check each other), leaving part of the time to `deadline` for handing
  // an error to the host.
  void leaderStep(at::Tensor& tensor, c10d::ReduceOp::RedOpType op, bool compress,
                  c10d::AllreduceOptions leaderOpts, Clock::time_point deadline);
  // How a leader's ops reach the other leaders: checked where they check
  // each other (the check owns the raw route and passes timeouts, shutdown
  // and abort down to it), else raw; null off the leaders.
  Route* leadersRoute() const;
  // What the host's ranks raise when this leader's step failed with `e`.
  std::string leaderError(const std::exception& e) const;

  std::shared_ptr<InnerRoute> leaders_;  // local rank 0 only
  // leaders_ behind the leaders' rank-agreement check (null: unchecked).
  std::shared_ptr<CheckedRoute> checkedLeaders_;
  std::unique_ptr<CompressedAllreduce> leaderCompression_;  // over the hosts
};

}  // namespace xcomm
