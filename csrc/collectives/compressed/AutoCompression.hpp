#pragma once
// Options(compression="auto"): per allreduce, the method predicted fastest on
// this link and machine (none, bf16 or int8).
//
// Each method's time is the cost model's (CostModel.hpp, the one every auto
// predicts with). The inputs are measured, never guessed: the codecs timed
// once on this machine, the link probed by the group's own collectives at
// rounds (LinkEstimate, the one every auto measures with: median of three
// readings, probes sized and rounds spaced to take about 1% of the time
// between them, at least every `interval` choices, and a reading 2x off the
// median that would change the last choice confirmed at the next choice),
// and every input agreed by one allreduce MAX, so every rank computes the
// same choice from the same numbers and their collectives match. A "step"
// of LinkEstimate is one choice here.
//
// Two environment variables bound it (read and agreed by every rank when the
// group is made, backend/GroupSettings, and passed in the config):
// XCOMM_AUTO_METHODS="none,bf16" limits the choice; XCOMM_AUTO_LINK=
// "<latency s>,<bytes/s>" fixes the link instead of probing it (a known
// network; tests). Codec costs are still measured and agreed.
//
// The loop is closed (ObservedFactors, the one every auto uses): every
// allreduce auto runs is timed and compared with its prediction, because the
// codecs were timed on randn data on an idle machine and the probe can read
// a link slow. none's observations correct the link (key 0), a codec's
// correct that method (keys 1 and 2, bf16 and int8), and the ratios since
// the last round go into the round's allreduce MAX, so the factors, and
// hence the choices, are the same on every rank.
// XCOMM_AUTO_TEST_SLOW="<method>,<seconds>" (tests only: a codec far slower
// than calibrated on any machine) takes that method's calibrated cost as 0
// and makes each of its allreduces take <seconds> longer.
//
// Rounds run on the transport the choices' collectives use, in the same
// order on every rank (the caller runs every choice and its collectives on
// one thread, in issue order: XcommBackend's compressed-allreduce worker, or
// the shared-memory backend's worker for a hierarchical group's leaders).
#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "collectives/compressed/CostModel.hpp"
#include "collectives/compressed/LinkEstimate.hpp"
#include "collectives/compressed/ObservedFactors.hpp"
#include "common/Compression.hpp"
#include "runtime/Route.hpp"

namespace xcomm {

// What the cost model needs; the same on every rank after a round.
struct AutoInputs {
  double latencySeconds = 0;
  double secondsPerByte = 0;  // of a ring allreduce's link bytes
  double bf16SecondsPerElem = 0;
  double int8SecondsPerElem = 0;
};

// What auto did so far (xcomm's stats and the group's explanation).
struct AutoReport {
  int64_t rounds = 0;
  int64_t nextRound = 0;  // the choice (counted from 0) at which the next round is due
  int64_t probeBytes = 0;
  AutoInputs inputs;
  std::array<int64_t, 3> chosen{};  // none, bf16, int8
  std::string last;                 // the last choice and its predictions, in words
  // Per ObservedFactors key (the link, bf16, int8): the factor applied and
  // the key it comes from (-1: uncorrected), as of the last round.
  std::array<double, 3> factors{1.0, 1.0, 1.0};
  std::array<int, 3> factorSources{-1, -1, -1};
};

class AutoCompression {
 public:
  // Methods auto chooses from, cheapest codec first (ties go to the earlier):
  // the method table's default backend methods (checked below).
  static constexpr std::array<Compression, 3> kMethods{Compression::kNone, Compression::kBf16,
                                                       Compression::kInt8};
  // The share of the time its rounds (probes and agreement) may take.
  static constexpr double kProbeFraction = 0.01;

  // The methods `names` name ("none", "bf16", "int8"), deduplicated, in
  // kMethods' order; ValueError naming `source` (the variable or option that
  // gave them) for an unknown name or an empty list.
  static std::vector<Compression> methodsNamed(const std::vector<std::string>& names,
                                               const std::string& source);

