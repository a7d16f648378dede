// Broadcast over shared memory: the root copies a chunk into its slot, one
// barrier, every other rank copies it out. Double-buffered slots let the root
// write the next chunk while the others still read the previous one.
#include <cstring>

#include "collectives/ShmCollectives.hpp"

namespace xcomm::shm {

void broadcast(ShmTransport& transport, at::Tensor& tensor, int root, Deadline deadline) {
  constexpr const char* name = "broadcast";
  const int rank = transport.rank();
  const size_t totalBytes = tensor.numel() * tensor.element_size();
  uint8_t* data = detail::bytes(tensor);
  transport.publishDescriptor(
      detail::describe(detail::OpCode::kBroadcast, tensor.scalar_type(), 0, root), totalBytes);
  size_t offset = 0;
  bool first = true;
  do {  // at least once: the first barrier also checks that the ranks agree
    const size_t length = std::min(transport.slotBytes(), totalBytes - offset);
    const int parity = transport.nextParity();
    if (rank == root && length) std::memcpy(transport.slot(root, parity), data + offset, length);
    transport.barrier(deadline, name);
    if (first) transport.checkDescriptors(name);
    first = false;
    if (rank != root && length) std::memcpy(data + offset, transport.slot(root, parity), length);
    offset += length;
  } while (offset < totalBytes);
}

void barrier(ShmTransport& transport, Deadline deadline) {
  transport.publishDescriptor(
      detail::describe(detail::OpCode::kBarrier, at::ScalarType::Undefined, 0, 0), 0);
  transport.barrier(deadline, "barrier");
  transport.checkDescriptors("barrier");
}

}  // namespace xcomm::shm
