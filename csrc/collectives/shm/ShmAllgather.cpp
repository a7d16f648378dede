// Allgather over shared memory: every rank copies a chunk of its input into
// its slot, one barrier, every rank copies every slot's chunk out.
#include <cstring>

#include "collectives/shm/ShmCollectives.hpp"

namespace xcomm::shm {

void allgather(ShmTransport& transport, const at::Tensor& input, std::vector<at::Tensor>& outputs,
               Deadline deadline) {
  constexpr const char* name = "all_gather";
  const int rank = transport.rank();
  const int size = transport.size();
  TORCH_CHECK(static_cast<int>(outputs.size()) == size, "xcomm shm: all_gather needs ", size,
              " outputs");
  const size_t totalBytes = input.numel() * input.element_size();
  const uint8_t* in = detail::bytes(input);
  transport.publishDescriptor(
      deadline, name,
      {detail::describe(detail::OpCode::kAllgather, input.scalar_type(), 0, 0), totalBytes});
  size_t offset = 0;
  bool first = true;
  do {
    const size_t length = std::min(transport.slotBytes(), totalBytes - offset);
    const int parity = transport.nextParity();
    if (length) std::memcpy(transport.slot(rank, parity), in + offset, length);
    transport.barrier(deadline, name);
    if (first) detail::checkAgreement(transport, name);
    first = false;
    for (int r = 0; r < size && length; ++r) {
      const uint8_t* src = r == rank ? in + offset : transport.slot(r, parity);
      std::memcpy(detail::bytes(outputs[r]) + offset, src, length);
    }
    offset += length;
  } while (offset < totalBytes);
}

}  // namespace xcomm::shm
