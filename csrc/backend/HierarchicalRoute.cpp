#include "backend/HierarchicalRoute.hpp"

#include <optional>

#include <c10/util/Exception.h>

#include "collectives/shm/ShmCollectives.hpp"
#include "common/ErrorText.hpp"

namespace xcomm {
namespace {

using RedOp = c10d::ReduceOp::RedOpType;

}  // namespace

std::shared_ptr<HierarchicalRoute> HierarchicalRoute::tryCreate(
    const c10::intrusive_ptr<c10d::Store>& localStore, int localRank, int localSize, int rank,
    int size, int hosts, std::chrono::milliseconds timeout, std::shared_ptr<Route> fallback,
    Leaders leaders, Config config, std::string* whyNot) {
  TORCH_CHECK(fallback, "xcomm shm: a fallback route is required");
  TORCH_CHECK((localRank == 0) == static_cast<bool>(leaders.gloo),
              "xcomm shm: the leaders' backend is needed on local rank 0 and only there");
  TORCH_CHECK(hosts >= 1 && (!leaders.gloo || leaders.gloo->size() == hosts),
              "xcomm shm: the leaders' backend must span one rank per host (", hosts, " hosts)");
  TORCH_CHECK(!leaders.checks || leaders.gloo,
              "xcomm shm: leader checks need the leaders' backend");
  leaders.compression.validate();
  auto transportConfig = config.transport;
  transportConfig.groupRank = rank;  // errors name peers by their rank in the group
  auto transport = ShmTransport::create(localStore, localRank, localSize, transportConfig, whyNot);
  if (!transport) return {};
  return std::make_shared<HierarchicalRoute>(std::move(transport), rank, size, hosts,
                                             std::move(fallback), std::move(leaders), timeout,
                                             config);
}

HierarchicalRoute::HierarchicalRoute(std::unique_ptr<ShmTransport> transport, int rank, int size,
                                     int hosts, std::shared_ptr<Route> fallback, Leaders leaders,
                                     std::chrono::milliseconds timeout, Config config)
    : ShmRouteBase(std::move(transport), rank, size, std::move(fallback), timeout, config) {
  if (leaders.compression.method != Compression::kNone) {
    leaderCompression_ = std::make_unique<CompressedAllreduce>(leaders.compression, hosts);
  }
  if (leaders.gloo) {
    leaders_ = leaders.gloo;
    if (leaders.checks) {
      checkedLeaders_ =
          std::make_shared<CheckedRoute>(leaders.gloo, std::move(leaders.checks), timeout,
                                         leaders.carryBytes, "host", leaders.directExchange);
    }
  }
}

HierarchicalRoute::~HierarchicalRoute() = default;

Route* HierarchicalRoute::leadersRoute() const {
  if (checkedLeaders_) return checkedLeaders_.get();  // over leaders_
  return leaders_.get();
}

void HierarchicalRoute::setTimeout(std::chrono::milliseconds timeout) {
  ShmRouteBase::setTimeout(timeout);
  if (Route* leaders = leadersRoute()) leaders->setTimeout(timeout);
}

void HierarchicalRoute::shutdown() {
  ShmRouteBase::shutdown();
  if (Route* leaders = leadersRoute()) leaders->shutdown();
}

void HierarchicalRoute::abort() {
  ShmRouteBase::abort();
  if (Route* leaders = leadersRoute()) leaders->abort();
}

c10::intrusive_ptr<c10d::Work> HierarchicalRoute::run(Op op) {
  const bool allreduce = op.kind == OpKind::kAllreduce || op.kind == OpKind::kAllreduceCoalesced;
  if (!allreduce || !reducible(op.inputs, op.reduceOp.op_)) {
    // The transport covers this host's ranks only: the data-movement ops
    // cross hosts on the fallback, in its own order.
    return fallback_->run(std::move(op));
  }
  return submit(
      op, [this, tensors = op.inputs, reduceOp = op.reduceOp](Clock::time_point deadline) mutable {
        for (auto& t : tensors) allreduceOne(t, reduceOp, deadline);
      });
}

void HierarchicalRoute::allreduceOne(at::Tensor& tensor, const c10d::ReduceOp& reduceOp,
                                     Clock::time_point deadline) {
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

std::string HierarchicalRoute::leaderError(const std::exception& e) const {
  return c10::str("xcomm: all_reduce's step between hosts failed on this host's leader (rank ",
                  rank_, "): ", messageOf(e));
}

void HierarchicalRoute::leaderStep(at::Tensor& tensor, RedOp op, bool compress,
                                   c10d::AllreduceOptions leaderOpts, Clock::time_point deadline) {
  // A tenth of what is left (at most 2 s) stays for handing an error to the
  // host: the other ranks wait for it in the broadcast until the deadline.
  const auto left = deadline - Clock::now();
  const auto reserve = std::min<Clock::duration>(left / 10, std::chrono::seconds(2));
  leaderOpts.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::max(left - reserve, Clock::duration(std::chrono::milliseconds(1))));
  if (!compress) {
    // Checked (and carried, when small) where the leaders check each other.
    leadersRoute()->allreduce(tensor, leaderOpts)->wait();
    return;
  }
  // The compressed step's own collectives run unchecked on the leaders'
  // Gloo, which only this route's (ordered) ops use: int8's two and auto's
  // link probes. The call they make up is agreed on first.
  if (checkedLeaders_) checkedLeaders_->agree(Op::allreduce({tensor}, leaderOpts))->wait();
  // Divide before compressing: the low-precision sum then cannot overflow
  // where the mean does not.
  if (op == RedOp::AVG) tensor.div_(size_);
  leaderCompression_->run(*leaders_, tensor, leaderOpts);
}

}  // namespace xcomm
