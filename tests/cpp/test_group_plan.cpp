// GroupPlan: a group's shape, auxiliary groups and compression site follow
// from the members' host identities and the options alone.
#include "backend/GroupPlan.hpp"
#include "collectives/gloo/CarriedCollectives.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

using Catch::Contains;
using xcomm::AuxGroup;
using xcomm::carryCapacityBytes;
using xcomm::Compression;
using xcomm::GroupPlan;
using xcomm::GroupSettings;
using xcomm::GroupShape;
using xcomm::XcommOptions;

namespace {

std::vector<std::string> auxNames(const GroupPlan& plan) {
  std::vector<std::string> names;
  for (const auto& g : plan.auxGroups()) names.push_back(g.name);
  return names;
}

const AuxGroup& aux(const GroupPlan& plan, const std::string& name) {
  static std::vector<AuxGroup> groups;
  groups = plan.auxGroups();
  for (const auto& g : groups) {
    if (g.name == name) return g;
  }
  FAIL("no auxiliary group " << name);
  return groups.front();
}

XcommOptions withCompression(Compression method) {
  XcommOptions options;
  options.compression.method = method;
  return options;
}

}  // namespace

TEST_CASE("every rank on one host: single-host shared memory, the backend compresses", "[plan]") {
  const auto options = withCompression(Compression::kFp16);
  for (int rank = 0; rank < 3; ++rank) {
    auto plan = GroupPlan::decide(rank, 3, {"a", "a", "a"}, options, GroupSettings{});
    CHECK(plan.shape == GroupShape::kSingleHostShm);
    CHECK(plan.usesShm());
    CHECK(plan.backendCompression.method == Compression::kFp16);
    CHECK(plan.leaderCompression.method == Compression::kNone);
    CHECK(auxNames(plan) == std::vector<std::string>{"xcomm/gloo"});
  }
}

TEST_CASE("hosts with several ranks: hierarchical, only the leaders' step compresses", "[plan]") {
  // Ranks 0 and 2 on host "x", 1 and 3 on host "y", 4 alone on "z".
  const std::vector<std::string> ids{"x", "y", "x", "y", "z"};
  const auto options = withCompression(Compression::kInt8);
  const int expectHost[] = {0, 1, 0, 1, 2};
  const int expectLocal[] = {0, 0, 1, 1, 0};
  const int expectLocalSize[] = {2, 2, 2, 2, 1};
  for (int rank = 0; rank < 5; ++rank) {
    auto plan = GroupPlan::decide(rank, 5, ids, options, GroupSettings{});
    INFO("rank " << rank);
    CHECK(plan.shape == GroupShape::kHierarchical);
    CHECK(plan.hosts == 3);
    CHECK(plan.host == expectHost[rank]);
    CHECK(plan.localRank == expectLocal[rank]);
    CHECK(plan.localSize == expectLocalSize[rank]);
    CHECK(plan.backendCompression.method == Compression::kNone);
    CHECK(plan.leaderCompression.method == Compression::kInt8);
    // int8 runs on the leaders' group, not on a group of its own.
    // Its Gloo ops span hosts: checked over a group of their own.
    // The leaders check each other over a group of their own.
    CHECK(auxNames(plan) == std::vector<std::string>{"xcomm/gloo", "xcomm/gloo-check",
                                                     "xcomm/leaders", "xcomm/leaders-check"});
    for (const char* name : {"xcomm/leaders", "xcomm/leaders-check"}) {
      const auto& leaders = aux(plan, name);
      CHECK(leaders.member == (expectLocal[rank] == 0));
      CHECK(leaders.size == 3);
      CHECK(leaders.rank == (leaders.member ? expectHost[rank] : -1));
    }
    CHECK(plan.checksLeaders());
    CHECK(plan.leaderCarryBytes() == carryCapacityBytes(3));
    CHECK_THAT(plan.describe(), Contains("leaders' checks: on"));
  }
  // Off with the other checks; nothing carried without carry_small_ops.
  XcommOptions unchecked = options;
  unchecked.checkCollectives = false;
  auto off = GroupPlan::decide(0, 5, ids, unchecked, GroupSettings{});
  CHECK_FALSE(off.checksLeaders());
  CHECK(auxNames(off) == std::vector<std::string>{"xcomm/gloo", "xcomm/leaders"});
  XcommOptions uncarried = options;
  uncarried.carrySmallOps = false;
  auto checkedOnly = GroupPlan::decide(0, 5, ids, uncarried, GroupSettings{});
  CHECK(checkedOnly.checksLeaders());
  CHECK(checkedOnly.leaderCarryBytes() == 0);
}

