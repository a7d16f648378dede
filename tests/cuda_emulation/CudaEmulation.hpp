#pragma once
// xcomm's CUDA kernels, run on the CPU: what the test build that emulates a
// GPU compiles csrc/compress/cuda/*.cu against (XCOMM_CUDA_EMULATION), so the
// kernels' arithmetic, indexing, barriers and warp collectives are checked on
// every CI run, where no GPU exists. Not a performance model.
//
// Each thread of a block is a fiber (ucontext); a block's fibers run on one
// OS thread, taking turns at each barrier, and blocks run one after another:
// - __shared__ variables are function statics (one block at a time uses
//   them; like CUDA they start with whatever the last block left);
// - __syncthreads waits for every thread of the block that has not exited;
// - a warp collective (__shfl_*_sync, __match_any_sync, __reduce_*_sync,
//   __any_sync, ...) waits for every lane its mask names, so a collective
//   that a lane never reaches (it exited, or took another branch) is reported
//   as a deadlock instead of reading garbage;
// - atomics are plain read-modify-writes (threads switch only at barriers);
// - float arithmetic is IEEE single/double without FMA contraction (built
//   with -ffp-contract=off), as the kernels are with --fmad=false.
//
// Launches: tests/cuda_emulation/emulate_launches.py rewrites each
// `kernel<<<grid, block, shared, stream>>>(args)` as
// `::emu::launch(kernel, grid, block, shared, stream)(args)`.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__ __restrict
#define __launch_bounds__(...)

namespace emu {

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// The calling fiber's coordinates (valid inside a kernel only).
const dim3& threadIndex();
const dim3& blockIndex();
const dim3& blockDimension();
const dim3& gridDimension();

// __syncthreads with a count of the threads whose predicate was true.
int syncThreadsCount(int predicate);
// Deposits the calling lane's value and waits for the other lanes of `mask`;
// returns the warp's 32 slots (valid until the warp's next collective).
const uint64_t* warpExchange(uint64_t value, unsigned mask);
[[noreturn]] void trap();
void* dynamicShared();

// Runs `thread` once per thread of every block (blocks in order).
void run(dim3 grid, dim3 block, size_t sharedBytes, const std::function<void()>& thread);
// Kernel launches so far (tests count what a step costs in launches).
uint64_t launches();

template <typename Kernel>
struct Launch {
  Kernel* kernel;
  dim3 grid, block;
  size_t shared;
  template <typename... Args>
  void operator()(Args&&... args) const {
    run(grid, block, shared, [&] { kernel(args...); });
  }
};

template <typename Kernel>
Launch<Kernel> launch(Kernel* kernel, dim3 grid, dim3 block, size_t shared = 0,
                      void* /*stream*/ = nullptr) {
  return {kernel, grid, block, shared};
}

template <typename T>
uint64_t toBits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "8 bytes at most");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T fromBits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
inline int laneOf() {
  return static_cast<int>(threadIndex().x % 32);
}

}  // namespace emu

#define threadIdx (::emu::threadIndex())
#define blockIdx (::emu::blockIndex())
#define blockDim (::emu::blockDimension())
#define gridDim (::emu::gridDimension())

using emu::dim3;
using cudaStream_t = void*;
using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;

#ifndef C10_CUDA_KERNEL_LAUNCH_CHECK
#define C10_CUDA_KERNEL_LAUNCH_CHECK() \
  do {                                 \
  } while (0)
#endif
#ifndef C10_CUDA_CHECK
#define C10_CUDA_CHECK(expr) (void)(expr)
#endif

inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}

// Vector types, aligned as CUDA's.
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(4) char4 {
  signed char x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) {
  return {x, y, z, w};
}
inline float2 make_float2(float x, float y) {
  return {x, y};
}
inline uint2 make_uint2(unsigned x, unsigned y) {
  return {x, y};
}
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  return {x, y, z, w};
}
inline char4 make_char4(signed char x, signed char y, signed char z, signed char w) {
  return {x, y, z, w};
}

// Math: CUDA's overloads for float in the global namespace.
using std::isfinite;
using std::isnan;
using std::sqrt;
template <typename A, typename B>
constexpr std::common_type_t<A, B> min(A a, B b) {
  return b < a ? b : a;
}
template <typename A, typename B>
constexpr std::common_type_t<A, B> max(A a, B b) {
  return a < b ? b : a;
}

// Rounded-to-nearest arithmetic, never contracted.
inline float __fadd_rn(float a, float b) {
  return a + b;
}
inline float __fsub_rn(float a, float b) {
  return a - b;
}
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline float __fdiv_rn(float a, float b) {
  return a / b;
}
inline float __int_as_float(int b) {
  return emu::fromBits<float>(static_cast<uint32_t>(b));
}
inline float __uint_as_float(unsigned b) {
  return emu::fromBits<float>(b);
}
inline unsigned __float_as_uint(float f) {
  return static_cast<unsigned>(emu::toBits(f));
}
inline int __float_as_int(float f) {
  return static_cast<int>(emu::toBits(f));
}
inline int __popc(unsigned v) {
  return __builtin_popcount(v);
}
inline int __popcll(unsigned long long v) {
  return __builtin_popcountll(v);
}
inline int __ffs(int v) {
  return __builtin_ffs(v);
}
inline int __ffs(unsigned v) {
  return __builtin_ffs(static_cast<int>(v));
}
inline int __clz(int v) {
  return v == 0 ? 32 : __builtin_clz(static_cast<unsigned>(v));
}
template <typename T>
T __ldg(const T* p) {
  return *p;
}
[[noreturn]] inline void __trap() {
  emu::trap();
}

