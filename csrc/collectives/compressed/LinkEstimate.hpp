#pragma once
// auto's link measurement, one for every auto: the backend's compression=
// "auto" (AutoCompression) and, through the bindings, the DDP hook's and
// FSDP2's (hooks/_measure.py's MeasuredLink). The arithmetic only: the
// caller runs the probes and the agreement on its own group, in its own
// language, and hands the times here.
//
// A round: each probe (one per collective kind) runs twice back to back and
// the second is timed (secondsPerByte: the latency may explain at most half
// of it, so a noisy latency cannot make a link look infinitely fast); then
// one allreduce MAX agrees every input, the latency negated so it is agreed
// as the least over ranks (the first rank at an agreement also waited for
// the others to finish the probe). fold() then gives the links:
// - Per kind, the median of the last three agreed readings (of two, the
//   slower), so one noisy probe cannot flip a choice.
// - The next probe is sized to cost about probeFraction of the `interval`
//   steps between rounds, from the faster of the median and the newest
//   reading (a probe too small for its link reads it slow, and sizing from
//   that reading would keep it small), growing at most 4x a round, within
//   [64 kB, 32 MB]. Before any step was timed it keeps its size.
// - Rounds are spaced so they take about probeFraction of the time: a
//   round's cost is what its bytes and latency predict plus the median of
//   what the last three took beyond that (on a busy host a round's
//   collectives also wait to line up and on the scheduler).
// - A reading more than 2x off the median (before or after it joined) is a
//   change or noise: where the caller says it would change a choice, the
//   next round comes at the next step (at most three in a row), so a change
//   is followed at once and noise is outvoted at the cost of one round.
// Every input is agreed, so every rank computes the same links and rounds.
#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

namespace xcomm {

class LinkEstimate {
 public:
  static constexpr double kMinProbeBytes = 64e3, kMaxProbeBytes = 32e6;
  // A reading this far off the median is confirmed by a round at the next step.
  static constexpr double kChangeFactor = 2.0;
  // The most rounds in a row due at the next step.
  static constexpr int kMaxConfirmations = 3;

  // `kinds`: the probes (collective kinds) per round; `probeFraction`: the
  // share of the time rounds may take; `interval`: the fewest steps between.
  LinkEstimate(size_t kinds, double probeFraction, int64_t interval);

  size_t kinds() const { return kinds_; }
  int64_t interval() const { return interval_; }
  double probeFraction() const { return probeFraction_; }

  // The next probe's size, bytes.
  int64_t probeBytes() const { return probeBytes_; }
  void setProbeBytes(int64_t bytes) { probeBytes_ = bytes; }

  // The latency a probe's time is reduced by: the least recent agreement
  // on this rank (0 before any).
  double latency() const;
  // This rank's reading of a probe that took `tookSeconds` for `wireBytes`
  // link bytes: seconds per byte (0 for a group of one, which sends nothing).
  double secondsPerByte(double tookSeconds, double wireBytes) const;
  // An agreement took `seconds` here: the last five give the latency.
  void agreementTook(double seconds);
  // The last agreement's duration (0 before any): a round's cost counts it.
  double lastAgreement() const { return agreements_.empty() ? 0.0 : agreements_.back(); }
  const std::deque<double>& agreements() const { return agreements_; }
  void setAgreements(std::vector<double> seconds);

  // One round's agreed values: the latency (the least over ranks), the
  // median recent step (0 where none was timed yet), the round's cost so far
  // (the slowest rank's) and each kind's newest reading. Folds them in and
  // returns each kind's seconds per byte to predict with (the median).
  std::vector<double> fold(double latency, double stepSeconds, double roundSeconds,
                           const std::vector<double>& newest);
  // Whether the newest reading folded is more than kChangeFactor off the
  // median, before or after it joined (the caller asks whether it matters).
  bool changed() const { return changed_; }
  // Steps from this round to the next: 1 where `confirm` (a change that
  // matters) and fewer than kMaxConfirmations rounds in a row were; else
  // the spacing by cost.
  int64_t stride(bool confirm);

  // What the last rounds took beyond their bytes and latency, newest last.
  const std::deque<double>& roundOverheads() const { return overheads_; }

 private:
  std::vector<double> median() const;

  size_t kinds_;
  double probeFraction_;
  int64_t interval_;
  int64_t probeBytes_ = 1 << 20;
  std::deque<double> agreements_;
  std::deque<std::vector<double>> readings_;  // agreed, the last three rounds
  std::deque<double> overheads_;
  bool changed_ = false;
  int64_t spacing_ = 1;
  int confirmations_ = 0;
};

}  // namespace xcomm