TEST_CASE("a shared-memory failure falls back to plain and moves compression to the backend",
          "[plan]") {
  const auto options = withCompression(Compression::kInt8);
  auto plan = GroupPlan::decide(3, 4, {"x", "x", "y", "y"}, options, GroupSettings{});
  REQUIRE(plan.shape == GroupShape::kHierarchical);
  auto fallback = plan.fallbackToPlain("no /dev/shm");
  CHECK(fallback.shape == GroupShape::kPlain);
  CHECK_THAT(fallback.why, Contains("no /dev/shm"));
  CHECK(fallback.backendCompression.method == Compression::kInt8);
  CHECK(fallback.leaderCompression.method == Compression::kNone);
  CHECK(fallback.localRank == 3);
  // The compressed allreduce's collectives ride on the check's group...
  CHECK(auxNames(fallback) == std::vector<std::string>{"xcomm/gloo", "xcomm/gloo-check"});
  // ...and need one of their own where nothing is checked.
  auto unchecked = withCompression(Compression::kInt8);
  unchecked.checkCollectives = false;
  CHECK(auxNames(GroupPlan::decide(0, 2, {"x", "y"}, unchecked, GroupSettings{})) ==
        std::vector<std::string>{"xcomm/gloo", "xcomm/gloo-int8"});
}

TEST_CASE("plain groups: one rank per host, shm off by option or environment, one rank", "[plan]") {
  XcommOptions options;
  CHECK(GroupPlan::decide(0, 2, {"x", "y"}, options, GroupSettings{}).shape == GroupShape::kPlain);
  CHECK(GroupPlan::decide(0, 1, {}, options, GroupSettings{}).shape == GroupShape::kPlain);
  GroupSettings off;
  off.shm = false;
  auto byEnv = GroupPlan::decide(0, 2, {}, options, off);
  CHECK(byEnv.shape == GroupShape::kPlain);
  CHECK_THAT(byEnv.why, Contains("XCOMM_SHM"));
  GroupSettings flat;
  flat.shmHierarchical = false;
  CHECK(GroupPlan::decide(0, 4, {"x", "x", "y", "y"}, options, flat).shape == GroupShape::kPlain);
  options.shm = false;
  auto byOption = GroupPlan::decide(0, 2, {}, options, GroupSettings{});
  CHECK(byOption.shape == GroupShape::kPlain);
  CHECK_THAT(byOption.why, Contains("shm=False"));
}

TEST_CASE("collectives Gloo runs are checked unless one host's shared memory checks them",
          "[plan]") {
  XcommOptions options;
  auto twoHosts = GroupPlan::decide(0, 2, {"x", "y"}, options, GroupSettings{});
  CHECK(twoHosts.checksCollectives());
  CHECK(auxNames(twoHosts) == std::vector<std::string>{"xcomm/gloo", "xcomm/gloo-check"});
  CHECK_THAT(twoHosts.describe(), Contains("collective checks: on"));
  CHECK_FALSE(GroupPlan::decide(0, 2, {"a", "a"}, options, GroupSettings{}).checksCollectives());
  CHECK_FALSE(GroupPlan::decide(0, 1, {}, options, GroupSettings{}).checksCollectives());
  options.checkCollectives = false;
  auto off = GroupPlan::decide(0, 2, {"x", "y"}, options, GroupSettings{});
  CHECK_FALSE(off.checksCollectives());
  CHECK(auxNames(off) == std::vector<std::string>{"xcomm/gloo"});
  CHECK_THAT(off.describe(), Contains("check_collectives=False"));
}

