#pragma once
// The vocabulary of backend-level compression (xcomm.Options(compression=)):
// the methods, their names and the group's settings. Here, below both, so that
// the options (backend/XcommOptions) and the algorithms
// (collectives/compressed/) share it without including each other.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "common/Methods.hpp"

namespace xcomm {

// The backend's methods, in the table's order (common/Methods.hpp: the
// first four methods are the backend's, checked below), then kAuto: per
// allreduce, whichever of none, bf16 and int8 is predicted fastest
// (collectives/compressed/AutoCompression.hpp).
enum class Compression { kNone, kBf16, kFp16, kInt8, kAuto };

inline constexpr size_t kBackendMethodCount = static_cast<size_t>(Compression::kAuto);

constexpr bool backendMethodIs(Compression c, const char* name) {
  const auto& m = kMethodTable[static_cast<size_t>(c)];
  return (m.surfaces & kBackendSurface) && sameName(m.name, name);
}
static_assert(backendMethodIs(Compression::kNone, "none") &&
                  backendMethodIs(Compression::kBf16, "bf16") &&
                  backendMethodIs(Compression::kFp16, "fp16") &&
                  backendMethodIs(Compression::kInt8, "int8"),
              "Compression's methods must be kMethodTable's first entries, in its order");
static_assert(!(kMethodTable[kBackendMethodCount].surfaces & kBackendSurface),
              "a backend method in kMethodTable has no Compression value");

constexpr const char* compressionName(Compression c) {
  if (c == Compression::kAuto) return "auto";
  const auto i = static_cast<size_t>(c);
  return i < kBackendMethodCount ? kMethodTable[i].name : "?";
}

// Options(compression=)'s names: the backend's methods, then "auto" (bound as
// xcomm._C.compression_names(), which Options reads).
inline std::vector<std::string> compressionNames() {
  std::vector<std::string> names;
  for (size_t i = 0; i <= kBackendMethodCount; ++i) {
    names.emplace_back(compressionName(static_cast<Compression>(i)));
  }
  return names;
}

// The names, for an error: "none, bf16, fp16, int8, auto" (`quote`: each in
// single quotes; `withNone`: "none" included).
inline std::string compressionChoices(bool quote = false, bool withNone = true) {
  std::string out;
  for (const auto& name : compressionNames()) {
    if (!withNone && name == "none") continue;
    if (!out.empty()) out += ", ";
    out += quote ? "'" + name + "'" : name;
  }
  return out;
}

// A name (or "" for none) as its value; ValueError naming the choices otherwise.
inline Compression parseCompression(const std::string& name) {
  if (name.empty()) return Compression::kNone;
  for (size_t i = 0; i <= kBackendMethodCount; ++i) {
    const auto c = static_cast<Compression>(i);
    if (name == compressionName(c)) return c;
  }
  TORCH_CHECK_VALUE(false, "xcomm: unknown allreduce compression '", name, "'; choose one of ",
                    compressionChoices());
}

// fp16 or bf16: a cast to the low precision, the transport's own SUM.
inline bool isCast(Compression c) {
  return c == Compression::kFp16 || c == Compression::kBf16;
}

// Elements per float32 scale of int8 unless a caller says otherwise: the one
// default of every int8 path (Int8Codec, Options, hooks, FSDP2 and DiLoCo
// read it, Python through xcomm._C.Int8Codec.DEFAULT_CHUNK_ELEMS).
inline constexpr int64_t kDefaultInt8ChunkElems = 1024;

struct CompressionConfig {
  Compression method = Compression::kNone;
  int64_t minBytes = 64 * 1024;
  int64_t int8ChunkElems = kDefaultInt8ChunkElems;
  // auto's bounds, from XCOMM_AUTO_METHODS / XCOMM_AUTO_LINK as every rank
  // agreed them (backend/GroupSettings): the methods it may choose (empty:
  // all it knows), and a link fixed instead of probed (0 bytes/s: probe).
  std::vector<Compression> autoMethods;
  double autoLinkLatency = 0;
  double autoLinkBytesPerSecond = 0;

  void validate() const {
    TORCH_CHECK_VALUE(minBytes >= 0, "xcomm: compression_min_bytes must be >= 0, got ", minBytes);
    TORCH_CHECK_VALUE(int8ChunkElems > 0, "xcomm: int8_chunk_elems must be > 0, got ",
                      int8ChunkElems);
  }
};

}  // namespace xcomm
