#pragma once
// GroupPlan: what one xcomm process group is, decided once, in one place.
//
// From every member's host identity (transport/HostIdentity), the group's
// options and the environment's settings every rank agreed on
// (GroupSettings), it fixes:
// - the shape: plain (Gloo alone), single-host shared memory (every member on
//   one host), or hierarchical (several hosts, some with several ranks:
//   shared memory inside a host, Gloo among one leader per host);
// - the auxiliary groups the shape and options need, and why each exists;
// - who compresses what: backend-level compression (Options(compression=...))
//   runs in XcommBackend for a plain or single-host group, but only on the
//   leaders' step of a hierarchical group, so sums inside a host stay exact.
// GroupBuilder turns a plan into transports; a shared-memory setup failure
// anywhere turns it into the plain plan on every rank (fallbackToPlain).
// decide() is a pure function of values every rank agrees on, so every rank
// computes the same plan.
#include <string>
#include <vector>

#include "backend/GroupSettings.hpp"
#include "backend/XcommOptions.hpp"

namespace xcomm {

enum class GroupShape { kPlain, kSingleHostShm, kHierarchical };
const char* groupShapeName(GroupShape shape);

// One group of ranks besides the group itself, with its own transport.
struct AuxGroup {
  std::string name;  // store prefix, e.g. "xcomm/leaders"
  std::string why;
  bool member = false;  // whether this rank belongs to it
  int rank = -1;        // this rank's rank in it (when a member)
  int size = 0;
};

struct GroupPlan {
  GroupShape shape = GroupShape::kPlain;
  std::string why;  // why this shape, in words
  int rank = 0;
  int size = 1;
  // Hosts in order of first appearance among the ranks (the same on every rank).
  int hosts = 1;
  int host = 0;       // this rank's host
  int localRank = 0;  // rank among its host's ranks
  int localSize = 1;  // ranks on this rank's host
  // Compression done by XcommBackend's allreduce, and by the leaders' step of
  // a hierarchical allreduce; at most one of them is not kNone.
  CompressionConfig backendCompression;
  CompressionConfig leaderCompression;
  // Options(check_collectives): every collective Gloo runs for this group
  // first checks that all ranks called the same one (CheckedRoute).
  bool checkCollectives = true;
  // Options(carry_small_ops): small ops ride in the check's exchange.
  bool carrySmallOps = true;
  int64_t fusionThresholdBytes = 0;
  std::chrono::microseconds fusionCycle{0};
  // What the environment says, agreed by every rank (backend/GroupSettings).
  GroupSettings settings;

  // `hostIds[r]` is rank r's host identity (empty: shared memory is off and
  // identities were not exchanged).
  static GroupPlan decide(int rank, int size, const std::vector<std::string>& hostIds,
                          const XcommOptions& options, const GroupSettings& settings);
  // A plan with no host information: Gloo alone (the C++-only path, tests).
  static GroupPlan plain(int rank, int size, const XcommOptions& options, std::string why,
                         const GroupSettings& settings = {});
  // The plain plan a shared-memory setup failure leads to: compression moves
  // from the leaders' step to the backend.
  GroupPlan fallbackToPlain(const std::string& reason) const;

  bool usesShm() const { return shape != GroupShape::kPlain; }
  // What XcommBackend's allreduce does with backendCompression: auto on one
  // host is none (shared memory moves data at memory speed: no codec pays).
  Compression backendMethod() const {
    const bool autoOnOneHost =
        backendCompression.method == Compression::kAuto && shape == GroupShape::kSingleHostShm;
    return autoOnOneHost ? Compression::kNone : backendCompression.method;
  }
  // Whether Gloo's ops are checked by CheckedRoute: groups of two or
  // more ranks whose ops do not all pass shared memory's own agreement.
  bool checksCollectives() const {
    return checkCollectives && size > 1 && shape != GroupShape::kSingleHostShm;
  }
  // Bytes per rank an op may carry in the check's exchange (0: none).
  int64_t carryBytes() const;
  // Whether a hierarchical group's leaders check each other's allreduce
  // (over xcomm/leaders-check) before the step between hosts.
  bool checksLeaders() const { return checkCollectives && shape == GroupShape::kHierarchical; }
  // Bytes per leader a step between hosts may carry in that check.
  int64_t leaderCarryBytes() const;
  bool isLeader() const { return shape == GroupShape::kHierarchical && localRank == 0; }
  // Every auxiliary group this plan needs, members or not.
  std::vector<AuxGroup> auxGroups() const;
  // One line per fact, for users (xcomm.group_plan) and logs.
  std::string describe() const;
};

}  // namespace xcomm
