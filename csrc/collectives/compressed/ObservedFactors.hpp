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
//
// The link's factor corrects the link reading it was seen against: a probe
// can read a link slow while its size is small and close to right once it
// has grown, and a factor of 0.29 learned on a 1.3 Gbit/s reading, applied to
// a later 6.0 Gbit/s one, predicted the MLP's uncompressed buckets at 3.6x
// faster than they ran and sent them uncompressed for 13 steps at 10 Gbit/s.
// So setLink() is told the reading each round's predictions use. One more
// than kRelearn times off the reading the factor was seen against:
// - where uncompressed reductions were seen in the period just folded, the
//   factor is carried to the new reading, rescaled so the corrected link
//   stays where they ran (they are newer evidence than the probe);
// - otherwise the factor is dropped: the new reading stands until
//   uncompressed reductions are seen against it (a link that changed while
//   compressed methods ran is followed at once).
#include <cstddef>
#include <vector>

namespace xcomm {

class ObservedFactors {
 public:
  // One odd reading (a paused process) cannot make a method look free or
  // unusable for good.
  static constexpr double kFloor = 0.05, kCeiling = 100.0;
  static constexpr size_t kLink = 0;
  // A link reading this many times off the one the link's factor was seen
  // against drops or rescales the factor (the change LinkEstimate confirms).
  static constexpr double kRelearn = 2.0;

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
  // The agreed link reading (seconds per byte; 0: none) the predictions use
  // from now on; called after update(). Returns whether it dropped the
  // link's factor (a rescaled one is kept).
  bool setLink(double secondsPerByte);
  // The reading the link's factor was last seen against (0: not seen).
  double linkSeenAt() const { return linkSeenAt_; }

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
  // A checkpoint's linkSeenAt() (0 before the checkpoints kept it: the next
  // reading is taken as the one the factor was seen against).
  void restoreLinkSeenAt(double secondsPerByte);

 private:
  size_t checked(size_t key) const;

  std::vector<double> factors_;
  std::vector<bool> seen_;
  std::vector<double> observed_, predicted_;  // this period's sums
  double linkInForce_ = 0.0;                  // the reading this period's predictions use
  double linkSeenAt_ = 0.0;                   // the reading the link's factor was last seen against
  bool linkFresh_ = false;                    // whether the last update() saw the link
};

}  // namespace xcomm