TEST_CASE("small ops ride in the check: 128 KiB per pair, spread thinner past 3 ranks", "[plan]") {
  CHECK(carryCapacityBytes(1) == 0);
  CHECK(carryCapacityBytes(2) == 128 * 1024);
  CHECK(carryCapacityBytes(3) == 128 * 1024);
  // Each rank may send its bytes to every other rank: 256 KiB in all per op.
  CHECK(carryCapacityBytes(4) == 256 * 1024 / 3 / 8 * 8);
  CHECK(carryCapacityBytes(9) == 32 * 1024);
  CHECK(carryCapacityBytes(64) * 63 <= 256 * 1024);
  CHECK(carryCapacityBytes(64) % 8 == 0);
  XcommOptions options;
  auto twoHosts = GroupPlan::decide(0, 2, {"x", "y"}, options, GroupSettings{});
  CHECK(twoHosts.carryBytes() == 128 * 1024);
  CHECK_THAT(twoHosts.describe(), Contains("ops of up to 131072 bytes per rank"));
  // Nothing to carry without the check, or on one host (shared memory's own route).
  CHECK(GroupPlan::decide(0, 2, {"a", "a"}, options, GroupSettings{}).carryBytes() == 0);
  options.carrySmallOps = false;
  CHECK(GroupPlan::decide(0, 2, {"x", "y"}, options, GroupSettings{}).carryBytes() == 0);
  options.carrySmallOps = true;
  options.checkCollectives = false;
  CHECK(GroupPlan::decide(0, 2, {"x", "y"}, options, GroupSettings{}).carryBytes() == 0);
}

TEST_CASE("fusion gets its own control group, on demand or with a cycle", "[plan]") {
  XcommOptions options;
  auto off = GroupPlan::decide(0, 2, {"a", "a"}, options, GroupSettings{});
  CHECK(auxNames(off) == std::vector<std::string>{"xcomm/gloo"});
  options.fusionThresholdBytes = 1 << 20;
  // On demand agrees too: what travels together must not depend on when each
  // rank waits.
  auto onDemand = GroupPlan::decide(0, 2, {"a", "a"}, options, GroupSettings{});
  CHECK(onDemand.fusionCycle.count() == 0);
  CHECK(auxNames(onDemand) == std::vector<std::string>{"xcomm/gloo", "xcomm/gloo-fusion"});
  options.fusionCycleMs = 0.0005;  // below 1 us: still a cycle
  auto cycle = GroupPlan::decide(0, 2, {"a", "a"}, options, GroupSettings{});
  CHECK(cycle.fusionCycle.count() == 1);
  CHECK(auxNames(cycle) == std::vector<std::string>{"xcomm/gloo", "xcomm/gloo-fusion"});
  CHECK_THAT(cycle.describe(), Contains("1 us cycle") && Contains("xcomm/gloo-fusion"));
}

TEST_CASE("options are validated once, naming the option", "[plan][options]") {
  XcommOptions options;
  CHECK_NOTHROW(options.validate());
  options.fusionCycleMs = 2.0;
  CHECK_THROWS_WITH(options.validate(), Contains("fusion_cycle_ms needs fusion on"));
  options.fusionThresholdBytes = -1;
  CHECK_THROWS_WITH(options.validate(), Contains("fusion_threshold_bytes must be >= 0"));
  XcommOptions chunks;
  chunks.compression.int8ChunkElems = 0;
  CHECK_THROWS_WITH(chunks.validate(), Contains("int8_chunk_elems"));
}

TEST_CASE("host identities must cover the group", "[plan]") {
  CHECK_THROWS_WITH(GroupPlan::decide(0, 3, {"a", "a"}, XcommOptions{}, GroupSettings{}),
                    Contains("expected 3 host identities"));
}
