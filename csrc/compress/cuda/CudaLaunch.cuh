#pragma once
// What every codec kernel file shares: the caller's stream, a launch check,
// and the block-wide reductions.
#include <cstdint>
#include <type_traits>
#include <utility>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#ifdef XCOMM_CUDA_EMULATION
// The test build that runs these kernels on the CPU (tests/cuda_emulation):
// CPU tensors stand for the device's, launches run on fibers.
#include "CudaEmulation.hpp"
#else
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace xcomm {
namespace cuda {

constexpr int kThreads = 256;

#ifdef XCOMM_CUDA_EMULATION
struct DeviceGuard {
  explicit DeviceGuard(c10::Device) {}
};
inline bool onKernelDevice(const at::Tensor& t) {
  return t.is_cpu();
}
inline cudaStream_t streamFor(const at::Tensor&) {
  return nullptr;
}
#else
using DeviceGuard = c10::cuda::CUDAGuard;
// Whether the kernels can take this tensor: it lives on a GPU.
inline bool onKernelDevice(const at::Tensor& t) {
  return t.is_cuda();
}
// The current stream of the tensor's device: the caller's (DDP's, a future
// callback's), so the kernels order with the work around them.
inline cudaStream_t streamFor(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}
#endif

// How many blocks of `kernel` (at `threads` per block) the device holds at
// once: a grid of that size runs in one wave, so what each block does once
// (set up and flush a shared histogram) is paid once per resident block.
#ifdef XCOMM_CUDA_EMULATION
template <typename Kernel>
int residentBlocks(Kernel*, int, const c10::Device&) {
  return 8;  // the emulated GPU: a few blocks, as a small device holds
}
#else
template <typename Kernel>
int residentBlocks(Kernel* kernel, int threads, const c10::Device& device) {
  static const int perSm = [&] {
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
    return n < 1 ? 1 : n;
  }();
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device.index()));
  return perSm * (sms < 1 ? 1 : sms);
}
#endif

inline void checkDevice(const at::Tensor& t, const char* what) {
  TORCH_CHECK(onKernelDevice(t) && t.is_contiguous(), "xcomm: ", what,
              " must be a contiguous CUDA tensor, got ", t.device(),
              t.is_contiguous() ? "" : " (not contiguous)");
}

// Calls fn(std::integral_constant<int, R>{}) with R the smallest power of two
// at least n, and at most kMax: a kernel's compile-time width for a runtime
// size (a PowerSGD rank, say).
template <int R, int kMax, typename Fn>
void withPowerOfTwoFrom(int64_t n, Fn&& fn) {
  if constexpr (R >= kMax) {
    fn(std::integral_constant<int, R>{});
  } else {
    if (n <= R) {
      fn(std::integral_constant<int, R>{});
    } else {
      withPowerOfTwoFrom<R * 2, kMax>(n, std::forward<Fn>(fn));
    }
  }
}
template <int kMax, typename Fn>
void withPowerOfTwo(int64_t n, Fn&& fn) {
  withPowerOfTwoFrom<1, kMax>(n, std::forward<Fn>(fn));
}

inline unsigned blocksFor(int64_t work, int64_t perBlock) {
  const int64_t b = (work + perBlock - 1) / perBlock;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535LL * 1024 ? 65535LL * 1024 : b));
}

// Largest value over the block (every thread gets it); `shared` holds one
// float per warp.
__device__ inline float blockMax(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Magnitude key of a float: its bits without the sign (orders magnitudes;
// NaN above Inf), as kernels::magnitudeKey.
__device__ inline uint32_t magnitudeKey(float x) {
  return __float_as_uint(x) & 0x7fffffffu;
}

// A float stored at any byte address (the int8 scales follow the int8 values
// and need not be 4-byte aligned).
__device__ inline void storeUnaligned(uint8_t* p, float v) {
  if ((reinterpret_cast<uintptr_t>(p) & 3u) == 0) {
    *reinterpret_cast<float*>(p) = v;
    return;
  }
  const uint32_t b = __float_as_uint(v);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(b >> (8 * i));
}
__device__ inline float loadUnaligned(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 3u) == 0) return *reinterpret_cast<const float*>(p);
  uint32_t b = 0;
  for (int i = 0; i < 4; ++i) b |= static_cast<uint32_t>(p[i]) << (8 * i);
  return __uint_as_float(b);
}

}  // namespace cuda
}  // namespace xcomm
