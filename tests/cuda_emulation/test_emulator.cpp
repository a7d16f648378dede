// The emulated GPU itself: its warp collectives and barriers answer as CUDA
// documents them, and the mistakes a GPU would hide (a collective some lane
// never reaches, a trap) fail loudly instead.
#include <stdexcept>
#include <vector>

#include "CudaEmulation.hpp"

#include <catch2/catch.hpp>

namespace {

__global__ void shuffleKernel(int* out) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int base = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x) * 6;
  out[base + 0] = __shfl_xor_sync(0xffffffffu, lane * 10, 1);
  out[base + 1] = __shfl_up_sync(0xffffffffu, lane * 10, 3);
  out[base + 2] = __shfl_sync(0xffffffffu, lane * 10, 5);
  out[base + 3] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 2 == 0) == 0x55555555u);
  out[base + 4] = static_cast<int>(__match_any_sync(0xffffffffu, lane / 8));
  out[base + 5] = static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(lane)));
}

// Threads publish through shared memory; the barrier makes every write visible.
__global__ void barrierKernel(int* out) {
  __shared__ int slots[256];
  slots[threadIdx.x] = static_cast<int>(threadIdx.x + blockIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = slots[(threadIdx.x + 1) % blockDim.x];
}

// Half the block exits early; the rest still meet at the barrier.
__global__ void earlyExitKernel(int* out) {
  __shared__ int total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  if (threadIdx.x >= 64) return;
  atomicAdd(&total, 1);
  __syncthreads();
  if (threadIdx.x == 0) *out = total;
}

// Lane 3 leaves before a full-mask shuffle: undefined on a GPU.
__global__ void brokenWarpKernel(int* out) {
  if (threadIdx.x % 32 == 3) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
}

__global__ void trapKernel() {
  if (threadIdx.x == 5) __trap();
}

}  // namespace

TEST_CASE("emulated warp collectives give CUDA's answers", "[emulated][emulator]") {
  std::vector<int> out(2 * 64 * 6);
  emu::launch(shuffleKernel, 2, 64)(out.data());
  for (int t = 0; t < 128; ++t) {
    const int lane = t % 32;
    const int* o = out.data() + t * 6;
    INFO("thread " << t);
    CHECK(o[0] == (lane ^ 1) * 10);
    CHECK(o[1] == (lane >= 3 ? lane - 3 : lane) * 10);  // lanes below delta keep their own
    CHECK(o[2] == 50);
    CHECK(o[3] == 1);
    CHECK(static_cast<unsigned>(o[4]) == 0xffu << (8 * (lane / 8)));
    CHECK(o[5] == 31 * 32 / 2);
  }
}

TEST_CASE("emulated barriers order shared memory and count only live threads",
          "[emulated][emulator]") {
  std::vector<int> out(3 * 256);
  emu::launch(barrierKernel, 3, 256)(out.data());
  for (int b = 0; b < 3; ++b) {
    for (int t = 0; t < 256; ++t) CHECK(out[b * 256 + t] == (t + 1) % 256 + b);
  }
  int total = -1;
  emu::launch(earlyExitKernel, 1, 128)(&total);
  CHECK(total == 64);
}

TEST_CASE("emulated GPU reports a warp collective a lane never reaches, and a trap",
          "[emulated][emulator]") {
  std::vector<int> out(32);
  CHECK_THROWS_WITH(emu::launch(brokenWarpKernel, 1, 32)(out.data()), Catch::Contains("deadlock"));
  CHECK_THROWS_WITH(emu::launch(trapKernel, 1, 32)(), Catch::Contains("__trap"));
  // The emulator is usable again after a failed launch.
  std::vector<int> again(64 * 6);
  emu::launch(shuffleKernel, 1, 64)(again.data());
  CHECK(again[2] == 50);
}
