#pragma once
// All-to-all and all-gather as point-to-point messages, every one posted at
// once: rank r's piece for rank p goes straight to p as one send matched by
// one receive.
//
// Why not Gloo's own all-to-all and all-gather: on a rate-limited link they
// move a large message at about 55-65% of the rate (measured on the emulated
// cluster, 2 nodes, one 5 MiB piece per peer: 6.0 of 11.6 MB/s at 0.1 Gbit/s,
// 59 of 116 MB/s at 1 Gbit/s), while the same bytes as one Gloo send and
// receive per pair reach 97-100%. The bytes on each rank's link are the same
// as Gloo's: (n-1)/n of the input for an all-to-all, (n-1) inputs for an
// all-gather.
//
// The caller must have agreed with every rank on the op and its sizes first
// (CheckedRoute's check): a receive takes the matching send whatever its
// length, and ranks that disagreed would trade the wrong bytes.
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "runtime/Route.hpp"

namespace xcomm {

class DirectExchange {
 public:
  // What a post...() call started: one work per message, and its peer.
  struct Posted {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<int> peers;
  };

  // `p2p` (which must outlive this) carries the messages on point-to-point
  // tag `tag`, which nothing else posts on; messages of consecutive exchanges
  // share the tag and match in posting order, which is the same on every rank.
  DirectExchange(InnerRoute& p2p, int tag);

  // all_to_all_single: `input`'s piece r (`sendBytes[r]` bytes, in rank
  // order) goes to rank r; rank r's piece for this rank lands at its place in
  // `output` (`recvBytes[r]` bytes). Both tensors contiguous.
  Posted postAlltoall(const at::Tensor& output, const at::Tensor& input,
                      const std::vector<int64_t>& sendBytes,
                      const std::vector<int64_t>& recvBytes) const;
  // all_to_all with lists: inputs[r] goes to rank r, outputs[r] comes from it.
  Posted postAlltoall(const std::vector<at::Tensor>& outputs,
                      const std::vector<at::Tensor>& inputs) const;
  // all_gather_into_tensor: every rank's `input` lands at row r of `output`.
  Posted postAllgather(const at::Tensor& output, const at::Tensor& input) const;
  // all_gather with a list: every rank's `input` lands in outputs[r].
  Posted postAllgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input) const;

  // Waits for every message until `deadline`. One that did not arrive or
  // leave by then is a DistBackendError naming `title`, the peer (called
  // `memberName` N) and the time limit `limit`.
  static void waitAll(const Posted& posted, const std::string& title, const std::string& memberName,
                      std::chrono::steady_clock::time_point deadline,
                      std::chrono::milliseconds limit);

  // Flat byte views of one tensor's pieces, `bytes[r]` long each, in order.
  static std::vector<at::Tensor> pieces(const at::Tensor& t, const std::vector<int64_t>& bytes);
  // A contiguous tensor's bytes, flat.
  static at::Tensor bytesOf(const at::Tensor& t);

  // Posts a receive of fromPeer[r] from each rank r and a send of toPeer[r]
  // to it (none for an empty piece); copies this rank's own piece locally.
  Posted post(const std::vector<at::Tensor>& toPeer, const std::vector<at::Tensor>& fromPeer) const;

 private:
  InnerRoute& p2p_;
  int tag_;
  int rank_;
  int size_;
};

}  // namespace xcomm
