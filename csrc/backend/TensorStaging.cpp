#include "backend/TensorStaging.hpp"

#include "common/CurrentStream.hpp"

namespace xcomm {

bool TensorStaging::needsStaging(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && !t.is_contiguous();
}

at::Tensor TensorStaging::in(const at::Tensor& t) {
  return needsStaging(t) ? t.contiguous() : t;
}

at::Tensor TensorStaging::inOut(const at::Tensor& t) {
  if (!needsStaging(t)) {
    return t;
  }
  at::Tensor staged = t.contiguous();
  copies_.emplace_back(t, staged);
  return staged;
}

at::Tensor TensorStaging::out(const at::Tensor& t) {
  if (!needsStaging(t)) {
    return t;
  }
  at::Tensor staged = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  copies_.emplace_back(t, staged);
  return staged;
}

std::vector<at::Tensor> TensorStaging::in(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> staged;
  staged.reserve(ts.size());
  for (const auto& t : ts) staged.push_back(in(t));
  return staged;
}

std::vector<at::Tensor> TensorStaging::inOut(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> staged;
  staged.reserve(ts.size());
  for (const auto& t : ts) staged.push_back(inOut(t));
  return staged;
}

std::vector<at::Tensor> TensorStaging::out(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> staged;
  staged.reserve(ts.size());
  for (const auto& t : ts) staged.push_back(out(t));
  return staged;
}

std::vector<std::vector<at::Tensor>> TensorStaging::out(
    const std::vector<std::vector<at::Tensor>>& ts) {
  std::vector<std::vector<at::Tensor>> staged;
  staged.reserve(ts.size());
  for (const auto& list : ts) staged.push_back(out(list));
  return staged;
}

std::function<void()> TensorStaging::copyBack() const {
  if (empty()) {
    return {};
  }
  return [copies = copies_, steps = steps_] {
    for (const auto& [callers, staged] : copies) {
      callers.copy_(staged);
      usedOnCurrentStream({staged});
    }
    for (const auto& step : steps) step();
  };
}

}  // namespace xcomm
