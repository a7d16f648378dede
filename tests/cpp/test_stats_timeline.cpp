// StatsRegistry and Timeline: exact totals under concurrent recording, reset,
// and the Chrome trace JSON's structure.
#include <thread>
#include <vector>

#include "observe/Stats.hpp"
#include "observe/Timeline.hpp"

#include <catch2/catch.hpp>

using Catch::Contains;

TEST_CASE("StatsRegistry sums exactly under concurrent records and resets", "[stats]") {
  xcomm::StatsRegistry registry;
  constexpr int kThreads = 8;
  constexpr int kPerThread = 5000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&registry, t] {
      for (int i = 0; i < kPerThread; ++i) {
        registry.record(t % 2 ? "ALLREDUCE" : "BROADCAST", 8, 2, 0.5, 0.25);
      }
    });
  }
  for (auto& th : threads) th.join();
  auto snap = registry.snapshot();
  REQUIRE(snap.size() == 2);
  const auto& ar = snap.at("ALLREDUCE");
  CHECK(ar.calls == kThreads / 2 * kPerThread);
  CHECK(ar.bytesIn == 8ull * ar.calls);
  CHECK(ar.bytesOnWire == 2ull * ar.calls);
  CHECK(ar.queuedSeconds == Approx(0.5 * ar.calls));
  CHECK(ar.wireSeconds == Approx(0.25 * ar.calls));
  registry.reset();
  CHECK(registry.snapshot().empty());
}

TEST_CASE("Timeline records only while enabled and writes trace-event JSON", "[timeline]") {
  xcomm::Timeline timeline;
  timeline.add({"dropped", "c", "t", 0, 1, {}});
  CHECK(timeline.spans().empty());
  timeline.setEnabled(true);
  timeline.add({"enc\"ode", "encode", "track A", 10, 5, {{"bucket", "0"}}});
  timeline.add({"transfer", "transfer", "track B", 12, 7, {}});
  REQUIRE(timeline.spans().size() == 2);
  const std::string json = timeline.toChromeJson(3);
  CHECK_THAT(json, Contains("{\"displayTimeUnit\":\"ms\",\"traceEvents\":["));
  CHECK_THAT(json, Contains("\"name\":\"enc\\\"ode\""));  // escaped quote
  CHECK_THAT(json, Contains("\"ph\":\"X\",\"pid\":3,\"tid\":1,\"ts\":10,\"dur\":5"));
  CHECK_THAT(json, Contains("\"ph\":\"X\",\"pid\":3,\"tid\":2,\"ts\":12,\"dur\":7"));
  CHECK_THAT(json, Contains("\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":3,\"tid\":2,"
                            "\"args\":{\"name\":\"track B\"}"));
  timeline.clear();
  CHECK(timeline.spans().empty());
}
