#include "collectives/chains/SparseAllreduce.hpp"

#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>

#include "common/CurrentStream.hpp"

namespace xcomm {
namespace {

class TopKStep : public BucketStep {
 public:
  TopKStep(std::shared_ptr<const TopKCodec> codec, c10::intrusive_ptr<c10d::ProcessGroup> group,
           at::Tensor buffer, at::Tensor flat, at::Tensor index, at::Tensor packed, int64_t k,
           const ChainResult& how)
      : BucketStep(std::move(group), std::move(buffer), how),
        codec_(std::move(codec)),
        flat_(std::move(flat)),
        index_(std::move(index)),
        packed_(std::move(packed)),
        k_(k) {
    gathered_ = at::empty({worldSize() * packed_.numel()}, packed_.options());
  }

  void issueFirst() override {
    c10::OptionalStreamGuard guard(issueStream());  // maybe another thread than the encode's
    auto done = collectives().allgather(gathered_, packed_);
    markIssued();
    then<TopKStep>(done, [](TopKStep& s) { s.onGathered(); });
  }

 private:
  void onGathered() {
    codec_->decode(gathered_, k_, flat_, static_cast<double>(worldSize()));
    usedOnCurrentStream({gathered_});
    completeFrom(flat_, index_);
  }

  std::shared_ptr<const TopKCodec> codec_;
  at::Tensor flat_;
  at::Tensor index_;
  at::Tensor packed_;
  int64_t k_;
  at::Tensor gathered_;
};

class RandomKStep : public BucketStep {
 public:
  RandomKStep(std::shared_ptr<const RandomKCodec> codec,
              c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor buffer, at::Tensor flat,
              at::Tensor index, at::Tensor values, at::Tensor positions, const ChainResult& how)
      : BucketStep(std::move(group), std::move(buffer), how),
        codec_(std::move(codec)),
        flat_(std::move(flat)),
        index_(std::move(index)),
        values_(std::move(values)),
        positions_(std::move(positions)) {}

  void issueFirst() override {
    c10::OptionalStreamGuard guard(issueStream());
    auto done = collectives().allreduce(values_);
    markIssued();
    then<RandomKStep>(done, [](RandomKStep& s) { s.onReduced(); });
  }

 private:
  void onReduced() {
    codec_->decode(values_, positions_, flat_, static_cast<double>(worldSize()));
    usedOnCurrentStream({values_, positions_});
    completeFrom(flat_, index_);
  }

  std::shared_ptr<const RandomKCodec> codec_;
  at::Tensor flat_;
  at::Tensor index_;
  at::Tensor values_;  // summed in place by the allreduce
  at::Tensor positions_;
};

}  // namespace

StartedBucket TopKAllreduce::start(std::shared_ptr<const TopKCodec> codec,
                                   c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor buffer,
                                   at::Tensor flat, at::Tensor index, at::Tensor packed, int64_t k,
                                   FuturePtr turn) {
  TORCH_CHECK(codec && group, "TopKAllreduce: a codec and a process group are needed");
  return turns_.start(
      std::make_shared<TopKStep>(std::move(codec), std::move(group), std::move(buffer),
                                 std::move(flat), std::move(index), std::move(packed), k, how_),
      std::move(turn));
}

StartedBucket RandomKAllreduce::start(std::shared_ptr<const RandomKCodec> codec,
                                      c10::intrusive_ptr<c10d::ProcessGroup> group,
                                      at::Tensor buffer, at::Tensor flat, at::Tensor index,
                                      at::Tensor values, at::Tensor positions, FuturePtr turn) {
  TORCH_CHECK(codec && group, "RandomKAllreduce: a codec and a process group are needed");
  return turns_.start(std::make_shared<RandomKStep>(
                          std::move(codec), std::move(group), std::move(buffer), std::move(flat),
                          std::move(index), std::move(values), std::move(positions), how_),
                      std::move(turn));
}

}  // namespace xcomm
