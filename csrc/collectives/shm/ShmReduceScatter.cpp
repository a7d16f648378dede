// Reduce-scatter over shared memory, chunk by chunk: every rank copies the
// chunk of each of its p inputs into its slot (p pieces), one barrier, rank r
// reduces piece r of every slot, in rank order, into its output.
#include <cstring>

#include "collectives/reduce/VectorReduce.hpp"
#include "collectives/shm/ShmCollectives.hpp"

namespace xcomm::shm {

void reduceScatter(ShmTransport& transport, at::Tensor& output,
                   const std::vector<at::Tensor>& inputs, const c10d::ReduceOp& reduceOp,
                   Deadline deadline) {
  constexpr const char* name = "reduce_scatter";
  const int rank = transport.rank();
  const int size = transport.size();
  TORCH_CHECK(static_cast<int>(inputs.size()) == size, "xcomm shm: reduce_scatter needs ", size,
              " inputs");
  const RedOp op = reduceOp.op_;
  const auto dtype = output.scalar_type();
  const int64_t elem = output.element_size();
  const int64_t numel = output.numel();
  transport.publishDescriptor(
      deadline, name, detail::describeReduction(detail::OpCode::kReduceScatter, output, reduceOp));
  const int64_t chunkElems =
      std::max<int64_t>(1, static_cast<int64_t>(transport.slotBytes()) / (elem * size));
  std::vector<const void*> srcs(size);
  int64_t offset = 0;
  bool first = true;
  do {
    const int64_t length = std::min(chunkElems, numel - offset);
    const int parity = transport.nextParity();
    uint8_t* mine = transport.slot(rank, parity);
    for (int r = 0; r < size && length; ++r) {
      std::memcpy(mine + r * length * elem, detail::bytes(inputs[r]) + offset * elem,
                  length * elem);
    }
    transport.barrier(deadline, name);
    if (first) detail::checkAgreement(transport, name);
    first = false;
    for (int r = 0; r < size; ++r) srcs[r] = transport.slot(r, parity) + rank * length * elem;
    reduceBuffers(detail::bytes(output) + offset * elem, srcs.data(), size, length, dtype, op);
    offset += length;
  } while (offset < numel);
  if (op == RedOp::AVG) output.div_(size);
}

}  // namespace xcomm::shm
