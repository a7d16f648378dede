#include "backend/GroupSettings.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <sstream>

#include <c10/util/Exception.h>

#include "backend/StoreText.hpp"
#include "collectives/compressed/AutoCompression.hpp"
#include "transport/HostIdentity.hpp"

namespace xcomm {
namespace {

using StorePtr = c10::intrusive_ptr<c10d::Store>;

// The first field of every record: a record of another format (another
// xcomm version, or not xcomm's at all) is named as such.
constexpr const char* kMagic = "xcomm-settings/1";
constexpr char kSeparator = '\0';  // cannot occur in an environment variable
constexpr const char* kUnset = "unset";
constexpr const char* kNotApplicable = "-";

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

// 0/false/off/no (any case, surrounding blanks ignored) turn a switch off.
bool envSwitch(const char* name) {
  const char* value = env(name);
  if (!value) return true;
  std::string v(value);
  v.erase(0, v.find_first_not_of(" \t"));
  v.erase(v.find_last_not_of(" \t") + 1);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  return !(v == "0" || v == "false" || v == "off" || v == "no");
}

int64_t envInt(const char* name, int64_t fallback) {
  const char* value = env(name);
  if (!value) return fallback;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK_VALUE(end && *end == '\0', "xcomm: ", name, " must be an integer, got '", value, "'");
  return parsed;
}

// XCOMM_AUTO_METHODS ("none,bf16"), else the option's list.
std::vector<Compression> autoMethodsOf(const XcommOptions& options) {
  const char* methods = env("XCOMM_AUTO_METHODS");
  if (!methods) return options.compression.autoMethods;
  std::vector<std::string> names;
  std::stringstream list(methods);
  std::string name;
  while (std::getline(list, name, ',')) names.push_back(name);
  return AutoCompression::methodsNamed(names, "XCOMM_AUTO_METHODS (comma-separated)");
}

std::string number(double value) {
  std::ostringstream out;
  out.precision(17);
  out << value;
  return out.str();
}

std::string yesNo(bool value) {
  return value ? "on" : "off";
}

// 64-bit FNV-1a: the same digest on every rank and build, unlike std::hash.
uint64_t digest(const std::vector<std::string>& records) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& record : records) {
    for (unsigned char c : record) {
      h ^= c;
      h *= 1099511628211ull;
    }
    h ^= 0xff;  // a record boundary
    h *= 1099511628211ull;
  }
  return h;
}

std::vector<std::string> split(const std::string& record) {
  std::vector<std::string> fields;
  size_t start = 0;
  while (true) {
    const size_t end = record.find(kSeparator, start);
    fields.push_back(
        record.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return fields;
    start = end + 1;
  }
}

// What a record the store gave back for `rank` looks like in an error:
// printable, and short.
std::string shown(const std::string& record) {
  std::string out;
  for (char c : record.substr(0, 60)) out += std::isprint(static_cast<unsigned char>(c)) ? c : '?';
  return "'" + out + (record.size() > 60 ? "...'" : "'");
}

// A rank's record as read from the store.
struct Record {
  std::string error;  // the rank could not read its own settings
  std::vector<std::pair<std::string, std::string>> shared;
  std::string host;
};

Record parse(const std::string& raw, int rank, const std::string& key) {
  const auto fields = split(raw);
  Record record;
  const bool known = !fields.empty() && fields[0] == kMagic;
  TORCH_CHECK_VALUE(known, "xcomm: rank ", rank, "'s set-up record (store key '", key, "') is ",
                    shown(raw),
                    ", not one this xcomm wrote: another xcomm version, or another process wrote "
                    "to this group's keys in the store");
  if (fields.size() == 3 && fields[1] == "error") {
    record.error = fields[2];
    return record;
  }
  for (size_t i = 1; i < fields.size(); ++i) {
    const auto eq = fields[i].find('=');
    TORCH_CHECK_VALUE(eq != std::string::npos, "xcomm: rank ", rank,
                      "'s set-up record (store key '", key, "') has a field ", shown(fields[i]),
                      " with no '='");
    std::string name = fields[i].substr(0, eq);
    std::string value = fields[i].substr(eq + 1);
    if (name == "host") {
      record.host = std::move(value);
    } else {
      record.shared.emplace_back(std::move(name), std::move(value));
    }
  }
  return record;
}

// Every rank's value of one setting, for an error: "rank 0 'int8', rank 1
// 'none'" (ranks with the same value grouped).
std::string everyRanksValue(const std::vector<Record>& records, size_t index) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(records.size()); ++r) {
    const auto& value = records[r].shared[index].second;
    auto it =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == value; });
    if (it == groups.end()) {
      groups.push_back({value, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  std::ostringstream out;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (g > 0) out << "; ";
    const auto& ranks = groups[g].second;
    out << (ranks.size() > 1 ? "ranks " : "rank ");
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (i == 4 && ranks.size() > 5) {
        out << ", ... (" << ranks.size() << " ranks)";
        break;
      }
      out << (i > 0 ? ", " : "") << ranks[i];
    }
    out << " " << (groups[g].first == kUnset ? std::string(kUnset) : "'" + groups[g].first + "'");
  }
  return out.str();
}

}  // namespace

