// random-k on the GPU: the shared positions drawn on the device (the CPU's
// hash, so every rank and every device draws the same), error feedback's
// add, and the gather/scatter of the selected values.
#include "compress/cuda/CudaCodecs.hpp"
#include "compress/cuda/CudaLaunch.cuh"

namespace xcomm {
namespace cuda {
namespace {

// SplitMix64, as RandomKCodec's mix().
__device__ inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// One position per stratum [n i / k, n (i + 1) / k); numel < 2^31 keeps n * i
// within 64 bits, where the CPU's 128-bit product gives the same quotient.
__global__ void positionsKernel(uint64_t base, uint64_t n, uint64_t k, int64_t* out) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < k;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint64_t lo = n * i / k, hi = n * (i + 1) / k;
    out[i] = static_cast<int64_t>(lo + mix(base + i) % (hi - lo));
  }
}

__global__ void addIntoKernel(const float* src, float* acc, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  // float4 where both are 16-byte aligned (fresh allocations are), then the tail.
  const bool vec = (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(acc)) % 16 == 0;
  const int64_t nv = vec ? n / 4 : 0;
  for (int64_t i = first; i < nv; i += stride) {
    const float4 s = reinterpret_cast<const float4*>(src)[i];
    float4 a = reinterpret_cast<float4*>(acc)[i];
    a.x = __fadd_rn(s.x, a.x);
    a.y = __fadd_rn(s.y, a.y);
    a.z = __fadd_rn(s.z, a.z);
    a.w = __fadd_rn(s.w, a.w);
    reinterpret_cast<float4*>(acc)[i] = a;
  }
  for (int64_t i = nv * 4 + first; i < n; i += stride) acc[i] = __fadd_rn(src[i], acc[i]);
}

__global__ void gatherKernel(float* acc, const int64_t* pos, int64_t k, float* values, bool zero) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < k;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = pos[i];
    values[i] = acc[p];
    if (zero) acc[p] = 0.f;
  }
}

__global__ void scatterKernel(const float* values, const int64_t* pos, int64_t k, float divisor,
                              float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < k;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[pos[i]] = divisor != 1.f ? __fdiv_rn(values[i], divisor) : values[i];
  }
}

// Enough blocks to fill the GPU for a streaming loop; the loops stride.
unsigned streamBlocks(int64_t work) {
  return blocksFor(work, kThreads * 4LL) > 8192 ? 8192 : blocksFor(work, kThreads * 4LL);
}

void checkFloat(const at::Tensor& t, const char* what) {
  checkDevice(t, what);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "xcomm: ", what, " must be float32");
}

void checkPositions(const at::Tensor& p) {
  checkDevice(p, "random-k positions");
  TORCH_CHECK(p.scalar_type() == at::kLong && p.dim() == 1,
              "xcomm: random-k positions must be a 1-D int64 tensor");
}

}  // namespace

void randomkPositions(uint64_t base, int64_t numel, const at::Tensor& out) {
  checkPositions(out);
  TORCH_CHECK(numel < (int64_t{1} << 31),
              "xcomm: random-k on the GPU takes buckets under 2^31 "
              "elements, got ",
              numel);
  const int64_t k = out.numel();
  if (k == 0) return;
  DeviceGuard guard(out.device());
  positionsKernel<<<streamBlocks(k), kThreads, 0, streamFor(out)>>>(
      base, static_cast<uint64_t>(numel), static_cast<uint64_t>(k), out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void addInto(const at::Tensor& src, const at::Tensor& acc) {
  checkFloat(src, "the error-feedback input");
  checkFloat(acc, "the error-feedback residual");
  TORCH_CHECK(src.numel() == acc.numel(), "xcomm: residual and input sizes differ");
  if (src.numel() == 0) return;
  DeviceGuard guard(acc.device());
  addIntoKernel<<<streamBlocks(src.numel() / 4 + 1), kThreads, 0, streamFor(acc)>>>(
      src.data_ptr<float>(), acc.data_ptr<float>(), src.numel());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gatherPositions(const at::Tensor& acc, const at::Tensor& positions, const at::Tensor& values,
                     bool zero) {
  checkFloat(acc, "the random-k input");
  checkFloat(values, "the random-k values");
  checkPositions(positions);
  const int64_t k = positions.numel();
  if (k == 0) return;
  DeviceGuard guard(acc.device());
  gatherKernel<<<streamBlocks(k), kThreads, 0, streamFor(acc)>>>(
      acc.data_ptr<float>(), positions.data_ptr<int64_t>(), k, values.data_ptr<float>(), zero);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scatterPositions(const at::Tensor& values, const at::Tensor& positions, float divisor,
                      const at::Tensor& out) {
  checkFloat(values, "the random-k values");
  checkFloat(out, "the random-k output");
  checkPositions(positions);
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device());
  const auto stream = streamFor(out);
  C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr<float>(), 0, out.numel() * sizeof(float), stream));
  const int64_t k = positions.numel();
  if (k == 0) return;
  scatterKernel<<<streamBlocks(k), kThreads, 0, stream>>>(
      values.data_ptr<float>(), positions.data_ptr<int64_t>(), k, divisor, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace xcomm
