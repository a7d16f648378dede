#include "collectives/compressed/AutoCompression.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "common/LinkBytes.hpp"
#include "compress/Int8Codec.hpp"

namespace xcomm {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// The least time of three runs of `fn`.
template <typename Fn>
double bestOfThree(Fn&& fn) {
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Clock::now();
    fn();
    best = std::min(best, seconds(t0));
  }
  return best;
}

void allreduceAndWait(Route& transport, at::Tensor t, c10d::ReduceOp::RedOpType op,
                      std::chrono::milliseconds timeout) {
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(op);
  opts.timeout = timeout;
  transport.allreduce(t, opts)->wait();
}

size_t index(Compression m) {
  return m == Compression::kNone ? 0 : (m == Compression::kBf16 ? 1 : 2);
}

}  // namespace

AutoCompression::AutoCompression(int size, const CompressionConfig& config, int64_t interval)
    : size_(size), chunkElems_(config.int8ChunkElems), interval_(interval) {
  TORCH_CHECK_VALUE(interval_ > 0, "xcomm: auto compression's interval must be > 0");
  for (Compression m : kMethods) {
    const bool listed = std::find(config.autoMethods.begin(), config.autoMethods.end(), m) !=
                        config.autoMethods.end();
    if (config.autoMethods.empty() || listed) allowed_.push_back(m);  // cheapest codec first
  }
  TORCH_CHECK_VALUE(!allowed_.empty(), "xcomm: auto has no method to choose from");
  if (config.autoLinkBytesPerSecond > 0) {
    fixedLatency_ = config.autoLinkLatency;
    fixedBandwidth_ = config.autoLinkBytesPerSecond;
  }
  // Read on each rank, not agreed: its only effects (a calibration and the
  // observed times) reach the choice through the round's allreduce MAX.
  if (const char* slow = std::getenv("XCOMM_AUTO_TEST_SLOW")) {
    const std::string spec = slow;
    const auto comma = spec.find(',');
    const auto methods = methodsNamed({spec.substr(0, comma)}, "XCOMM_AUTO_TEST_SLOW");
    slowMethod_ = methods[0];
    slowSeconds_ = comma == std::string::npos ? 0.0 : std::atof(spec.c_str() + comma + 1);
    TORCH_CHECK_VALUE(slowSeconds_ > 0, "xcomm: XCOMM_AUTO_TEST_SLOW must be '<method>,<seconds>' ",
                      "with seconds > 0, got '", spec, "'");
  }
}

std::vector<Compression> AutoCompression::methodsNamed(const std::vector<std::string>& names,
                                                       const std::string& source) {
  std::vector<Compression> methods;
  for (const auto& name : names) {
    const auto it = std::find_if(kMethods.begin(), kMethods.end(),
                                 [&](Compression m) { return name == compressionName(m); });
    TORCH_CHECK_VALUE(it != kMethods.end(), "xcomm: ", source, " names '", name,
                      "'; auto chooses among none, bf16 and int8");
    if (std::find(methods.begin(), methods.end(), *it) == methods.end()) methods.push_back(*it);
  }
  TORCH_CHECK_VALUE(!methods.empty(), "xcomm: ", source, " names no method");
  std::sort(methods.begin(), methods.end(),
            [](Compression a, Compression b) { return index(a) < index(b); });
  return methods;
}

ReductionCost AutoCompression::predict(Compression method, int64_t numel, int64_t elementSize,
                                       int size, int64_t int8ChunkElems, const AutoInputs& in) {
  TORCH_CHECK(method != Compression::kAuto, "xcomm: auto predicts none, bf16, fp16 or int8");
  BucketShape bucket;
  bucket.numel = numel;
  bucket.elementSize = elementSize;
  bucket.world = size;
  bucket.int8ChunkElems = int8ChunkElems;
  const LinkModel link{in.latencySeconds, in.secondsPerByte > 0 ? 1.0 / in.secondsPerByte : 0.0};
  const CodecCosts costs{{"bf16", in.bf16SecondsPerElem},
                         {"fp16", in.bf16SecondsPerElem},
                         {"int8", in.int8SecondsPerElem}};
  return predictAllreduce(compressionName(method), bucket, link, costs);
}

