// int8 quantization on the GPU: Int8Codec's encode (with error feedback),
// reduce-and-requantize and decode, one thread block per chunk of elements.
//
// The arithmetic is the CPU kernels' (compress/kernels/CodecKernelsImpl.cpp),
// operation for operation: scale = absmax / 127 (1 when absmax is 0),
// q = rint(a * (1 / scale)), residual = a - q * scale, a chunk holding NaN or
// Inf gets scale NaN, q = 0 and a NaN residual. Explicit _rn intrinsics (and
// --fmad=false) keep multiplies and adds from fusing into FMAs, so a GPU
// rank and a CPU rank agree bit for bit.
#include <cmath>

#include "compress/cuda/CudaCodecs.hpp"
#include "compress/cuda/CudaLaunch.cuh"

namespace xcomm {
namespace cuda {
namespace {

// Chunks of up to kThreads * kPerThread elements stay in registers between
// the pass that finds their scale and the pass that quantizes them.
constexpr int kPerThread = 16;

int threadsForChunk(int64_t chunk) {
  const int64_t warps = (chunk + 31) / 32;
  return static_cast<int>(warps >= kThreads / 32 ? kThreads : warps * 32);
}

// The second half of encoding one chunk whose values are known (in `vals`
// with kRegs, else at `from`): scale, quantize, residual.
template <bool kRegs>
__device__ void quantizeChunk(const float (&vals)[kPerThread], const float* from, float* r,
                              int64_t cnt, int64_t padded, float localMax, bool localFinite,
                              int8_t* q, uint8_t* scaleAt, float* shared) {
  const bool finite = __syncthreads_and(localFinite);
  const float absmax = blockMax(localMax, shared);
  if (!finite) {
    // As the CPU: the chunk decodes to NaN; a NaN value stays itself in the
    // residual, anything else becomes the quiet NaN.
    const float nan = __int_as_float(0x7fc00000);
    for (int64_t i = threadIdx.x; i < padded; i += blockDim.x) q[i] = 0;
    if (r != nullptr) {
#pragma unroll
      for (int j = 0; j < (kRegs ? kPerThread : 1); ++j) {
        if (!kRegs) break;
        const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
        if (i < cnt) r[i] = isnan(vals[j]) ? vals[j] : nan;
      }
      if (!kRegs) {
        for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) r[i] = isnan(r[i]) ? r[i] : nan;
      }
    }
    if (threadIdx.x == 0) storeUnaligned(scaleAt, nan);
    return;
  }
  const float scale = absmax > 0.f ? __fdiv_rn(absmax, 127.f) : 1.f;
  const float inv = __fdiv_rn(1.f, scale);
  auto emit = [&](int64_t i, float v) {
    const int qi = static_cast<int>(rintf(__fmul_rn(v, inv)));
    q[i] = static_cast<int8_t>(qi);
    if (r != nullptr) r[i] = __fsub_rn(v, __fmul_rn(static_cast<float>(qi), scale));
  };
  if (kRegs) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (i < cnt) emit(i, vals[j]);
    }
  } else {
    for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) emit(i, from[i]);
  }
  for (int64_t i = cnt + threadIdx.x; i < padded; i += blockDim.x) q[i] = 0;
  if (threadIdx.x == 0) storeUnaligned(scaleAt, scale);
}

struct EncodeArgs {
  const float* src;  // null: the values are in res
  float* res;        // null: no error feedback
  int64_t n, stride, qLen, chunk, rowBytes;
  uint8_t* out;
};

