#pragma once
// A point-to-point byte transport over a c10d::Store.
//
// Each message is one store key written by the sender and deleted by its only
// reader, so nothing accumulates in the store. It needs nothing but a Store,
// which makes it the transport of xcomm's C++-only path (LibTorch programs,
// the C++ tests); it is correct and simple, not fast: Python users get Gloo.
//
// A receive polls with check() rather than blocking in Store::wait: a
// TCPStore client holds its one connection for the whole of a wait, so a
// receive waiting on one thread would hold up a send on another, and two
// ranks that each wait before they send would wait for each other until the
// timeout.
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace xcomm {

class StoreTransport {
 public:
  StoreTransport(c10::intrusive_ptr<c10d::Store> store, int rank, int size);

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Posts `nbytes` at `data` for rank `dst` on `channel`; returns at once.
  void send(int dst, const std::string& channel, const void* data, size_t nbytes);

  // Blocks until rank `src` has posted on `channel` (or `timeout` passes),
  // copies the message into `data`, which must be exactly `nbytes` long.
  void recv(int src, const std::string& channel, void* data, size_t nbytes,
            std::chrono::milliseconds timeout);

  // Like recv, from whichever of `sources` posts first; returns that rank.
  // `channelFor(src)` names the channel to look at for each source.
  int recvAny(const std::vector<int>& sources, const std::function<std::string(int)>& channelFor,
              void* data, size_t nbytes, std::chrono::milliseconds timeout);

 private:
  std::string key(int src, int dst, const std::string& channel) const;
  // The index in `keys` of one that is posted, polling until `timeout`
  // passes; -1 if none is by then.
  int firstPosted(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) const;
  void take(const std::string& key, int src, void* data, size_t nbytes);

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
};

}  // namespace xcomm
