#include "collectives/chains/Int8Allreduce.hpp"

#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/StreamGuard.h>

#include "common/CurrentStream.hpp"

namespace xcomm {
namespace {

class Int8Step : public BucketStep {
 public:
  Int8Step(std::shared_ptr<const Int8Codec> codec, std::shared_ptr<ChainCollectives> collectives,
           at::Tensor buffer, at::Tensor flat, at::Tensor index, at::Tensor packed, double divisor,
           const ChainResult& how)
      : BucketStep(std::move(collectives), std::move(buffer), how),
        codec_(std::move(codec)),
        flat_(std::move(flat)),
        index_(std::move(index)),
        packed_(std::move(packed)),
        divisor_(divisor) {
    TORCH_CHECK(
        packed_.dim() == 2 && packed_.size(0) == worldSize() && packed_.scalar_type() == at::kByte,
        "Int8Allreduce: packed must be uint8 [world_size, bytes], as pack_shards returns");
    shardElems_ = codec_->shardElems(flat_.numel(), static_cast<int>(worldSize()));
    received_ = at::empty_like(packed_);
    gathered_ = at::empty({packed_.numel()}, packed_.options());
  }

  void issueFirst() override {
    c10::OptionalStreamGuard guard(issueStream());  // maybe another thread than the encode's
    auto done = collectives().alltoall(received_, packed_);
    then<Int8Step>(done, [](Int8Step& s) { s.onReceived(); });
  }

 private:
  void onReceived() {
    at::Tensor mean = codec_->reduceAndPack(received_, shardElems_, divisor_);
    usedOnCurrentStream({received_});
    auto done = collectives().allgather(gathered_, mean);
    markIssued();
    then<Int8Step>(done, [](Int8Step& s) { s.onGathered(); });
  }

  void onGathered() {
    codec_->unpackAll(gathered_, shardElems_, flat_);
    usedOnCurrentStream({gathered_});
    completeFrom(flat_, index_);
  }

  std::shared_ptr<const Int8Codec> codec_;
  at::Tensor flat_;
  at::Tensor index_;
  at::Tensor packed_;
  double divisor_;
  int64_t shardElems_ = 0;
  at::Tensor received_;
  at::Tensor gathered_;
};

}  // namespace

StartedBucket Int8Allreduce::start(std::shared_ptr<const Int8Codec> codec,
                                   c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor buffer,
                                   at::Tensor flat, at::Tensor index, at::Tensor packed,
                                   FuturePtr turn) {
  TORCH_CHECK(codec && group, "Int8Allreduce: a codec and a process group are needed");
  const auto world = static_cast<double>(group->getSize());
  return start(std::move(codec), ChainCollectives::of(std::move(group)), std::move(buffer),
               std::move(flat), std::move(index), std::move(packed), world, std::move(turn));
}

StartedBucket Int8Allreduce::start(std::shared_ptr<const Int8Codec> codec,
                                   std::shared_ptr<ChainCollectives> collectives, at::Tensor buffer,
                                   at::Tensor flat, at::Tensor index, at::Tensor packed,
                                   double divisor, FuturePtr turn) {
  TORCH_CHECK(codec && collectives, "Int8Allreduce: a codec and its collectives are needed");
  return turns_.start(std::make_shared<Int8Step>(
                          std::move(codec), std::move(collectives), std::move(buffer),
                          std::move(flat), std::move(index), std::move(packed), divisor, how_),
                      std::move(turn));
}

}  // namespace xcomm
