#pragma once
// Stream bookkeeping for work that finishes in a future's callback.
#include <ATen/core/Tensor.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <initializer_list>

namespace xcomm {

// A finalizer runs in a future's callback, on a stream from torch's pool, and
// reads buffers the caller's stream allocated. Recording that use keeps CUDA's
// caching allocator from handing the memory back to the caller's stream (the
// next op's buffers) before this stream has read it. Called after queuing the
// kernels; CPU tensors need nothing.
inline void usedOnCurrentStream(std::initializer_list<at::Tensor> tensors) {
  for (const auto& t : tensors) {
    if (!t.defined() || !t.is_cuda()) continue;
    const c10::impl::VirtualGuardImpl impl(t.device().type());
    t.record_stream(impl.getStream(t.device()));
  }
}

}  // namespace xcomm
