#include "collectives/PowerSgdAllreduce.hpp"

#include <optional>
#include <utility>
#include <vector>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace xcomm {
namespace {

using Future = c10::ivalue::Future;

// One bucket's step, kept alive by the callbacks that continue it.
struct BucketStep : std::enable_shared_from_this<BucketStep> {
  std::shared_ptr<PowerSgdCodec> codec;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int64_t bucket = 0;
  int64_t worldSize = 1;
  at::Tensor buffer;
  at::Tensor wire;
  std::optional<c10::Stream> issueStream;    // GPU only: where prepare ran
  PowerSgdAllreduce::WrapResult wrapResult;  // empty: the tensor itself
  c10::intrusive_ptr<Future> result;
  c10::intrusive_ptr<Future> issued;  // this bucket's turn is over

  c10::intrusive_ptr<Future> allreduce(const at::Tensor& tensor) {
    std::vector<at::Tensor> tensors{tensor};
    return group->allreduce(tensors, c10d::AllreduceOptions())->getFuture();
  }

  // The group is let go once the last collective is out: this step may end on
  // one of the group's own threads (a Gloo worker runs the Q callback), and
  // if it held the last reference there (the caller destroyed the group
  // meanwhile), the group's destructor would join the thread it runs on.
  void markIssued() {
    group.reset();
    if (!issued->completed()) issued->markCompleted(c10::IValue());
  }

  void fail(const std::exception_ptr& error) {
    group.reset();
    issued->setErrorIfNeeded(error);
    try {
      codec->abortStep(bucket);
    } catch (...) {  // the bucket's own error is the one to report
    }
    result->setErrorIfNeeded(error);
  }

  // Runs `next` once `done` completed, or fails the step with its error.
  template <typename Next>
  void then(const c10::intrusive_ptr<Future>& done, Next next) {
    done->addCallback([self = shared_from_this(), next](Future& f) {
      if (f.hasError()) {
        self->fail(f.exception_ptr());
        return;
      }
      try {
        next(*self);
      } catch (...) {
        self->fail(std::current_exception());
      }
    });
  }

  void issueWire() {
    if (wire.numel() == 0) {
      onWire();
      return;
    }
    c10::OptionalStreamGuard guard(issueStream);  // maybe another thread than prepare's
    then(allreduce(wire), [](BucketStep& s) { s.onWire(); });
  }

  void onWire() {
    at::Tensor q = codec->reduceP(bucket, wire, worldSize);
    if (q.numel() == 0) {  // nothing compressed in this bucket
      markIssued();
      onQ(q);
      return;
    }
    auto done = allreduce(q);
    markIssued();
    then(done, [q](BucketStep& s) { s.onQ(q); });
  }

  void onQ(const at::Tensor& summedQ) {
    codec->finish(bucket, summedQ, worldSize);
    result->markCompleted(wrapResult ? wrapResult(buffer) : c10::IValue(buffer));
  }
};

}  // namespace

PowerSgdAllreduce::Started PowerSgdAllreduce::start(std::shared_ptr<PowerSgdCodec> codec,
                                                    c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                    int64_t bucket, at::Tensor buffer,
                                                    at::Tensor wire,
                                                    c10::intrusive_ptr<Future> turn) {
  TORCH_CHECK(codec && group, "PowerSgdAllreduce: a codec and a process group are needed");
  auto step = std::make_shared<BucketStep>();
  step->codec = std::move(codec);
  step->worldSize = group->getSize();
  step->group = std::move(group);
  step->bucket = bucket;
  std::vector<c10::Device> devices;
  if (buffer.is_cuda()) {
    devices.push_back(buffer.device());
    step->issueStream =
        c10::impl::VirtualGuardImpl(buffer.device().type()).getStream(buffer.device());
  }
  step->wrapResult = wrapResult_;
  step->result = c10::make_intrusive<Future>(resultType_, std::move(devices));
  step->issued = c10::make_intrusive<Future>(c10::NoneType::get());
  step->buffer = std::move(buffer);
  step->wire = std::move(wire);

  if (!turn) {
    std::lock_guard<std::mutex> lock(mutex_);
    turn = std::exchange(tail_, step->issued);
  }
  Started started{step->result, step->issued};
  if (!turn) {
    try {
      step->issueWire();
    } catch (...) {
      step->fail(std::current_exception());
    }
  } else {
    // An earlier bucket's failure fails this one too.
    step->then(turn, [](BucketStep& s) { s.issueWire(); });
  }
  return started;
}

}  // namespace xcomm
