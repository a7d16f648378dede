#pragma once
// Text values in a c10d::Store, for the set-up records the group builder and
// the settings agreement exchange, and the members' statements a shrink and a
// reconfigure agree through.
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/ErrorText.hpp"

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

// Waits for every key as the store does (its timeout), then reads them in
// one request where the store has one (TCPStore: one round trip for the
// lot, where a get per key costs two each).
inline std::vector<std::string> getStoreTexts(const c10::intrusive_ptr<c10d::Store>& store,
                                              const std::vector<std::string>& keys) {
  std::vector<std::string> texts;
  texts.reserve(keys.size());
  for (const auto& bytes : store->multiGet(keys)) texts.emplace_back(bytes.begin(), bytes.end());
  return texts;
}

// One round of statements: this member states `mine` under `prefix + me`;
// once every member of `members` has (the wait ends at `timeout`), returns
// their statements in `members`' order. A member that does not come in time
// is a DistBackendError with the text `late(why)`.
inline std::vector<std::string> exchangeStoreTexts(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int64_t me,
    const std::string& mine, const std::vector<int64_t>& members, std::chrono::milliseconds timeout,
    const std::function<std::string(const std::string&)>& late) {
  setStoreText(store, prefix + std::to_string(me), mine);
  std::vector<std::string> keys;
  for (auto member : members) keys.push_back(prefix + std::to_string(member));
  try {
    store->wait(keys, timeout);
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, late(messageOf(e)));
  }
  return getStoreTexts(store, keys);
}

}  // namespace xcomm
