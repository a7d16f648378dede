#include "collectives/chains/BucketChain.hpp"

#include <utility>
#include <vector>

#include <c10/core/impl/VirtualGuardImpl.h>

#include "common/CurrentStream.hpp"
#include "common/TorchCompat.hpp"

namespace xcomm {
namespace {

class GroupCollectives : public ChainCollectives {
 public:
  explicit GroupCollectives(c10::intrusive_ptr<c10d::ProcessGroup> group)
      : group_(std::move(group)) {}

  int64_t size() const override { return group_->getSize(); }
  FuturePtr allreduce(at::Tensor& tensor) override {
    std::vector<at::Tensor> tensors{tensor};
    return group_->allreduce(tensors, c10d::AllreduceOptions())->getFuture();
  }
  FuturePtr allgather(at::Tensor& output, at::Tensor& input) override {
    return compat::allGatherSingle(*group_, output, input)->getFuture();
  }
  FuturePtr alltoall(at::Tensor& output, at::Tensor& input) override {
    std::vector<int64_t> even;
    return compat::allToAllSingle(*group_, output, input, even, even)->getFuture();
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

}  // namespace

std::shared_ptr<ChainCollectives> ChainCollectives::of(
    c10::intrusive_ptr<c10d::ProcessGroup> group) {
  TORCH_CHECK(group, "xcomm: a bucket's chain needs a process group");
  return std::make_shared<GroupCollectives>(std::move(group));
}

BucketStep::BucketStep(std::shared_ptr<ChainCollectives> collectives, at::Tensor buffer,
                       const ChainResult& how)
    : collectives_(std::move(collectives)), buffer_(std::move(buffer)), wrap_(how.wrap) {
  TORCH_CHECK(collectives_, "xcomm: a bucket's chain needs its collectives");
  worldSize_ = collectives_->size();
  std::vector<c10::Device> devices;
  if (buffer_.is_cuda()) {
    devices.push_back(buffer_.device());
    issueStream_ = c10::impl::VirtualGuardImpl(buffer_.device().type()).getStream(buffer_.device());
  }
  result_ = c10::make_intrusive<c10::ivalue::Future>(how.type, std::move(devices));
  issued_ = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
}

void BucketStep::markIssued() {
  collectives_.reset();
  if (!issued_->completed()) issued_->markCompleted(c10::IValue());
}

void BucketStep::complete() {
  result_->markCompleted(wrap_ ? wrap_(buffer_) : c10::IValue(buffer_));
}

void BucketStep::completeFrom(const at::Tensor& flat, const at::Tensor& index) {
  if (index.defined()) {
    buffer_.index_copy_(0, index, flat);
    usedOnCurrentStream({flat, index});  // this step's temporaries, on a callback's stream
  }
  complete();
}

void BucketStep::fail(const std::exception_ptr& error) {
  collectives_.reset();
  issued_->setErrorIfNeeded(error);
  try {
    abort();
  } catch (...) {  // the bucket's own error is the one to report
  }
  result_->setErrorIfNeeded(error);
}

StartedBucket BucketTurns::start(const std::shared_ptr<BucketStep>& step, FuturePtr turn) {
  const StartedBucket started = step->futures();
  if (!turn) {
    std::lock_guard<std::mutex> lock(mutex_);
    turn = std::exchange(tail_, started.issued);
  }
  auto issue = [step] {
    try {
      step->issueFirst();
    } catch (...) {
      step->fail(std::current_exception());
    }
  };
  if (!turn) {
    issue();
    return started;
  }
  turn->addCallback([step, issue](c10::ivalue::Future& f) {
    if (f.hasError()) {  // an earlier bucket's failure fails this one too
      step->fail(f.exception_ptr());
      return;
    }
    issue();
  });
  return started;
}

}  // namespace xcomm
