#pragma once
// Reductions over raw buffers (shared-memory slots), written so the compiler
// vectorises them: a block of each source is folded into a small accumulator
// array, one simple loop per source, then stored once.
//
// The sources are folded in the order given, so every rank that reduces the
// same element from the same buffers gets the same bits.
#include <cstdint>

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace xcomm {

// True when reduceBuffers handles `dtype` (float32/64, float16, bfloat16,
// the integer types and bool).
bool vectorReduceSupports(at::ScalarType dtype);

// dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... (op) srcs[n-1][i], for `count`
// elements of `dtype`. dst may be one of the sources. AVG and PREMUL_SUM
// reduce as SUM (the caller divides / premultiplies). float16 and bfloat16
// accumulate in float32 and are rounded once. Integer SUM/PRODUCT wrap around
// as in two's complement; bool SUM is a logical or, PRODUCT a logical and.
// With `copy`, the result is also written there (block by block, while it is
// still in cache), which saves a separate pass over dst.
void reduceBuffers(void* dst, const void* const* srcs, int n, int64_t count, at::ScalarType dtype,
                   c10d::ReduceOp::RedOpType op, void* copy = nullptr);

}  // namespace xcomm
