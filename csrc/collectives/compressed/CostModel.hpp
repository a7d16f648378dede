#pragma once
// auto's cost model, one for every auto: the backend's compression="auto"
// (AutoCompression), the DDP hook's (hooks/auto.py, predict_seconds) and
// FSDP2's (hooks/fsdp.py, predict_reduce_scatter_seconds) all predict with
// these formulas, bound as _C.predict_allreduce / _C.predict_reduce_scatter.
//
// A prediction is split into the codec's seconds and the link's, because the
// closed loop (ObservedFactors) corrects the two apart. For a bucket of n
// elements of b bytes over w ranks, a link of latency L per collective and
// B bytes per second, ring(x) = 2 (w-1)/w x, and c_m the codec's calibrated
// seconds per element:
//   allreduce
//     none     : L + ring(n b) / B
//     bf16/fp16: c n + L + ring(2n) / B
//     int8     : c n + 2L + ring(n (1 + 4/chunk)) / B     (all-to-all + all-gather)
//     topk     : c n + L + (w-1) k (4 + b) / B,  k = max(1, ceil(density n))
//     powersgd : c_mnr mnr + c_pass n + (Q ? 2 : 1) L + (ring(P b) + ring(Q b)) / B
//   reduce-scatter (links in bytes of input per second, one per collective kind)
//     none     : L_rs + n b / B_rs
//     bf16/fp16: c n + L_a2a + 2n / B_a2a
//     int8     : c n + L_a2a + n (1 + 4/chunk) / B_a2a
#include <cstdint>
#include <map>
#include <string>

#include "common/Compression.hpp"

namespace xcomm {

struct LinkModel {
  double latencySeconds = 0;
  double bytesPerSecond = 0;  // 0: a link that costs nothing but its latency
  double seconds(int collectives, double bytes) const {
    return collectives * latencySeconds + (bytesPerSecond > 0 ? bytes / bytesPerSecond : 0.0);
  }
};

// Codec seconds per element by method name ("bf16", "int8", "topk", ...;
// PowerSGD's as "powersgd_mnr" per multiply-add and "powersgd_pass" per
// element), as calibrated on this machine.
using CodecCosts = std::map<std::string, double>;

// What the formulas read beyond a bucket's size and element size.
struct BucketShape {
  int64_t numel = 0;
  int64_t elementSize = 4;
  int world = 1;
  int64_t int8ChunkElems = kDefaultInt8ChunkElems;
  double topkDensity = 0.01;
  // PowerSGD's allreduced factors P and Q in elements (tensors it does not
  // compress go whole with P) and the multiply-adds of its products.
  int64_t powersgdP = 0, powersgdQ = 0;
  double powersgdMultiplyAdds = 0;
};

struct ReductionCost {
  double codecSeconds = 0;
  double wireSeconds = 0;
  double total() const { return codecSeconds + wireSeconds; }
};

// One allreduce of `bucket` with `method` ("none", "bf16", "fp16", "int8",
// "topk", "powersgd"); ValueError for another name or a cost `costs` lacks.
ReductionCost predictAllreduce(const std::string& method, const BucketShape& bucket,
                               const LinkModel& link, const CodecCosts& costs);

// One reduce-scatter of `bucket` ("none", "bf16", "fp16", "int8"): none on
// the reduce-scatter link, the codecs' rows on the all-to-all link.
ReductionCost predictReduceScatter(const std::string& method, const BucketShape& bucket,
                                   const LinkModel& reduceScatter, const LinkModel& allToAll,
                                   const CodecCosts& costs);

}  // namespace xcomm
