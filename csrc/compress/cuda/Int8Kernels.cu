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
#include <initializer_list>
#include <type_traits>

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

// Calls f(i) for each element i < cnt of the chunk that the calling thread
// owns. With kRegs: elements threadIdx.x + j * blockDim.x, j < kPerThread,
// f's results kept in vals (0 past cnt); else every blockDim.x-th element,
// results dropped (f stores them).
template <bool kRegs, typename Fn>
__device__ inline void visitChunk(float (&vals)[kPerThread], int64_t cnt, Fn&& f) {
  if (kRegs) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      vals[j] = i < cnt ? f(i) : 0.f;
    }
  } else {
    for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) f(i);
  }
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

// Chunk c of row `row`: its elements (cnt real ones, padded with zeros to
// `padded` in q), where they come from and where its row starts.
struct EncodeChunk {
  int64_t lo, cnt, padded;
  const float* s;  // null: the values are in r
  float* r;        // null: no error feedback
  uint8_t* rowStart;
};
__device__ inline EncodeChunk encodeChunk(const EncodeArgs& a, int64_t row, int64_t c) {
  const int64_t lo = c * a.chunk, offset = row * a.stride;
  const int64_t valid = min(max(a.n - offset, int64_t{0}), a.stride);
  return {lo,
          max(min(valid, lo + a.chunk) - lo, int64_t{0}),
          min(a.qLen, lo + a.chunk) - lo,
          a.src != nullptr ? a.src + offset + lo : nullptr,
          a.res != nullptr ? a.res + offset + lo : nullptr,
          a.out + row * a.rowBytes};
}

// Block (c, row): chunk c of row `row`.
template <bool kRegs>
__global__ void int8EncodeKernel(EncodeArgs a) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.y, c = blockIdx.x;
  const EncodeChunk ch = encodeChunk(a, row, c);
  const int64_t lo = ch.lo, cnt = ch.cnt, padded = ch.padded;
  const float* s = ch.s;
  float* r = ch.r;
  uint8_t* rowStart = ch.rowStart;
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
  visitChunk<kRegs>(vals, cnt, take);
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
    if (sum != nullptr) sum[lo + i] = acc;  // without kRegs, the quantize pass reads it back
    return acc;
  };
  visitChunk<kRegs>(vals, chunk, reduceAt);
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

// -- One warp per chunk (chunks of up to 2048 elements, in float4s) ---------
//
// The common case (1024-element chunks): no block barrier, and each lane
// moves 16 bytes at a time with several loads in flight, which the block
// kernels above (one scalar per thread, three barriers per chunk) do not.
// Same arithmetic, element for element.

constexpr int kWarpsPerBlock = kThreads / 32;

__device__ inline float warpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Loads the 4 elements at p (the first `valid` of them real; the rest 0).
__device__ inline float4 load4(const float* p, int64_t valid) {
  if (valid >= 4) return *reinterpret_cast<const float4*>(p);
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (valid > 0) v.x = p[0];
  if (valid > 1) v.y = p[1];
  if (valid > 2) v.z = p[2];
  return v;
}
// Stores the first `valid` of v's 4 elements at p (one 16- or 4-byte store
// when all 4 are): floats from a float4, int8 values from a char4.
template <typename T, typename V>
__device__ inline void storeUpTo4(T* p, V v, int64_t valid) {
  if (valid >= 4) {
    *reinterpret_cast<V*>(p) = v;
    return;
  }
  if (valid > 0) p[0] = v.x;
  if (valid > 1) p[1] = v.y;
  if (valid > 2) p[2] = v.z;
}
__device__ inline float4 add4(float4 a, float4 b) {
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z),
                     __fadd_rn(a.w, b.w));
}
__device__ inline float max4(float m, float4 a) {
  return fmaxf(fmaxf(fmaxf(m, fabsf(a.x)), fmaxf(fabsf(a.y), fabsf(a.z))), fabsf(a.w));
}
__device__ inline bool finite4(float4 a) {
  return isfinite(a.x) && isfinite(a.y) && isfinite(a.z) && isfinite(a.w);
}

