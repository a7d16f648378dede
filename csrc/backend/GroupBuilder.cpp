#include "backend/GroupBuilder.hpp"

#include <cstdlib>
#include <random>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "backend/CheckedCpuBackend.hpp"
#include "backend/GroupPlan.hpp"
#include "backend/ShmCpuBackend.hpp"
#include "transport/HostIdentity.hpp"

namespace xcomm {
namespace {

using StorePtr = c10::intrusive_ptr<c10d::Store>;
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;

StorePtr prefixed(const std::string& prefix, const StorePtr& store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, store);
}

std::string getString(const StorePtr& store, const std::string& key) {
  const auto bytes = store->get(key);
  return std::string(bytes.begin(), bytes.end());
}

void setString(const StorePtr& store, const std::string& key, const std::string& value) {
  store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

// An environment variable as a non-negative integer; ValueError naming it otherwise.
int64_t envInt(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (!value || !*value) return fallback;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK_VALUE(end && *end == '\0', "xcomm: ", name, " must be an integer, got '", value, "'");
  return parsed;
}

std::vector<std::string> exchangeHostIdentities(const StorePtr& shmStore, int rank, int size) {
  setString(shmStore, "host/" + std::to_string(rank), hostIdentity());
  std::vector<std::string> ids;
  for (int r = 0; r < size; ++r) ids.push_back(getString(shmStore, "host/" + std::to_string(r)));
  return ids;
}

// Slot and small-allreduce sizes, chosen by rank 0 so that every rank takes
// the same algorithm for the same message; the spin time is per rank.
ShmCpuBackend::Config shmConfig(const StorePtr& shmStore, int rank) {
  ShmCpuBackend::Config config;
  if (rank == 0) {
    std::string shared;
    try {
      const int64_t slot = envInt("XCOMM_SHM_SLOT_BYTES", config.transport.slotBytes);
      const int64_t small = envInt("XCOMM_SHM_SMALL_BYTES", config.smallAllreduceBytes);
      TORCH_CHECK_VALUE(slot > 0 && small >= 0,
                        "xcomm: XCOMM_SHM_SLOT_BYTES must be > 0 and XCOMM_SHM_SMALL_BYTES >= 0");
      shared = std::to_string(slot) + "," + std::to_string(small);
    } catch (const c10::Error& e) {
      // Every rank waits for rank 0's choice: it gets the error instead of a hang.
      shared = "error:" + e.msg();
    }
    setString(shmStore, "config", shared);
  }
  const std::string shared = getString(shmStore, "config");
  TORCH_CHECK_VALUE(shared.rfind("error:", 0) != 0, shared.substr(6), " (on rank 0)");
  const auto comma = shared.find(',');
  config.transport.slotBytes = std::stoull(shared.substr(0, comma));
  config.smallAllreduceBytes = std::stoull(shared.substr(comma + 1));
  config.transport.spinMicros = static_cast<int>(envInt("XCOMM_SHM_SPIN_US", -1));
  return config;
}

// Every rank's verdict on its own setup; true when all succeeded.
bool allSucceeded(const StorePtr& shmStore, int rank, int size, bool mine) {
  setString(shmStore, "ok/" + std::to_string(rank), mine ? "1" : "0");
  bool all = true;
  for (int r = 0; r < size; ++r) all = getString(shmStore, "ok/" + std::to_string(r)) == "1" && all;
  return all;
}

// A namespace for every key this group puts in the store, fresh for each
// group built. An earlier group of the same name leaves its keys behind (the
// same store after destroy_process_group() + init_process_group(), a job
// restarted over a long-lived store): a rank that read one before its peer
// overwrote it got the earlier group's shm segment name, host list, setup
// verdicts or Gloo addresses, so ranks took different transports or failed to
// connect. Rank 0 draws a token and hands it to each rank under a key the
// reader deletes once read; the next group's rank then waits for the next
// token instead of finding this one.
std::string agreeGroupToken(const StorePtr& store, int rank, int size) {
  const std::string prefix = "xcomm/token/";
  if (rank == 0) {
    std::random_device rd;
    std::ostringstream token;
    token << std::hex << rd() << rd() << rd() << rd();  // 128 bits
    for (int r = 1; r < size; ++r) setString(store, prefix + std::to_string(r), token.str());
    return token.str();
  }
  const std::string key = prefix + std::to_string(rank);
  std::string token = getString(store, key);
  try {
    store->deleteKey(key);
  } catch (const c10::Error&) {
    // A store without deleteKey: still right whenever no earlier group left a token.
  }
  return token;
}

const AuxGroup* findAux(const std::vector<AuxGroup>& groups, const std::string& name) {
  for (const auto& g : groups) {
    if (g.name == name) return &g;
  }
  return nullptr;
}

}  // namespace

c10::intrusive_ptr<XcommBackend> buildGroup(const StorePtr& store, int rank, int size,
                                            c10::intrusive_ptr<XcommOptions> options,
                                            const InnerBackendFactory& factory, bool allowShm) {
  TORCH_CHECK(options, "xcomm: options must not be null");
  TORCH_CHECK(factory.cpu, "xcomm: the inner-backend factory must make CPU backends");
  options->validate();
  const auto timeout = options->timeout;
  const auto switches = ShmSwitches::fromEnvironment();
  const StorePtr groupStore = prefixed("xcomm/" + agreeGroupToken(store, rank, size), store);
  const StorePtr shmStore = prefixed("shm", groupStore);

  GroupPlan plan = GroupPlan::plain(rank, size, *options, "shared memory not used");
  if (allowShm) {
    std::vector<std::string> ids;
    if (size >= 2 && options->shm && switches.enabled) {
      ids = exchangeHostIdentities(shmStore, rank, size);
    }
    plan = GroupPlan::decide(rank, size, ids, *options, switches);
  }
  if (!factory.receivesShorter) plan.carrySmallOps = false;
  auto make = [&](const std::string& name) -> BackendPtr {
    const auto groups = plan.auxGroups();
    const AuxGroup* g = findAux(groups, name);
    if (!g || !g->member) return {};
    return factory.cpu(prefixed(name, groupStore), g->rank, g->size, timeout);
  };

  // Rank 0's shared-memory sizes are agreed before any Gloo connection: a bad
  // value then fails every rank here, rather than rank 0 tearing down its
  // half of a Gloo mesh its peers are still connecting ("closed by peer").
  ShmCpuBackend::Config config;
  if (plan.usesShm()) {
    config = shmConfig(shmStore, rank);
    config.leaderCompression = plan.leaderCompression;
    config.leaderCarryBytes = plan.leaderCarryBytes();
  }
  XcommBackend::InnerBackends inner;
  BackendPtr gloo = make("xcomm/gloo");
  // Checked before the shared-memory attempt in a hierarchical group (its
  // Gloo ops span hosts), after it otherwise (a failed single-host attempt
  // leaves a plain group, which needs it): every rank builds it at the same point.
  auto checked = [&] {
    if (auto checks = make("xcomm/gloo-check")) {
      inner.checked =
          c10::make_intrusive<CheckedCpuBackend>(gloo, checks, timeout, plan.carryBytes());
      gloo = inner.checked;
    }
  };
  const bool checkFirst = plan.shape == GroupShape::kHierarchical;
  if (checkFirst) checked();
  if (plan.usesShm()) {
    std::string whyNot;
    c10::intrusive_ptr<ShmCpuBackend> shm;
    if (plan.shape == GroupShape::kSingleHostShm) {
      // Collective: null on every rank when any rank failed.
      shm = ShmCpuBackend::tryCreate(shmStore, rank, size, timeout, gloo, config, &whyNot);
    } else {
      shm = ShmCpuBackend::tryCreateHierarchical(
          prefixed("shm/host" + std::to_string(plan.host), groupStore), plan.localRank,
          plan.localSize, rank, size, plan.hosts, timeout, gloo, make("xcomm/leaders"),
          make("xcomm/leaders-check"), config, &whyNot);
      // Every host must take the same path, or allreduce would deadlock.
      if (!allSucceeded(shmStore, rank, size, static_cast<bool>(shm))) shm.reset();
    }
    if (shm) {
      inner.shm = shm;
    } else {
      if (whyNot.empty()) whyNot = "setup failed on another rank";
      LOG(WARNING) << "xcomm: shared memory unavailable (" << whyNot << "); this group uses gloo";
      plan = plan.fallbackToPlain(whyNot);
    }
  }
  if (!checkFirst && plan.shape == GroupShape::kPlain) checked();
  inner.cpu = inner.shm ? BackendPtr(inner.shm) : gloo;
  inner.cpuCompressed = make("xcomm/gloo-int8");
  BackendPtr fusionControl = make("xcomm/gloo-fusion");
  if (fusionControl && inner.shm && plan.shape == GroupShape::kSingleHostShm) {
    // The rounds' agreement (an 8-byte allreduce) over a small segment of its
    // own: ~10 us where Gloo's costs ~1 ms on busy cores, more than the small
    // transfers it fuses. Its own segment and thread, so its order never mixes
    // with the group's ops; Gloo stays underneath for abort and as fallback.
    ShmCpuBackend::Config control = inner.shm->config();  // its spin time
    control.transport.slotBytes = 4096;
    std::string whyNot;
    if (auto shm = ShmCpuBackend::tryCreate(prefixed("shm-fusion", groupStore), rank, size, timeout,
                                            fusionControl, control, &whyNot)) {
      fusionControl = shm;
    } else {
      LOG(WARNING) << "xcomm: fusion rounds agree over gloo (" << whyNot << ")";
    }
  }
  if (factory.cuda) {
    inner.cuda = factory.cuda(prefixed("xcomm/nccl", groupStore), rank, size, timeout);
  }
  auto backend = c10::make_intrusive<XcommBackend>(std::move(options), plan, std::move(inner));
  if (plan.fusionThresholdBytes > 0) {
    backend->setFusionThreshold(plan.fusionThresholdBytes, plan.fusionCycle, fusionControl);
  }
  return backend;
}

}  // namespace xcomm
