#include "compress/PowerSgdCodec.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "common/ErrorText.hpp"
#include "compress/PowerSgdKernels.hpp"
#include "compress/cuda/CudaCodecs.hpp"

namespace xcomm {

namespace {

// Work items are cut to about this many elements, so a big matrix spreads
// over threads and small ones are not split into pieces too small to pay
// for their scheduling.
constexpr int64_t kTaskElements = int64_t{1} << 16;
// Below this many elements in total a phase runs on the calling thread.
constexpr int64_t kParallelThreshold = int64_t{1} << 15;
// projectColumns keeps (column range x rank) accumulators; bound them to
// stay in L1.
constexpr int64_t kMaxColumnAccumulators = 2048;

bool supportedDtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

std::string shapeString(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << (sizes.size() == 1 ? ",)" : ")");
  return os.str();
}

// One unit of parallel work: `item` is a tensor of the plan, [begin, end)
// rows or columns of it.
struct Task {
  int64_t item;
  int64_t begin;
  int64_t end;
  int64_t cost;
};

// Runs every task once, spread over the intra-op threads by cost. Each task
// computes its outputs alone, so the split never changes a result.
template <typename F>
void runTasks(const std::vector<Task>& tasks, const F& fn) {
  int64_t total = 0;
  for (const auto& t : tasks) total += t.cost;
  const int64_t threads = at::get_num_threads();
  if (tasks.size() < 2 || total < kParallelThreshold || threads < 2 || at::in_parallel_region()) {
    for (const auto& t : tasks) fn(t);
    return;
  }
  // Cut the task list into up to 4 parts per thread of about equal cost.
  const int64_t parts = std::min<int64_t>(static_cast<int64_t>(tasks.size()), 4 * threads);
  std::vector<size_t> bounds{0};
  int64_t acc = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    acc += tasks[i].cost;
    const auto part = static_cast<int64_t>(bounds.size());
    if (part < parts && acc * parts >= total * part) bounds.push_back(i + 1);
  }
  bounds.push_back(tasks.size());
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (size_t i = bounds[p]; i < bounds[p + 1]; ++i) fn(tasks[i]);
    }
  });
}

// Splits [0, extent) into chunks of `step` (the last may be shorter).
void addChunks(std::vector<Task>& tasks, int64_t item, int64_t extent, int64_t step,
               int64_t costPerUnit) {
  step = std::max<int64_t>(step, 1);
  for (int64_t b = 0; b < extent; b += step) {
    const int64_t e = std::min(extent, b + step);
    tasks.push_back({item, b, e, (e - b) * costPerUnit});
  }
}

}  // namespace

void PowerSgdOptions::validate() const {
  TORCH_CHECK_VALUE(matrixApproximationRank >= 1,
                    "xcomm: PowerSGD matrix_approximation_rank must be >= 1 (1 to 4 is typical); "
                    "got ",
                    matrixApproximationRank);
  TORCH_CHECK_VALUE(minCompressionRate >= 0 && !std::isnan(minCompressionRate),
                    "xcomm: PowerSGD min_compression_rate must be a number >= 0 (a matrix is "
                    "compressed when it shrinks by more than this factor); got ",
                    minCompressionRate);
  TORCH_CHECK_VALUE(orthogonalizationEpsilon >= 0 && std::isfinite(orthogonalizationEpsilon),
                    "xcomm: PowerSGD orthogonalization_epsilon must be a finite number >= 0 "
                    "(0, or a small value such as 1e-8); got ",
                    orthogonalizationEpsilon);
}

// ---------------------------------------------------------------------------
// Layout

struct PowerSgdCodec::TensorPlan {
  int64_t key = 0;
  int64_t offset = 0;  // in the bucket buffer
  int64_t numel = 0;
  std::vector<int64_t> sizes;
  // Matrix view and rank; rank 0 means sent uncompressed.
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t rank = 0;
  // Uncompressed: where the tensor lies in the wire. Compressed: where its
  // P lies in the wire, and its Q in the Q buffer.
  int64_t wireOffset = 0;
  int64_t qOffset = 0;

  bool compressed() const { return rank > 0; }
  bool sameAs(const TensorPlan& o) const {
    return key == o.key && offset == o.offset && sizes == o.sizes;
  }
};

struct PowerSgdCodec::BucketPlan {
  int64_t bufferNumel = 0;
  at::ScalarType dtype = at::kFloat;
  std::vector<TensorPlan> tensors;  // bucket order
  // Compressed tensors in torch's P/Q order: grouped by matrix shape, groups
  // in order of first appearance.
  std::vector<int64_t> compressed;
  // Ranges of `compressed` whose random Qs come from one randn call.
  std::vector<std::pair<size_t, size_t>> drawGroups;
  int64_t uncompressedNumel = 0;
  int64_t pNumel = 0;
  int64_t qNumel = 0;
  int64_t numelAfter = 0;
  bool anyRankAboveOne = false;

  bool holds(int64_t key) const {
    return std::any_of(tensors.begin(), tensors.end(),
                       [key](const TensorPlan& t) { return t.key == key; });
  }
  bool sameAs(const BucketPlan& o) const {
    if (bufferNumel != o.bufferNumel || dtype != o.dtype || tensors.size() != o.tensors.size()) {
      return false;
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!tensors[i].sameAs(o.tensors[i])) return false;
    }
    return true;
  }
};

