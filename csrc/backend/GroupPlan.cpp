#include "backend/GroupPlan.hpp"

#include <algorithm>
#include <sstream>

#include <c10/util/Exception.h>

#include "collectives/gloo/CarriedCollectives.hpp"

namespace xcomm {
const char* groupShapeName(GroupShape shape) {
  switch (shape) {
    case GroupShape::kPlain:
      return "plain";
    case GroupShape::kSingleHostShm:
      return "single-host shared memory";
    case GroupShape::kHierarchical:
      return "hierarchical";
  }
  return "?";
}

GroupPlan GroupPlan::plain(int rank, int size, const XcommOptions& options, std::string why,
                           const GroupSettings& settings) {
  TORCH_CHECK_VALUE(size > 0 && rank >= 0 && rank < size, "xcomm: rank ", rank,
                    " is out of range for a group of size ", size);
  GroupPlan plan;
  plan.shape = GroupShape::kPlain;
  plan.why = std::move(why);
  plan.rank = rank;
  plan.size = size;
  plan.hosts = 1;
  plan.host = 0;
  plan.localRank = rank;
  plan.localSize = size;
  plan.settings = settings;
  // The options give these settings; the environment overrides the sizes and
  // may turn the switches off (both agreed by every rank, GroupSettings).
  plan.settings.shmHierarchical = options.shmHierarchical && settings.shmHierarchical;
  if (settings.shmSlotBytes < 0) plan.settings.shmSlotBytes = options.shmSlotBytes;
  if (settings.shmSmallBytes < 0) plan.settings.shmSmallBytes = options.shmSmallBytes;
  plan.settings.directExchange = options.directExchange && settings.directExchange;
  plan.backendCompression = options.compression;
  plan.backendCompression.autoMethods = settings.autoMethods;
  plan.backendCompression.autoLinkLatency = settings.autoLinkLatency;
  plan.backendCompression.autoLinkBytesPerSecond = settings.autoLinkBytesPerSecond;
  plan.checkCollectives = options.checkCollectives;
  plan.carrySmallOps = options.carrySmallOps;
  plan.fusionThresholdBytes = options.fusionThresholdBytes;
  plan.fusionCycle =
      options.fusionThresholdBytes > 0 ? options.fusionCycle() : std::chrono::microseconds{0};
  return plan;
}

GroupPlan GroupPlan::decide(int rank, int size, const std::vector<std::string>& hostIds,
                            const XcommOptions& options, const GroupSettings& settings) {
  auto plainBecause = [&](std::string why) {
    return plain(rank, size, options, std::move(why), settings);
  };
  if (size < 2) return plainBecause("one rank: nothing to share");
  if (!options.shm) return plainBecause("shared memory off (Options(shm=False))");
  if (!settings.shm) return plainBecause("shared memory off (XCOMM_SHM)");
  TORCH_CHECK(static_cast<int>(hostIds.size()) == size, "xcomm: expected ", size,
              " host identities, got ", hostIds.size());

  // Hosts in order of first appearance: the same list on every rank.
  std::vector<std::string> hosts;
  for (const auto& id : hostIds) {
    if (std::find(hosts.begin(), hosts.end(), id) == hosts.end()) hosts.push_back(id);
  }
  if (hosts.size() == 1) {
    GroupPlan plan = plainBecause("every rank on one host");
    plan.shape = GroupShape::kSingleHostShm;
    return plan;
  }
  if (static_cast<int>(hosts.size()) == size) {
    return plainBecause("one rank per host: nothing to share within a host");
  }
  if (!options.shmHierarchical) {
    return plainBecause("ranks span hosts; hierarchical off (Options(shm_hierarchical=False))");
  }
  if (!settings.shmHierarchical) {
    return plainBecause("ranks span hosts; hierarchical off (XCOMM_SHM_HIERARCHICAL)");
  }
  GroupPlan plan = plainBecause("ranks span hosts, some host has several");
  plan.shape = GroupShape::kHierarchical;
  plan.hosts = static_cast<int>(hosts.size());
  plan.host =
      static_cast<int>(std::find(hosts.begin(), hosts.end(), hostIds[rank]) - hosts.begin());
  plan.localRank = 0;
  plan.localSize = 0;
  for (int r = 0; r < size; ++r) {
    if (hostIds[r] != hostIds[rank]) continue;
    if (r < rank) ++plan.localRank;
    ++plan.localSize;
  }
  // Only the step between hosts is compressed: sums inside a host stay exact.
  plan.leaderCompression = plan.backendCompression;
  plan.backendCompression = CompressionConfig{};
  plan.backendCompression.method = Compression::kNone;
  return plan;
}

GroupPlan GroupPlan::fallbackToPlain(const std::string& reason) const {
  GroupPlan plan = *this;
  plan.shape = GroupShape::kPlain;
  plan.why = "shared memory unavailable (" + reason + ")";
  plan.hosts = 1;
  plan.host = 0;
  plan.localRank = rank;
  plan.localSize = size;
  if (leaderCompression.method != Compression::kNone) {
    plan.backendCompression = leaderCompression;
    plan.leaderCompression = CompressionConfig{};
  }
  return plan;
}

std::vector<AuxGroup> GroupPlan::auxGroups() const {
  std::vector<AuxGroup> groups;
  groups.push_back({"xcomm/gloo", "the CPU transport: every op the shape does not run itself", true,
                    rank, size});
  if (checksCollectives()) {
    groups.push_back({"xcomm/gloo-check",
                      "checks that every rank calls the same collective (op, dtype, reduce op, "
                      "root, sizes) before Gloo runs it: Gloo aborts, hangs or returns a wrong "
                      "result otherwise; also carries the int8/auto allreduce's own collectives",
                      true, rank, size});
  }
  if (shape == GroupShape::kHierarchical) {
    groups.push_back({"xcomm/leaders", "the hierarchical allreduce's step between hosts",
                      localRank == 0, localRank == 0 ? host : -1, hosts});
  }
  if (checksLeaders()) {
    groups.push_back({"xcomm/leaders-check",
                      "checks that every host's leader calls the same allreduce before the step "
                      "between hosts (each host's ranks agree over shared memory)",
                      localRank == 0, localRank == 0 ? host : -1, hosts});
  }
  // The int8/auto allreduce's collectives (and auto's link probes) run on a
  // worker thread and must not interleave with the caller's ops. The check's
  // group carries them where there is one (it sends only tagged messages of
  // its own, which never pair with theirs); an unchecked group needs a group
  // for them alone.
  if ((backendMethod() == Compression::kInt8 || backendMethod() == Compression::kAuto) &&
      !checksCollectives()) {
    groups.push_back({"xcomm/gloo-int8",
                      "int8/auto allreduce without the check: its collectives (and auto's link "
                      "probes) run on a worker thread and must not interleave with the caller's "
                      "ops",
                      true, rank, size});
  }
  if (fusionThresholdBytes > 0) {
    groups.push_back({"xcomm/gloo-fusion",
                      "tensor fusion's agreement rounds, apart from the ops they schedule "
                      "(over a shared-memory segment of their own in a single-host group)",
                      true, rank, size});
  }
  return groups;
}

int64_t GroupPlan::carryBytes() const {
  return checksCollectives() && carrySmallOps ? carryCapacityBytes(size) : 0;
}

int64_t GroupPlan::leaderCarryBytes() const {
  return checksLeaders() && carrySmallOps ? carryCapacityBytes(hosts) : 0;
}

std::string GroupPlan::describe() const {
  std::ostringstream out;
  out << "shape: " << groupShapeName(shape) << " (" << why << ")\n";
  out << "rank " << rank << " of " << size;
  if (shape == GroupShape::kHierarchical) {
    out << "; host " << host << " of " << hosts << ", local rank " << localRank << " of "
        << localSize;
  }
  out << "\n";
  out << "compression: backend " << compressionName(backendCompression.method);
  if (backendMethod() != backendCompression.method) {
    out << " (none: one host, data moves through shared memory)";
  }
  out << ", leaders' step " << compressionName(leaderCompression.method) << "\n";
  out << "fusion: ";
  if (fusionThresholdBytes == 0) {
    out << "off\n";
  } else {
    out << fusionThresholdBytes << " bytes, "
        << (fusionCycle.count() > 0 ? std::to_string(fusionCycle.count()) + " us cycle"
                                    : std::string("on demand"))
        << "\n";
  }
  out << "collective checks: "
      << (checksCollectives()
              ? (carryBytes() > 0
                     ? "on (before each Gloo op; ops of up to " + std::to_string(carryBytes()) +
                           " bytes per rank, and barriers, carried by the check)"
                     : std::string("on (before each Gloo op)"))
          : shape == GroupShape::kSingleHostShm
              ? "over shared memory"
              : (size < 2 ? "off (one rank)" : "off (Options(check_collectives=False))"))
      << "\n";
  if (checksLeaders()) {
    out << "leaders' checks: on (before each step between hosts"
        << (leaderCarryBytes() > 0
                ? "; sums of up to " + std::to_string(leaderCarryBytes()) + " bytes carried by it)"
                : std::string(")"))
        << "\n";
  }
  out << settings.describe();
  for (const auto& g : auxGroups()) {
    out << "group " << g.name << (g.member ? "" : " (not a member)") << ": " << g.why << "\n";
  }
  return out.str();
}

}  // namespace xcomm
