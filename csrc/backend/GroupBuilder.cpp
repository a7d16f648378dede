#include "backend/GroupBuilder.hpp"

#include <algorithm>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "backend/CheckedRoute.hpp"
#include "backend/GroupPlan.hpp"
#include "backend/GroupSettings.hpp"
#include "backend/HierarchicalRoute.hpp"
#include "backend/ShmRoute.hpp"
#include "backend/StoreRoute.hpp"
#include "backend/StoreText.hpp"
#include "common/ErrorText.hpp"

namespace xcomm {
namespace {

using StorePtr = c10::intrusive_ptr<c10d::Store>;
using InnerPtr = std::shared_ptr<InnerRoute>;

StorePtr prefixed(const std::string& prefix, const StorePtr& store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, store);
}

// The segment's sizes, as every rank agreed on them; the spin time is per
// rank (it changes when a rank sleeps, not what it sends).
ShmRoute::Config shmConfig(const GroupSettings& settings) {
  ShmRoute::Config config;
  if (settings.shmSlotBytes >= 0) config.transport.slotBytes = settings.shmSlotBytes;
  if (settings.shmSmallBytes >= 0) config.smallAllreduceBytes = settings.shmSmallBytes;
  config.transport.spinMicros = static_cast<int>(settings.shmSpinMicros);
  return config;
}

// Every rank's verdict on its own setup; true when all succeeded.
bool allSucceeded(const StorePtr& shmStore, int rank, int size, bool mine) {
  setStoreText(shmStore, "ok/" + std::to_string(rank), mine ? "1" : "0");
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back("ok/" + std::to_string(r));
  const auto said = getStoreTexts(shmStore, keys);
  return std::all_of(said.begin(), said.end(), [](const std::string& s) { return s == "1"; });
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
    // One request for all of them (a set per key where the store has no multiSet).
    std::vector<std::string> keys;
    std::vector<std::vector<uint8_t>> values;
    const std::string text = token.str();
    for (int r = 1; r < size; ++r) {
      keys.push_back(prefix + std::to_string(r));
      values.emplace_back(text.begin(), text.end());
    }
    if (!keys.empty()) store->multiSet(keys, values);
    return text;
  }
  const std::string key = prefix + std::to_string(rank);
  std::string token = getStoreText(store, key);
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

// How a group's successors (after a shrink or reconfigure) are built: as the
// group itself was, with the same inner backends and the same shm choice.
XcommBackend::Regroup regroupWith(const InnerBackendFactory& factory, bool allowShm) {
  return [factory, allowShm](const StorePtr& store, int rank, int size,
                             c10::intrusive_ptr<XcommOptions> options, bool freshNamespace) {
    return buildGroup(store, rank, size, std::move(options), factory, allowShm, freshNamespace);
  };
}

c10::intrusive_ptr<XcommBackend> buildOrThrow(const StorePtr& store, int rank, int size,
                                              c10::intrusive_ptr<XcommOptions> options,
                                              const InnerBackendFactory& factory, bool allowShm,
                                              bool freshNamespace) {
  TORCH_CHECK(options, "xcomm: options must not be null");
  TORCH_CHECK(factory.cpu, "xcomm: the inner-backend factory must make CPU backends");
  options->validate();
  const auto timeout = options->timeout;
  // A namespace no group used (a shrink's, in its group's): no token round.
  const StorePtr groupStore = freshNamespace
                                  ? prefixed("xcomm", store)
                                  : prefixed("xcomm/" + agreeGroupToken(store, rank, size), store);
  const StorePtr shmStore = prefixed("shm", groupStore);

  // Before any transport: a setting the ranks disagree on (or cannot read)
  // fails every rank here, at once, not one rank in the middle of a Gloo
  // mesh its peers are still connecting ("closed by peer").
  const AgreedSettings agreed = agreeGroupSettings(groupStore, rank, size, *options, allowShm);
  GroupPlan plan =
      allowShm ? GroupPlan::decide(rank, size, agreed.hostIds, *options, agreed.settings)
               : GroupPlan::plain(rank, size, *options, "shared memory not used", agreed.settings);
  if (!factory.receivesShorter) plan.carrySmallOps = false;
  auto make = [&](const std::string& name) -> InnerPtr {
    const auto groups = plan.auxGroups();
    const AuxGroup* g = findAux(groups, name);
    if (!g || !g->member) return {};
    try {
      return factory.cpu(prefixed(name, groupStore), g->rank, g->size, timeout);
    } catch (...) {
      rethrowSetUpFailure("its Gloo group " + name, rank, size, timeout, std::current_exception());
    }
  };

  const ShmRoute::Config config = shmConfig(plan.settings);
  XcommBackend::Routes routes;
  // A single-host segment is begun before Gloo connects: its creator
  // reserves the segment's pages meanwhile.
  std::unique_ptr<ShmTransport::Setup> shmSetup;
  if (plan.shape == GroupShape::kSingleHostShm) {
    shmSetup = ShmTransport::Setup::begin(shmStore, rank, size, config.transport);
  }
  InnerPtr gloo = make("xcomm/gloo");
  // Checked before the shared-memory attempt in a hierarchical group (its
  // Gloo ops span hosts), after it otherwise (a failed single-host attempt
  // leaves a plain group, which needs it): every rank builds it at the same point.
  InnerPtr checks;
  auto checked = [&] {
    if ((checks = make("xcomm/gloo-check"))) {
      routes.checked = std::make_shared<CheckedRoute>(gloo, checks, timeout, plan.carryBytes(),
                                                      "rank", plan.settings.directExchange);
    }
  };
  // Gloo over the whole group, checked where the plan checks it.
  auto glooRoute = [&]() -> std::shared_ptr<Route> {
    if (routes.checked) return routes.checked;
    return gloo;
  };
  const bool checkFirst = plan.shape == GroupShape::kHierarchical;
  if (checkFirst) checked();
  if (plan.usesShm()) {
    std::string whyNot;
    if (plan.shape == GroupShape::kSingleHostShm) {
      // Collective: null on every rank when any rank failed.
      routes.shm = ShmRoute::tryCreate(*shmSetup, timeout, gloo, config, &whyNot);
    } else {
      HierarchicalRoute::Leaders leaders;
      leaders.gloo = make("xcomm/leaders");
      leaders.checks = make("xcomm/leaders-check");
      leaders.carryBytes = plan.leaderCarryBytes();
      leaders.directExchange = plan.settings.directExchange;
      leaders.compression = plan.leaderCompression;
      routes.hierarchical =
          HierarchicalRoute::tryCreate(prefixed("shm/host" + std::to_string(plan.host), groupStore),
                                       plan.localRank, plan.localSize, rank, size, plan.hosts,
                                       timeout, glooRoute(), std::move(leaders), config, &whyNot);
      // Every host must take the same path, or allreduce would deadlock.
      if (!allSucceeded(shmStore, rank, size, static_cast<bool>(routes.hierarchical))) {
        routes.hierarchical.reset();
      }
      routes.shm = routes.hierarchical;
    }
    if (!routes.shm) {
      if (whyNot.empty()) whyNot = "setup failed on another rank";
      LOG(WARNING) << "xcomm: shared memory unavailable (" << whyNot << "); this group uses gloo";
      plan = plan.fallbackToPlain(whyNot);
    }
  }
  if (!checkFirst && plan.shape == GroupShape::kPlain) checked();
  routes.cpu = routes.shm ? std::shared_ptr<Route>(routes.shm) : glooRoute();
  routes.cpuInner = gloo;
  // The compressed allreduce's own collectives: on the check's group where
  // the plan checks (GroupPlan::auxGroups says why that is safe), else on a
  // group of their own.
  routes.cpuCompressed = make("xcomm/gloo-int8");
  const Compression method = plan.backendMethod();
  if (!routes.cpuCompressed && (method == Compression::kInt8 || method == Compression::kAuto) &&
      plan.shape == GroupShape::kPlain) {
    routes.cpuCompressed = checks;
  }
  std::shared_ptr<Route> fusionControl;
  if (InnerPtr fusionGloo = make("xcomm/gloo-fusion")) {
    fusionControl = fusionGloo;
    if (routes.shm && plan.shape == GroupShape::kSingleHostShm) {
      // The rounds' agreement (an 8-byte allreduce) over a small segment of
      // its own: ~10 us where Gloo's costs ~1 ms on busy cores, more than the
      // small transfers it fuses. Its own segment and thread, so its order
      // never mixes with the group's ops; Gloo stays underneath for abort and
      // as fallback.
      ShmRoute::Config control = config;  // its spin time
      control.transport.slotBytes = 4096;
      std::string whyNot;
      auto setup = ShmTransport::Setup::begin(prefixed("shm-fusion", groupStore), rank, size,
                                              control.transport);
      if (auto shm = ShmRoute::tryCreate(*setup, timeout, fusionControl, control, &whyNot)) {
        fusionControl = shm;
      } else {
        LOG(WARNING) << "xcomm: fusion rounds agree over gloo (" << whyNot << ")";
      }
    }
  }
  if (factory.cuda) {
    InnerPtr nccl;
    try {
      nccl = factory.cuda(prefixed("xcomm/nccl", groupStore), rank, size, timeout);
    } catch (...) {
      rethrowSetUpFailure("its NCCL group xcomm/nccl", rank, size, timeout,
                          std::current_exception());
    }
    routes.cuda = nccl;
  }
  auto backend = c10::make_intrusive<XcommBackend>(std::move(options), plan, std::move(routes));
  backend->setRegroup(store, groupStore, regroupWith(factory, allowShm));
  if (plan.fusionThresholdBytes > 0) {
    backend->setFusionThreshold(plan.fusionThresholdBytes, plan.fusionCycle, fusionControl);
  }
  return backend;
}

}  // namespace