struct PowerSgdCodec::Bucket {
  BucketPlan plan;
  // The buffers below hold the parameters' state (set by prepare).
  bool adopted = false;
  at::Tensor wire;              // uncompressed gradients, then P
  at::Tensor q;                 // Q; between steps, the warm-start memory
  at::Tensor qT;                // Q transposed, for matrices of rank > 1
  at::Tensor error;             // error feedback, indexed like the bucket buffer
  std::vector<uint8_t> finite;  // per compressed matrix: P was finite
  // The same on a GPU bucket, as 0-dim bool tensors on the device: reading
  // them on the host would wait for the device.
  std::vector<at::Tensor> finiteOnDevice;
  // The device route: where each entry of the wire's uncompressed part lies
  // in the bucket (int64, on the bucket's device), so those tensors move in
  // one gather and one scatter however many there are.
  at::Tensor uncompressedIndex;
  Phase phase = Phase::kIdle;
  at::Tensor buffer;  // the bucket buffer of the step in flight
};

PowerSgdCodec::PowerSgdCodec(PowerSgdOptions options) : options_(options) {
  options_.validate();
  const char* route = std::getenv("XCOMM_POWERSGD_ROUTE");
  atenOnCpu_ = route != nullptr && std::string(route) == "aten";
}

PowerSgdCodec::~PowerSgdCodec() = default;

PowerSgdCodec::BucketPlan PowerSgdCodec::planLayout(const at::Tensor& buffer,
                                                    const std::vector<at::Tensor>& grads,
                                                    const std::vector<int64_t>& keys) const {
  TORCH_CHECK_VALUE(buffer.defined(), "xcomm: PowerSGD got an undefined bucket buffer");
  TORCH_CHECK_VALUE(supportedDtype(buffer.scalar_type()),
                    "xcomm: PowerSGD compresses float32, float64, float16 and bfloat16 "
                    "gradients; this bucket holds ",
                    dtypeName(buffer.scalar_type()));
  TORCH_CHECK_VALUE(buffer.dim() == 1 && buffer.is_contiguous(),
                    "xcomm: PowerSGD expects the bucket buffer to be a contiguous 1-D tensor "
                    "(bucket.buffer()); got shape ",
                    shapeString(buffer.sizes()));
  TORCH_CHECK_VALUE(grads.size() == keys.size(), "xcomm: PowerSGD setLayout got ", grads.size(),
                    " gradients but ", keys.size(), " parameter keys");

  BucketPlan plan;
  plan.bufferNumel = buffer.numel();
  plan.dtype = buffer.scalar_type();
  const int64_t base = buffer.storage_offset();
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    TORCH_CHECK_VALUE(g.defined() && g.scalar_type() == plan.dtype && g.is_contiguous() &&
                          (g.numel() == 0 || g.is_alias_of(buffer)),
                      "xcomm: PowerSGD expects gradient ", i,
                      " to be a contiguous view into the bucket buffer (bucket.gradients()), "
                      "of the buffer's dtype ",
                      dtypeName(plan.dtype));
    TensorPlan t;
    t.key = keys[i];
    t.offset = g.numel() == 0 ? 0 : g.storage_offset() - base;
    t.numel = g.numel();
    t.sizes = g.sizes().vec();
    TORCH_CHECK_VALUE(t.offset >= 0 && t.offset + t.numel <= plan.bufferNumel,
                      "xcomm: PowerSGD gradient ", i, " lies outside the bucket buffer");
    // torch views each gradient as size(0) x rest. A 0-d gradient (which
    // makes torch's hook fail) and an empty one are sent uncompressed.
    if (g.dim() >= 1 && t.numel > 0) {
      const int64_t rows = g.size(0);
      const int64_t cols = t.numel / rows;
      const int64_t rank = std::min({rows, cols, options_.matrixApproximationRank});
      // Exactly torch's test, in doubles (exact for every realistic size).
      if (static_cast<double>((rows + cols) * rank) * options_.minCompressionRate <
          static_cast<double>(rows * cols)) {
        t.rows = rows;
        t.cols = cols;
        t.rank = rank;
      }
    }
    plan.tensors.push_back(std::move(t));
  }

  // DDP never overlaps gradients; anything else would be compressed twice.
  std::vector<const TensorPlan*> byOffset;
  for (const auto& t : plan.tensors) {
    if (t.numel > 0) byOffset.push_back(&t);
  }
  std::sort(byOffset.begin(), byOffset.end(),
            [](const TensorPlan* a, const TensorPlan* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < byOffset.size(); ++i) {
    TORCH_CHECK_VALUE(byOffset[i - 1]->offset + byOffset[i - 1]->numel <= byOffset[i]->offset,
                      "xcomm: PowerSGD got overlapping gradients in one bucket");
  }

  // Uncompressed tensors first in the wire, in bucket order (torch's cat).
  for (auto& t : plan.tensors) {
    if (!t.compressed()) {
      t.wireOffset = plan.uncompressedNumel;
      plan.uncompressedNumel += t.numel;
      plan.numelAfter += t.numel;
    } else {
      plan.numelAfter += (t.rows + t.cols) * t.rank;
    }
  }
  // Compressed ones grouped by matrix shape, as torch's shape_to_tensors.
  std::vector<std::pair<int64_t, int64_t>> shapes;
  std::vector<std::vector<int64_t>> groups;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const auto& t = plan.tensors[i];
    if (!t.compressed()) continue;
    const std::pair<int64_t, int64_t> shape{t.rows, t.cols};
    auto it = std::find(shapes.begin(), shapes.end(), shape);
    if (it == shapes.end()) {
      shapes.push_back(shape);
      groups.emplace_back();
      it = shapes.end() - 1;
    }
    groups[it - shapes.begin()].push_back(static_cast<int64_t>(i));
  }
  int64_t p = plan.uncompressedNumel;
  for (const auto& group : groups) {
    const size_t first = plan.compressed.size();
    for (int64_t i : group) {
      auto& t = plan.tensors[i];
      t.wireOffset = p;
      t.qOffset = plan.qNumel;
      p += t.rows * t.rank;
      plan.qNumel += t.cols * t.rank;
      plan.anyRankAboveOne = plan.anyRankAboveOne || t.rank > 1;
      plan.compressed.push_back(i);
      if (!options_.batchTensorsWithSameShape) {
        plan.drawGroups.emplace_back(plan.compressed.size() - 1, plan.compressed.size());
      }
    }
    if (options_.batchTensorsWithSameShape) {
      plan.drawGroups.emplace_back(first, plan.compressed.size());
    }
  }
  plan.pNumel = p - plan.uncompressedNumel;
  return plan;
}

