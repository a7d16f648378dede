#pragma once
// The vocabulary of backend-level compression (xcomm.Options(compression=)):
// the methods, their names and the group's settings. Here, below both, so that
// the options (backend/XcommOptions) and the algorithms
// (collectives/compressed/) share it without including each other.
#include <cstdint>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

namespace xcomm {

// kAuto: per allreduce, whichever of none, bf16 and int8 is predicted
// fastest (collectives/compressed/AutoCompression.hpp).
enum class Compression { kNone, kFp16, kBf16, kInt8, kAuto };

// "none", "fp16", "bf16", "int8", "auto" (ValueError naming the choices otherwise).
inline Compression parseCompression(const std::string& name) {
  if (name.empty() || name == "none") return Compression::kNone;
  if (name == "fp16") return Compression::kFp16;
  if (name == "bf16") return Compression::kBf16;
  if (name == "int8") return Compression::kInt8;
  if (name == "auto") return Compression::kAuto;
  TORCH_CHECK_VALUE(false, "xcomm: unknown allreduce compression '", name,
                    "'; choose one of none, fp16, bf16, int8, auto");
}

inline const char* compressionName(Compression c) {
  switch (c) {
    case Compression::kNone:
      return "none";
    case Compression::kFp16:
      return "fp16";
    case Compression::kBf16:
      return "bf16";
    case Compression::kInt8:
      return "int8";
    case Compression::kAuto:
      return "auto";
  }
  return "?";
}

// fp16 or bf16: a cast to the low precision, the transport's own SUM.
inline bool isCast(Compression c) {
  return c == Compression::kFp16 || c == Compression::kBf16;
}

struct CompressionConfig {
  // Int8Codec::kDefaultChunkElems (asserted equal where both are seen,
  // CompressedAllreduce.cpp), spelled out so this floor needs no codec.
  static constexpr int64_t kDefaultInt8ChunkElems = 1024;

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
