#pragma once
// Text values in a c10d::Store, for the set-up records the group builder and
// the settings agreement exchange.
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace xcomm {

inline void setStoreText(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key,
                         const std::string& value) {
  store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

// Waits for `key` as the store does (its timeout).
inline std::string getStoreText(const c10::intrusive_ptr<c10d::Store>& store,
                                const std::string& key) {
  const auto bytes = store->get(key);
  return std::string(bytes.begin(), bytes.end());
}

}  // namespace xcomm
