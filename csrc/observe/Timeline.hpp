#pragma once
// A process-wide timeline of spans, written as Chrome trace-event JSON
// ({"traceEvents": [...]}, complete "X" events in microseconds) that
// chrome://tracing and Perfetto load. Each span sits on a named track; each
// track becomes a thread (tid) with a thread_name metadata event.
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace xcomm {

struct TraceSpan {
  std::string name;
  std::string category;
  std::string track;
  int64_t startUs = 0;
  int64_t durationUs = 0;
  std::map<std::string, std::string> args;
};

class Timeline {
 public:
  static Timeline& global();

  // Microseconds on the monotonic clock (CLOCK_MONOTONIC, as Python's
  // time.monotonic_ns), the time base of every span.
  static int64_t nowUs();

  void setEnabled(bool enabled);
  bool enabled() const;
  // Dropped silently while disabled, so callers need no check of their own.
  void add(TraceSpan span);
  std::vector<TraceSpan> spans() const;
  void clear();
  // The trace; `pid` names the process track (use the rank).
  std::string toChromeJson(int pid) const;

 private:
  mutable std::mutex mutex_;
  bool enabled_ = false;
  std::vector<TraceSpan> spans_;
};

}  // namespace xcomm