// Block (c, row): chunk c of row `row`.
template <bool kRegs>
__global__ void int8EncodeKernel(EncodeArgs a) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.y, c = blockIdx.x;
  const int64_t lo = c * a.chunk, offset = row * a.stride;
  const int64_t valid = min(max(a.n - offset, int64_t{0}), a.stride);
  const int64_t cnt = max(min(valid, lo + a.chunk) - lo, int64_t{0});
  const int64_t padded = min(a.qLen, lo + a.chunk) - lo;
  const float* s = a.src != nullptr ? a.src + offset + lo : nullptr;
  float* r = a.res != nullptr ? a.res + offset + lo : nullptr;
  uint8_t* rowStart = a.out + row * a.rowBytes;
  int8_t* q = reinterpret_cast<int8_t*>(rowStart) + lo;
  uint8_t* scaleAt = rowStart + a.qLen + c * static_cast<int64_t>(sizeof(float));

  float vals[kPerThread];
  float m = 0.f;
  bool finite = true;
  auto take = [&](int64_t i) {
    float v = s != nullptr ? s[i] : r[i];
    if (s != nullptr && r != nullptr) {
      v = __fadd_rn(v, r[i]);
      if (!kRegs) r[i] = v;  // the quantize pass reads it back
    }
    m = fmaxf(m, fabsf(v));
    finite = finite && isfinite(v);
    return v;
  };
  if (kRegs) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      vals[j] = i < cnt ? take(i) : 0.f;
    }
  } else {
    for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) take(i);
  }
  quantizeChunk<kRegs>(vals, r != nullptr ? r : s, r, cnt, padded, m, finite, q, scaleAt, shared);
}

// Block c: chunk c of the shard, summed over `world` rows in rank order.
template <bool kRegs>
__global__ void int8ReduceKernel(const uint8_t* rows, int64_t rowBytes, int world, int64_t shard,
                                 int64_t chunk, float divisor, float* sum, uint8_t* packed) {
  __shared__ float shared[32];
  const int64_t c = blockIdx.x, lo = c * chunk;
  float vals[kPerThread];
  float m = 0.f;
  bool finite = true;
  auto reduceAt = [&](int64_t i) {
    float acc = 0.f;
    for (int r = 0; r < world; ++r) {  // rank order: the same bits on every rank
      const uint8_t* row = rows + r * rowBytes;
      const float scale = loadUnaligned(row + shard + c * static_cast<int64_t>(sizeof(float)));
      const float v = static_cast<float>(reinterpret_cast<const int8_t*>(row)[lo + i]);
      acc = __fadd_rn(acc, __fmul_rn(v, scale));
    }
    if (divisor != 1.f) acc = __fdiv_rn(acc, divisor);
    m = fmaxf(m, fabsf(acc));
    finite = finite && isfinite(acc);
    return acc;
  };
  if (kRegs) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      vals[j] = i < chunk ? reduceAt(i) : 0.f;
      if (sum != nullptr && i < chunk) sum[lo + i] = vals[j];
    }
  } else {
    for (int64_t i = threadIdx.x; i < chunk; i += blockDim.x) sum[lo + i] = reduceAt(i);
  }
  if (packed == nullptr) return;
  quantizeChunk<kRegs>(vals, sum != nullptr ? sum + lo : nullptr, nullptr, chunk, chunk, m, finite,
                       reinterpret_cast<int8_t*>(packed) + lo,
                       packed + shard + c * static_cast<int64_t>(sizeof(float)), shared);
}

// Block (c, row): dequantizes chunk c of row `row`, for elements below n.
__global__ void int8DecodeKernel(const uint8_t* rows, int64_t rowBytes, int64_t shard,
                                 int64_t chunk, int64_t n, float* dst) {
  const int64_t row = blockIdx.y, c = blockIdx.x;
  const int64_t lo = c * chunk, base = row * shard + lo;
  const int64_t cnt = min(chunk, n - base);
  if (cnt <= 0) return;
  const uint8_t* rowStart = rows + row * rowBytes;
  const float scale = loadUnaligned(rowStart + shard + c * static_cast<int64_t>(sizeof(float)));
  const int8_t* q = reinterpret_cast<const int8_t*>(rowStart) + lo;
  for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) {
    dst[base + i] = __fmul_rn(static_cast<float>(q[i]), scale);
  }
}

void checkFloat(const at::Tensor& t, const char* what) {
  checkDevice(t, what);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "xcomm: ", what, " must be float32, got ",
              t.scalar_type());
}

void checkRows(const at::Tensor& t, const char* what) {
  checkDevice(t, what);
  TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 2, "xcomm: ", what,
              " must be a 2-D uint8 tensor");
}

}  // namespace

bool codecsBuilt() {
  return true;
}