GroupSettings GroupSettings::fromEnvironment(const XcommOptions& options, int size,
                                             bool mayUseShm) {
  GroupSettings s;
  s.shm = mayUseShm && options.shm && envSwitch("XCOMM_SHM");
  if (s.shm && size > 1) {
    s.shmHierarchical = envSwitch("XCOMM_SHM_HIERARCHICAL");
    s.shmSlotBytes = envInt("XCOMM_SHM_SLOT_BYTES", -1);
    s.shmSmallBytes = envInt("XCOMM_SHM_SMALL_BYTES", -1);
    s.shmSpinMicros = envInt("XCOMM_SHM_SPIN_US", -1);
    TORCH_CHECK_VALUE(s.shmSpinMicros >= -1, "xcomm: XCOMM_SHM_SPIN_US must be >= 0, got ",
                      s.shmSpinMicros);
    TORCH_CHECK_VALUE(s.shmSlotBytes == -1 || s.shmSlotBytes > 0,
                      "xcomm: XCOMM_SHM_SLOT_BYTES must be > 0, got ", s.shmSlotBytes);
    TORCH_CHECK_VALUE(s.shmSmallBytes >= -1, "xcomm: XCOMM_SHM_SMALL_BYTES must be >= 0, got ",
                      s.shmSmallBytes);
  }
  if (options.checkCollectives && size > 1) s.directExchange = envSwitch("XCOMM_DIRECT_EXCHANGE");
  if (options.compression.method == Compression::kAuto) {
    // The variables override the options' auto_methods / auto_link.
    s.autoMethods = autoMethodsOf(options);
    s.autoLinkLatency = options.compression.autoLinkLatency;
    s.autoLinkBytesPerSecond = options.compression.autoLinkBytesPerSecond;
    if (const char* link = env("XCOMM_AUTO_LINK")) {
      char* end = nullptr;
      s.autoLinkLatency = std::strtod(link, &end);
      const bool comma = end != nullptr && *end == ',';
      if (comma) s.autoLinkBytesPerSecond = std::strtod(end + 1, &end);
      TORCH_CHECK_VALUE(comma && end != nullptr && *end == '\0' && s.autoLinkLatency >= 0 &&
                            s.autoLinkBytesPerSecond > 0,
                        "xcomm: XCOMM_AUTO_LINK must be '<latency seconds>,<bytes per second>' "
                        "with latency >= 0 and bandwidth > 0, got '",
                        link, "'");
    }
  }
  return s;
}

