#pragma once
// The codecs' inner loops, compiled once per CPU instruction set and picked at
// run time (as ATen does with its DEFAULT / AVX2 / AVX512 kernels).
//
// Every kernel gives the same bits whichever instruction set runs it: the
// loops keep each element's arithmetic in program order, never contract a
// multiply and an add into an FMA (built with -ffp-contract=off), and only
// reduce with max, whose result does not depend on the order. So ranks on
// different CPUs still agree bit for bit.
//
// All kernels work on float32 ranges [begin, end); the codecs split a bucket
// into ranges and run them in parallel.
#include <cstdint>

namespace xcomm {
namespace kernels {

struct CodecKernels {
  const char* isa;  // "default", "avx2" or "avx512"

  // int8 quantization of chunks [c0, c1) of a shard whose first `valid`
  // elements are real; q entries from `valid` up to `qLen` are written as 0.
  // With `residual` (error feedback): quantizes src + residual and leaves
  // residual = (src + residual) - dequant(q), in the same pass.
  // A chunk holding NaN/Inf gets scale NaN and q = 0.
  void (*int8Encode)(const float* src, float* residual, int64_t valid, int64_t qLen, int64_t chunk,
                     int64_t c0, int64_t c1, int8_t* q, float* scales);
  // dst[i] = q[i] * scale of its chunk, for chunks [c0, c1), i < valid.
  void (*int8Decode)(const int8_t* q, const float* scales, int64_t valid, int64_t chunk, int64_t c0,
                     int64_t c1, float* dst);
  // For chunks [c0, c1) of one shard held by `world` packed rows (row r at
  // rows + r * rowBytes: [int8 x shard | float scales]): sums the rows'
  // dequantized values in rank order, divides by `divisor` (unless 1), and
  // either stores the float sum in `sum` or, when `sum` is null, quantizes it
  // into q/scales. `scratch` holds `chunk` floats.
  void (*int8ReduceShard)(const uint8_t* rows, int64_t rowBytes, int world, int64_t shard,
                          int64_t chunk, int64_t c0, int64_t c1, float divisor, float* sum,
                          int8_t* q, float* scales, float* scratch);
  // acc[i] += src[i] for i in [begin, end).
  void (*addInto)(const float* src, float* acc, int64_t begin, int64_t end);
  // dst[i] = src[i] / divisor for i in [begin, end).
  void (*divideInto)(const float* src, float* dst, float divisor, int64_t begin, int64_t end);
  // Top-k candidate scan over [begin, end): a = src[i] (+ residual[i], then
  // stored back into residual); keeps (i, a) when |a| as bits > threshold
  // (bits of |a| order floats by magnitude and put NaN above Inf), and counts
  // the entries equal to it into *ties without keeping them, so a threshold
  // that many entries share (0 in a mostly-zero gradient) costs no more than
  // any other. Writes at most `cap` pairs and returns how many passed
  // (possibly more than cap).
  int64_t (*topkScan)(const float* src, float* residual, int64_t begin, int64_t end,
                      uint32_t threshold, int32_t* indices, float* values, int64_t cap,
                      int64_t* ties);
  // The indices of the first `cap` entries of values[begin, end) whose
  // magnitude key equals `key`, ascending; returns how many it wrote. Stops
  // reading once it has `cap`.
  int64_t (*topkTies)(const float* values, int64_t begin, int64_t end, uint32_t key,
                      int32_t* indices, int64_t cap);
};

// The kernels for this CPU, capped by XCOMM_CPU_CAPABILITY (default, avx2,
// avx512) when set. Chosen once per process.
const CodecKernels& codecKernels();

// The kernels for one instruction set, or null when not built or not
// supported by this CPU (for tests that compare them).
const CodecKernels* codecKernelsFor(const char* isa);

// Magnitude key of a float: its bits without the sign.
inline uint32_t magnitudeKey(float x) {
  uint32_t bits;
  static_assert(sizeof(bits) == sizeof(x), "float is 32 bits");
  __builtin_memcpy(&bits, &x, sizeof(bits));
  return bits & 0x7fffffffu;
}

}  // namespace kernels
}  // namespace xcomm