// Quantizes one chunk held by the warp: lane l has elements l*4 + v*128 + 0..3
// in vals[v]. `cnt` real elements, `padded` q entries.
template <int V>
__device__ void quantizeWarpChunk(float4 (&vals)[V], int64_t cnt, int64_t padded, float localMax,
                                  bool localFinite, float* r, int8_t* q, uint8_t* scaleAt) {
  const int lane = threadIdx.x % 32;
  const bool finite = __all_sync(0xffffffffu, localFinite);
  const float absmax = warpMax(localMax);
  const float nan = __int_as_float(0x7fc00000);
  const float scale = !finite ? nan : (absmax > 0.f ? __fdiv_rn(absmax, 127.f) : 1.f);
  const float inv = __fdiv_rn(1.f, scale);
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const int64_t i = lane * 4 + v * 128;
    if (i >= padded) continue;
    const float4 a = vals[v];
    char4 qq = make_char4(0, 0, 0, 0);
    float4 e = a;
    if (finite) {
      const float x[4] = {a.x, a.y, a.z, a.w};
      int qi[4];
      float ei[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        qi[j] = static_cast<int>(rintf(__fmul_rn(x[j], inv)));
        ei[j] = __fsub_rn(x[j], __fmul_rn(static_cast<float>(qi[j]), scale));
      }
      qq = make_char4(static_cast<signed char>(qi[0]), static_cast<signed char>(qi[1]),
                      static_cast<signed char>(qi[2]), static_cast<signed char>(qi[3]));
      e = make_float4(ei[0], ei[1], ei[2], ei[3]);
    } else {  // as the CPU: NaN stays itself, anything else becomes the quiet NaN
      e = make_float4(isnan(a.x) ? a.x : nan, isnan(a.y) ? a.y : nan, isnan(a.z) ? a.z : nan,
                      isnan(a.w) ? a.w : nan);
    }
    storeUpTo4(q + i, qq, padded - i);
    if (r != nullptr && i < cnt) storeUpTo4(r + i, e, cnt - i);
  }
  if (lane == 0) storeUnaligned(scaleAt, scale);
}

// Warp w of block b: global chunk b * kWarpsPerBlock + w, of row chunk / chunksPerRow.
template <int V>
__global__ void int8EncodeWarpKernel(EncodeArgs a, int64_t chunksPerRow, int64_t chunks) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (g >= chunks) return;
  const int lane = threadIdx.x % 32;
  const int64_t row = g / chunksPerRow, c = g - row * chunksPerRow;
  const EncodeChunk ch = encodeChunk(a, row, c);
  const int64_t lo = ch.lo, cnt = ch.cnt, padded = ch.padded;
  const float* s = ch.s;
  float* r = ch.r;
  uint8_t* rowStart = ch.rowStart;
  float4 vals[V];
  float m = 0.f;
  bool finite = true;
#pragma unroll
  for (int v = 0; v < V; ++v) {  // all loads first: V in flight per lane
    const int64_t i = lane * 4 + v * 128;
    vals[v] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (i < cnt) vals[v] = load4(s != nullptr ? s + i : r + i, cnt - i);
  }
  if (s != nullptr && r != nullptr) {
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const int64_t i = lane * 4 + v * 128;
      if (i < cnt) vals[v] = add4(vals[v], load4(r + i, cnt - i));
    }
  }
#pragma unroll
  for (int v = 0; v < V; ++v) {
    m = max4(m, vals[v]);
    finite = finite && finite4(vals[v]);
  }
  quantizeWarpChunk<V>(vals, cnt, padded, m, finite, r, reinterpret_cast<int8_t*>(rowStart) + lo,
                       rowStart + a.qLen + c * static_cast<int64_t>(sizeof(float)));
}

// Warp w of block b: chunk b * kWarpsPerBlock + w of the shard.
template <int V>
__global__ void int8ReduceWarpKernel(const uint8_t* rows, int64_t rowBytes, int world,
                                     int64_t shard, int64_t chunk, float divisor, float* sum,
                                     uint8_t* packed) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (c >= shard / chunk) return;
  const int lane = threadIdx.x % 32;
  const int64_t lo = c * chunk;
  float4 acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int r = 0; r < world; ++r) {  // rank order: the same bits on every rank
    const uint8_t* row = rows + r * rowBytes;
    const float scale = loadUnaligned(row + shard + c * static_cast<int64_t>(sizeof(float)));
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const int64_t i = lane * 4 + v * 128;
      if (i >= chunk) continue;
      const char4 q = *reinterpret_cast<const char4*>(row + lo + i);
      acc[v] = add4(acc[v], make_float4(__fmul_rn(static_cast<float>(q.x), scale),
                                        __fmul_rn(static_cast<float>(q.y), scale),
                                        __fmul_rn(static_cast<float>(q.z), scale),
                                        __fmul_rn(static_cast<float>(q.w), scale)));
    }
  }
  float m = 0.f;
  bool finite = true;
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const int64_t i = lane * 4 + v * 128;
    if (i >= chunk) continue;
    if (divisor != 1.f) {
      acc[v] = make_float4(__fdiv_rn(acc[v].x, divisor), __fdiv_rn(acc[v].y, divisor),
                           __fdiv_rn(acc[v].z, divisor), __fdiv_rn(acc[v].w, divisor));
    }
    if (sum != nullptr) *reinterpret_cast<float4*>(sum + lo + i) = acc[v];
    m = max4(m, acc[v]);
    finite = finite && finite4(acc[v]);
  }
  if (packed == nullptr) return;
  quantizeWarpChunk<V>(acc, chunk, chunk, m, finite, nullptr,
                       reinterpret_cast<int8_t*>(packed) + lo,
                       packed + shard + c * static_cast<int64_t>(sizeof(float)));
}