void PowerSgdCodec::setLayout(int64_t bucket, const at::Tensor& buffer,
                              const std::vector<at::Tensor>& grads,
                              const std::vector<int64_t>& keys) {
  BucketPlan plan = planLayout(buffer, grads, keys);
  std::lock_guard<std::mutex> lock(mutex_);
  auto& slot = buckets_[bucket];
  if (!slot) slot = std::make_unique<Bucket>();
  Bucket& b = *slot;
  TORCH_CHECK(b.phase == Phase::kIdle, "xcomm: PowerSGD bucket ", bucket,
              " changed its layout in the middle of a step");
  if (b.plan.sameAs(plan) && !b.plan.tensors.empty()) return;
  b.plan = std::move(plan);
  b.adopted = false;
}

bool PowerSgdCodec::hasLayout(int64_t bucket) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return findBucket(bucket) != nullptr;
}

const PowerSgdCodec::Bucket* PowerSgdCodec::findBucket(int64_t bucket) const {
  auto it = buckets_.find(bucket);
  return it == buckets_.end() ? nullptr : it->second.get();
}

PowerSgdCodec::Bucket& PowerSgdCodec::bucketOrThrow(int64_t bucket, const char* phase) {
  auto it = buckets_.find(bucket);
  TORCH_CHECK(it != buckets_.end(), "xcomm: PowerSGD ", phase, " for bucket ", bucket,
              ", whose layout was never set (call setLayout first)");
  return *it->second;
}

PowerSgdCodec::Bucket& PowerSgdCodec::bucketAfter(int64_t bucket, const char* step, Phase expected,
                                                  const char* previous) {
  // Buckets live behind unique_ptrs: the reference stays valid after the lock.
  std::lock_guard<std::mutex> lock(mutex_);
  Bucket& b = bucketOrThrow(bucket, step);
  TORCH_CHECK(b.phase == expected, "xcomm: PowerSGD ", step, " for bucket ", bucket, " without a ",
              previous, " before it (each step runs prepare, reduceP, finish)");
  return b;
}

std::vector<int64_t> PowerSgdCodec::compressionRanks(int64_t bucket) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Bucket* b = findBucket(bucket);
  TORCH_CHECK(b != nullptr, "xcomm: PowerSGD has no layout for bucket ", bucket);
  std::vector<int64_t> ranks;
  for (const auto& t : b->plan.tensors) ranks.push_back(t.rank);
  return ranks;
}

// ---------------------------------------------------------------------------
// State

bool PowerSgdCodec::missingQ(int64_t bucket, const Bucket& b) const {
  // As torch: a bucket draws on its first step and, without warm start, on
  // every step, even when it has nothing to compress (the draw still
  // advances the seed sequence). Also when a parameter has no Q (state
  // restored from another configuration).
  if (!options_.warmStart || warmBuckets_.count(bucket) == 0) return true;
  for (int64_t i : b.plan.compressed) {
    auto it = params_.find(b.plan.tensors[i].key);
    if (it == params_.end() || !it->second.q.defined()) return true;
  }
  return false;
}

bool PowerSgdCodec::needsSeed(int64_t bucket) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Bucket* b = findBucket(bucket);
  TORCH_CHECK(b != nullptr, "xcomm: PowerSGD needsSeed for bucket ", bucket,
              ", whose layout was never set (call setLayout first)");
  return missingQ(bucket, *b);
}

