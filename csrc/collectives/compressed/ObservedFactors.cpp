#include "collectives/compressed/ObservedFactors.hpp"

#include <algorithm>
#include <cmath>

#include <c10/util/Exception.h>

namespace xcomm {

ObservedFactors::ObservedFactors(size_t keys)
    : factors_(keys, 1.0), seen_(keys, false), observed_(keys, 0.0), predicted_(keys, 0.0) {
  TORCH_CHECK_VALUE(keys > 0, "xcomm: auto's observed factors need at least the link's key");
}

size_t ObservedFactors::checked(size_t key) const {
  TORCH_CHECK_INDEX(key < keys(), "xcomm: auto's observed factors have ", keys(), " keys, not key ",
                    key);
  return key;
}

void ObservedFactors::record(size_t key, double observedSeconds, double predictedSeconds) {
  checked(key);
  if (!(observedSeconds > 0) || !(predictedSeconds > 0)) return;
  observed_[key] += observedSeconds;
  predicted_[key] += predictedSeconds;
}

std::vector<double> ObservedFactors::local() const {
  std::vector<double> ratios(keys(), 0.0);
  for (size_t k = 0; k < keys(); ++k) {
    if (predicted_[k] > 0) ratios[k] = observed_[k] / predicted_[k];
  }
  return ratios;
}

void ObservedFactors::update(const std::vector<double>& agreed) {
  TORCH_CHECK_VALUE(agreed.size() == keys(), "xcomm: auto agreed ", agreed.size(),
                    " observed ratios for ", keys(), " keys");
  linkFresh_ = agreed[kLink] > 0;
  for (size_t k = 0; k < keys(); ++k) {
    if (agreed[k] > 0) {
      // The first reading is the factor; later ones are averaged in
      // geometrically, so one noisy round moves it by its square root.
      const double reading = std::min(std::max(agreed[k], kFloor), kCeiling);
      factors_[k] = seen_[k] ? std::sqrt(factors_[k] * reading) : reading;
      seen_[k] = true;
      if (k == kLink) linkSeenAt_ = linkInForce_;
    }
    observed_[k] = predicted_[k] = 0.0;
  }
}

bool ObservedFactors::setLink(double secondsPerByte) {
  if (!(secondsPerByte > 0) || !std::isfinite(secondsPerByte)) return false;
  linkInForce_ = secondsPerByte;
  if (!seen_[kLink]) return false;
  if (!(linkSeenAt_ > 0)) {  // restored from a checkpoint without it
    linkSeenAt_ = secondsPerByte;
    return false;
  }
  const double off = secondsPerByte / linkSeenAt_;
  if (off <= kRelearn && off >= 1.0 / kRelearn) return false;
  if (linkFresh_) {
    // Seen just now: the corrected link stays where uncompressed reductions ran.
    factors_[kLink] = std::min(std::max(factors_[kLink] / off, kFloor), kCeiling);
    linkSeenAt_ = secondsPerByte;
    return false;
  }
  factors_[kLink] = 1.0;
  seen_[kLink] = false;
  linkSeenAt_ = 0.0;
  return true;
}

void ObservedFactors::restoreLinkSeenAt(double secondsPerByte) {
  TORCH_CHECK_VALUE(secondsPerByte >= 0 && std::isfinite(secondsPerByte),
                    "xcomm: the link reading a factor was seen against must be >= 0, got ",
                    secondsPerByte);
  linkSeenAt_ = secondsPerByte;
}

int ObservedFactors::source(size_t key) const {
  if (seen_[checked(key)]) return static_cast<int>(key);
  if (key == kLink) return -1;  // the probe (or a fixed link) stands
  int least = -1;
  for (size_t k = kLink + 1; k < keys(); ++k) {
    if (seen_[k] && (least < 0 || factors_[k] < factors_[least])) least = static_cast<int>(k);
  }
  return least;
}

double ObservedFactors::factor(size_t key) const {
  const int from = source(key);
  return from < 0 ? 1.0 : factors_[from];
}

double ObservedFactors::base(size_t key, double codecSeconds, double wireSeconds) const {
  if (checked(key) == kLink) return wireSeconds;
  return codecSeconds + factor(kLink) * wireSeconds;
}

double ObservedFactors::predict(size_t key, double codecSeconds, double wireSeconds) const {
  if (checked(key) == kLink) return factor(kLink) * wireSeconds;
  return factor(key) * base(key, codecSeconds, wireSeconds);
}

double ObservedFactors::stored(size_t key) const {
  return factors_[checked(key)];
}

bool ObservedFactors::seen(size_t key) const {
  return seen_[checked(key)];
}

void ObservedFactors::restore(size_t key, double factor, bool seen) {
  TORCH_CHECK_VALUE(factor > 0 && std::isfinite(factor),
                    "xcomm: an observed factor must be a positive number, got ", factor);
  factors_[checked(key)] = factor;
  seen_[key] = seen;
}

}  // namespace xcomm
