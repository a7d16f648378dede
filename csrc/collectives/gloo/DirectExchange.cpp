#include "collectives/gloo/DirectExchange.hpp"

#include <algorithm>
#include <utility>

#include <c10/util/Exception.h>

#include "common/ErrorText.hpp"

namespace xcomm {

DirectExchange::DirectExchange(InnerRoute& p2p, int tag)
    : p2p_(p2p), tag_(tag), rank_(p2p.rank()), size_(p2p.size()) {}

at::Tensor DirectExchange::bytesOf(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "DirectExchange: tensors must be contiguous");
  return t.reshape({-1}).view(at::kByte);
}

std::vector<at::Tensor> DirectExchange::pieces(const at::Tensor& t,
                                               const std::vector<int64_t>& bytes) {
  const at::Tensor flat = bytesOf(t);
  std::vector<at::Tensor> out;
  int64_t at = 0;
  for (int64_t n : bytes) {
    out.push_back(flat.narrow(0, at, n));
    at += n;
  }
  return out;
}

DirectExchange::Posted DirectExchange::post(const std::vector<at::Tensor>& toPeer,
                                            const std::vector<at::Tensor>& fromPeer) const {
  TORCH_CHECK(
      static_cast<int>(toPeer.size()) == size_ && static_cast<int>(fromPeer.size()) == size_,
      "DirectExchange: one piece per rank");
  Posted posted;
  // Receives first, so each peer's message finds its buffer waiting. Peers
  // in ring order from this rank: everyone starts on a different peer.
  for (int i = 1; i < size_; ++i) {
    const int r = (rank_ + size_ - i) % size_;
    if (fromPeer[r].numel() == 0) continue;
    std::vector<at::Tensor> in{fromPeer[r]};
    posted.works.push_back(p2p_.recv(in, r, tag_));
    posted.peers.push_back(r);
  }
  for (int i = 1; i < size_; ++i) {
    const int r = (rank_ + i) % size_;
    if (toPeer[r].numel() == 0) continue;
    std::vector<at::Tensor> out{toPeer[r]};
    posted.works.push_back(p2p_.send(out, r, tag_));
    posted.peers.push_back(r);
  }
  // This rank's own piece while the messages travel.
  if (toPeer[rank_].numel() > 0) fromPeer[rank_].copy_(toPeer[rank_]);
  return posted;
}

DirectExchange::Posted DirectExchange::postAlltoall(const at::Tensor& output,
                                                    const at::Tensor& input,
                                                    const std::vector<int64_t>& sendBytes,
                                                    const std::vector<int64_t>& recvBytes) const {
  return post(pieces(input, sendBytes), pieces(output, recvBytes));
}

DirectExchange::Posted DirectExchange::postAlltoall(const std::vector<at::Tensor>& outputs,
                                                    const std::vector<at::Tensor>& inputs) const {
  std::vector<at::Tensor> to;
  std::vector<at::Tensor> from;
  for (const auto& t : inputs) to.push_back(bytesOf(t));
  for (const auto& t : outputs) from.push_back(bytesOf(t));
  return post(to, from);
}

DirectExchange::Posted DirectExchange::postAllgather(const at::Tensor& output,
                                                     const at::Tensor& input) const {
  const at::Tensor mine = bytesOf(input);
  return post(std::vector<at::Tensor>(size_, mine),
              pieces(output, std::vector<int64_t>(size_, mine.numel())));
}

DirectExchange::Posted DirectExchange::postAllgather(const std::vector<at::Tensor>& outputs,
                                                     const at::Tensor& input) const {
  std::vector<at::Tensor> from;
  for (const auto& t : outputs) from.push_back(bytesOf(t));
  return post(std::vector<at::Tensor>(size_, bytesOf(input)), from);
}

void DirectExchange::waitAll(const Posted& posted, const std::string& title,
                             const std::string& memberName,
                             std::chrono::steady_clock::time_point deadline,
                             std::chrono::milliseconds limit) {
  // Each message gets what is left of the time; the first failure is raised
  // once every message was waited for.
  std::exception_ptr first;
  for (size_t i = 0; i < posted.works.size(); ++i) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    try {
      posted.works[i]->wait(std::max(left, std::chrono::milliseconds(1)));
    } catch (const std::exception& e) {
      if (first) continue;
      try {
        // Time since the op's limit began, which is when its messages were posted.
        const auto elapsed = limit - std::chrono::duration_cast<std::chrono::milliseconds>(
                                         deadline - std::chrono::steady_clock::now());
        if (elapsed.count() * 10 < limit.count() * 9) {
          C10_THROW_ERROR(DistBackendError,
                          c10::str("xcomm.", title, ": ",
                                   peerFailure(memberName, posted.peers[i], elapsed, limit),
                                   " during the transfer (the peer died or left): ", messageOf(e)));
        }
        C10_THROW_ERROR(DistBackendError,
                        c10::str("xcomm.", title, ": the transfer with ", memberName, " ",
                                 posted.peers[i], " did not complete within ", limit.count(),
                                 " ms (the peer died, hangs, or stopped reading): ", messageOf(e)));
      } catch (...) {
        first = std::current_exception();
      }
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace xcomm