// Points the bucket's buffers at the state of the parameters it now holds.
void PowerSgdCodec::adoptState(Bucket& b, const at::Tensor& buffer) {
  const BucketPlan& plan = b.plan;
  b.uncompressedIndex = at::Tensor();  // the layout's, rebuilt on the next device step
  const auto opts = buffer.options();
  at::Tensor wire = at::empty({plan.uncompressedNumel + plan.pNumel}, opts);
  at::Tensor q = at::empty({plan.qNumel}, opts);
  at::Tensor qT = plan.anyRankAboveOne ? at::empty({plan.qNumel}, opts) : at::Tensor();
  at::Tensor error = options_.useErrorFeedback ? at::zeros({plan.bufferNumel}, opts) : at::Tensor();

  for (const auto& t : plan.tensors) {
    auto& state = params_[t.key];
    if (options_.useErrorFeedback && t.numel > 0) {
      at::Tensor view = error.narrow(0, t.offset, t.numel);
      if (state.error.defined()) {
        TORCH_CHECK_VALUE(state.error.numel() == t.numel, "xcomm: PowerSGD error-feedback state ",
                          "for parameter key ", t.key, " has ", state.error.numel(),
                          " elements, but its gradient has shape ", shapeString(t.sizes),
                          "; the state belongs to a different model");
        view.copy_(state.error.reshape({-1}));
      }
      state.error = view;
    }
    if (t.compressed() && options_.warmStart) {
      at::Tensor view = q.narrow(0, t.qOffset, t.cols * t.rank).view({t.cols, t.rank});
      if (state.q.defined()) {
        TORCH_CHECK_VALUE(state.q.sizes() == view.sizes(), "xcomm: PowerSGD warm-start Q for ",
                          "parameter key ", t.key, " has shape ", shapeString(state.q.sizes()),
                          ", but a ", shapeString(t.sizes), " gradient at rank ", t.rank, " needs ",
                          shapeString(view.sizes()),
                          "; the state belongs to a different model or rank");
        view.copy_(state.q);
        state.q = view;
      }
    }
  }
  b.wire = std::move(wire);
  b.q = std::move(q);
  b.qT = std::move(qT);
  b.error = std::move(error);
  b.finite.assign(plan.compressed.size(), 1);
  b.adopted = true;
}

void PowerSgdCodec::drawQ(Bucket& b, uint64_t seed) {
  // torch's hook: torch.manual_seed(seed), then one torch.randn(*q.shape) per
  // (possibly batched) q, in P/Q order. A fresh generator seeded alike draws
  // the same numbers without touching the global one.
  at::Generator gen = at::detail::createCPUGenerator(seed);
  // Drawn on the host for a GPU bucket too: the same numbers on every rank
  // and device, from a generator of its own.
  const auto opts = b.q.options().device(at::kCPU);
  for (const auto& [first, last] : b.plan.drawGroups) {
    const auto& t = b.plan.tensors[b.plan.compressed[first]];
    const auto count = static_cast<int64_t>(last - first);
    at::Tensor drawn = at::randn({count, t.cols, t.rank}, gen, opts);
    b.q.narrow(0, t.qOffset, count * t.cols * t.rank).copy_(drawn.reshape({-1}));
  }
}

std::vector<int64_t> PowerSgdCodec::stateKeys() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> keys;
  for (const auto& [key, state] : params_) {
    if (state.error.defined() || state.q.defined()) keys.push_back(key);
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

PowerSgdParamState PowerSgdCodec::paramState(int64_t key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = params_.find(key);
  PowerSgdParamState out;
  if (it == params_.end()) return out;
  if (it->second.error.defined()) out.error = it->second.error.reshape({-1}).clone();
  if (it->second.q.defined()) out.q = it->second.q.clone();
  return out;
}

void PowerSgdCodec::setParamState(int64_t key, const PowerSgdParamState& state) {
  std::lock_guard<std::mutex> lock(mutex_);
  // A bucket in flight writes its parameters' state when it finishes, so the
  // state of one of them cannot be replaced then; another bucket's parameter
  // can (a caller moving an idle bucket to another method while the next
  // bucket's step runs).
  for (auto& [index, b] : buckets_) {
    TORCH_CHECK(b->phase == Phase::kIdle || !b->plan.holds(key),
                "xcomm: PowerSGD state of parameter key ", key, " cannot be replaced while bucket ",
                index, ", which holds it, is in the middle of a step");
  }
  PowerSgdParamState copy;
  if (state.error.defined()) copy.error = state.error.detach().to(at::kCPU).reshape({-1}).clone();
  if (state.q.defined()) {
    TORCH_CHECK_VALUE(state.q.dim() == 2, "xcomm: PowerSGD Q state must be 2-D (cols x rank)");
    copy.q = state.q.detach().to(at::kCPU).clone();
  }
  params_[key] = std::move(copy);
  // The buckets that hold it re-read their parameters' state at their next prepare.
  for (auto& [index, b] : buckets_) {
    if (b->plan.holds(key)) b->adopted = false;
  }
}

void PowerSgdCodec::clearState() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [index, b] : buckets_) {
    TORCH_CHECK(b->phase == Phase::kIdle,
                "xcomm: PowerSGD state cannot be cleared in the middle of a step");
    b->adopted = false;
  }
  params_.clear();
  warmBuckets_.clear();
}

std::vector<int64_t> PowerSgdCodec::warmBuckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {warmBuckets_.begin(), warmBuckets_.end()};
}

void PowerSgdCodec::setWarmBuckets(const std::vector<int64_t>& buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  warmBuckets_ = std::set<int64_t>(buckets.begin(), buckets.end());
}

