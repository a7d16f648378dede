#include "transport/StoreTransport.hpp"

#include <algorithm>
#include <cstring>
#include <thread>

#include <c10/util/Exception.h>

namespace xcomm {

StoreTransport::StoreTransport(c10::intrusive_ptr<c10d::Store> store, int rank, int size)
    : store_(std::move(store)), rank_(rank), size_(size) {
  TORCH_CHECK(store_, "xcomm: StoreTransport needs a store");
}

std::string StoreTransport::key(int src, int dst, const std::string& channel) const {
  return "xcomm/msg/" + channel + "/" + std::to_string(src) + "-" + std::to_string(dst);
}

void StoreTransport::send(int dst, const std::string& channel, const void* data, size_t nbytes) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  store_->set(key(rank_, dst, channel), std::vector<uint8_t>(bytes, bytes + nbytes));
}

void StoreTransport::take(const std::string& k, int src, void* data, size_t nbytes) {
  std::vector<uint8_t> value = store_->get(k);
  try {
    store_->deleteKey(k);
  } catch (const c10::Error&) {
    // The message is here; removing it is housekeeping. Its store may be gone
    // already when the peer hosting it finished (a barrier's last message),
    // and a channel is never read twice, so a leftover key is harmless.
  }
  TORCH_CHECK(value.size() == nbytes, "xcomm: rank ", src, " sent ", value.size(),
              " bytes where rank ", rank_, " expected ", nbytes,
              "; the ranks called the collective with tensors of different sizes or dtypes");
  if (nbytes > 0) {
    std::memcpy(data, value.data(), nbytes);
  }
}

int StoreTransport::firstPosted(const std::vector<std::string>& keys,
                                std::chrono::milliseconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // Short pauses first: on one host a message is usually a few microseconds
  // away; long waits back off to a millisecond between checks.
  auto pause = std::chrono::microseconds(10);
  while (true) {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (store_->check({keys[i]})) return static_cast<int>(i);
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return -1;
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

void StoreTransport::recv(int src, const std::string& channel, void* data, size_t nbytes,
                          std::chrono::milliseconds timeout) {
  const std::string k = key(src, rank_, channel);
  TORCH_CHECK(firstPosted({k}, timeout) == 0, "xcomm: timed out after ", timeout.count(),
              " ms waiting for rank ", src, " (", channel,
              "); the peer is dead, stuck, or called a different collective");
  take(k, src, data, nbytes);
}

int StoreTransport::recvAny(const std::vector<int>& sources,
                            const std::function<std::string(int)>& channelFor, void* data,
                            size_t nbytes, std::chrono::milliseconds timeout) {
  std::vector<std::string> keys;
  for (int src : sources) keys.push_back(key(src, rank_, channelFor(src)));
  const int i = firstPosted(keys, timeout);
  TORCH_CHECK(i >= 0, "xcomm: timed out after ", timeout.count(),
              " ms in recv from any source; no peer sent a message");
  take(keys[i], sources[i], data, nbytes);
  return sources[i];
}

}  // namespace xcomm
