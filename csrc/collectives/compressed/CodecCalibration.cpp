#include "collectives/compressed/CodecCalibration.hpp"

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <optional>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "collectives/compressed/CompressedRows.hpp"
#include "common/Methods.hpp"
#include "compress/ErrorFeedback.hpp"
#include "compress/Int8Codec.hpp"
#include "compress/PowerSgdCodec.hpp"
#include "compress/TopKCodec.hpp"

namespace xcomm {
namespace {

// The least wall time of three runs of `fn`, each until the work it queued
// on `device` has finished (a CPU device has nothing queued).
template <typename Fn>
double bestOfThree(const c10::Device& device, Fn&& fn) {
  const auto sync = [&device] {
    if (device.type() != c10::DeviceType::CPU) {
      c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
    }
  };
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 3; ++i) {
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    sync();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

at::Tensor flatFloat(const at::Tensor& sample) {
  TORCH_CHECK_VALUE(sample.numel() > 0, "xcomm: auto calibrates its codecs on a non-empty sample");
  return sample.detach().reshape({-1}).to(at::kFloat).clone();
}

// The largest power of two m with m * m <= numel: a square matrix's side.
int64_t squareSide(int64_t numel) {
  int bits = 0;
  for (int64_t n = numel; n > 1; n >>= 1) ++bits;  // bit length - 1
  return int64_t{1} << (bits / 2);
}

}  // namespace

CodecCosts calibrateAllreduceCodecs(const at::Tensor& sample, int world, int64_t int8ChunkElems,
                                    int64_t powersgdRank, const std::vector<std::string>& methods,
                                    bool errorFeedback) {
  TORCH_CHECK_VALUE(world >= 1, "xcomm: auto calibrates for a group of >= 1 ranks, got ", world);
  const at::Tensor x = flatFloat(sample);
  const c10::Device device = x.device();
  const int64_t numel = x.numel();
  const double n = static_cast<double>(numel);
  at::Tensor out = at::empty_like(x);
  CodecCosts costs;
  for (const std::string& method : methods) {
    if (method == "none") continue;
    if (method == "bf16" || method == "fp16") {
      const auto dtype = method == "bf16" ? at::kBFloat16 : at::kHalf;
      costs[method] = bestOfThree(device, [&] { out.copy_(x.to(dtype).div_(world)); }) / n;
    } else if (method == "int8") {
      Int8Codec codec(int8ChunkElems);
      ErrorFeedback feedback;
      const int64_t shard = codec.shardElems(numel, world);
      costs[method] = bestOfThree(device,
                                  [&] {
                                    at::Tensor packed =
                                        errorFeedback
                                            ? codec.packShardsWithFeedback(x, world, feedback, 0)
                                            : codec.packShards(x, world);
                                    at::Tensor mean = codec.reduceAndPack(packed, shard, world);
                                    codec.unpackAll(mean.repeat({world}), shard, out);
                                  }) /
                      n;
    } else if (method == "topk") {
      TopKCodec codec(false, false);
      ErrorFeedback feedback;
      const int64_t k = TopKCodec::kFor(numel, 0.01);
      costs[method] =
          bestOfThree(device,
                      [&] {
                        at::Tensor packed =
                            codec.encode(0, x, k, errorFeedback ? &feedback : nullptr);
                        codec.decode(packed.repeat({world}).reshape({world, -1}), k, out, world);
                      }) /
          n;
    } else if (method == "powersgd") {
      // xcomm's own codec (all three products, error feedback,
      // orthogonalisation, decompression) on one square matrix.
      PowerSgdOptions options;
      options.matrixApproximationRank = powersgdRank;
      options.useErrorFeedback = errorFeedback;
      PowerSgdCodec codec(options);
      const int64_t m = squareSide(numel);
      at::Tensor matrix = x.narrow(0, 0, m * (numel / m)).clone();
      codec.setLayout(0, matrix, {matrix.view({m, -1})}, {0});
      const double seconds = bestOfThree(device, [&] {
        const std::optional<uint64_t> seed =
            codec.needsSeed(0) ? std::optional<uint64_t>(1) : std::nullopt;
        const PowerSgdStepInfo step = codec.prepare(0, matrix, seed);
        codec.finish(0, codec.reduceP(0, step.wire, world), world);
      });
      costs["powersgd_mnr"] = seconds / (static_cast<double>(matrix.numel()) *
                                         static_cast<double>(std::min<int64_t>(powersgdRank, m)));
      costs["powersgd_pass"] = bestOfThree(device, [&] { out.add_(x); }) / n;
    } else {
      TORCH_CHECK_VALUE(false, "xcomm: auto has no calibration for method '", method,
                        "'; it calibrates ", methodChoices(kDdpSurface, /*lossyOnly=*/true));
    }
  }
  return costs;
}

std::vector<std::string> allreduceCostKeys(const std::vector<std::string>& methods) {
  std::vector<std::string> keys;
  for (const std::string& method : methods) {
    if (method == "none") continue;
    if (method == "powersgd") {
      keys.insert(keys.end(), {"powersgd_mnr", "powersgd_pass"});
    } else {
      keys.push_back(method);
    }
  }
  return keys;
}

CodecCosts calibrateReduceScatterCodecs(const at::Tensor& sample, int world,
                                        int64_t int8ChunkElems) {
  TORCH_CHECK_VALUE(world >= 1, "xcomm: auto calibrates for a group of >= 1 ranks, got ", world);
  at::Tensor x = flatFloat(sample);
  const int64_t numel = x.numel() - x.numel() % world;
  TORCH_CHECK_VALUE(numel > 0, "xcomm: auto's reduce-scatter calibration needs at least ", world,
                    " elements, got ", x.numel());
  x = x.narrow(0, 0, numel);
  const c10::Device device = x.device();
  at::Tensor out = at::empty({numel / world}, x.options());
  auto codec = std::make_shared<const Int8Codec>(int8ChunkElems);
  ErrorFeedback feedback;
  CodecCosts costs;
  for (const auto& info : kMethodTable) {
    if (!(info.surfaces & kFsdpSurface) || info.lossless) continue;
    const char* method = info.name;
    const CompressedRows rows(parseCompression(method), world, codec);
    ErrorFeedback* fb = std::string(method) == "int8" ? &feedback : nullptr;
    // The encode, and (as if every rank sent the same rows) the decode and
    // sum of what arrives.
    costs[method] =
        bestOfThree(device, [&] { rows.reduceInto(rows.encode(x, fb, 0), out, false); }) /
        static_cast<double>(numel);
  }
  return costs;
}

}  // namespace xcomm
