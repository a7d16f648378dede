#pragma once
// The vocabulary of backend-level compression (xcomm.Options(compression=)):
// the methods, their names and the group's settings. Here, below both, so that
// the options (backend/XcommOptions) and the algorithms
// (collectives/compressed/) share it without including each other.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

namespace xcomm {

// kAuto: per allreduce, whichever of none, bf16 and int8 is predicted
// fastest (collectives/compressed/AutoCompression.hpp).
enum class Compression { kNone, kFp16, kBf16, kInt8, kAuto };

// Every value's name, in the enum's order: the one list of backend methods
// (bound as xcomm._C.compression_names(), which Options reads).
inline constexpr std::array<const char*, 5> kCompressionNames = {"none", "fp16", "bf16", "int8",
                                                                 "auto"};

inline const char* compressionName(Compression c) {
  const auto i = static_cast<size_t>(c);
  return i < kCompressionNames.size() ? kCompressionNames[i] : "?";
}

// The names, for an error: "none, fp16, bf16, int8, auto" (`quote`: each in
// single quotes; `withNone`: "none" included).
inline std::string compressionChoices(bool quote = false, bool withNone = true) {
  std::string out;
  for (const char* name : kCompressionNames) {
    if (!withNone && std::string(name) == "none") continue;
    if (!out.empty()) out += ", ";
    out += quote ? "'" + std::string(name) + "'" : std::string(name);
  }
  return out;
}

// A name (or "" for none) as its value; ValueError naming the choices otherwise.
inline Compression parseCompression(const std::string& name) {
  if (name.empty()) return Compression::kNone;
  for (size_t i = 0; i < kCompressionNames.size(); ++i) {
    if (name == kCompressionNames[i]) return static_cast<Compression>(i);
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