// Warp w of block b: chunk b * kWarpsPerBlock + w of all rows' chunks.
template <int V>
__global__ void int8DecodeWarpKernel(const uint8_t* rows, int64_t rowBytes, int64_t shard,
                                     int64_t chunk, int64_t chunksPerRow, int64_t chunks, int64_t n,
                                     float* dst) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (g >= chunks) return;
  const int lane = threadIdx.x % 32;
  const int64_t row = g / chunksPerRow, c = g - row * chunksPerRow;
  const int64_t lo = c * chunk, base = row * shard + lo;
  const int64_t cnt = min(chunk, n - base);
  if (cnt <= 0) return;
  const uint8_t* rowStart = rows + row * rowBytes;
  const float scale = loadUnaligned(rowStart + shard + c * static_cast<int64_t>(sizeof(float)));
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const int64_t i = lane * 4 + v * 128;
    if (i >= cnt) continue;
    const char4 q = *reinterpret_cast<const char4*>(rowStart + lo + i);
    storeUpTo4(dst + base + i,
               make_float4(__fmul_rn(static_cast<float>(q.x), scale),
                           __fmul_rn(static_cast<float>(q.y), scale),
                           __fmul_rn(static_cast<float>(q.z), scale),
                           __fmul_rn(static_cast<float>(q.w), scale)),
               cnt - i);
  }
}

// float4s per lane for a chunk, or 0 when the warp kernels do not apply:
// chunks of whole float4s up to 2048 elements, every base 16-byte aligned.
int warpVecs(int64_t chunk, std::initializer_list<const void*> bases, int64_t multipleOf4) {
  if (chunk % 4 != 0 || chunk > 128 * 16 || multipleOf4 % 4 != 0) return 0;
  for (const void* p : bases) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return 0;
  }
  int v = 1;
  while (128 * v < chunk) v *= 2;
  return v;
}

// Calls fn(std::integral_constant<int, V>) for V in {1, 2, 4, 8, 16}.
template <typename Fn>
void withVecs(int v, Fn fn) {
  switch (v) {
    case 1:
      fn(std::integral_constant<int, 1>());
      break;
    case 2:
      fn(std::integral_constant<int, 2>());
      break;
    case 4:
      fn(std::integral_constant<int, 4>());
      break;
    case 8:
      fn(std::integral_constant<int, 8>());
      break;
    default:
      fn(std::integral_constant<int, 16>());
      break;
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
  DeviceGuard guard(any.device());
  const int threads = threadsForChunk(chunk);
  const EncodeArgs args{src.defined() ? src.data_ptr<float>() : nullptr,
                        residual.defined() ? residual.data_ptr<float>() : nullptr,
                        n,
                        stride,
                        qLen,
                        chunk,
                        out.size(1),
                        out.data_ptr<uint8_t>()};
  const int vecs = warpVecs(chunk, {args.src, args.res, args.out}, stride | qLen | args.rowBytes);
  if (vecs > 0) {
    const int64_t chunks = chunksPerRow * rows;
    const unsigned blocks = static_cast<unsigned>((chunks + kWarpsPerBlock - 1) / kWarpsPerBlock);
    withVecs(vecs, [&](auto v) {
      int8EncodeWarpKernel<decltype(v)::value>
          <<<blocks, kThreads, 0, streamFor(any)>>>(args, chunksPerRow, chunks);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
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
  DeviceGuard guard(rows.device());
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
  const int vecs =
      warpVecs(chunk, {rows.data_ptr<uint8_t>(), sumPtr, packedPtr}, shard | rows.size(1));
  if (vecs > 0 && (sum.defined() || packed.defined())) {
    const unsigned blocks = static_cast<unsigned>((chunks + kWarpsPerBlock - 1) / kWarpsPerBlock);
    withVecs(vecs, [&](auto v) {
      int8ReduceWarpKernel<decltype(v)::value><<<blocks, kThreads, 0, stream>>>(
          rows.data_ptr<uint8_t>(), rows.size(1), world, shard, chunk, divisor,
          sum.defined() ? sumPtr : nullptr, packedPtr);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
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
  DeviceGuard guard(rows.device());
  const int vecs =
      warpVecs(chunk, {rows.data_ptr<uint8_t>(), dst.data_ptr<float>()}, shard | rows.size(1));
  if (vecs > 0) {
    const int64_t chunks = chunksPerRow * rows.size(0);
    const unsigned blocks = static_cast<unsigned>((chunks + kWarpsPerBlock - 1) / kWarpsPerBlock);
    withVecs(vecs, [&](auto v) {
      int8DecodeWarpKernel<decltype(v)::value><<<blocks, kThreads, 0, streamFor(rows)>>>(
          rows.data_ptr<uint8_t>(), rows.size(1), shard, chunk, chunksPerRow, chunks, n,
          dst.data_ptr<float>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const dim3 grid(static_cast<unsigned>(chunksPerRow), static_cast<unsigned>(rows.size(0)));
  int8DecodeKernel<<<grid, threadsForChunk(chunk), 0, streamFor(rows)>>>(
      rows.data_ptr<uint8_t>(), rows.size(1), shard, chunk, n, dst.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace xcomm
