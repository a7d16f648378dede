// The fiber scheduler behind CudaEmulation.hpp: one block at a time, its
// threads as ucontext fibers on the calling OS thread, switched only where a
// thread waits (a block barrier or a warp collective) or exits.
#include "CudaEmulation.hpp"

#include <ucontext.h>

#include <exception>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;  // left uninitialized: pages are touched as used
  dim3 index;
  bool done = true;
};

struct Warp {
  uint64_t generation = 0;
  unsigned arrived = 0;
  unsigned mask = 0;
  uint64_t slots[2][32] = {};  // by generation parity: read while the next fills
};

struct LaunchState {
  dim3 grid, block, blockIndex;
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  ucontext_t scheduler;
  int live = 0;
  // Block barrier.
  uint64_t barrierGeneration = 0;
  int barrierArrived = 0;
  int barrierCount[2] = {0, 0};
  std::vector<Warp> warps;
  uint64_t progress = 0;  // arrivals and exits: no change in a round means deadlock
  std::exception_ptr error;
  std::vector<unsigned char> shared;
};

// The launch in progress: launches run one at a time, from one OS thread.
LaunchState* active = nullptr;
uint64_t launchCount = 0;

LaunchState& current() {
  if (active == nullptr || active->current == nullptr) {
    throw std::logic_error("emulated CUDA: a device function was called outside a kernel");
  }
  return *active;
}

void yieldToScheduler() {
  LaunchState& l = *active;
  swapcontext(&l.current->context, &l.scheduler);
}

void releaseBarrierIfComplete(LaunchState& l) {
  if (l.barrierArrived > 0 && l.barrierArrived == l.live) {
    l.barrierArrived = 0;
    ++l.barrierGeneration;
  }
}

struct Trapped {};

void fiberEntry() {
  LaunchState& l = *active;
  try {
    (*l.body)();
  } catch (const Trapped&) {
    l.error =
        std::make_exception_ptr(std::runtime_error("emulated CUDA: a kernel called __trap()"));
  } catch (...) {
    l.error = std::current_exception();
  }
  l.current->done = true;
  --l.live;
  ++l.progress;
  releaseBarrierIfComplete(l);
  // Returning resumes uc_link: the scheduler.
}

std::string where(const LaunchState& l) {
  std::ostringstream os;
  os << "block (" << l.blockIndex.x << ", " << l.blockIndex.y << ", " << l.blockIndex.z
     << ") of grid (" << l.grid.x << ", " << l.grid.y << ", " << l.grid.z << "), " << l.block.x
     << " x " << l.block.y << " x " << l.block.z << " threads";
  return os.str();
}

void runBlock(LaunchState& l) {
  const int threads = static_cast<int>(l.block.x * l.block.y * l.block.z);
  for (int t = 0; t < threads; ++t) {
    Fiber& f = l.fibers[t];
    if (!f.stack) f.stack.reset(new char[kStackBytes]);
    f.index = dim3(t % l.block.x, (t / l.block.x) % l.block.y, t / (l.block.x * l.block.y));
    f.done = false;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &l.scheduler;
    makecontext(&f.context, fiberEntry, 0);
  }
  l.live = threads;
  l.barrierArrived = 0;
  for (Warp& w : l.warps) w.arrived = 0;
  // Dynamic shared memory starts as garbage, as on a GPU: a kernel that
  // reads it before writing shows up.
  std::memset(l.shared.data(), 0xa5, l.shared.size());
  while (l.live > 0) {
    const uint64_t before = l.progress;
    for (int t = 0; t < threads; ++t) {
      Fiber& f = l.fibers[t];
      if (f.done) continue;
      l.current = &f;
      swapcontext(&l.scheduler, &f.context);
      l.current = nullptr;
      if (l.error) std::rethrow_exception(l.error);
    }
    if (l.live > 0 && l.progress == before) {
      throw std::runtime_error(
          "emulated CUDA: deadlock in " + where(l) +
          ": every live thread waits at a barrier or warp collective that cannot complete "
          "(a lane named in a collective's mask exited or took another branch)");
    }
  }
}

}  // namespace

const dim3& threadIndex() {
  return current().current->index;
}
const dim3& blockIndex() {
  return current().blockIndex;
}
const dim3& blockDimension() {
  return current().block;
}
const dim3& gridDimension() {
  return current().grid;
}
void* dynamicShared() {
  return current().shared.data();
}

int syncThreadsCount(int predicate) {
  LaunchState& l = current();
  const int parity = static_cast<int>(l.barrierGeneration & 1);
  if (l.barrierArrived == 0) l.barrierCount[parity] = 0;
  l.barrierCount[parity] += predicate != 0;
  ++l.barrierArrived;
  ++l.progress;
  const uint64_t mine = l.barrierGeneration;
  releaseBarrierIfComplete(l);
  while (l.barrierGeneration == mine) yieldToScheduler();
  return l.barrierCount[parity];
}

const uint64_t* warpExchange(uint64_t value, unsigned mask) {
  LaunchState& l = current();
  const auto& idx = l.current->index;
  const unsigned linear = idx.x + l.block.x * (idx.y + l.block.y * idx.z);
  Warp& w = l.warps[linear / 32];
  const unsigned lane = linear % 32;
  if ((mask >> lane & 1u) == 0) {
    throw std::logic_error("emulated CUDA: a lane called a warp collective its mask leaves out");
  }
  if (w.arrived == 0) {
    w.mask = mask;
  } else if (w.mask != mask) {
    throw std::logic_error(
        "emulated CUDA: lanes of one warp met at a collective with different "
        "masks");
  }
  const int parity = static_cast<int>(w.generation & 1);
  w.slots[parity][lane] = value;
  ++w.arrived;
  ++l.progress;
  const uint64_t mine = w.generation;
  if (w.arrived == static_cast<unsigned>(__builtin_popcount(mask))) {
    w.arrived = 0;
    ++w.generation;
  }
  while (w.generation == mine) yieldToScheduler();
  return w.slots[parity];
}

void trap() {
  throw Trapped{};
}

uint64_t launches() {
  return launchCount;
}

void run(dim3 grid, dim3 block, size_t sharedBytes, const std::function<void()>& thread) {
  if (active != nullptr) throw std::logic_error("emulated CUDA: a kernel launched another");
  ++launchCount;
  const unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads > 1024) {
    throw std::invalid_argument("emulated CUDA: a block must have 1 to 1024 threads, got " +
                                std::to_string(threads));
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
    throw std::invalid_argument("emulated CUDA: invalid grid");
  }
  if (sharedBytes > 227 * 1024) {
    throw std::invalid_argument("emulated CUDA: more dynamic shared memory than an H100 block has");
  }
  // Fibers (and their stacks) are kept between launches.
  static std::vector<Fiber> pool(1024);
  LaunchState l;
  l.grid = grid;
  l.block = block;
  l.body = &thread;
  l.fibers.swap(pool);
  l.warps.assign((threads + 31) / 32, Warp{});
  l.shared.assign(sharedBytes, 0);
  active = &l;
  try {
    for (unsigned z = 0; z < grid.z; ++z) {
      for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) {
          l.blockIndex = dim3(x, y, z);
          runBlock(l);
        }
      }
    }
  } catch (...) {
    active = nullptr;
    l.fibers.swap(pool);
    throw;
  }
  active = nullptr;
  l.fibers.swap(pool);
}

}  // namespace emu
