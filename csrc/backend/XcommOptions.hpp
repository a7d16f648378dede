#pragma once
// Options of an xcomm process group (the C++ side of xcomm.Options).
#include <chrono>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "collectives/CompressedAllreduce.hpp"

namespace xcomm {

struct XcommOptions : c10d::Backend::Options {
  explicit XcommOptions(std::chrono::milliseconds timeout = ::kBackendDefaultTimeout)
      : Options("xcomm", timeout) {}

  // Backend-level allreduce compression (xcomm.Options(compression=...)).
  CompressionConfig compression;

  static c10::intrusive_ptr<XcommOptions> create(
      std::chrono::milliseconds timeout = ::kBackendDefaultTimeout) {
    return c10::make_intrusive<XcommOptions>(timeout);
  }
};

}  // namespace xcomm
