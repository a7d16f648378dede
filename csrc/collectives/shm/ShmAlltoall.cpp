// All-to-all over shared memory, with per-pair sizes (uneven splits).
//
// Each slot holds a header, then one region of C bytes per destination rank.
// Round 0's header is what this rank sends to each rank and expects from
// each rank (bytes); after round 0's barrier every rank reads every header,
// so a pair whose sizes disagree raises the same ValueError on every rank at
// the same barrier (the ranks stay in step). Round k carries bytes
// [kC, (k+1)C) of every pair's piece; every rank derives the number of rounds
// from the largest piece in the headers. A rank's piece for itself is copied
// directly.
#include <algorithm>
#include <cstring>

#include "collectives/shm/ShmCollectives.hpp"

namespace xcomm::shm {
namespace {

struct Layout {
  size_t headerBytes;  // 2 x size counts of 8 bytes
  size_t regionBytes;  // per destination rank, per round
};

Layout layoutOf(const ShmTransport& transport) {
  const size_t size = transport.size();
  const size_t header = 2 * size * sizeof(uint64_t);
  if (transport.slotBytes() < header + size) return {header, 0};
  size_t region = (transport.slotBytes() - header) / size;
  // Aligned regions copy faster; keep at least one byte per region.
  if (region >= 64) region &= ~size_t{63};
  return {header, region};
}

size_t bytesOf(const at::Tensor& t) {
  return t.numel() * t.element_size();
}

}  // namespace

bool alltoallFits(const ShmTransport& transport) {
  return layoutOf(transport).regionBytes > 0;
}

void alltoall(ShmTransport& transport, const std::vector<at::Tensor>& sends,
              std::vector<at::Tensor>& recvs, Deadline deadline, const char* op) {
  const int rank = transport.rank();
  const int size = transport.size();
  TORCH_CHECK(static_cast<int>(sends.size()) == size && static_cast<int>(recvs.size()) == size,
              "xcomm shm: ", op, " needs ", size, " inputs and outputs");
  const Layout layout = layoutOf(transport);
  TORCH_CHECK(layout.regionBytes > 0, "xcomm shm: ", op, ": slots of ", transport.slotBytes(),
              " bytes are too small for ", size, " ranks");
  const auto dtype = sends[0].scalar_type();
  transport.publishDescriptor(deadline, op,
                              {detail::describe(detail::OpCode::kAlltoall, dtype, 0, 0), 0});

  // Round 0: the header, then the first bytes of every piece.
  int parity = transport.nextParity();
  auto* header = reinterpret_cast<uint64_t*>(transport.slot(rank, parity));
  for (int r = 0; r < size; ++r) {
    header[r] = bytesOf(sends[r]);
    header[size + r] = bytesOf(recvs[r]);
  }
  const size_t C = layout.regionBytes;
  auto writeRound = [&](size_t round, int parity) {
    uint8_t* mine = transport.slot(rank, parity) + layout.headerBytes;
    for (int d = 0; d < size; ++d) {
      const size_t total = bytesOf(sends[d]);
      if (d == rank || total <= round * C) continue;
      const size_t length = std::min(C, total - round * C);
      std::memcpy(mine + d * C, detail::bytes(sends[d]) + round * C, length);
    }
  };
  writeRound(0, parity);
  transport.barrier(deadline, op);
  detail::checkAgreement(transport, op);

  // Every rank checks every pair, in the same order, so all raise alike.
  size_t largest = 0;
  for (int s = 0; s < size; ++s) {
    const auto* from = reinterpret_cast<const uint64_t*>(transport.slot(s, parity));
    for (int d = 0; d < size; ++d) {
      const auto* to = reinterpret_cast<const uint64_t*>(transport.slot(d, parity));
      const uint64_t sent = from[d];
      const uint64_t expected = to[size + s];
      TORCH_CHECK_VALUE(sent == expected, "xcomm.", op, ": rank ", s, " sends ", sent,
                        " bytes to rank ", d, ", but rank ", d, " expects ", expected,
                        " bytes from rank ", s,
                        "; each rank's input split for a peer must equal that peer's output "
                        "split for it");
      if (s != d) largest = std::max<size_t>(largest, sent);
    }
  }
  const size_t rounds = std::max<size_t>(1, (largest + C - 1) / C);
  if (bytesOf(sends[rank])) {
    std::memcpy(detail::bytes(recvs[rank]), detail::bytes(sends[rank]), bytesOf(sends[rank]));
  }
  auto readRound = [&](size_t round, int parity) {
    for (int s = 0; s < size; ++s) {
      const size_t total = bytesOf(recvs[s]);
      if (s == rank || total <= round * C) continue;
      const size_t length = std::min(C, total - round * C);
      const uint8_t* theirs = transport.slot(s, parity) + layout.headerBytes + rank * C;
      std::memcpy(detail::bytes(recvs[s]) + round * C, theirs, length);
    }
  };
  readRound(0, parity);
  for (size_t round = 1; round < rounds; ++round) {
    parity = transport.nextParity();
    writeRound(round, parity);
    transport.barrier(deadline, op);
    readRound(round, parity);
  }
}

}  // namespace xcomm::shm