ReductionCost AutoCompression::uncorrected(Compression method, int64_t numel,
                                           int64_t elementSize) const {
  return predict(method, numel, elementSize, size_, chunkElems_, inputs_);
}

double AutoCompression::base(Compression method, int64_t numel, int64_t elementSize) const {
  const ReductionCost c = uncorrected(method, numel, elementSize);
  return observed_.base(index(method), c.codecSeconds, c.wireSeconds);
}

double AutoCompression::corrected(Compression method, int64_t numel, int64_t elementSize) const {
  const ReductionCost c = uncorrected(method, numel, elementSize);
  return observed_.predict(index(method), c.codecSeconds, c.wireSeconds);
}

void AutoCompression::agreeFactors(const double* agreedRatios) {
  observed_.update(std::vector<double>(agreedRatios, agreedRatios + observed_.keys()));
}

void AutoCompression::calibrate() {
  // 16 MiB of float32: out of cache, as gradients are. The work each method
  // adds to an allreduce of it (float32 in and out, this group's size).
  constexpr int64_t kElems = 1 << 22;
  at::Tensor x = at::randn({kElems}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor out = at::empty_like(x);
  localBf16_ = bestOfThree([&] { out.copy_(x.to(at::kBFloat16)); }) / kElems;
  Int8Codec codec(chunkElems_);
  const int64_t shard = codec.shardElems(kElems, size_);
  localInt8_ = bestOfThree([&] {
                 at::Tensor packed = codec.packShards(x, size_);
                 at::Tensor mine = codec.reduceAndPack(packed, shard, 1.0);
                 codec.unpackAll(mine.repeat({size_}), shard, out);
               }) /
               kElems;
  if (slowMethod_ == Compression::kBf16) localBf16_ = 0;
  if (slowMethod_ == Compression::kInt8) localInt8_ = 0;
  calibrated_ = true;
}

void AutoCompression::round(Route& transport, std::chrono::milliseconds timeout) {
  if (!calibrated_) calibrate();
  const double sinceLast = calls_ == 0 ? 0.0 : seconds(lastRound_);
  if (fixedBandwidth_ > 0) {  // XCOMM_AUTO_LINK: agree the codec costs only
    const auto ratios = observed_.local();
    at::Tensor costs = at::tensor({localBf16_, localInt8_, ratios[0], ratios[1], ratios[2]},
                                  at::TensorOptions().dtype(at::kDouble));
    allreduceAndWait(transport, costs, c10d::ReduceOp::MAX, timeout);
    lastRound_ = Clock::now();
    const double* c = costs.data_ptr<double>();
    agreeFactors(c + 2);
    inputs_ = AutoInputs{fixedLatency_, 1.0 / fixedBandwidth_, c[0], c[1]};
    publish();
    return;
  }
  // A probe twice back to back, timing the second: the first lines the ranks
  // up and drains what a link lets through faster than its sustained rate
  // after an idle moment (a token bucket's burst, switch buffers).
  at::Tensor probe = at::zeros({std::max<int64_t>(1, probeBytes_ / 4)});
  allreduceAndWait(transport, probe, c10d::ReduceOp::SUM, timeout);
  const auto t0 = Clock::now();
  allreduceAndWait(transport, probe, c10d::ReduceOp::SUM, timeout);
  const double took = seconds(t0);
  const double probeWireBytes = ringAllreduceBytes(static_cast<double>(probe.numel()) * 4.0, size_);
  // The latency is the least of the recent agreements (a late rank inflates
  // one) and may explain at most half of the probe, so a noisy latency cannot
  // make the link look infinitely fast.
  const double latency =
      agreements_.empty() ? 0.0 : *std::min_element(agreements_.begin(), agreements_.end());
  const double perByte = std::max(took - latency, 0.5 * took) / probeWireBytes;

  const auto ratios = observed_.local();
  at::Tensor agreed = at::tensor(
      {latency, perByte, localBf16_, localInt8_, sinceLast, ratios[0], ratios[1], ratios[2]},
      at::TensorOptions().dtype(at::kDouble));
  const auto t1 = Clock::now();
  allreduceAndWait(transport, agreed, c10d::ReduceOp::MAX, timeout);
  agreements_.push_back(seconds(t1));
  if (agreements_.size() > 5) agreements_.pop_front();
  lastRound_ = Clock::now();

  const double* v = agreed.data_ptr<double>();
  // The link used is the median of the last three agreed readings (of two,
  // the slower), so one noisy probe cannot flip the choices until the next
  // round. The readings are agreed values: the median is the same everywhere.
  readings_.push_back(v[1]);
  if (readings_.size() > 3) readings_.pop_front();
  std::vector<double> sorted(readings_.begin(), readings_.end());
  std::sort(sorted.begin(), sorted.end());
  AutoInputs in{v[0], sorted[sorted.size() / 2], v[2], v[3]};
  agreeFactors(v + 5);
  // The next probe: about 1% of the time between rounds (both runs of it),
  // growing at most 4x a round, between 64 kB (less measures a burst) and
  // 32 MB; sized from the faster of the median and the newest reading (a
  // probe too small for its link reads it slow, and sizing from that reading
  // would keep it small). The first round has no time between rounds to size
  // from: the probe keeps its size rather than shrinking to the smallest.
  if (v[4] > 0) {
    const double budget = 0.01 * v[4] / 2.0;
    const double fastest = std::max(std::min(in.secondsPerByte, v[1]), 1e-15);
    const double next = std::min({budget / fastest, 4.0 * static_cast<double>(probeBytes_), 32e6});
    probeBytes_ = static_cast<int64_t>(std::max(next, 64e3));
  }
  inputs_ = in;
  publish();
}

void AutoCompression::publish() {
  std::lock_guard<std::mutex> lock(mutex_);
  report_.rounds++;
  report_.inputs = inputs_;
  for (size_t k = 0; k < observed_.keys(); ++k) {
    report_.factors[k] = observed_.factor(k);
    report_.factorSources[k] = observed_.source(k);
  }
}

Compression AutoCompression::choose(Route& transport, int64_t numel, int64_t elementSize,
                                    std::chrono::milliseconds timeout) {
  if (calls_ % interval_ == 0) round(transport, timeout);
  ++calls_;
  Compression best = kMethods[0];
  double bestSeconds = std::numeric_limits<double>::infinity();
  std::ostringstream why;
  why << numel << " elements:";
  for (Compression m : allowed_) {
    // Corrected by what the methods were seen to take (the factors agreed).
    const double f = observed_.factor(index(m));
    const double t = corrected(m, numel, elementSize);
    why << " " << compressionName(m) << " " << t * 1e3 << " ms";
    if (f != 1.0) why << " (x" << f << ")";
    if (t < bestSeconds) {
      best = m;
      bestSeconds = t;
    }
  }
  why << " -> " << compressionName(best);
  pending_ = static_cast<int>(index(best));
  pendingBase_ = base(best, numel, elementSize);
  std::lock_guard<std::mutex> lock(mutex_);
  report_.chosen[index(best)]++;
  report_.last = why.str();
  return best;
}

void AutoCompression::observed(double seconds) {
  if (pending_ < 0) return;
  const auto key = static_cast<size_t>(pending_);
  pending_ = -1;
  if (kMethods[key] == slowMethod_) {
    std::this_thread::sleep_for(std::chrono::duration<double>(slowSeconds_));
    seconds += slowSeconds_;
  }
  // A method's first run pays one-time set-up (buffers, the direct
  // exchange's first messages): not what it costs from then on.
  if (!warm_[key]) {
    warm_[key] = true;
    return;
  }
  observed_.record(key, seconds, pendingBase_);
}

AutoReport AutoCompression::report() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return report_;
}

}  // namespace xcomm
