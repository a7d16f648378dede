#pragma once
// Every compression method xcomm knows, listed once: its name, whether it is
// exact, whether auto chooses among it by default, whether its codec needs the
// host where xcomm's CUDA kernels are not built, and where it runs. The
// backend's enum (common/Compression.hpp), the cost model's and calibration's
// errors and, through xcomm._C.methods(), every Python list of method names
// (python/xcomm/hooks/_methods.py) are questions to this table.
//
// Order: cheapest codec first. Every chooser breaks ties towards the earlier
// method, DiLoCo agrees on a method by its index, and the backend's enum
// follows it, so the order is part of the contract.
#include <array>
#include <cstdint>
#include <string>

namespace xcomm {

// Where a method runs (bits of MethodInfo::surfaces).
enum MethodSurface : uint8_t {
  kDdpSurface = 1,      // auto_hook can choose it; each also has a hook of its own
  kFsdpSurface = 2,     // compress_reduce_scatter (FSDP2)
  kDilocoSurface = 4,   // DiLoCo's outer allreduce
  kBackendSurface = 8,  // Options(compression=)
};

struct MethodInfo {
  const char* name;
  bool lossless;
  // auto chooses among it unless told otherwise. fp16 is left out: bf16 sends
  // the same bytes without its range limit.
  bool inDefault;
  // Where xcomm was built without its CUDA codec kernels, its codec runs on
  // the host for a GPU bucket (a cast runs on the device with torch's ops).
  bool hostOnly;
  uint8_t surfaces;
};

inline constexpr uint8_t kEverySurface =
    kDdpSurface | kFsdpSurface | kDilocoSurface | kBackendSurface;

inline constexpr std::array<MethodInfo, 6> kMethodTable = {{
    {"none", true, true, false, kEverySurface},
    {"bf16", false, true, false, kEverySurface},
    {"fp16", false, false, false, kEverySurface},
    {"int8", false, true, true, kEverySurface},
    {"topk", false, true, true, kDdpSurface},
    {"powersgd", false, true, true, kDdpSurface},
}};

// The names of the methods that run on `surface` (`lossyOnly`: without the
// exact one), joined by ", " for an error.
inline std::string methodChoices(MethodSurface surface, bool lossyOnly = false) {
  std::string out;
  for (const auto& m : kMethodTable) {
    if (!(m.surfaces & surface) || (lossyOnly && m.lossless)) continue;
    if (!out.empty()) out += ", ";
    out += m.name;
  }
  return out;
}

// Compile-time string equality, for the checks that tie an enum to the table.
constexpr bool sameName(const char* a, const char* b) {
  while (*a && *a == *b) {
    ++a;
    ++b;
  }
  return *a == *b;
}

}  // namespace xcomm
