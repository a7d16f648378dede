// Broadcast over shared memory: the root copies a chunk into its slot and
// arrives; every other rank waits for the root only, then copies it out. The
// root does not wait for the readers; before it (or anyone) next writes a
// slot of the same parity, ShmTransport::prepareWrite makes sure every rank
// has finished reading it.
//
// The first chunk alone takes a full barrier, so that every rank, the root
// included, checks that all ranks agree on the op, the root and the size:
// ranks that each believe they are the root would otherwise all return at
// once with different data.
#include <cstring>

#include "collectives/ShmCollectives.hpp"

namespace xcomm::shm {

void broadcast(ShmTransport& transport, at::Tensor& tensor, int root, Deadline deadline) {
  constexpr const char* name = "broadcast";
  const int rank = transport.rank();
  const size_t totalBytes = tensor.numel() * tensor.element_size();
  uint8_t* data = detail::bytes(tensor);
  transport.publishDescriptor(
      deadline, name,
      {detail::describe(detail::OpCode::kBroadcast, tensor.scalar_type(), 0, root), totalBytes});
  size_t offset = 0;
  bool first = true;
  do {  // at least once: the first arrival also checks that the ranks agree
    const size_t length = std::min(transport.slotBytes(), totalBytes - offset);
    const int parity = transport.nextParity();
    if (rank == root && length) {
      transport.prepareWrite(deadline, name);
      std::memcpy(transport.slot(root, parity), data + offset, length);
    }
    if (first) {
      transport.barrier(deadline, name);
      detail::checkAgreement(transport, name);
      first = false;
    } else {
      transport.arriveAndWaitForRoot(root, deadline, name);
    }
    if (rank != root && length) std::memcpy(data + offset, transport.slot(root, parity), length);
    offset += length;
  } while (offset < totalBytes);
}

void barrier(ShmTransport& transport, Deadline deadline) {
  constexpr const char* name = "barrier";
  transport.publishDescriptor(
      deadline, name,
      {detail::describe(detail::OpCode::kBarrier, at::ScalarType::Undefined, 0, 0), 0});
  transport.nextParity();  // as every op does before its check: see agree()
  transport.barrier(deadline, name);
  detail::checkAgreement(transport, name);
}

}  // namespace xcomm::shm
