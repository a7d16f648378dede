#include "observe/Timeline.hpp"

#include <chrono>
#include <cstdio>
#include <sstream>

namespace xcomm {
namespace {

// JSON string escaping for names and args (control characters as \u00XX).
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace

Timeline& Timeline::global() {
  static Timeline timeline;
  return timeline;
}

int64_t Timeline::nowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Timeline::setEnabled(bool enabled) {
  std::lock_guard<std::mutex> lock(mutex_);
  enabled_ = enabled;
}

bool Timeline::enabled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return enabled_;
}

void Timeline::add(TraceSpan span) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (enabled_) spans_.push_back(std::move(span));
}

std::vector<TraceSpan> Timeline::spans() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spans_;
}

void Timeline::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.clear();
}

std::string Timeline::toChromeJson(int pid) const {
  const auto spans = this->spans();
  std::map<std::string, int> tids;  // track -> tid, in order of first use
  for (const auto& s : spans) tids.emplace(s.track, static_cast<int>(tids.size()) + 1);

  std::ostringstream out;
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  auto sep = [&] {
    if (!first) out << ",";
    first = false;
  };
  sep();
  out << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << pid
      << ",\"tid\":0,\"args\":{\"name\":" << quoted("xcomm rank " + std::to_string(pid)) << "}}";
  for (const auto& [track, tid] : tids) {
    sep();
    out << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << pid << ",\"tid\":" << tid
        << ",\"args\":{\"name\":" << quoted(track) << "}}";
  }
  for (const auto& s : spans) {
    sep();
    out << "{\"name\":" << quoted(s.name) << ",\"cat\":" << quoted(s.category)
        << ",\"ph\":\"X\",\"pid\":" << pid << ",\"tid\":" << tids.at(s.track)
        << ",\"ts\":" << s.startUs << ",\"dur\":" << s.durationUs << ",\"args\":{";
    bool firstArg = true;
    for (const auto& [k, v] : s.args) {
      if (!firstArg) out << ",";
      firstArg = false;
      out << quoted(k) << ":" << quoted(v);
    }
    out << "}}";
  }
  out << "]}";
  return out.str();
}

}  // namespace xcomm