// ---------------------------------------------------------------------------
// The three phases

namespace {

template <typename T>
T* ptr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

}  // namespace

PowerSgdStepInfo PowerSgdCodec::prepare(int64_t bucket, const at::Tensor& buffer,
                                        std::optional<uint64_t> seed) {
  Bucket* bp = nullptr;
  bool draw = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Bucket& b = bucketOrThrow(bucket, "prepare");
    TORCH_CHECK(b.phase == Phase::kIdle, "xcomm: PowerSGD prepare for bucket ", bucket,
                " while its previous step is unfinished (each step runs prepare, reduceP, "
                "finish)");
    TORCH_CHECK_VALUE(buffer.defined() && buffer.dim() == 1 && buffer.is_contiguous() &&
                          buffer.scalar_type() == b.plan.dtype &&
                          buffer.numel() == b.plan.bufferNumel &&
                          (!b.adopted || !b.wire.defined() || buffer.device() == b.wire.device()),
                      "xcomm: PowerSGD prepare for bucket ", bucket,
                      " got a buffer that does not match its layout (expected a contiguous ",
                      dtypeName(b.plan.dtype), " tensor of ", b.plan.bufferNumel,
                      " elements on the bucket's device); call setLayout when the bucket changes");
    draw = missingQ(bucket, b);
    TORCH_CHECK_VALUE(draw == seed.has_value(), "xcomm: PowerSGD prepare for bucket ", bucket,
                      draw ? " needs a seed to draw random Qs (see needsSeed)"
                           : " got a seed but has warm-start Qs (see needsSeed)");
    if (!b.adopted) adoptState(b, buffer);
    if (draw && options_.warmStart) {
      warmBuckets_.insert(bucket);
      // The Qs drawn below become the parameters' warm-start state.
      for (int64_t i : b.plan.compressed) {
        const auto& t = b.plan.tensors[i];
        params_[t.key].q = b.q.narrow(0, t.qOffset, t.cols * t.rank).view({t.cols, t.rank});
      }
    }
    b.buffer = buffer;
    bp = &b;
  }
  Bucket& b = *bp;
  const BucketPlan& plan = b.plan;
  if (draw) drawQ(b, *seed);
  if (onDeviceRoute(buffer)) {
    prepareOnDevice(b, buffer);
    return stepInfo(b);
  }

  // Orthogonalize every Q (drawn or warm) and transpose the rank > 1 ones.
  std::vector<Task> matrices;
  for (size_t c = 0; c < plan.compressed.size(); ++c) {
    const auto& t = plan.tensors[plan.compressed[c]];
    matrices.push_back({static_cast<int64_t>(c), 0, 0, t.cols * t.rank * t.rank});
  }
  // Then P = (M + E) Q by rows, and the uncompressed gradients into the wire.
  std::vector<Task> rows;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const auto& t = plan.tensors[i];
    if (t.compressed()) {
      addChunks(rows, static_cast<int64_t>(i), t.rows, kTaskElements / t.cols,
                t.cols * (1 + t.rank));
    } else if (t.numel > 0) {
      addChunks(rows, static_cast<int64_t>(i), t.numel, kTaskElements, 1);
    }
  }

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, plan.dtype, "powersgd_prepare", [&] {
    scalar_t* buf = ptr<scalar_t>(buffer);
    scalar_t* err = ptr<scalar_t>(b.error);
    scalar_t* wire = ptr<scalar_t>(b.wire);
    scalar_t* q = ptr<scalar_t>(b.q);
    scalar_t* qT = ptr<scalar_t>(b.qT);
    const double eps = options_.orthogonalizationEpsilon;
    runTasks(matrices, [&](const Task& task) {
      const auto& t = plan.tensors[plan.compressed[task.item]];
      powersgd::orthonormalize(q + t.qOffset, t.cols, t.rank, eps);
      if (t.rank > 1) powersgd::transposeInto(qT + t.qOffset, q + t.qOffset, t.cols, t.rank);
    });
    runTasks(rows, [&](const Task& task) {
      const auto& t = plan.tensors[task.item];
      scalar_t* e = err != nullptr ? err + t.offset : nullptr;
      if (t.compressed()) {
        const scalar_t* qt = (t.rank > 1 ? qT : q) + t.qOffset;
        powersgd::projectRows(buf + t.offset, e, t.cols, qt, t.rank, wire + t.wireOffset,
                              task.begin, task.end);
      } else {
        powersgd::packUncompressed(buf + t.offset + task.begin, e ? e + task.begin : nullptr,
                                   wire + t.wireOffset + task.begin, task.end - task.begin);
      }
    });
  });

  return stepInfo(b);
}

PowerSgdStepInfo PowerSgdCodec::stepInfo(Bucket& b) const {
  const BucketPlan& plan = b.plan;
  b.phase = Phase::kPrepared;
  PowerSgdStepInfo info;
  info.wire = b.wire;
  info.qNumel = plan.qNumel;
  info.numelBefore = 0;
  for (const auto& t : plan.tensors) info.numelBefore += t.numel;
  info.numelAfter = plan.numelAfter;
  return info;
}

void PowerSgdCodec::abortStep(int64_t bucket) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = buckets_.find(bucket);
  if (it == buckets_.end()) return;
  it->second->phase = Phase::kIdle;
  it->second->buffer = at::Tensor();
}