c10::intrusive_ptr<XcommBackend> buildGroup(const StorePtr& store, int rank, int size,
                                            c10::intrusive_ptr<XcommOptions> options,
                                            const InnerBackendFactory& factory, bool allowShm,
                                            bool freshNamespace) {
  try {
    return buildOrThrow(store, rank, size, std::move(options), factory, allowShm, freshNamespace);
  } catch (...) {
    // A member killed mid-set-up may have created a segment whose name its
    // peers never read (they fail first, in a store round or in Gloo): the
    // segments of creators that are gone are removed before this one fails.
    if (allowShm) ShmTransport::removeOrphanedSegments();
    throw;
  }
}

c10::intrusive_ptr<XcommBackend> buildAwaitingReconfigure(const StorePtr& store, int rank, int size,
                                                          c10::intrusive_ptr<XcommOptions> options,
                                                          const InnerBackendFactory& factory,
                                                          bool allowShm) {
  TORCH_CHECK(options, "xcomm: options must not be null");
  TORCH_CHECK(factory.cpu, "xcomm: the inner-backend factory must make CPU backends");
  options->validate();
  auto backend = XcommBackend::awaitingReconfigure(std::move(options), rank, size);
  backend->setRegroup(store, /*groupStore=*/{}, regroupWith(factory, allowShm));
  return backend;
}

// Defined here, beside buildGroup, so the c10d face does not include its builder.
c10::intrusive_ptr<XcommBackend> XcommBackend::createWithStore(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    c10::intrusive_ptr<XcommOptions> options) {
  InnerBackendFactory factory;
  factory.cpu = [](const c10::intrusive_ptr<c10d::Store>& prefixed, int r, int n,
                   std::chrono::milliseconds timeout) -> std::shared_ptr<InnerRoute> {
    return std::make_shared<StoreRoute>(prefixed, r, n, timeout);
  };
  factory.receivesShorter = false;
  return buildGroup(store, rank, size, std::move(options), factory, /*allowShm=*/false);
}

}  // namespace xcomm
