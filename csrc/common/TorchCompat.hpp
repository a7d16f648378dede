#pragma once
// What differs between the torch versions xcomm builds against (2.11 to 2.14),
// in one place. Everything else uses names common to all of them.
#include <cstdint>
#include <vector>

#include <torch/headeronly/version.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

// torch 2.14 added Backend::gather_single, with gather_into_tensor as its
// overridable alias; earlier versions have neither.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
#define XCOMM_HAS_GATHER_SINGLE 1
#else
#define XCOMM_HAS_GATHER_SINGLE 0
#endif

// torch 2.13 is the first xcomm builds against whose Backend has shrink()
// and supportsShrinking() (dist.shrink_group).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define XCOMM_HAS_SHRINK 1
#else
#define XCOMM_HAS_SHRINK 0
#endif
// torch 2.14 added the experimental reconfigure API (Backend::reconfigure,
// get_reconfigure_handle, supportsReconfigure; ReconfigureOptions).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
#define XCOMM_HAS_RECONFIGURE 1
#else
#define XCOMM_HAS_RECONFIGURE 0
#endif
// torch main is turning the supportsX() capability queries into non-virtual
// accessors of a bitset: override them only on the versions known to keep
// them virtual.
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR <= 14
#define XCOMM_VIRTUAL_CAPABILITIES 1
#else
#define XCOMM_VIRTUAL_CAPABILITIES 0
#endif

namespace xcomm::compat {

// torch 2.13 renamed NCCLPreMulSumSupplement (keeping an alias); 2.14 dropped
// the old name.
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
using PreMulSumSupplement = c10d::NCCLPreMulSumSupplement;
#else
using PreMulSumSupplement = c10d::PreMulSumSupplement;
#endif

// A PREMUL_SUM ReduceOp with `factor` (a double or a one-element tensor).
template <typename T>
c10d::ReduceOp makePreMulSum(const T& factor) {
  c10d::ReduceOp op;
  op.op_ = c10d::ReduceOp::PREMUL_SUM;
  op.supplement_ = c10::make_intrusive<PreMulSumSupplement>(factor);
  return op;
}

// torch 2.13 named ProcessGroup's one-tensor collectives all_gather_single and
// all_to_all_single, deprecating _allgather_base and alltoall_base (later
// torch removes them); torch 2.11 and 2.12 have only the old names. Templates,
// so that this header need not include ProcessGroup.hpp.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define XCOMM_HAS_PG_SINGLE 1
#else
#define XCOMM_HAS_PG_SINGLE 0
#endif

template <typename Group>
auto allGatherSingle(Group& group, at::Tensor& output, at::Tensor& input) {
#if XCOMM_HAS_PG_SINGLE
  return group.all_gather_single(output, input);
#else
  return group._allgather_base(output, input);
#endif
}

template <typename Group>
auto allToAllSingle(Group& group, at::Tensor& output, at::Tensor& input,
                    std::vector<int64_t>& outputSplits, std::vector<int64_t>& inputSplits) {
#if XCOMM_HAS_PG_SINGLE
  return group.all_to_all_single(output, input, outputSplits, inputSplits);
#else
  return group.alltoall_base(output, input, outputSplits, inputSplits);
#endif
}

}  // namespace xcomm::compat