namespace {

// Checks a tensor handed back by the caller after an allreduce and copies it
// into the codec's buffer when the collective returned a different tensor.
void adoptReduced(const at::Tensor& reduced, at::Tensor& own, int64_t bucket, const char* what) {
  TORCH_CHECK_VALUE(reduced.defined() && reduced.numel() == own.numel() &&
                        reduced.scalar_type() == own.scalar_type(),
                    "xcomm: PowerSGD bucket ", bucket, ": the summed ", what, " has ",
                    reduced.defined() ? reduced.numel() : 0, " elements of ",
                    reduced.defined() ? dtypeName(reduced.scalar_type()) : std::string("?"),
                    ", expected the ", own.numel(), " elements of ", dtypeName(own.scalar_type()),
                    " this bucket sent");
  if (own.numel() > 0 && reduced.data_ptr() != own.data_ptr()) own.copy_(reduced.reshape({-1}));
}

int64_t columnChunk(int64_t rows, int64_t cols, int64_t rank) {
  const int64_t wanted = (kTaskElements / std::max<int64_t>(rows, 1) + 15) / 16 * 16;
  const int64_t cap = std::max<int64_t>(16, kMaxColumnAccumulators / rank);
  return std::min(cols, std::clamp<int64_t>(wanted, 16, cap));
}

}  // namespace

at::Tensor PowerSgdCodec::reduceP(int64_t bucket, const at::Tensor& summedWire, int64_t worldSize) {
  Bucket& b = bucketAfter(bucket, "reduceP", Phase::kPrepared, "prepare");
  TORCH_CHECK_VALUE(worldSize >= 1, "xcomm: PowerSGD world size must be >= 1; got ", worldSize);
  adoptReduced(summedWire, b.wire, bucket, "wire (uncompressed gradients and P)");
  const BucketPlan& plan = b.plan;
  if (onDeviceRoute(b.buffer)) {
    reducePOnDevice(b, worldSize);
    b.phase = Phase::kReducedP;
    return b.q;
  }

  std::vector<Task> first;  // orthogonalize P; unpack the uncompressed gradients
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const auto& t = plan.tensors[i];
    if (t.compressed()) {
      first.push_back({static_cast<int64_t>(i), 0, 0, t.rows * t.rank * t.rank});
    } else if (t.numel > 0) {
      addChunks(first, static_cast<int64_t>(i), t.numel, kTaskElements, 1);
    }
  }
  b.finite.assign(plan.tensors.size(), 1);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, plan.dtype, "powersgd_reduce_p", [&] {
    scalar_t* buf = ptr<scalar_t>(b.buffer);
    scalar_t* err = ptr<scalar_t>(b.error);
    scalar_t* wire = ptr<scalar_t>(b.wire);
    scalar_t* q = ptr<scalar_t>(b.q);
    runTasks(first, [&](const Task& task) {
      const auto& t = plan.tensors[task.item];
      if (t.compressed()) {
        scalar_t* p = wire + t.wireOffset;
        // P is a sum over ranks: if any rank's M + E was not finite, P is
        // not finite on every rank alike (see finish).
        b.finite[task.item] = powersgd::allFinite(p, t.rows * t.rank);
        if (b.finite[task.item]) {
          powersgd::orthonormalize(p, t.rows, t.rank, options_.orthogonalizationEpsilon);
        }
      } else {
        scalar_t* e = err != nullptr ? err + t.offset + task.begin : nullptr;
        powersgd::unpackUncompressed(buf + t.offset + task.begin, e,
                                     wire + t.wireOffset + task.begin, task.end - task.begin,
                                     worldSize);
      }
    });
    // Q = M^T P by column ranges. A matrix whose P is not finite keeps its
    // (orthogonalized) previous Q, so its warm start survives the step.
    std::vector<Task> columns;
    for (int64_t i : plan.compressed) {
      const auto& t = plan.tensors[i];
      if (b.finite[i]) addChunks(columns, i, t.cols, columnChunk(t.rows, t.cols, t.rank), t.rows);
    }
    runTasks(columns, [&](const Task& task) {
      const auto& t = plan.tensors[task.item];
      powersgd::projectColumns(buf + t.offset, t.rows, t.cols, wire + t.wireOffset, t.rank,
                               q + t.qOffset, task.begin, task.end);
    });
  });
  b.phase = Phase::kReducedP;
  return b.q;
}

