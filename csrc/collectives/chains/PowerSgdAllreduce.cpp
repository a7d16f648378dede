#include "collectives/chains/PowerSgdAllreduce.hpp"

#include <utility>
#include <vector>

#include <c10/core/StreamGuard.h>

namespace xcomm {
namespace {

class PowerSgdStep : public BucketStep {
 public:
  PowerSgdStep(std::shared_ptr<PowerSgdCodec> codec, c10::intrusive_ptr<c10d::ProcessGroup> group,
               int64_t bucket, at::Tensor buffer, at::Tensor wire, const ChainResult& how)
      : BucketStep(std::move(group), std::move(buffer), how),
        codec_(std::move(codec)),
        bucket_(bucket),
        wire_(std::move(wire)) {}

  void issueFirst() override {
    if (wire_.numel() == 0) {
      onWire();
      return;
    }
    c10::OptionalStreamGuard guard(issueStream());  // maybe another thread than prepare's
    then<PowerSgdStep>(allreduce(wire_), [](PowerSgdStep& s) { s.onWire(); });
  }

 private:
  void abort() override { codec_->abortStep(bucket_); }

  FuturePtr allreduce(at::Tensor tensor) { return collectives().allreduce(tensor); }

  void onWire() {
    at::Tensor q = codec_->reduceP(bucket_, wire_, worldSize());
    if (q.numel() == 0) {  // nothing compressed in this bucket
      markIssued();
      onQ(q);
      return;
    }
    auto done = allreduce(q);
    markIssued();
    then<PowerSgdStep>(done, [q](PowerSgdStep& s) { s.onQ(q); });
  }

  void onQ(const at::Tensor& summedQ) {
    codec_->finish(bucket_, summedQ, worldSize());
    complete();
  }

  std::shared_ptr<PowerSgdCodec> codec_;
  int64_t bucket_;
  at::Tensor wire_;
};

}  // namespace

StartedBucket PowerSgdAllreduce::start(std::shared_ptr<PowerSgdCodec> codec,
                                       c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t bucket,
                                       at::Tensor buffer, at::Tensor wire, FuturePtr turn) {
  TORCH_CHECK(codec && group, "PowerSgdAllreduce: a codec and a process group are needed");
  return turns_.start(std::make_shared<PowerSgdStep>(std::move(codec), std::move(group), bucket,
                                                     std::move(buffer), std::move(wire), how_),
                      std::move(turn));
}

}  // namespace xcomm
