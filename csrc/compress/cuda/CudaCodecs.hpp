#pragma once
// The codecs' CUDA kernels: what Int8Codec, RandomKCodec and TopKCodec run
// when a bucket lives on a GPU, so a CUDA bucket is encoded, reduced and
// decoded on its own device, on the caller's current stream, with no copy to
// the host and no synchronization.
//
// Plain declarations (no CUDA headers): the codecs include this from C++.
// The kernels are compiled only where a CUDA toolkit is found
// (CMakeLists.txt); elsewhere CudaCodecsMissing.cpp defines the functions,
// codecsBuilt() is false and the codecs keep their host route.
//
// Every kernel computes the same bits as the CPU kernels
// (compress/kernels/CodecKernelsImpl.cpp): the same operations in the same
// order per element, no FMA contraction (built with --fmad=false), and only
// max as a reduction whose order could vary. tests/gpu checks this bit for bit.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace xcomm {
namespace cuda {

// Whether this build has the CUDA kernels.
bool codecsBuilt();

// int8: quantizes `rows` rows of the float32 source into `out` (uint8, device,
// [rows, rowBytes] with rowBytes = qLen + 4 * ceil(qLen / chunk)). Row j takes
// source elements [j * stride, j * stride + min(stride, n - j * stride)); q
// entries past them, up to qLen, are 0. The source is `src` (+ `residual`
// when both are defined, stored back into it), or `residual` alone when `src`
// is undefined; with `residual`, it is left holding a - dequant(q).
void int8Encode(const at::Tensor& src, const at::Tensor& residual, int64_t n, int rows,
                int64_t stride, int64_t qLen, int64_t chunk, at::Tensor& out);
// int8: sums the dequantized rows of one shard (uint8 [world, rowBytes]) in
// rank order and divides by `divisor` (unless 1); stores the float32 sums in
// `sum` when it is defined, else quantizes them into `packed` (one row).
void int8Reduce(const at::Tensor& rows, int64_t shard, int64_t chunk, float divisor,
                const at::Tensor& sum, const at::Tensor& packed);
// int8: dequantizes the first `n` elements held by the packed rows (uint8
// [world, rowBytes], `shard` elements per row) into float32 `dst`.
void int8Decode(const at::Tensor& rows, int64_t shard, int64_t chunk, int64_t n,
                const at::Tensor& dst);

// random-k: the positions of RandomKCodec::positions (same hash, same
// strata) into int64 `out` of k entries; numel < 2^31.
void randomkPositions(uint64_t base, int64_t numel, const at::Tensor& out);
// acc += src (float32, same numel), in place.
void addInto(const at::Tensor& src, const at::Tensor& acc);
// values[i] = acc[positions[i]]; with `zero`, acc[positions[i]] = 0 after.
void gatherPositions(const at::Tensor& acc, const at::Tensor& positions, const at::Tensor& values,
                     bool zero);
// out = 0, then out[positions[i]] = values[i] (/ divisor unless 1).
void scatterPositions(const at::Tensor& values, const at::Tensor& positions, float divisor,
                      const at::Tensor& out);

// top-k: selects the exact top-k of |a| (ties: the lower index; NaN above
// Inf), where a = src (+ residual, stored back into it; or residual alone
// when src is undefined), and packs [k int32 indices ascending | k float32
// values] into `packed` (uint8, device). With `residual`, the sent entries
// are zeroed there.
void topkEncode(const at::Tensor& src, const at::Tensor& residual, int64_t k,
                const at::Tensor& packed);
// top-k: out = sum over the rows (uint8 [world, packedBytes]) of their
// (index, value) pairs, in rank order, divided by `divisor` (unless 1).
void topkDecode(const at::Tensor& rows, int64_t k, float divisor, const at::Tensor& out);

// PowerSGD: Gram-Schmidt of the columns of `x` (rows x rank, contiguous,
// float32/float64, on a GPU) in place, one kernel. Returns false (and does
// nothing) for anything else, which the caller then orthonormalizes itself.
bool gramSchmidt(const at::Tensor& x, double eps);
// The same for every matrix of `xs` (one dtype, one device), as few launches
// as their shapes allow (up to 32 matrices each); with `finite` (bool, one
// entry per matrix, on their device), also whether each matrix was finite
// before. Returns false (and does nothing) if any matrix does not apply.
bool gramSchmidtBatch(const std::vector<at::Tensor>& xs, double eps, const at::Tensor& finite);
// PowerSGD's last phase for one matrix, in one pass: with D = p q^T (`m`
// rows x cols, `p` rows x rank, `q` cols x rank, all contiguous, one dtype),
// err = m - D (when `err` is defined) and m = D; where `finite` (a 0-dim bool
// on the device) is false, m becomes NaN and err is left as it was. Sums in
// float32 (float64 for double), k in order. Returns false (and does nothing)
// where it does not apply; the caller then runs its ATen ops.
bool powersgdReconstruct(const at::Tensor& m, const at::Tensor& err, const at::Tensor& p,
                         const at::Tensor& q, const at::Tensor& finite);
// PowerSGD's uncompressed tensors (biases, norms) after their allreduce, in
// one pass: for i < index.numel(), avg = wire[i] * (1 / worldSize) (as
// ATen's division by a scalar computes it on a GPU; in float for the 16-bit
// types); with `error`, error[index[i]] = buffer[index[i]] - avg where avg
// is finite (left as it was elsewhere); then buffer[index[i]] = avg. All 1-D
// and contiguous, `index` int64, the rest of one dtype, on one device.
// Returns false (and does nothing) where it does not apply.
bool powersgdUnpackUncompressed(const at::Tensor& buffer, const at::Tensor& error,
                                const at::Tensor& wire, const at::Tensor& index, int64_t worldSize);
// PowerSGD's products where XCOMM_POWERSGD_MATMUL=xcomm: p = m q, and
// q = m^T p where `finite` (a 0-dim bool on the device) is true (q is left
// as it was elsewhere). `m` rows x cols, `p` rows x rank, `q` cols x rank,
// rank 1 to 32; all contiguous, float32 or float64, on one device. Each
// reads m once; sums in a fixed order. Return false (and do nothing) where
// they do not apply; the caller then runs at::mm.
bool powersgdProject(const at::Tensor& p, const at::Tensor& m, const at::Tensor& q);
bool powersgdProjectBack(const at::Tensor& q, const at::Tensor& m, const at::Tensor& p,
                         const at::Tensor& finite);

}  // namespace cuda
}  // namespace xcomm