void PowerSgdCodec::finish(int64_t bucket, const at::Tensor& summedQ, int64_t worldSize) {
  Bucket& b = bucketAfter(bucket, "finish", Phase::kReducedP, "reduceP");
  TORCH_CHECK_VALUE(worldSize >= 1, "xcomm: PowerSGD world size must be >= 1; got ", worldSize);
  adoptReduced(summedQ, b.q, bucket, "Q");
  const BucketPlan& plan = b.plan;
  if (onDeviceRoute(b.buffer)) {
    finishOnDevice(b, worldSize);
    b.buffer = at::Tensor();
    b.phase = Phase::kIdle;
    return;
  }

  std::vector<Task> matrices;
  std::vector<Task> rows;
  for (int64_t i : plan.compressed) {
    const auto& t = plan.tensors[i];
    matrices.push_back({i, 0, 0, t.cols * t.rank});
    addChunks(rows, i, t.rows, kTaskElements / t.cols, t.cols * (t.rank + 2));
  }

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, plan.dtype, "powersgd_finish", [&] {
    scalar_t* buf = ptr<scalar_t>(b.buffer);
    scalar_t* err = ptr<scalar_t>(b.error);
    scalar_t* wire = ptr<scalar_t>(b.wire);
    scalar_t* q = ptr<scalar_t>(b.q);
    scalar_t* qT = ptr<scalar_t>(b.qT);
    runTasks(matrices, [&](const Task& task) {
      const auto& t = plan.tensors[task.item];
      // Q is kept divided by the world size, as torch keeps it.
      powersgd::divideInto(q + t.qOffset, q + t.qOffset, t.cols * t.rank, worldSize);
      if (t.rank > 1) powersgd::transposeInto(qT + t.qOffset, q + t.qOffset, t.cols, t.rank);
    });
    runTasks(rows, [&](const Task& task) {
      const auto& t = plan.tensors[task.item];
      scalar_t* m = buf + t.offset;
      if (!b.finite[task.item]) {
        // Non-finite input on some rank: the whole matrix becomes NaN on every
        // rank (as in torch, where the NaN spreads through orthogonalization),
        // but the error feedback is left as it was, so a step skipped by a
        // GradScaler does not poison the following ones.
        std::fill(m + task.begin * t.cols, m + task.end * t.cols,
                  scalar_t(std::numeric_limits<float>::quiet_NaN()));
        return;
      }
      const scalar_t* qt = (t.rank > 1 ? qT : q) + t.qOffset;
      powersgd::reconstructRows(m, err != nullptr ? err + t.offset : nullptr, t.cols,
                                wire + t.wireOffset, qt, t.rank, task.begin, task.end);
    });
  });
  b.buffer = at::Tensor();
  b.phase = Phase::kIdle;
}

// ---------------------------------------------------------------------------
// The three phases on a GPU bucket: the same steps in ATen ops on the
// bucket's device (cuBLAS matmuls), queued on the caller's stream with no
// host synchronization; where xcomm's CUDA kernels are built, Gram-Schmidt
// and the last phase's decompression are one kernel each. The CPU route's per-element arithmetic is
// not reproduced bit for bit (cuBLAS sums in its own order), but every rank computes the same bits
// on the same GPU model.

namespace {

// Gram-Schmidt as torch's hook: each column divided by (its norm + eps),
// then taken out of the later ones; Householder QR (torch.linalg.qr) for
// double matrices of rank > 2, as the CPU route chooses.
void orthonormalizeOnDevice(const at::Tensor& x, double eps) {
  const int64_t rank = x.size(1);
  if (rank > 2 && x.scalar_type() == at::kDouble) {
    x.copy_(std::get<0>(at::linalg_qr(x)));
    return;
  }
  if (cuda::gramSchmidt(x, eps)) return;  // one kernel where xcomm has its CUDA kernels
  for (int64_t i = 0; i < rank; ++i) {
    at::Tensor col = x.narrow(1, i, 1);
    at::Tensor norm = at::linalg_vector_norm(col, 2, at::IntArrayRef{0}, /*keepdim=*/true);
    if (eps != 0.0) norm.add_(eps);
    col.div_(norm);
    if (i + 1 < rank) {
      at::Tensor rest = x.narrow(1, i + 1, rank - i - 1);
      rest.sub_((col * rest).sum(0, /*keepdim=*/true) * col);
    }
  }
}

at::Tensor matrixOf(const at::Tensor& flat, int64_t offset, int64_t rows, int64_t cols) {
  return flat.narrow(0, offset, rows * cols).view({rows, cols});
}

// Orthonormalizes every matrix of `xs` (a bucket's Ps or Qs). Where xcomm's
// CUDA kernels take them all, that is one launch per run of similar shapes,
// and with `finite` the same launches say which matrix was finite before
// (finite[c] a 0-dim bool on the device); otherwise one matrix at a time.
void orthonormalizeAllOnDevice(const std::vector<at::Tensor>& xs, double eps,
                               std::vector<at::Tensor>* finite) {
  if (xs.empty()) return;
  const bool householder = std::any_of(xs.begin(), xs.end(), [](const at::Tensor& x) {
    return x.size(1) > 2 && x.scalar_type() == at::kDouble;
  });
  if (!householder && cuda::codecsBuilt()) {
    const auto count = static_cast<int64_t>(xs.size());
    at::Tensor flags = finite != nullptr ? at::empty({count}, xs.front().options().dtype(at::kBool))
                                         : at::Tensor();
    if (cuda::gramSchmidtBatch(xs, eps, flags)) {
      if (finite != nullptr) {
        finite->clear();
        for (int64_t c = 0; c < count; ++c) finite->push_back(flags.select(0, c));
      }
      return;
    }
  }
  if (finite != nullptr) finite->clear();
  for (const auto& x : xs) {
    if (finite != nullptr) finite->push_back(at::isfinite(x).all());
    orthonormalizeOnDevice(x, eps);
  }
}

}  // namespace