  // `config`: the int8 chunk and auto's bounds (autoMethods, autoLink*).
  AutoCompression(int size, const CompressionConfig& config, int64_t interval = 64);

  // The methods it may choose (config.autoMethods, default all of kMethods).
  const std::vector<Compression>& allowed() const { return allowed_; }

  // The cost model's prediction (CostModel.hpp, uncorrected) of `method` for
  // `numel` elements of `elementSize` bytes from a round's inputs.
  static ReductionCost predict(Compression method, int64_t numel, int64_t elementSize, int size,
                               int64_t int8ChunkElems, const AutoInputs& in);

  // The method for one allreduce of `numel` elements. Where a round is due
  // (the first call, then as LinkEstimate spaces them) it first runs one on
  // `transport`: probe, agree. Blocking; call it on the thread that issues
  // the op's collectives.
  Compression choose(Route& transport, int64_t numel, int64_t elementSize,
                     std::chrono::milliseconds timeout);

  // The allreduce choose() returned took `seconds` on this rank (from its
  // choice to its end); the closed loop's observation.
  void observed(double seconds);

  AutoReport report() const;

 private:
  void round(Route& transport, std::chrono::milliseconds timeout);
  void calibrate();
  // The prediction `method`'s observations are compared with: corrected by
  // the link factor, not by its own.
  double base(Compression method, int64_t numel, int64_t elementSize) const;
  ReductionCost uncorrected(Compression method, int64_t numel, int64_t elementSize) const;
  // The allowed method predicted fastest (corrected) for `numel` elements
  // under `in`; with `why`, its predictions in words.
  Compression best(int64_t numel, int64_t elementSize, const AutoInputs& in,
                   std::ostringstream* why = nullptr) const;
  void agreeFactors(const double* agreedRatios);
  // A round's agreed inputs and factors into report_.
  void publish();

  int size_;
  int64_t chunkElems_;
  int64_t interval_;
  std::vector<Compression> allowed_;
  double fixedLatency_ = -1, fixedBandwidth_ = -1;  // config.autoLink*; -1: probe
  int64_t calls_ = 0;
  int64_t nextRound_ = 0;                        // the call at which the next round is due
  int64_t lastRoundCall_ = 0;                    // the call of the last round
  int64_t lastNumel_ = 0, lastElementSize_ = 4;  // the last choice's (does a change matter)
  bool calibrated_ = false;
  double localBf16_ = 0, localInt8_ = 0;
  LinkEstimate link_;
  std::chrono::steady_clock::time_point lastRound_;
  ObservedFactors observed_{kMethods.size()};  // keyed by kMethods' index
  AutoInputs inputs_;                          // the last round's, for this thread's predictions
  std::array<bool, kMethods.size()> warm_{};   // a method's first run pays its set-up
  int pending_ = -1;                           // the key choose() returned last
  double pendingBase_ = 0;
  Compression slowMethod_ = Compression::kAuto;  // XCOMM_AUTO_TEST_SLOW; kAuto: none
  double slowSeconds_ = 0;
  mutable std::mutex mutex_;  // guards report_ (read from other threads)
  AutoReport report_;
};

// AutoCompression::kMethods is exactly the table's default backend methods.
constexpr bool autoMethodsAreTheDefaultBackendOnes() {
  size_t listed = 0;
  for (const auto& m : kMethodTable) {
    if (!(m.surfaces & kBackendSurface) || !m.inDefault) continue;
    if (listed >= AutoCompression::kMethods.size() ||
        !sameName(compressionName(AutoCompression::kMethods[listed]), m.name)) {
      return false;
    }
    ++listed;
  }
  return listed == AutoCompression::kMethods.size();
}
static_assert(autoMethodsAreTheDefaultBackendOnes(),
              "AutoCompression::kMethods must be kMethodTable's default backend methods, in order");

}  // namespace xcomm
