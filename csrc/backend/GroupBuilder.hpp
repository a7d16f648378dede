#pragma once
// GroupBuilder: builds one xcomm process group from its GroupPlan.
//
// Collective over the group's store: every rank publishes its host identity,
// GroupPlan::decide fixes the group's shape, and the builder asks an
// InnerBackendFactory for each inner route the plan names (Gloo and NCCL, as
// RawRoutes, when created from Python; xcomm's StoreRoute in a C++-only
// program). When
// the shared-memory segment cannot be set up on some rank, every rank falls
// back to the plain plan (agreed through the store) before anything else is
// built, so all ranks always hold the same plan.
#include <chrono>
#include <functional>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/XcommBackend.hpp"

namespace xcomm {

struct InnerBackendFactory {
  using Make = std::function<std::shared_ptr<InnerRoute>(
      const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
      std::chrono::milliseconds timeout)>;
  // A CPU inner route among `size` ranks over `store` (already prefixed with
  // the auxiliary group's name); `rank` is this rank's rank in it.
  Make cpu;
  // The CUDA inner route of the whole group, or null (no CUDA, no GPU); unset: none.
  Make cuda;
  // Whether the CPU backends' receives take a message shorter than their
  // buffer (Gloo's do; xcomm's store transport wants exact sizes): small ops
  // ride in the collective checks' exchange only then.
  bool receivesShorter = true;
};

// `allowShm` false keeps the group plain whatever the options say (the
// C++-only store transport path), and exchanges no host identities.
// `freshNamespace`: no group can have used `store`'s keys before (a
// shrink's, inside its group's namespace), so the ranks need not first agree
// on a namespace of their own.
c10::intrusive_ptr<XcommBackend> buildGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                            int size, c10::intrusive_ptr<XcommOptions> options,
                                            const InnerBackendFactory& factory,
                                            bool allowShm = true, bool freshNamespace = false);

// A group created with enable_reconfigure=True (torch 2.14): no communicator,
// and nothing exchanged with the other ranks, until its first reconfigure()
// builds one (with buildGroup) for the members that reconfigure names.
c10::intrusive_ptr<XcommBackend> buildAwaitingReconfigure(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    c10::intrusive_ptr<XcommOptions> options, const InnerBackendFactory& factory,
    bool allowShm = true);

}  // namespace xcomm