// Atomics: plain read-modify-writes (a fiber never switches inside one),
// with CUDA's overloads, so an int argument converts as it does there.
#define XCOMM_EMU_ATOMIC(name, expr)                                            \
  template <typename T>                                                         \
  T name##Of(T* p, T v) {                                                       \
    const T old = *p;                                                           \
    *p = (expr);                                                                \
    return old;                                                                 \
  }                                                                             \
  inline int name(int* p, int v) {                                              \
    return name##Of(p, v);                                                      \
  }                                                                             \
  inline unsigned name(unsigned* p, unsigned v) {                               \
    return name##Of(p, v);                                                      \
  }                                                                             \
  inline unsigned long long name(unsigned long long* p, unsigned long long v) { \
    return name##Of(p, v);                                                      \
  }
XCOMM_EMU_ATOMIC(atomicAdd, old + v)
XCOMM_EMU_ATOMIC(atomicOr, old | v)
XCOMM_EMU_ATOMIC(atomicAnd, old& v)
XCOMM_EMU_ATOMIC(atomicMax, old < v ? v : old)
XCOMM_EMU_ATOMIC(atomicMin, v < old ? v : old)
XCOMM_EMU_ATOMIC(atomicExch, v)
#undef XCOMM_EMU_ATOMIC
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}
inline double atomicAdd(double* p, double v) {
  const double old = *p;
  *p = old + v;
  return old;
}
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned v) {
  const unsigned old = *p;
  if (old == compare) *p = v;
  return old;
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long compare,
                                    unsigned long long v) {
  const unsigned long long old = *p;
  if (old == compare) *p = v;
  return old;
}

// Block barrier.
inline void __syncthreads() {
  emu::syncThreadsCount(0);
}
inline int __syncthreads_count(int predicate) {
  return emu::syncThreadsCount(predicate);
}
inline int __syncthreads_and(int predicate) {
  const auto& d = emu::blockDimension();
  return emu::syncThreadsCount(predicate) == static_cast<int>(d.x * d.y * d.z);
}
inline int __syncthreads_or(int predicate) {
  return emu::syncThreadsCount(predicate) > 0;
}
inline void __threadfence() {}
inline void __threadfence_block() {}

// Warp collectives (1-D blocks; width 32 unless given).
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::warpExchange(0, mask);
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const uint64_t* s = emu::warpExchange(emu::toBits(v), mask);
  const int lane = emu::laneOf(), base = lane & ~(width - 1);
  return emu::fromBits<T>(s[base + ((src % width) + width) % width]);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int laneMask, int width = 32) {
  const uint64_t* s = emu::warpExchange(emu::toBits(v), mask);
  const int lane = emu::laneOf(), base = lane & ~(width - 1), src = lane ^ laneMask;
  return src >= base + width ? v : emu::fromBits<T>(s[src]);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const uint64_t* s = emu::warpExchange(emu::toBits(v), mask);
  const int lane = emu::laneOf(), base = lane & ~(width - 1);
  const int src = lane - static_cast<int>(delta);
  return src < base ? v : emu::fromBits<T>(s[src]);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const uint64_t* s = emu::warpExchange(emu::toBits(v), mask);
  const int lane = emu::laneOf(), base = lane & ~(width - 1);
  const int src = lane + static_cast<int>(delta);
  return src >= base + width ? v : emu::fromBits<T>(s[src]);
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  const uint64_t* s = emu::warpExchange(predicate != 0, mask);
  unsigned out = 0;
  for (int l = 0; l < 32; ++l) {
    if ((mask >> l & 1u) && s[l] != 0) out |= 1u << l;
  }
  return out;
}
inline int __any_sync(unsigned mask, int predicate) {
  return __ballot_sync(mask, predicate) != 0;
}
inline int __all_sync(unsigned mask, int predicate) {
  return __ballot_sync(mask, predicate) == mask;
}
template <typename T>
unsigned __match_any_sync(unsigned mask, T value) {
  const uint64_t* s = emu::warpExchange(emu::toBits(value), mask);
  const uint64_t mine = s[emu::laneOf()];
  unsigned out = 0;
  for (int l = 0; l < 32; ++l) {
    if ((mask >> l & 1u) && s[l] == mine) out |= 1u << l;
  }
  return out;
}
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
  const uint64_t* s = emu::warpExchange(v, mask);
  unsigned out = 0;
  for (int l = 0; l < 32; ++l) {
    if (mask >> l & 1u) out += static_cast<unsigned>(s[l]);
  }
  return out;
}
inline int __reduce_add_sync(unsigned mask, int v) {
  return static_cast<int>(__reduce_add_sync(mask, static_cast<unsigned>(v)));
}
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) {
  const uint64_t* s = emu::warpExchange(v, mask);
  unsigned out = 0;
  for (int l = 0; l < 32; ++l) {
    if ((mask >> l & 1u) && static_cast<unsigned>(s[l]) > out) out = static_cast<unsigned>(s[l]);
  }
  return out;
}