void int8Encode(const at::Tensor& src, const at::Tensor& residual, int64_t n, int rows,
                int64_t stride, int64_t qLen, int64_t chunk, at::Tensor& out) {
  TORCH_CHECK(src.defined() || residual.defined(), "xcomm: int8 encode needs a source");
  if (src.defined()) checkFloat(src, "the int8 source");
  if (residual.defined()) checkFloat(residual, "the int8 residual");
  checkRows(out, "the int8 payload");
  const at::Tensor& any = src.defined() ? src : residual;
  const int64_t chunksPerRow = (qLen + chunk - 1) / chunk;
  TORCH_CHECK(out.size(0) == rows && out.size(1) == qLen + 4 * chunksPerRow,
              "xcomm: int8 payload has the wrong shape");
  if (rows == 0 || chunksPerRow == 0) return;
  c10::cuda::CUDAGuard guard(any.device());
  const int threads = threadsForChunk(chunk);
  const EncodeArgs args{src.defined() ? src.data_ptr<float>() : nullptr,
                        residual.defined() ? residual.data_ptr<float>() : nullptr,
                        n,
                        stride,
                        qLen,
                        chunk,
                        out.size(1),
                        out.data_ptr<uint8_t>()};
  const dim3 grid(static_cast<unsigned>(chunksPerRow), static_cast<unsigned>(rows));
  if (chunk <= static_cast<int64_t>(threads) * kPerThread) {
    int8EncodeKernel<true><<<grid, threads, 0, streamFor(any)>>>(args);
  } else {
    int8EncodeKernel<false><<<grid, threads, 0, streamFor(any)>>>(args);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void int8Reduce(const at::Tensor& rows, int64_t shard, int64_t chunk, float divisor,
                const at::Tensor& sum, const at::Tensor& packed) {
  checkRows(rows, "the int8 shards");
  TORCH_CHECK(shard % chunk == 0, "xcomm: int8 shard of ", shard, " elements is not whole chunks");
  const int64_t chunks = shard / chunk;
  if (chunks == 0) return;
  c10::cuda::CUDAGuard guard(rows.device());
  const int threads = threadsForChunk(chunk);
  const bool regs = chunk <= static_cast<int64_t>(threads) * kPerThread;
  at::Tensor scratch = sum;
  if (!sum.defined() && !regs) scratch = at::empty({shard}, rows.options().dtype(at::kFloat));
  if (scratch.defined()) checkFloat(scratch, "the int8 sum");
  if (packed.defined()) checkDevice(packed, "the int8 packed shard");
  float* sumPtr = scratch.defined() ? scratch.data_ptr<float>() : nullptr;
  uint8_t* packedPtr = packed.defined() ? packed.data_ptr<uint8_t>() : nullptr;
  const auto stream = streamFor(rows);
  const auto world = static_cast<int>(rows.size(0));
  if (regs) {
    int8ReduceKernel<true><<<static_cast<unsigned>(chunks), threads, 0, stream>>>(
        rows.data_ptr<uint8_t>(), rows.size(1), world, shard, chunk, divisor, sumPtr, packedPtr);
  } else {
    int8ReduceKernel<false><<<static_cast<unsigned>(chunks), threads, 0, stream>>>(
        rows.data_ptr<uint8_t>(), rows.size(1), world, shard, chunk, divisor, sumPtr, packedPtr);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void int8Decode(const at::Tensor& rows, int64_t shard, int64_t chunk, int64_t n,
                const at::Tensor& dst) {
  checkRows(rows, "the int8 payload");
  checkFloat(dst, "the int8 output");
  const int64_t chunksPerRow = (shard + chunk - 1) / chunk;
  if (n == 0 || rows.size(0) == 0 || chunksPerRow == 0) return;
  c10::cuda::CUDAGuard guard(rows.device());
  const dim3 grid(static_cast<unsigned>(chunksPerRow), static_cast<unsigned>(rows.size(0)));
  int8DecodeKernel<<<grid, threadsForChunk(chunk), 0, streamFor(rows)>>>(
      rows.data_ptr<uint8_t>(), rows.size(1), shard, chunk, n, dst.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace xcomm
