#pragma once
// PowerSGD (Vogels et al., 2019) gradient compression for DDP buckets: the
// computation of torch's powerSGD_hook, with the collectives left to the
// caller. Per bucket and step the caller runs
//
//   setLayout (when the bucket's parameters change) -> prepare -> allreduce
//   the returned wire -> reduceP -> allreduce the returned Q -> finish
//
// and the bucket buffer then holds the averaged, decompressed gradient.
//
// What is compressed is decided as torch decides it: each gradient is viewed
// as a matrix (size(0) x rest); it is compressed at rank
// r = min(rows, cols, matrixApproximationRank) when
// (rows + cols) * r * minCompressionRate < rows * cols, and otherwise sent
// as it is, averaged with the others in the same allreduce as the P factors.
//
// State lives per parameter (keyed by the caller's parameter key), not per
// bucket: error feedback and warm-start Q follow a parameter when DDP
// rebuilds its buckets, and a checkpoint taken under one bucket layout
// resumes under another.
//
// A bucket on a GPU runs the same phases as ATen ops on its device (cuBLAS
// matmuls, no host synchronization); a CPU bucket runs xcomm's own kernels.
// XCOMM_POWERSGD_ROUTE=aten (read when a codec is made) sends CPU buckets
// down the device route too: its ATen ops are device-generic, so CPU-only
// machines test the route GPU buckets take.
//
// Threading: the phases of one bucket must not overlap (they never do in
// DDP); different buckets may run their phases concurrently.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

namespace xcomm {

struct PowerSgdOptions {
  int64_t matrixApproximationRank = 1;
  // A matrix is compressed only when it shrinks at least this much.
  double minCompressionRate = 2.0;
  // Added to column norms in Gram-Schmidt; 0 turns a zero column into NaN,
  // as in torch.
  double orthogonalizationEpsilon = 0.0;
  bool useErrorFeedback = true;
  // Start each step's power iteration from the previous step's Q.
  bool warmStart = true;
  // Only decides how fresh random Qs are drawn (one draw per group of
  // same-shaped matrices instead of one per matrix), to draw the numbers
  // torch draws. The arithmetic never copies matrices into batches.
  bool batchTensorsWithSameShape = false;

  // Throws c10::ValueError naming the bad field.
  void validate() const;
};

// Element counts of one prepared step, as torch's hook counts them.
struct PowerSgdStepInfo {
  at::Tensor wire;          // uncompressed gradients, then the P factors
  int64_t qNumel = 0;       // elements of the second allreduce (Q factors)
  int64_t numelBefore = 0;  // gradient elements (torch: total_numel_before_compression)
  int64_t numelAfter = 0;   // elements sent for them (torch: total_numel_after_compression)
};

// The saved state of one parameter; undefined tensors where it has none.
struct PowerSgdParamState {
  at::Tensor error;  // 1-D, numel of the parameter
  at::Tensor q;      // cols x rank, the warm-start Q (already divided by world size)
};

class PowerSgdCodec {
 public:
  explicit PowerSgdCodec(PowerSgdOptions options);
  ~PowerSgdCodec();
  PowerSgdCodec(const PowerSgdCodec&) = delete;
  PowerSgdCodec& operator=(const PowerSgdCodec&) = delete;

  const PowerSgdOptions& options() const { return options_; }

  // Declares which gradients the bucket holds: `grads` are views into
  // `buffer` (bucket.gradients()), `keys` identify their parameters across
  // buckets and runs. A no-op when nothing changed; otherwise state follows
  // the parameters on the next prepare.
  void setLayout(int64_t bucket, const at::Tensor& buffer, const std::vector<at::Tensor>& grads,
                 const std::vector<int64_t>& keys);
  bool hasLayout(int64_t bucket) const;

  // Whether the next prepare of `bucket` draws random Qs and so needs a
  // seed: always without warm start, otherwise while any of its compressed
  // parameters has no Q yet.
  bool needsSeed(int64_t bucket) const;

