#pragma once
// auto's codec calibration, one for every auto: the backend's compression=
// "auto" (AutoCompression, at its first round) and, through the bindings,
// the DDP hook's (hooks/auto.py, calibrate_codecs) and FSDP2's
// (hooks/fsdp.py, calibrate_reduce_scatter_codecs).
//
// Each codec's seconds per element on this machine: the work its method adds
// to one reduction of `sample` (encode, with error feedback where the
// caller's codecs keep residuals, then decode and sum `world` received copies, as if every rank
// sent the same), the least of three runs, to completion on the sample's device. `sample` is what
// will be reduced where the caller has it (a codec's cost depends on its input: top-k's on a mostly
// zero bucket) and randn otherwise; float32, flat.
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "collectives/compressed/CostModel.hpp"

namespace xcomm {

// For an allreduce, each of `methods` ("bf16", "fp16", "int8", "topk",
// "powersgd"; none costs nothing): CostModel's keys, PowerSGD's as
// "powersgd_mnr" (per multiply-add of a rank-`powersgdRank` step on one
// square matrix) and "powersgd_pass" (per element sent whole). Top-k at 1%.
// `errorFeedback`: as the caller's codecs run (the hooks' int8, top-k and
// PowerSGD keep residuals; the backend's int8 does not).
CodecCosts calibrateAllreduceCodecs(const at::Tensor& sample, int world, int64_t int8ChunkElems,
                                    int64_t powersgdRank, const std::vector<std::string>& methods,
                                    bool errorFeedback = true);

// The keys calibrateAllreduceCodecs gives for `methods`, in their order:
// none has none, PowerSGD two, every other method its name.
std::vector<std::string> allreduceCostKeys(const std::vector<std::string>& methods);

// For a reduce-scatter (FSDP2's rows: encode `world` rows, decode and sum
// them), "bf16", "fp16" and "int8". The sample's size is cut to a multiple
// of `world`.
CodecCosts calibrateReduceScatterCodecs(const at::Tensor& sample, int world,
                                        int64_t int8ChunkElems);

}  // namespace xcomm
