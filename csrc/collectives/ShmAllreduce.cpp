// Allreduce over shared memory.
//
// Small messages: every rank copies its input into its slot once, one
// barrier, then every rank reduces all slots (in rank order) into its output.
// Large messages, chunk by chunk: copy in (all but one's own slice), barrier,
// rank r reduces slice r of the chunk over all ranks into its tensor and
// publishes it in its slot (reduce-scatter), barrier, every rank copies the
// other reduced slices out (allgather). Double-buffered slots make
// a trailing barrier unnecessary.
#include <cstring>

#include "collectives/ShmCollectives.hpp"
#include "collectives/VectorReduce.hpp"

namespace xcomm::shm {

bool supports(at::ScalarType dtype) {
  return vectorReduceSupports(dtype);
}

bool supports(at::ScalarType dtype, RedOp op) {
  switch (op) {
    case RedOp::SUM:
    case RedOp::PRODUCT:
    case RedOp::MIN:
    case RedOp::MAX:
      return supports(dtype);
    case RedOp::AVG:
      return supports(dtype) && at::isFloatingType(dtype);
    case RedOp::BAND:
    case RedOp::BOR:
    case RedOp::BXOR:
      return supports(dtype) && at::isIntegralType(dtype, /*includeBool=*/true);
    default:
      return false;
  }
}

namespace {

// [begin, begin + length) of part `index` when `n` items split into `parts`.
std::pair<int64_t, int64_t> part(int64_t n, int parts, int index) {
  const int64_t base = n / parts;
  const int64_t extra = n % parts;
  const int64_t begin = index * base + std::min<int64_t>(index, extra);
  return {begin, base + (index < extra ? 1 : 0)};
}

void finish(at::Tensor& tensor, RedOp op, int size) {
  if (op == RedOp::AVG) tensor.div_(size);
}

}  // namespace

void allreduce(ShmTransport& transport, at::Tensor& tensor, RedOp op, Deadline deadline,
               size_t smallBytes) {
  constexpr const char* name = "all_reduce";
  const int size = transport.size();
  const int rank = transport.rank();
  const auto dtype = tensor.scalar_type();
  const int64_t elem = tensor.element_size();
  const int64_t numel = tensor.numel();
  const size_t totalBytes = static_cast<size_t>(numel * elem);
  uint8_t* data = detail::bytes(tensor);
  transport.publishDescriptor(
      deadline, name, detail::describe(detail::OpCode::kAllreduce, dtype, static_cast<int>(op), 0),
      totalBytes);
  std::vector<const void*> srcs(size);

  if (totalBytes <= std::min(smallBytes, transport.slotBytes())) {
    const int parity = transport.nextParity();
    if (totalBytes) std::memcpy(transport.slot(rank, parity), data, totalBytes);
    transport.barrier(deadline, name);
    transport.checkDescriptors(name);
    for (int r = 0; r < size; ++r) srcs[r] = transport.slot(r, parity);
    reduceBuffers(data, srcs.data(), size, numel, dtype, op);
    finish(tensor, op, size);
    return;
  }

  const int64_t chunkElems = static_cast<int64_t>(transport.slotBytes()) / elem;
  bool first = true;
  for (int64_t offset = 0; offset < numel; offset += chunkElems) {
    const int64_t length = std::min(chunkElems, numel - offset);
    uint8_t* chunk = data + offset * elem;
    const int parity = transport.nextParity();
    uint8_t* mine = transport.slot(rank, parity);
    const auto [begin, count] = part(length, size, rank);
    // Copy in all but my own slice: only I reduce it, from my tensor.
    std::memcpy(mine, chunk, begin * elem);
    std::memcpy(mine + (begin + count) * elem, chunk + (begin + count) * elem,
                (length - begin - count) * elem);
    transport.barrier(deadline, name);
    if (first) transport.checkDescriptors(name);
    first = false;
    // Reduce-scatter: my slice of the chunk, from every rank, in rank order.
    for (int r = 0; r < size; ++r) {
      srcs[r] = (r == rank ? chunk : transport.slot(r, parity)) + begin * elem;
    }
    // ... into my tensor and, in the same pass, into my slot for the others.
    reduceBuffers(chunk + begin * elem, srcs.data(), size, count, dtype, op, mine + begin * elem);
    transport.barrier(deadline, name);
    // Allgather: every other reduced slice, from its owner's slot.
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      const auto [b, c] = part(length, size, r);
      std::memcpy(chunk + b * elem, transport.slot(r, parity) + b * elem, c * elem);
    }
  }
  finish(tensor, op, size);
}

}  // namespace xcomm::shm
