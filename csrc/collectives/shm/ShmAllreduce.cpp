// Allreduce over shared memory.
//
// Small messages: every rank copies its input into its slot once, one
// barrier, then every rank reduces all slots (in rank order) into its output.
// Large messages, chunk by chunk: copy in (all but one's own slice), barrier,
// rank r reduces slice r of the chunk over all ranks into its tensor and
// publishes it in its slot (reduce-scatter), copies the next chunk in (other
// parity), barrier, copies the other reduced slices out (allgather): one
// barrier per chunk. Double-buffered slots make a trailing barrier
// unnecessary.
#include <cstring>

#include "collectives/reduce/VectorReduce.hpp"
#include "collectives/shm/ShmCollectives.hpp"

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

void allreduce(ShmTransport& transport, at::Tensor& tensor, const c10d::ReduceOp& reduceOp,
               Deadline deadline, size_t smallBytes) {
  constexpr const char* name = "all_reduce";
  const int size = transport.size();
  const int rank = transport.rank();
  const RedOp op = reduceOp.op_;
  const auto dtype = tensor.scalar_type();
  const int64_t elem = tensor.element_size();
  const int64_t numel = tensor.numel();
  const size_t totalBytes = static_cast<size_t>(numel * elem);
  uint8_t* data = detail::bytes(tensor);
  transport.publishDescriptor(
      deadline, name, detail::describeReduction(detail::OpCode::kAllreduce, tensor, reduceOp));
  std::vector<const void*> srcs(size);

  if (totalBytes <= std::min(smallBytes, transport.slotBytes())) {
    const int parity = transport.nextParity();
    if (totalBytes) std::memcpy(transport.slot(rank, parity), data, totalBytes);
    transport.barrier(deadline, name);
    detail::checkAgreement(transport, name);
    for (int r = 0; r < size; ++r) srcs[r] = transport.slot(r, parity);
    reduceBuffers(data, srcs.data(), size, numel, dtype, op);
    finish(tensor, op, size);
    return;
  }

  const int64_t chunkElems = static_cast<int64_t>(transport.slotBytes()) / elem;
  const int64_t chunks = (numel + chunkElems - 1) / chunkElems;
  // Rank r's slice of a chunk: the same range of the slot for every chunk
  // (clipped to the chunk's length), so what one chunk's step writes into a
  // slot never overlaps what a peer may still read there from two chunks ago.
  auto slice = [&](int r, int64_t length) {
    const auto [b, c] = part(chunkElems, size, r);
    const int64_t begin = std::min(b, length);
    return std::pair<int64_t, int64_t>{begin, std::min(b + c, length) - begin};
  };
  auto lengthOf = [&](int64_t k) { return std::min(chunkElems, numel - k * chunkElems); };
  // Copy in all but my own slice of chunk k (only I reduce that one, from my tensor).
  auto copyIn = [&](int64_t k, uint8_t* mine) {
    const int64_t length = lengthOf(k);
    const uint8_t* chunk = data + k * chunkElems * elem;
    const auto [begin, count] = slice(rank, length);
    std::memcpy(mine, chunk, begin * elem);
    std::memcpy(mine + (begin + count) * elem, chunk + (begin + count) * elem,
                (length - begin - count) * elem);
  };
  // One barrier per chunk: after reducing chunk k, a rank copies chunk k+1 in
  // (into the other parity) before it arrives, so the barrier that publishes
  // the reduced slices of k also publishes the inputs of k+1.
  int parity = transport.nextParity();
  copyIn(0, transport.slot(rank, parity));
  transport.barrier(deadline, name);
  detail::checkAgreement(transport, name);
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t length = lengthOf(k);
    uint8_t* chunk = data + k * chunkElems * elem;
    uint8_t* mine = transport.slot(rank, parity);
    const auto [begin, count] = slice(rank, length);
    // Reduce-scatter: my slice of the chunk, from every rank, in rank order,
    // into my tensor and, in the same pass, into my slot for the others.
    for (int r = 0; r < size; ++r) {
      srcs[r] = (r == rank ? chunk : transport.slot(r, parity)) + begin * elem;
    }
    reduceBuffers(chunk + begin * elem, srcs.data(), size, count, dtype, op, mine + begin * elem);
    const int current = parity;
    if (k + 1 < chunks) {
      // The other parity's slot was last read (chunk k-1) before the previous barrier.
      parity = transport.nextParity();
      copyIn(k + 1, transport.slot(rank, parity));
    }
    transport.barrier(deadline, name);
    // Allgather: every other reduced slice of chunk k, from its owner's slot.
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      const auto [b, c] = slice(r, length);
      std::memcpy(chunk + b * elem, transport.slot(r, current) + b * elem, c * elem);
    }
  }
  finish(tensor, op, size);
}

}  // namespace xcomm::shm
