#pragma once
// GroupSettings: the environment's say in what a group's ranks do together,
// read once when the group is built and agreed by every rank before any
// transport is made.
//
// Options travel with each new_group() call; XCOMM_* variables come from
// each process's environment, and a job's ranks need not share one. A
// variable that changes which collectives a rank issues, or how a segment is
// laid out, must therefore be the same on every rank, or the ranks issue
// different collectives and hang or mix data. So every rank publishes its
// settings (and its host identity) in the group's store, reads every
// rank's, and either all ranks go on with the same values or all raise the
// same ValueError naming the setting, the ranks and their values.
//
// Compared, in their canonical form, only where they matter to the group:
// - the Options fields that shape a group (compression and its sizes, shm
//   and its settings, check_collectives, carry_small_ops, direct_exchange,
//   fusion), so that one rank's
//   Options(compression="int8") against another's None is an error too;
// - XCOMM_SHM, XCOMM_SHM_HIERARCHICAL, XCOMM_SHM_SLOT_BYTES,
//   XCOMM_SHM_SMALL_BYTES (when the group may use shared memory);
// - XCOMM_DIRECT_EXCHANGE (when collectives are checked);
// - XCOMM_AUTO_METHODS, XCOMM_AUTO_LINK (when compression is "auto").
// Not compared: choices that give the same bits and the same collectives on
// every rank (XCOMM_SHM_SPIN_US, XCOMM_CPU_CAPABILITY, the CUDA kernels'
// switches) and the host identity itself (XCOMM_SHM_HOST_TAG).
//
// The records are read back from the store by every rank (its own
// included), and a second round compares a digest of what each rank read,
// so a record changed in the store while the ranks read it (another
// process writing to an unauthenticated store) fails every rank alike
// instead of leading ranks into different plans.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/XcommOptions.hpp"

namespace xcomm {

struct GroupSettings {
  // Shared memory allowed by Options(shm) and XCOMM_SHM (0/false/off/no: off).
  bool shm = true;
  // XCOMM_SHM_HIERARCHICAL=0 keeps a group that spans hosts plain.
  bool shmHierarchical = true;
  // XCOMM_SHM_SLOT_BYTES / XCOMM_SHM_SMALL_BYTES; -1: the transport's default.
  int64_t shmSlotBytes = -1;
  int64_t shmSmallBytes = -1;
  // XCOMM_SHM_SPIN_US, this rank's own (not compared: how long a waiting
  // rank spins before it sleeps changes no bits); -1: the transport's default.
  int64_t shmSpinMicros = -1;
  // XCOMM_DIRECT_EXCHANGE=0 keeps large all-to-alls and all-gathers on Gloo's
  // collectives instead of point-to-point messages.
  bool directExchange = true;
  // XCOMM_AUTO_METHODS and XCOMM_AUTO_LINK, for compression="auto".
  std::vector<Compression> autoMethods;  // empty: every method auto knows
  double autoLinkLatency = 0;            // seconds
  double autoLinkBytesPerSecond = 0;     // 0: probe the link

  // This process's settings, from `options` and its environment; ValueError
  // naming a variable whose value it cannot use. `mayUseShm`: whether
  // the group may use shared memory at all (false on the store-only path).
  static GroupSettings fromEnvironment(const XcommOptions& options, int size, bool mayUseShm);

  // Every setting the group's ranks must share, as (name, canonical value);
  // "-" where it does not apply to this group.
  std::vector<std::pair<std::string, std::string>> shared(const XcommOptions& options, int size,
                                                          bool mayUseShm) const;

  // One line per setting that differs from its default, for group_plan.
  std::string describe() const;
};

// What a group's ranks agreed on when it was built.
struct AgreedSettings {
  GroupSettings settings;
  // Rank r's host identity (empty when shared memory is off for the group).
  std::vector<std::string> hostIds;
};

// Publishes this rank's settings (and host identity, when `mayUseShm`)
// under `store` and returns the agreed values, or raises the same
// ValueError on every rank. A rank whose own settings cannot be read still
// publishes, so its error reaches every rank at once rather than after the
// timeout. One rank: no exchange.
AgreedSettings agreeGroupSettings(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                  const XcommOptions& options, bool mayUseShm);

}  // namespace xcomm
