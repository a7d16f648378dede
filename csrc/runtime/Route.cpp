#include "runtime/Route.hpp"

#include <c10/util/Exception.h>

namespace xcomm {
namespace {

// The backend's own op limit, where it says (c10d's default otherwise).
std::chrono::milliseconds timeoutOf(c10d::Backend& backend) {
  try {
    if (auto options = backend.getBackendOptions()) return options->timeout;
  } catch (const c10::Error&) {
    // a backend without options
  }
  return std::chrono::minutes(30);
}

}  // namespace

RawRoute::RawRoute(c10::intrusive_ptr<c10d::Backend> backend)
    : InnerRoute(backend ? backend->getRank() : 0, backend ? backend->getSize() : 0),
      backend_(std::move(backend)) {
  TORCH_CHECK(backend_, "xcomm: a raw route needs a backend");
  timeoutMs_ = timeoutOf(*backend_).count();
}

void RawRoute::setTimeout(std::chrono::milliseconds timeout) {
  timeoutMs_ = timeout.count();
  backend_->setTimeout(timeout);
}

}  // namespace xcomm
