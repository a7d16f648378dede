// Broadcast over shared memory: the root copies a chunk into its slot and
// arrives; every other rank waits for the root only, then copies it out. The
// root does not wait for the readers; before it (or anyone) next writes a
// slot of the same parity, ShmTransport::prepareWrite makes sure every rank
// has finished reading it.
//
// The first chunk alone takes a full barrier, so that every rank, the root
// included, checks that all ranks agree on the op, the root and the size:
// ranks that each believe they are the root would otherwise all return at
// once with different data. A root without the data publishes its error
// there instead (RootError), and every rank raises it.
#include <algorithm>
#include <cstring>

#include <c10/util/Exception.h>

#include "collectives/shm/ShmCollectives.hpp"

namespace xcomm::shm {

namespace {

// The root's side of a failed broadcast: its error in its slot, in place of
// the first chunk. Raises on the root as on every other rank.
[[noreturn]] void publishRootError(ShmTransport& transport, int root, Deadline deadline,
                                   const RootError& error) {
  constexpr const char* name = "broadcast";
  const size_t length = std::min(error.message.size(), transport.slotBytes());
  transport.publishDescriptor(
      deadline, name,
      {detail::describe(detail::OpCode::kRootError, at::ScalarType::Undefined,
                        error.invalidInput ? 1 : 0, root),
       length});
  const int parity = transport.nextParity();
  transport.prepareWrite(deadline, name);
  std::memcpy(transport.slot(root, parity), error.message.data(), length);
  transport.barrier(deadline, name);
  if (error.invalidInput) TORCH_CHECK_VALUE(false, error.message);
  C10_THROW_ERROR(DistBackendError, error.message);
}

// After the first barrier: raises the root's error if it published one.
void raiseIfRootFailed(const ShmTransport& transport, int root, int parity) {
  const auto published = transport.descriptorOf(root);
  if (static_cast<detail::OpCode>(published.what >> 56) != detail::OpCode::kRootError) return;
  const auto* text = reinterpret_cast<const char*>(transport.slot(root, parity));
  const std::string message(text, std::min<size_t>(published.bytes, transport.slotBytes()));
  if ((published.what >> 40) & 0xff) TORCH_CHECK_VALUE(false, message);
  C10_THROW_ERROR(DistBackendError, message);
}

}  // namespace

void broadcast(ShmTransport& transport, at::Tensor& tensor, int root, Deadline deadline) {
  broadcast(transport, tensor, root, deadline, nullptr);
}

void broadcast(ShmTransport& transport, at::Tensor& tensor, int root, Deadline deadline,
               const RootError* rootError) {
  constexpr const char* name = "broadcast";
  const int rank = transport.rank();
  if (rootError && rank == root) publishRootError(transport, root, deadline, *rootError);
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
      raiseIfRootFailed(transport, root, parity);
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