  // Phase 1: adds the error feedback into `buffer` in place, packs the
  // uncompressed gradients and computes P = M Q for the others. `seed`
  // (torch.manual_seed's argument in torch's hook) is required when
  // needsSeed(bucket). The returned wire is the codec's own buffer: allreduce
  // it (sum) and pass the result to reduceP.
  PowerSgdStepInfo prepare(int64_t bucket, const at::Tensor& buffer, std::optional<uint64_t> seed);

  // Phase 2: the wire, summed over ranks. Writes the averaged uncompressed
  // gradients into the buffer, orthogonalizes P and returns Q = M^T P
  // (the codec's buffer, to be allreduced with sum; empty when the bucket
  // has nothing compressed).
  at::Tensor reduceP(int64_t bucket, const at::Tensor& summedWire, int64_t worldSize);

  // Phase 3: Q summed over ranks. Decompresses P Q^T / worldSize into the
  // buffer and keeps the new error and Q.
  void finish(int64_t bucket, const at::Tensor& summedQ, int64_t worldSize);

  // Abandons the bucket's step in flight after a failure (a failed
  // collective), so the next step can start; the bucket's gradients and
  // that step's error feedback are then undefined.
  void abortStep(int64_t bucket);

  // Parameters with state, and their state (copies).
  std::vector<int64_t> stateKeys() const;
  PowerSgdParamState paramState(int64_t key) const;
  // Restores a parameter's state; takes effect at the next prepare of the
  // bucket that holds it, where it is checked against the gradient. Refused
  // while that bucket is in the middle of a step (other buckets may be).
  void setParamState(int64_t key, const PowerSgdParamState& state);
  // Buckets that have drawn their Qs (torch: the keys of p_memory_dict);
  // with warm start they draw no more seeds.
  std::vector<int64_t> warmBuckets() const;
  void setWarmBuckets(const std::vector<int64_t>& buckets);
  // Forgets all state (not the layouts).
  void clearState();

  // Testing and introspection: which of the bucket's gradients (bucket
  // order) are compressed, and at what rank (0 = sent uncompressed).
  std::vector<int64_t> compressionRanks(int64_t bucket) const;

 private:
  struct TensorPlan;
  struct BucketPlan;
  struct Bucket;

  // Where a bucket is in its step: prepare, reduceP and finish run in turn.
  enum class Phase { kIdle, kPrepared, kReducedP };

  Bucket& bucketOrThrow(int64_t bucket, const char* phase);
  // The end of prepare: the bucket is prepared; what to send.
  PowerSgdStepInfo stepInfo(Bucket& b) const;
  // The phases on a bucket that is not in host memory (a GPU's): ATen ops on
  // its device instead of the CPU kernels (also CPU buckets, with
  // XCOMM_POWERSGD_ROUTE=aten).
  bool onDeviceRoute(const at::Tensor& buffer) const { return atenOnCpu_ || !buffer.is_cpu(); }
  void prepareOnDevice(Bucket& b, const at::Tensor& buffer);
  void reducePOnDevice(Bucket& b, int64_t worldSize);
  void finishOnDevice(Bucket& b, int64_t worldSize);
  // `bucket`, checked under the lock to be in `expected`, the phase `previous` leaves.
  Bucket& bucketAfter(int64_t bucket, const char* step, Phase expected, const char* previous);
  const Bucket* findBucket(int64_t bucket) const;
  BucketPlan planLayout(const at::Tensor& buffer, const std::vector<at::Tensor>& grads,
                        const std::vector<int64_t>& keys) const;
  void adoptState(Bucket& b, const at::Tensor& buffer);
  bool missingQ(int64_t bucket, const Bucket& b) const;
  void drawQ(Bucket& b, uint64_t seed);

  PowerSgdOptions options_;
  bool atenOnCpu_ = false;    // XCOMM_POWERSGD_ROUTE=aten
  mutable std::mutex mutex_;  // guards the two maps, not the buckets' contents
  std::map<int64_t, std::unique_ptr<Bucket>> buckets_;
  std::unordered_map<int64_t, PowerSgdParamState> params_;
  std::set<int64_t> warmBuckets_;
};

}  // namespace xcomm
