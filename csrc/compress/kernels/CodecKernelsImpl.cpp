// The codec kernels, compiled once per instruction set (see CMakeLists.txt):
// XCOMM_KERNEL_ISA names the set and the namespace. Plain loops over lanes
// that the compiler vectorizes for the set it targets; built with -O3 and
// -ffp-contract=off, so every set gives the same bits (see CodecKernels.hpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "compress/kernels/CodecKernels.hpp"

#if !defined(XCOMM_KERNEL_ISA) || !defined(XCOMM_KERNEL_NS)
#error "XCOMM_KERNEL_ISA and XCOMM_KERNEL_NS (isa_<set>) must name the instruction set"
#endif
#define XCOMM_STR2(x) #x
#define XCOMM_STR(x) XCOMM_STR2(x)

namespace xcomm {
namespace kernels {
namespace XCOMM_KERNEL_NS {
namespace {

// One vector of floats (GCC/Clang vector extensions: the same source becomes
// SSE2, AVX2 or AVX-512 code, and plain scalar code elsewhere). The per-lane
// max and sum keep each lane's arithmetic in program order.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;  // one SSE2 / NEON register
#endif
typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t VecU __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline VecF load(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, VecF v) {
  std::memcpy(p, &v, sizeof(v));
}
inline VecU magnitudeKeys(VecF v) {
  VecU bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits & 0x7fffffffu;
}
inline VecF vecAbs(VecF v) {
  VecU bits = magnitudeKeys(v);
  VecF out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
// Whether any lane of a comparison result (0 or -1 per lane) is set.
inline bool anyLane(VecI mask) {
  int32_t acc = 0;
  for (int l = 0; l < kLanes; ++l) acc |= mask[l];
  return acc != 0;
}

// Adding then subtracting 1.5 * 2^23 rounds a float with |v| < 2^22 to the
// nearest integer, ties to even: std::nearbyint's result, in two adds that
// vectorize on every instruction set.
constexpr float kRoundMagic = 12582912.0f;

inline float roundToInt(float v) {
  return (v + kRoundMagic) - kRoundMagic;
}

// Largest |a| and whether every a is finite, over a[0, n). With kAdd,
// a = s + r and is stored into r; otherwise a = s.
template <bool kAdd>
void chunkStats(const float* s, float* r, int64_t n, float* absmax, bool* finite) {
  VecF m = {};
  VecF z = {};  // a - a: 0 for finite a, NaN for Inf/NaN
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    VecF a = load(s + i);
    if constexpr (kAdd) {
      a = a + load(r + i);
      store(r + i, a);
    }
    const VecF b = vecAbs(a);
    m = b > m ? b : m;
    z += a - a;
  }
  float mm = 0.f, zz = 0.f;
  for (int l = 0; l < kLanes; ++l) {
    mm = m[l] > mm ? m[l] : mm;
    zz += z[l];
  }
  for (; i < n; ++i) {
    float a = s[i];
    if constexpr (kAdd) {
      a = a + r[i];
      r[i] = a;
    }
    const float b = std::fabs(a);
    mm = b > mm ? b : mm;
    zz += a - a;
  }
  *absmax = mm;
  *finite = zz == 0.f;
}

// q = round(a / scale) (as a * (1 / scale), the codec's definition); with
// kResidual, r = a - q * scale, where a is read from r.
template <bool kResidual>
void quantizeChunk(const float* __restrict a, float* __restrict r, int64_t n, float scale,
                   int8_t* __restrict q) {
  const float inv = 1.f / scale;
  for (int64_t i = 0; i < n; ++i) {
    const float x = kResidual ? r[i] : a[i];
    const int32_t qi = static_cast<int32_t>(roundToInt(x * inv));
    q[i] = static_cast<int8_t>(qi);
    if constexpr (kResidual) {
      r[i] = x - static_cast<float>(qi) * scale;
    }
  }
}

// One chunk: stats, scale, quantize; `r` (optional) is the error feedback.
// With src null the chunk's values are already in r.
void encodeChunk(const float* src, float* r, int64_t n, int64_t padded, int8_t* q, float* scale) {
  float absmax = 0.f;
  bool finite = true;
  if (n > 0) {
    if (r && src) {
      chunkStats<true>(src, r, n, &absmax, &finite);
    } else {
      chunkStats<false>(src ? src : r, nullptr, n, &absmax, &finite);
    }
  }
  if (!finite) {
    // A non-finite chunk decodes to NaN; its residual becomes a - 0 * NaN, as
    // before: a NaN a stays itself, anything else becomes the quiet NaN.
    const float nan = std::numeric_limits<float>::quiet_NaN();
    *scale = nan;
    std::memset(q, 0, padded);
    if (r) {
      for (int64_t i = 0; i < n; ++i) r[i] = std::isnan(r[i]) ? r[i] : nan;
    }
    return;
  }
  const float s = absmax > 0.f ? absmax / 127.f : 1.f;
  *scale = s;
  if (r) {
    quantizeChunk<true>(nullptr, r, n, s, q);
  } else {
    quantizeChunk<false>(src, nullptr, n, s, q);
  }
  if (padded > n) std::memset(q + n, 0, padded - n);
}

void int8Encode(const float* src, float* residual, int64_t valid, int64_t qLen, int64_t chunk,
                int64_t c0, int64_t c1, int8_t* q, float* scales) {
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t lo = c * chunk;
    const int64_t n = std::max<int64_t>(0, std::min(valid, lo + chunk) - lo);
    const int64_t padded = std::max<int64_t>(0, std::min(qLen, lo + chunk) - lo);
    encodeChunk(src ? src + lo : nullptr, residual ? residual + lo : nullptr, n, padded, q + lo,
                scales + c);
  }
}

void dequantizeChunk(const int8_t* __restrict q, float scale, int64_t n, float* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(q[i]) * scale;
}

void int8Decode(const int8_t* q, const float* scales, int64_t valid, int64_t chunk, int64_t c0,
                int64_t c1, float* dst) {
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t lo = c * chunk;
    const int64_t n = std::min(valid, lo + chunk) - lo;
    if (n <= 0) break;
    dequantizeChunk(q + lo, scales[c], n, dst + lo);
  }
}

void accumulateChunk(const int8_t* __restrict q, float scale, int64_t n, float* __restrict acc) {
  for (int64_t i = 0; i < n; ++i) acc[i] += static_cast<float>(q[i]) * scale;
}

void divideRange(const float* __restrict src, float* __restrict dst, float divisor, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] / divisor;
}

void int8ReduceShard(const uint8_t* rows, int64_t rowBytes, int world, int64_t shard, int64_t chunk,
                     int64_t c0, int64_t c1, float divisor, float* sum, int8_t* q, float* scales,
                     float* scratch) {
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t lo = c * chunk;
    std::fill(scratch, scratch + chunk, 0.f);
    for (int r = 0; r < world; ++r) {  // rank order: the same bits on every rank
      const uint8_t* row = rows + r * rowBytes;
      float scale;
      std::memcpy(&scale, row + shard + c * static_cast<int64_t>(sizeof(float)), sizeof(float));
      accumulateChunk(reinterpret_cast<const int8_t*>(row) + lo, scale, chunk, scratch);
    }
    if (divisor != 1.f) {
      for (int64_t i = 0; i < chunk; ++i) scratch[i] = scratch[i] / divisor;
    }
    if (sum) {
      std::memcpy(sum + lo, scratch, chunk * sizeof(float));
    } else {
      encodeChunk(scratch, nullptr, chunk, chunk, q + lo, scales + c);
    }
  }
}

