#pragma once
// Catch assertions made on rank threads (tests that run one thread per
// rank). Include after <catch2/catch.hpp>.
#include <mutex>

// Catch2 v2 is not thread-safe: assertions made on rank threads take a lock.
inline std::mutex& catchMutex() {
  static std::mutex m;
  return m;
}
#define RANK_CHECK(...)                                  \
  do {                                                   \
    std::lock_guard<std::mutex> catchLock(catchMutex()); \
    CHECK(__VA_ARGS__);                                  \
  } while (0)
#define RANK_REQUIRE(...)                                \
  do {                                                   \
    std::lock_guard<std::mutex> catchLock(catchMutex()); \
    REQUIRE(__VA_ARGS__);                                \
  } while (0)
// Only for expressions that throw without blocking (they run under the lock).
#define RANK_CHECK_THROWS_WITH(expr, matcher)            \
  do {                                                   \
    std::lock_guard<std::mutex> catchLock(catchMutex()); \
    CHECK_THROWS_WITH(expr, matcher);                    \
  } while (0)
#define RANK_INFO_CHECK(message, ...)                    \
  do {                                                   \
    std::lock_guard<std::mutex> catchLock(catchMutex()); \
    INFO(message);                                       \
    CHECK(__VA_ARGS__);                                  \
  } while (0)
