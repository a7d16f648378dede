#pragma once
// Options of an xcomm process group: every setting's default and its
// validation live here, once. Python's xcomm.Options is a typed face over
// this struct (its defaults are read from here, its values checked here).
#include <chrono>
#include <cstdint>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "common/Compression.hpp"

namespace xcomm {

struct XcommOptions : c10d::Backend::Options {
  explicit XcommOptions(std::chrono::milliseconds timeout = ::kBackendDefaultTimeout)
      : Options("xcomm", timeout) {}

  // Backend-level allreduce compression (xcomm.Options(compression=...)):
  // method, smallest tensor compressed, elements per int8 scale, and auto's
  // bounds (auto_methods, auto_link; XCOMM_AUTO_METHODS / XCOMM_AUTO_LINK
  // override them, backend/GroupSettings).
  CompressionConfig compression;
  // CPU collectives over shared memory where the group's shape allows it
  // (GroupPlan); the environment's XCOMM_SHM=0 also turns it off.
  bool shm = true;
  // The shared-memory settings the environment may override or turn off
  // (XCOMM_SHM_HIERARCHICAL, XCOMM_SHM_SLOT_BYTES, XCOMM_SHM_SMALL_BYTES):
  // a group spanning hosts reduces hierarchically; the segment's bytes per
  // rank per buffer, and the largest allreduce taking the one-barrier path
  // (-1: the transport's defaults).
  bool shmHierarchical = true;
  int64_t shmSlotBytes = -1;
  int64_t shmSmallBytes = -1;
  // Check before each collective Gloo runs (groups without shared memory)
  // that every rank called the same one; a mismatch is a ValueError on
  // every rank instead of Gloo's abort, hang or wrong result.
  bool checkCollectives = true;
  // With the check on, small all_reduce, broadcast, all_gather and barrier
  // travel inside the check's own exchange instead of a Gloo op after it.
  bool carrySmallOps = true;
  // With the check on, large all-to-alls and all-gathers go as point-to-point
  // messages (DirectExchange); XCOMM_DIRECT_EXCHANGE=0 also keeps Gloo's.
  bool directExchange = true;
  // Fusion of small async CPU allreduces up to this many bytes; 0: off.
  int64_t fusionThresholdBytes = 0;
  // With fusion on, a background cycle sends held ops at most this late; 0: on demand.
  double fusionCycleMs = 0.0;

  // ValueError naming the option and the problem.
  void validate() const;

  // A positive cycle below 1 us still means "a cycle", not "on demand".
  std::chrono::microseconds fusionCycle() const {
    const auto us = static_cast<int64_t>(fusionCycleMs * 1000.0);
    return std::chrono::microseconds(fusionCycleMs > 0 && us < 1 ? 1 : us);
  }

  static c10::intrusive_ptr<XcommOptions> create(
      std::chrono::milliseconds timeout = ::kBackendDefaultTimeout) {
    return c10::make_intrusive<XcommOptions>(timeout);
  }
};

}  // namespace xcomm