void addInto(const float* __restrict src, float* __restrict acc, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) acc[i] = src[i] + acc[i];
}

void divideInto(const float* src, float* dst, float divisor, int64_t begin, int64_t end) {
  if (src == dst) {
    for (int64_t i = begin; i < end; ++i) dst[i] = dst[i] / divisor;
  } else {
    divideRange(src + begin, dst + begin, divisor, end - begin);
  }
}

template <bool kAdd>
int64_t scanRange(const float* src, float* r, int64_t begin, int64_t end, uint32_t threshold,
                  int32_t* indices, float* values, int64_t cap, int64_t* ties) {
  int64_t count = 0;
  auto keep = [&](int64_t i, float a) {
    if (count < cap) {
      indices[count] = static_cast<int32_t>(i);
      values[count] = a;
    }
    ++count;
  };
  VecI equal = {};  // per lane: minus the count of keys equal to the threshold
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    VecF a = load(src + i);
    if constexpr (kAdd) {
      a = a + load(r + i);
      store(r + i, a);
    }
    const VecU key = magnitudeKeys(a);
    const VecI hit = key > threshold;
    equal += key == threshold;
    if (anyLane(hit)) {
      if (count + kLanes <= cap) {
        // Branch-free: write every lane, advance past the ones that passed
        // (which lanes pass is random, so branching on each would mispredict).
        for (int l = 0; l < kLanes; ++l) {
          indices[count] = static_cast<int32_t>(i + l);
          values[count] = a[l];
          count += hit[l] & 1;
        }
      } else {
        for (int l = 0; l < kLanes; ++l) {
          if (hit[l]) keep(i + l, a[l]);
        }
      }
    }
  }
  int64_t tied = 0;
  for (int l = 0; l < kLanes; ++l) tied -= equal[l];
  for (; i < end; ++i) {
    float a = src[i];
    if constexpr (kAdd) {
      a = a + r[i];
      r[i] = a;
    }
    const uint32_t key = magnitudeKey(a);
    if (key > threshold) keep(i, a);
    tied += key == threshold;
  }
  *ties = tied;
  return count;
}

int64_t topkScan(const float* src, float* residual, int64_t begin, int64_t end, uint32_t threshold,
                 int32_t* indices, float* values, int64_t cap, int64_t* ties) {
  return residual
             ? scanRange<true>(src, residual, begin, end, threshold, indices, values, cap, ties)
             : scanRange<false>(src, nullptr, begin, end, threshold, indices, values, cap, ties);
}

int64_t topkTies(const float* values, int64_t begin, int64_t end, uint32_t key, int32_t* indices,
                 int64_t cap) {
  int64_t count = 0;
  int64_t i = begin;
  for (; i + kLanes <= end && count < cap; i += kLanes) {
    const VecI eq = magnitudeKeys(load(values + i)) == key;
    if (anyLane(eq)) {
      for (int l = 0; l < kLanes && count < cap; ++l) {
        if (eq[l]) indices[count++] = static_cast<int32_t>(i + l);
      }
    }
  }
  for (; i < end && count < cap; ++i) {
    if (magnitudeKey(values[i]) == key) indices[count++] = static_cast<int32_t>(i);
  }
  return count;
}

}  // namespace

extern const CodecKernels kKernels;
const CodecKernels kKernels = {XCOMM_STR(XCOMM_KERNEL_ISA),
                               int8Encode,
                               int8Decode,
                               int8ReduceShard,
                               addInto,
                               divideInto,
                               topkScan,
                               topkTies};

}  // namespace XCOMM_KERNEL_NS
}  // namespace kernels
}  // namespace xcomm
