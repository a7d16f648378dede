#include "collectives/compressed/LinkEstimate.hpp"

#include <algorithm>
#include <cmath>

#include <c10/util/Exception.h>

namespace xcomm {
namespace {

// What a round's bytes and latency take: every kind's probe twice, then the
// agreement.
double roundSeconds(double latency, double probeBytes, const std::vector<double>& perByte) {
  double sum = 0;
  for (double s : perByte) sum += latency + probeBytes * s;
  return 2 * sum + latency;
}

}  // namespace

LinkEstimate::LinkEstimate(size_t kinds, double probeFraction, int64_t interval)
    : kinds_(kinds), probeFraction_(probeFraction), interval_(interval) {
  TORCH_CHECK_VALUE(kinds > 0, "xcomm: auto's link measurement needs at least one probe");
  TORCH_CHECK_VALUE(probeFraction > 0 && probeFraction < 1,
                    "xcomm: auto's probe_fraction must be in (0, 1), got ", probeFraction);
  TORCH_CHECK_VALUE(interval > 0, "xcomm: auto's interval must be > 0, got ", interval);
}

double LinkEstimate::latency() const {
  return agreements_.empty() ? 0.0 : *std::min_element(agreements_.begin(), agreements_.end());
}

double LinkEstimate::secondsPerByte(double tookSeconds, double wireBytes) const {
  if (!(wireBytes > 0)) return 0.0;
  return std::max(tookSeconds - latency(), 0.5 * tookSeconds) / wireBytes;
}

void LinkEstimate::agreementTook(double seconds) {
  agreements_.push_back(seconds);
  while (agreements_.size() > 5) agreements_.pop_front();
}

void LinkEstimate::setAgreements(std::vector<double> seconds) {
  agreements_.assign(seconds.begin(), seconds.end());
}

std::vector<double> LinkEstimate::median() const {
  std::vector<double> out(kinds_, 0.0);
  if (readings_.empty()) return out;
  const size_t mid = readings_.size() / 2;
  for (size_t k = 0; k < kinds_; ++k) {
    std::vector<double> one;
    for (const auto& r : readings_) one.push_back(r[k]);
    std::sort(one.begin(), one.end());
    out[k] = one[mid];
  }
  return out;
}

std::vector<double> LinkEstimate::fold(double latency, double stepSeconds, double roundSeconds_,
                                       const std::vector<double>& newest) {
  TORCH_CHECK_VALUE(newest.size() == kinds_, "xcomm: auto's link measurement agreed ",
                    newest.size(), " readings for ", kinds_, " probes");
  const bool hadReadings = !readings_.empty();
  const std::vector<double> before = median();
  readings_.push_back(newest);
  while (readings_.size() > 3) readings_.pop_front();
  const std::vector<double> now = median();

  // The faster of the median and the newest reading, of the slowest kind.
  double slowestFaster = 0;
  for (size_t k = 0; k < kinds_; ++k) {
    slowestFaster = std::max(slowestFaster, std::min(now[k], newest[k]));
  }
  const double fastestBytesPerSecond = 1.0 / std::max(slowestFaster, 1e-15);
  spacing_ = interval_;
  if (stepSeconds > 0) {  // the first round also waits for the ranks to start
    const double explained = roundSeconds(latency, static_cast<double>(probeBytes_), newest);
    overheads_.push_back(std::max(roundSeconds_ - explained, 0.0));
    while (overheads_.size() > 3) overheads_.pop_front();
    // Before any step without a round was timed there is no budget to size
    // from: the probe keeps its size rather than shrinking to the smallest.
    const double budget = probeFraction_ * static_cast<double>(interval_) * stepSeconds /
                          (2.0 * static_cast<double>(kinds_));
    const double size = std::min(
        {budget * fastestBytesPerSecond, 4.0 * static_cast<double>(probeBytes_), kMaxProbeBytes});
    probeBytes_ = static_cast<int64_t>(std::max(size, kMinProbeBytes));
    double next = roundSeconds(latency, static_cast<double>(probeBytes_),
                               std::vector<double>(kinds_, 1.0 / fastestBytesPerSecond));
    std::vector<double> waits(overheads_.begin(), overheads_.end());
    std::sort(waits.begin(), waits.end());
    next += waits[(waits.size() - 1) / 2];  // the median; of two, the less
    // Bounded far past any run's length, so a tiny step time cannot overflow.
    const double steps = std::min(std::ceil(next / (probeFraction_ * stepSeconds)), 1e15);
    spacing_ = std::max<int64_t>(interval_, static_cast<int64_t>(steps));
  }
  changed_ = false;
  for (const auto* ref : {&now, hadReadings ? &before : &now}) {
    for (size_t k = 0; k < kinds_; ++k) {
      const double a = newest[k], b = (*ref)[k];
      if (std::max(a, b) > kChangeFactor * std::min(a, b)) changed_ = true;
    }
  }
  return now;
}

int64_t LinkEstimate::stride(bool confirm) {
  if (confirm && confirmations_ < kMaxConfirmations) {
    ++confirmations_;
    return 1;
  }
  confirmations_ = 0;
  return spacing_;
}

}  // namespace xcomm
