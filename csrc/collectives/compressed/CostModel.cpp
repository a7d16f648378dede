#include "collectives/compressed/CostModel.hpp"

#include <algorithm>
#include <cmath>

#include <c10/util/Exception.h>

#include "common/LinkBytes.hpp"
#include "common/Methods.hpp"

namespace xcomm {
namespace {

double cost(const CodecCosts& costs, const std::string& key) {
  const auto it = costs.find(key);
  TORCH_CHECK_VALUE(it != costs.end(), "xcomm: auto's cost model has no calibrated cost for '", key,
                    "' (seconds per element); calibrate the codecs first");
  return it->second;
}

}  // namespace

ReductionCost predictAllreduce(const std::string& method, const BucketShape& bucket,
                               const LinkModel& link, const CodecCosts& costs) {
  const double n = static_cast<double>(bucket.numel);
  const double b = static_cast<double>(bucket.elementSize);
  const auto ring = [&](double bytes) { return ringAllreduceBytes(bytes, bucket.world); };
  if (method == "none") return {0.0, link.seconds(1, ring(n * b))};
  if (method == "bf16" || method == "fp16") {
    return {cost(costs, method) * n, link.seconds(1, ring(n * 2.0))};
  }
  if (method == "int8") {
    const double chunk = static_cast<double>(bucket.int8ChunkElems);
    return {cost(costs, method) * n, link.seconds(2, ring(n * (1.0 + 4.0 / chunk)))};
  }
  if (method == "topk") {
    const double k = std::max(1.0, std::ceil(bucket.topkDensity * n));
    return {cost(costs, method) * n, link.seconds(1, (bucket.world - 1) * k * (4.0 + b))};
  }
  if (method == "powersgd") {
    const double p = static_cast<double>(bucket.powersgdP),
                 q = static_cast<double>(bucket.powersgdQ);
    return {cost(costs, "powersgd_mnr") * bucket.powersgdMultiplyAdds +
                cost(costs, "powersgd_pass") * n,
            link.seconds(q > 0 ? 2 : 1, ring(p * b) + ring(q * b))};
  }
  TORCH_CHECK_VALUE(false, "xcomm: unknown method '", method,
                    "' for auto's allreduce cost model; choose from ", methodChoices(kDdpSurface));
}

ReductionCost predictReduceScatter(const std::string& method, const BucketShape& bucket,
                                   const LinkModel& reduceScatter, const LinkModel& allToAll,
                                   const CodecCosts& costs) {
  const double n = static_cast<double>(bucket.numel);
  if (method == "none") {
    return {0.0, reduceScatter.seconds(1, n * static_cast<double>(bucket.elementSize))};
  }
  if (method == "bf16" || method == "fp16") {
    return {cost(costs, method) * n, allToAll.seconds(1, n * 2.0)};
  }
  if (method == "int8") {
    const double chunk = static_cast<double>(bucket.int8ChunkElems);
    return {cost(costs, method) * n, allToAll.seconds(1, n * (1.0 + 4.0 / chunk))};
  }
  TORCH_CHECK_VALUE(false, "xcomm: unknown method '", method,
                    "' for auto's reduce-scatter cost model; choose from ",
                    methodChoices(kFsdpSurface));
}

}  // namespace xcomm
