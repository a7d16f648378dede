#include "collectives/compressed/AutoCompression.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "collectives/compressed/CodecCalibration.hpp"
#include "collectives/compressed/MethodChoice.hpp"
#include "common/LinkBytes.hpp"

namespace xcomm {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
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
    : size_(size),
      chunkElems_(config.int8ChunkElems),
      interval_(interval),
      link_(1, kProbeFraction, interval) {
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

void AutoCompression::agreeFactors(const double* agreedRatios) {
  observed_.update(std::vector<double>(agreedRatios, agreedRatios + observed_.keys()));
}

void AutoCompression::calibrate() {
  // 16 MiB of float32 (out of cache, as gradients are), timed as every auto
  // times its codecs (CodecCalibration); without error feedback, as the
  // backend's int8 runs (timed with it, int8 read dearer and lost to bf16 at
  // 10 Gbit/s, where int8's steps were the faster).
  const CodecCosts costs =
      calibrateAllreduceCodecs(at::randn({int64_t{1} << 22}, at::TensorOptions().dtype(at::kFloat)),
                               size_, chunkElems_, 1, {"bf16", "int8"}, /*errorFeedback=*/false);
  localBf16_ = costs.at("bf16");
  localInt8_ = costs.at("int8");
  if (slowMethod_ == Compression::kBf16) localBf16_ = 0;
  if (slowMethod_ == Compression::kInt8) localInt8_ = 0;
  calibrated_ = true;
}

void AutoCompression::round(Route& transport, std::chrono::milliseconds timeout) {
  if (!calibrated_) calibrate();
  const auto start = Clock::now();
  // LinkEstimate's step is one choice: the time per choice since the last
  // round (0 at the first: no budget to size the next probe from yet).
  const int64_t choices = calls_ - lastRoundCall_;
  const double perChoice = choices > 0 ? seconds(lastRound_) / static_cast<double>(choices) : 0.0;
  lastRoundCall_ = calls_;
  const auto ratios = observed_.local();
  if (fixedBandwidth_ > 0) {  // XCOMM_AUTO_LINK: agree the codec costs only
    at::Tensor costs = at::tensor({localBf16_, localInt8_, ratios[0], ratios[1], ratios[2]},
                                  at::TensorOptions().dtype(at::kDouble));
    allreduceAndWait(transport, costs, c10d::ReduceOp::MAX, timeout);
    lastRound_ = Clock::now();
    const double* c = costs.data_ptr<double>();
    agreeFactors(c + 2);
    inputs_ = AutoInputs{fixedLatency_, 1.0 / fixedBandwidth_, c[0], c[1]};
    observed_.setLink(inputs_.secondsPerByte);
    nextRound_ = calls_ + interval_;
    publish();
    return;
  }
  // A probe twice back to back, timing the second: the first lines the ranks
  // up and drains what a link lets through faster than its sustained rate
  // after an idle moment (a token bucket's burst, switch buffers).
  at::Tensor probe = at::zeros({std::max<int64_t>(1, link_.probeBytes() / 4)});
  allreduceAndWait(transport, probe, c10d::ReduceOp::SUM, timeout);
  const auto t0 = Clock::now();
  allreduceAndWait(transport, probe, c10d::ReduceOp::SUM, timeout);
  const double perByte = link_.secondsPerByte(
      seconds(t0), ringAllreduceBytes(static_cast<double>(probe.numel()) * 4.0, size_));
  // The round's cost so far, and the last agreement's as this one's.
  const double spent = seconds(start) + link_.lastAgreement();
  // The latency negated: agreed as the least over ranks (the first rank at
  // an agreement also waited for the others to finish the probe).
  at::Tensor agreed = at::tensor({-link_.latency(), perByte, localBf16_, localInt8_, perChoice,
                                  spent, ratios[0], ratios[1], ratios[2]},
                                 at::TensorOptions().dtype(at::kDouble));
  const auto t1 = Clock::now();
  allreduceAndWait(transport, agreed, c10d::ReduceOp::MAX, timeout);
  link_.agreementTook(seconds(t1));
  lastRound_ = Clock::now();

  const double* v = agreed.data_ptr<double>();
  const double latency = -v[0];
  const std::vector<double> median = link_.fold(latency, v[4], v[5], {v[1]});
  agreeFactors(v + 6);
  inputs_ = AutoInputs{latency, median[0], v[2], v[3]};
  observed_.setLink(inputs_.secondsPerByte);
  // A reading far off the median is confirmed at the next choice where it
  // would change the last choice (agreed values only: the same on every rank).
  bool confirm = false;
  if (link_.changed() && lastNumel_ > 0) {
    const AutoInputs newest{latency, v[1], v[2], v[3]};
    confirm =
        best(lastNumel_, lastElementSize_, inputs_) != best(lastNumel_, lastElementSize_, newest);
  }
  nextRound_ = calls_ + link_.stride(confirm);
  publish();
}

void AutoCompression::publish() {
  std::lock_guard<std::mutex> lock(mutex_);
  report_.rounds++;
  report_.nextRound = nextRound_;
  report_.probeBytes = link_.probeBytes();
  report_.inputs = inputs_;
  for (size_t k = 0; k < observed_.keys(); ++k) {
    report_.factors[k] = observed_.factor(k);
    report_.factorSources[k] = observed_.source(k);
  }
}

Compression AutoCompression::best(int64_t numel, int64_t elementSize, const AutoInputs& in,
                                  std::ostringstream* why) const {
  std::vector<double> seconds;
  int noneIndex = -1;
  for (Compression m : allowed_) {
    // Corrected by what the methods were seen to take (the factors agreed).
    const ReductionCost c = predict(m, numel, elementSize, size_, chunkElems_, in);
    const double t = observed_.predict(index(m), c.codecSeconds, c.wireSeconds);
    if (why != nullptr) {
      const double f = observed_.factor(index(m));
      *why << " " << compressionName(m) << " " << t * 1e3 << " ms";
      if (f != 1.0) *why << " (x" << f << ")";
    }
    if (m == Compression::kNone) noneIndex = static_cast<int>(seconds.size());
    seconds.push_back(t);
  }
  // Every allreduce is a fresh choice (no method to keep: sizes vary, and the
  // agreed factors already drop a method seen slower than predicted).
  return allowed_[chooseMethod(seconds, /*current=*/-1, /*switchMargin=*/0.0, noneIndex)];
}

Compression AutoCompression::choose(Route& transport, int64_t numel, int64_t elementSize,
                                    std::chrono::milliseconds timeout) {
  if (calls_ >= nextRound_) round(transport, timeout);
  ++calls_;
  std::ostringstream why;
  why << numel << " elements:";
  const Compression pick = best(numel, elementSize, inputs_, &why);
  why << " -> " << compressionName(pick);
  lastNumel_ = numel;
  lastElementSize_ = elementSize;
  pending_ = static_cast<int>(index(pick));
  pendingBase_ = base(pick, numel, elementSize);
  std::lock_guard<std::mutex> lock(mutex_);
  report_.chosen[index(pick)]++;
  report_.last = why.str();
  return pick;
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