void PowerSgdCodec::prepareOnDevice(Bucket& b, const at::Tensor& buffer) {
  const BucketPlan& plan = b.plan;
  // M + E for the compressed matrices and g + e for the rest: the residual
  // is laid out like the bucket.
  if (b.error.defined()) buffer.add_(b.error);
  std::vector<at::Tensor> qs;
  for (int64_t i : plan.compressed) {
    const auto& t = plan.tensors[i];
    qs.push_back(matrixOf(b.q, t.qOffset, t.cols, t.rank));
  }
  orthonormalizeAllOnDevice(qs, options_.orthogonalizationEpsilon, nullptr);
  for (size_t c = 0; c < plan.compressed.size(); ++c) {
    const auto& t = plan.tensors[plan.compressed[c]];
    const at::Tensor& q = qs[c];
    at::Tensor p = matrixOf(b.wire, t.wireOffset, t.rows, t.rank);
    at::Tensor m = matrixOf(buffer, t.offset, t.rows, t.cols);
    if (!cuda::powersgdProject(p, m, q)) at::mm_out(p, m, q);
  }
  if (plan.uncompressedNumel > 0) {
    if (!b.uncompressedIndex.defined()) {
      std::vector<at::Tensor> parts;  // in wire order: the plan's order
      for (const auto& t : plan.tensors) {
        if (!t.compressed() && t.numel > 0) {
          parts.push_back(at::arange(t.offset, t.offset + t.numel, at::kLong));
        }
      }
      b.uncompressedIndex = at::cat(parts).to(buffer.device());
    }
    at::Tensor wire = b.wire.narrow(0, 0, plan.uncompressedNumel);
    at::index_select_out(wire, buffer, 0, b.uncompressedIndex);
  }
}

void PowerSgdCodec::reducePOnDevice(Bucket& b, int64_t worldSize) {
  const BucketPlan& plan = b.plan;
  const auto w = static_cast<double>(worldSize);
  b.finiteOnDevice.assign(plan.tensors.size(), at::Tensor());
  if (plan.uncompressedNumel > 0 &&
      !cuda::powersgdUnpackUncompressed(b.buffer, b.error, b.wire, b.uncompressedIndex,
                                        worldSize)) {
    const at::Tensor& index = b.uncompressedIndex;
    at::Tensor avg = b.wire.narrow(0, 0, plan.uncompressedNumel).div(w);
    if (b.error.defined()) {
      // The bucket still holds gradient + old error; where avg is not finite
      // the error is left as it was.
      at::Tensor grad = b.buffer.index_select(0, index);
      at::Tensor err = b.error.index_select(0, index);
      b.error.index_copy_(0, index, at::where(at::isfinite(avg), grad - avg, err));
    }
    b.buffer.index_copy_(0, index, avg);
  }
  // P is a sum over ranks: not finite on one rank, not finite on all alike.
  std::vector<at::Tensor> ps;
  for (int64_t i : plan.compressed) {
    const auto& t = plan.tensors[i];
    ps.push_back(matrixOf(b.wire, t.wireOffset, t.rows, t.rank));
  }
  std::vector<at::Tensor> finiteP;
  orthonormalizeAllOnDevice(ps, options_.orthogonalizationEpsilon, &finiteP);
  for (size_t c = 0; c < plan.compressed.size(); ++c) {
    const int64_t i = plan.compressed[c];
    const auto& t = plan.tensors[i];
    const at::Tensor& p = ps[c];
    const at::Tensor& finite = finiteP[c];
    b.finiteOnDevice[i] = finite;
    // A matrix whose P is not finite keeps its previous Q (its warm start).
    at::Tensor q = matrixOf(b.q, t.qOffset, t.cols, t.rank);
    at::Tensor m = matrixOf(b.buffer, t.offset, t.rows, t.cols);
    if (!cuda::powersgdProjectBack(q, m, p, finite)) {
      at::where_out(q, finite, at::mm(m.t(), p), q);  // elementwise: q may be its own `other`
    }
  }
}

void PowerSgdCodec::finishOnDevice(Bucket& b, int64_t worldSize) {
  const BucketPlan& plan = b.plan;
  const auto w = static_cast<double>(worldSize);
  // Q is kept divided by the world size, as torch keeps it; the Q buffer
  // holds the compressed matrices' Qs and nothing else: one division.
  if (b.q.numel() > 0) b.q.div_(w);
  for (int64_t i : plan.compressed) {
    const auto& t = plan.tensors[i];
    at::Tensor q = matrixOf(b.q, t.qOffset, t.cols, t.rank);
    at::Tensor m = matrixOf(b.buffer, t.offset, t.rows, t.cols);
    at::Tensor p = matrixOf(b.wire, t.wireOffset, t.rows, t.rank);
    const at::Tensor& finite = b.finiteOnDevice[i];
    at::Tensor err = b.error.defined() ? matrixOf(b.error, t.offset, t.rows, t.cols) : at::Tensor();
    if (cuda::powersgdReconstruct(m, err, p, q, finite)) continue;  // one kernel
    at::Tensor decompressed = at::mm(p, q.t());
    if (b.error.defined()) {
      // Not finite on some rank: NaN on every rank, and the error left as it was.
      at::where_out(err, finite, m - decompressed, err);
    }
    m.copy_(at::where(finite, decompressed, std::numeric_limits<double>::quiet_NaN()));
  }
}

}  // namespace xcomm