std::vector<std::pair<std::string, std::string>> GroupSettings::shared(const XcommOptions& options,
                                                                       int size,
                                                                       bool mayUseShm) const {
  const auto& c = options.compression;
  const bool compressing = c.method != Compression::kNone;
  const bool shmSettings = shm && size > 1;
  const bool optionsShm = mayUseShm && options.shm && size > 1;
  const bool checked = options.checkCollectives && size > 1;
  const bool isAuto = c.method == Compression::kAuto;
  const bool fusing = options.fusionThresholdBytes > 0;
  auto orUnset = [](int64_t v) { return v < 0 ? std::string(kUnset) : std::to_string(v); };
  std::string methods = kUnset;
  if (!autoMethods.empty()) {
    methods.clear();
    for (Compression m : autoMethods)
      methods += (methods.empty() ? "" : ",") + std::string(compressionName(m));
  }
  const std::string link = autoLinkBytesPerSecond > 0
                               ? number(autoLinkLatency) + "," + number(autoLinkBytesPerSecond)
                               : std::string(kUnset);
  const std::string na = kNotApplicable;
  return {
      {"Options.compression", compressionName(c.method)},
      {"Options.compression_min_bytes", compressing ? std::to_string(c.minBytes) : na},
      {"Options.int8_chunk_elems", compressing ? std::to_string(c.int8ChunkElems) : na},
      {"Options.shm", yesNo(mayUseShm && options.shm)},
      {"Options.shm_hierarchical", optionsShm ? yesNo(options.shmHierarchical) : na},
      {"Options.shm_slot_bytes", optionsShm ? orUnset(options.shmSlotBytes) : na},
      {"Options.shm_small_bytes", optionsShm ? orUnset(options.shmSmallBytes) : na},
      {"Options.check_collectives", yesNo(options.checkCollectives)},
      {"Options.carry_small_ops", checked ? yesNo(options.carrySmallOps) : na},
      {"Options.direct_exchange", checked ? yesNo(options.directExchange) : na},
      {"Options.fusion_threshold_bytes", std::to_string(options.fusionThresholdBytes)},
      {"Options.fusion_cycle_ms",
       fusing ? std::to_string(options.fusionCycle().count()) + " us" : na},
      {"XCOMM_SHM", mayUseShm && options.shm ? yesNo(shm) : na},
      {"XCOMM_SHM_HIERARCHICAL", shmSettings ? yesNo(shmHierarchical) : na},
      {"XCOMM_SHM_SLOT_BYTES", shmSettings ? orUnset(shmSlotBytes) : na},
      {"XCOMM_SHM_SMALL_BYTES", shmSettings ? orUnset(shmSmallBytes) : na},
      {"XCOMM_DIRECT_EXCHANGE", checked ? yesNo(directExchange) : na},
      {"XCOMM_AUTO_METHODS", isAuto ? methods : na},
      {"XCOMM_AUTO_LINK", isAuto ? link : na},
  };
}

std::string GroupSettings::describe() const {
  std::ostringstream out;
  if (!shmHierarchical) out << "XCOMM_SHM_HIERARCHICAL: off\n";
  if (shmSlotBytes >= 0) out << "XCOMM_SHM_SLOT_BYTES: " << shmSlotBytes << "\n";
  if (shmSmallBytes >= 0) out << "XCOMM_SHM_SMALL_BYTES: " << shmSmallBytes << "\n";
  if (shmSpinMicros >= 0) out << "XCOMM_SHM_SPIN_US: " << shmSpinMicros << " (this rank's)\n";
  if (!directExchange) out << "XCOMM_DIRECT_EXCHANGE: off\n";
  if (!autoMethods.empty()) {
    out << "XCOMM_AUTO_METHODS:";
    for (Compression m : autoMethods) out << " " << compressionName(m);
    out << "\n";
  }
  if (autoLinkBytesPerSecond > 0) {
    out << "XCOMM_AUTO_LINK: " << number(autoLinkLatency) << " s latency, "
        << number(autoLinkBytesPerSecond) << " bytes/s\n";
  }
  return out.str();
}

