#pragma once
// auto's closed loop, one for every auto (the backend's AutoCompression, and
// through the bindings the DDP hook's and FSDP2's, hooks/_measure.py's
// ObservedCosts): what each method is seen to take against what the model
// predicted.
//
// Key 0 is the link (corrected by uncompressed reductions, whose prediction
// is the link's time alone); keys 1.. are the compressed methods. Corrected,
//   none  : f_link * wire
//   method: f_m * (codec + f_link * wire)
// so a method seen taking 10x its prediction is predicted at what it took.
// Each period's observed/predicted sums give one ratio per key (local());
// the caller agrees them across ranks (MAX) and update() folds them in: a
// key's first ratio becomes its factor, later ones are averaged in
// geometrically (f <- sqrt(f * r)), each bounded to [kFloor, kCeiling] first.
// A compressed method never seen is predicted with the least factor of the
// compressed methods seen (ties to the earlier key): its calibration is as
// wrong as theirs was. Before any was seen, and for the link until none ran,
// the calibration stands (factor 1).
#include <cstddef>
#include <vector>

namespace xcomm {

class ObservedFactors {
 public:
  // One odd reading (a paused process) cannot make a method look free or
  // unusable for good.
  static constexpr double kFloor = 0.05, kCeiling = 100.0;
  static constexpr size_t kLink = 0;

  // `keys`: the link and the compressed methods, at least 1.
  explicit ObservedFactors(size_t keys);

  size_t keys() const { return factors_.size(); }

  // One reduction of `key`: observed seconds against its base() prediction.
  // Ignored unless both are > 0.
  void record(size_t key, double observedSeconds, double predictedSeconds);
  // This rank's ratios since the last update (0 where nothing was seen).
  std::vector<double> local() const;
  // The agreed ratios (one per key, 0: not seen) fold into the factors; a new period.
  void update(const std::vector<double>& agreed);

  // The key whose factor `key` is predicted with: itself once seen; for a
  // compressed method never seen, the seen one with the least factor; -1
  // where none applies (the calibration stands).
  int source(size_t key) const;
  double factor(size_t key) const;
  // The corrected prediction from the model's parts.
  double predict(size_t key, double codecSeconds, double wireSeconds) const;
  // What an observation of `key` is compared with: its prediction without
  // its own factor (none's: the wire alone).
  double base(size_t key, double codecSeconds, double wireSeconds) const;

  // A checkpoint's view: the key's own factor and whether a round saw it.
  double stored(size_t key) const;
  bool seen(size_t key) const;
  void restore(size_t key, double factor, bool seen);

 private:
  size_t checked(size_t key) const;

  std::vector<double> factors_;
  std::vector<bool> seen_;
  std::vector<double> observed_, predicted_;  // this period's sums
};

}  // namespace xcomm
