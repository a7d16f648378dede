#pragma once
// BucketLauncher: the plain (uncompressed, unchunked) engine behind
// GradientBucketer(schedule="immediate").
//
// Gradients arrive one parameter at a time during backward. Each is copied,
// scaled by 1/n, into its slot of a flat bucket; the moment a bucket and every
// bucket before it are full, the bucket's allreduce starts, asynchronously.
// Launching in index order gives every rank the same collectives in the same
// order, whatever order its gradients arrived in. When a reduction lands, the
// mean is copied back into the gradients it was built from, the bucket's
// future completes, and its transfer and copy-back are recorded (stats,
// timeline, torch.profiler). Python only registers the hooks and steps the
// optimizers; nothing here takes the GIL.
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace xcomm {

class BucketLauncher {
 public:
  // Where a parameter's gradient goes: elements [offset, offset + numel) of
  // bucket `bucket`.
  struct Slot {
    int bucket;
    int64_t offset;
    int64_t numel;
  };

  // `buffers`: one flat contiguous tensor per bucket; `slots`: one per
  // parameter, which `gradReady` names by index; every element of every
  // buffer belongs to exactly one slot.
  BucketLauncher(std::vector<at::Tensor> buffers, std::vector<Slot> slots,
                 c10::intrusive_ptr<c10d::Backend> backend);
  BucketLauncher(const BucketLauncher&) = delete;
  BucketLauncher& operator=(const BucketLauncher&) = delete;

  // Parameter `param`'s gradient is final for this backward. Copies it, times
  // 1/n, into its slot and launches every bucket that became launchable; the
  // reduced mean is later copied back into `grad`. Thread-safe. Throws if the
  // parameter was already ready this iteration.
  void gradReady(int param, const at::Tensor& grad);

  // Completes (with the bucket's buffer) once bucket `bucket` is reduced and
  // copied back, or with the transfer's error.
  c10::intrusive_ptr<c10::ivalue::Future> future(int bucket) const;
  // Timeline::nowUs() when bucket `bucket` was full / landed this iteration (0: not yet).
  int64_t readyUs(int bucket) const;
  int64_t landedUs(int bucket) const;
  int launched() const;

  // Starts the next iteration: empty buckets, fresh futures. Call only once
  // every launched bucket's future has completed.
  void reset();

 private:
  struct Bucket {
    at::Tensor buffer;
    int pending = 0;  // slots not yet filled this iteration
    int slots = 0;
    int64_t readyUs = 0;
    int64_t landedUs = 0;
    std::vector<std::pair<at::Tensor, Slot>> grads;  // where the mean goes back
    c10::intrusive_ptr<c10::ivalue::Future> future;
  };

  void launchLocked(int index);

  std::vector<std::shared_ptr<Bucket>> buckets_;
  std::vector<Slot> slots_;
  std::vector<bool> seen_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  double scale_;
  mutable std::mutex mutex_;
  int nextLaunch_ = 0;
};

}  // namespace xcomm