AgreedSettings agreeGroupSettings(const StorePtr& store, int rank, int size,
                                  const XcommOptions& options, bool mayUseShm) {
  AgreedSettings agreed;
  if (size < 2) {
    agreed.settings = GroupSettings::fromEnvironment(options, size, mayUseShm);
    return agreed;
  }
  // This rank's record: its shared settings and host identity, or the
  // error its environment gave (published all the same, so that no peer
  // waits for a record that never comes).
  std::string mine = kMagic;
  std::string myError;
  try {
    agreed.settings = GroupSettings::fromEnvironment(options, size, mayUseShm);
    for (const auto& [name, value] : agreed.settings.shared(options, size, mayUseShm)) {
      mine += kSeparator + name + "=" + value;
    }
    if (agreed.settings.shm) mine += kSeparator + std::string("host=") + hostIdentity();
  } catch (const c10::Error& e) {
    myError = e.msg();
    mine = std::string(kMagic) + kSeparator + "error" + kSeparator + myError;
  }
  const auto key = [](const char* what, int r) { return std::string(what) + std::to_string(r); };
  const auto keysOf = [&](const char* what) {
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back(key(what, r));
    return keys;
  };
  setStoreText(store, key("settings/", rank), mine);
  const std::vector<std::string> raw = getStoreTexts(store, keysOf("settings/"));

  // From here on every step is a function of `raw` alone: ranks that read the
  // same records reach the same verdict.
  std::string verdict;
  std::vector<Record> records(size);
  try {
    for (int r = 0; r < size; ++r) records[r] = parse(raw[r], r, key("settings/", r));
    for (int r = 0; r < size; ++r) {
      TORCH_CHECK_VALUE(records[r].error.empty(), records[r].error, " (on rank ", r, ")");
    }
    for (int r = 1; r < size; ++r) {
      TORCH_CHECK_VALUE(records[r].shared.size() == records[0].shared.size(), "xcomm: rank ", r,
                        " and rank 0 publish different sets of settings (",
                        records[r].shared.size(), " against ", records[0].shared.size(),
                        "): are they running different xcomm versions?");
      for (size_t i = 0; i < records[0].shared.size(); ++i) {
        TORCH_CHECK_VALUE(records[r].shared[i].first == records[0].shared[i].first, "xcomm: rank ",
                          r, " and rank 0 publish different settings ('",
                          records[r].shared[i].first, "' against '", records[0].shared[i].first,
                          "'): are they running different xcomm versions?");
      }
    }
    for (size_t i = 0; i < records[0].shared.size(); ++i) {
      const bool same = std::all_of(records.begin(), records.end(), [&](const Record& rec) {
        return rec.shared[i].second == records[0].shared[i].second;
      });
      TORCH_CHECK_VALUE(same, "xcomm: the ranks of this group differ on ",
                        records[0].shared[i].first, " (", everyRanksValue(records, i),
                        "); it changes which collectives a rank issues, so every rank must have "
                        "the same: set it alike on every rank (or on none)");
    }
    verdict = "ok:" + std::to_string(digest(raw));
  } catch (const c10::Error& e) {
    verdict = "error:" + e.msg();
  }

  // Second round: the ranks compare what they read. Equal digests mean equal
  // inputs, so equal plans; anything else fails every rank with the first
  // rank's error (or says that the records changed while being read).
  setStoreText(store, key("verdict/", rank), verdict);
  const std::vector<std::string> verdicts = getStoreTexts(store, keysOf("verdict/"));
  for (int r = 0; r < size; ++r) {
    if (verdicts[r].rfind("error:", 0) == 0) {
      TORCH_CHECK_VALUE(false, verdicts[r].substr(6));
    }
  }
  for (int r = 0; r < size; ++r) {
    TORCH_CHECK_VALUE(verdicts[r] == verdicts[0], "xcomm: rank ", r, " and rank 0 read different ",
                      "set-up records from the store (digests ", shown(verdicts[r]), " and ",
                      shown(verdicts[0]),
                      "): a record changed while the ranks read it; another process writes to this "
                      "group's keys in the store");
  }
  if (agreed.settings.shm) {
    for (const auto& record : records) agreed.hostIds.push_back(record.host);
  }
  return agreed;
}

}  // namespace xcomm
