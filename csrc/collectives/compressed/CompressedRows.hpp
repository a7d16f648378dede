#pragma once
// The arithmetic of a compressed reduce-scatter, whoever issues its
// all-to-all: each rank's input is `size` equal rows (row j is what rank j
// keeps); the rows are encoded (fp16/bf16: cast; int8: Int8Codec::packRows,
// one float32 scale per chunk, each row padded to whole chunks), and rank j
// sums the decoded rows it received in rank order. Used by the backend's
// CompressedReduceScatter, FSDP2's state (xcomm.hooks.fsdp) and auto's
// calibration (CodecCalibration).
#include <cstdint>
#include <memory>

#include <ATen/ATen.h>

#include "common/Compression.hpp"
#include "compress/ErrorFeedback.hpp"
#include "compress/Int8Codec.hpp"

namespace xcomm {

class CompressedRows {
 public:
  // `method`: fp16, bf16 or int8; `size`: the group's.
  CompressedRows(Compression method, int size, std::shared_ptr<const Int8Codec> int8);

  // Row j of `input` (`size` equal rows) encoded for rank j: int8 uint8
  // [size, bytes per row] (Int8Codec::packRows), a cast [size, row elements]
  // in the low precision. With `feedback`, the key's residual is added first
  // and what the encoding lost is stored back as the key's residual.
  at::Tensor encode(const at::Tensor& input, ErrorFeedback* feedback = nullptr,
                    int64_t key = 0) const;
  // The received rows decoded and summed in rank order (the same bits every
  // run), in float32 (float64 for a float64 output), divided by `size` under
  // `mean`, into `output` (one row's elements).
  void reduceInto(const at::Tensor& received, const at::Tensor& output, bool mean) const;
  // Link bytes this rank sends: an all-to-all of `wire`.
  int64_t sentBytes(const at::Tensor& wire) const;

 private:
  Compression method_;
  int size_;
  std::shared_ptr<const Int8Codec> int8_;
};

}  // namespace xcomm
