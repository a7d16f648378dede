// Rank agreement over shared memory: every shared-memory collective publishes
// what it is (op, dtype, reduce op, root, bytes) before its first barrier and
// checks after it that every rank published the same. A disagreement is a
// user bug (ranks issuing different collectives), and it raises on every rank
// at the same barrier, so the ranks stay in step and the group stays usable.
#include <sstream>

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "collectives/reduce/ReduceKernels.hpp"
#include "collectives/shm/ShmCollectives.hpp"
#include "common/OpNames.hpp"

namespace xcomm::shm {
namespace detail {
namespace {

// "broadcast(root=1, Float, 400 bytes)" and the like.
std::string render(ShmTransport::Descriptor d) {
  const auto code = static_cast<OpCode>(d.what >> 56);
  const auto dtype = static_cast<at::ScalarType>((d.what >> 48) & 0xff);
  const int redOp = static_cast<int>((d.what >> 40) & 0xff);
  const int fallbackOp = static_cast<int>((d.what >> 32) & 0xff);
  const auto root = static_cast<int32_t>(d.what & 0xffffffffu);
  std::ostringstream out;
  switch (code) {
    case OpCode::kAllreduce:
      out << "all_reduce(" << reduceOpName(static_cast<RedOp>(redOp)) << ", ";
      break;
    case OpCode::kBroadcast:
      out << "broadcast(root=" << root << ", ";
      break;
    case OpCode::kAllgather:
      out << "all_gather(";
      break;
    case OpCode::kReduceScatter:
      out << "reduce_scatter(" << reduceOpName(static_cast<RedOp>(redOp)) << ", ";
      break;
    case OpCode::kBarrier:
      return "barrier()";
    case OpCode::kAlltoall:  // sizes differ per rank; they are checked pair by pair
      return "all_to_all(" + std::string(c10::toString(dtype)) + ")";
    case OpCode::kRootError:
      return "broadcast(root=" + std::to_string(root) + ", failed at its root)";
    case OpCode::kFallback: {
      const auto type = static_cast<c10d::OpType>(fallbackOp);
      out << opName(type, -1) << "(";
      // Only the rooted ops' root means anything (the others publish 0).
      if (isRooted(type)) out << "root=" << root << ", ";
      break;
    }
    default:
      return "an unknown op";
  }
  if (dtype != at::ScalarType::Undefined) out << c10::toString(dtype) << ", ";
  out << d.bytes << " bytes)";
  return out.str();
}

}  // namespace

void checkAgreement(const ShmTransport& transport, const char* op) {
  const auto reference = transport.descriptorOf(0);
  for (int r = 1; r < transport.size(); ++r) {
    const auto other = transport.descriptorOf(r);
    TORCH_CHECK_VALUE(other == reference, "xcomm shm: ", op,
                      ": the ranks called different collectives (rank 0: ", render(reference),
                      "; rank ", r, ": ", render(other),
                      "); every rank must issue the same collectives, with the same root, sizes, "
                      "dtype and reduce op, in the same order");
  }
}

}  // namespace detail

void agree(ShmTransport& transport, ShmTransport::Descriptor call, Deadline deadline,
           const char* op) {
  transport.publishDescriptor(deadline, op, call);
  // Every shared-memory op takes a slot parity before its first barrier; so
  // does this one, or a rank whose op ran here would be a parity ahead of
  // one whose op ran elsewhere after the error, and read stale slots.
  transport.nextParity();
  transport.barrier(deadline, op);
  detail::checkAgreement(transport, op);
}

}  // namespace xcomm::shm
