#pragma once
// The arithmetic of PowerSGD on raw row-major matrices, one matrix (or a
// range of its rows or columns) per call, so the codec can spread a bucket's
// matrices over threads.
//
// Reproducibility: every result depends only on the values it is computed
// from, never on the thread count, the SIMD width or where in the bucket a
// matrix lies. Sums use a fixed number of independent partial sums combined
// in a fixed order (the compiler vectorises across those partial sums, which
// does not reorder them), and accumulate in `Acc<T>` (the type itself for
// float and double, as torch's matmuls do; float for the 16-bit types).
// That is what lets every rank, and a run resumed from a checkpoint, produce
// the same bits. (Accumulating float in double cost twice the time per
// element for no accuracy torch's hook has: its bmm sums in float.)
//
// Values that are stored (M + error, the decompressed matrix, the new error)
// are rounded to T exactly as torch's elementwise ops on T tensors round
// them, so only the dot products differ from torch's, and only by rounding.
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace xcomm::powersgd {

template <typename T>
struct AccOf {
  using type = T;
};
template <>
struct AccOf<c10::Half> {
  using type = float;
};
template <>
struct AccOf<c10::BFloat16> {
  using type = float;
};
template <typename T>
using Acc = typename AccOf<T>::type;

// Rows [rowBegin, rowEnd) of `mat` (rows x cols): with error feedback
// (`error` not null) first mat += error in place, then
// p[row, k] = mat[row, :] . qT[k, :] for k < rank.
// `qT` is Q transposed (rank x cols); `p` is rows x rank.
template <typename T>
void projectRows(T* mat, const T* error, int64_t cols, const T* qT, int64_t rank, T* p,
                 int64_t rowBegin, int64_t rowEnd);

// Columns [colBegin, colEnd) of Q = mat^T P: q[col, k] = sum over rows of
// mat[row, col] * p[row, k], summed in row order. `q` is cols x rank.
template <typename T>
void projectColumns(const T* mat, int64_t rows, int64_t cols, const T* p, int64_t rank, T* q,
                    int64_t colBegin, int64_t colEnd);

// Rows [rowBegin, rowEnd) of the decompression mat = P Q^T. With error
// feedback (`error` not null), error = (old mat) - (new mat) first, the part
// of the input that this step did not transmit.
template <typename T>
void reconstructRows(T* mat, T* error, int64_t cols, const T* p, const T* qT, int64_t rank,
                     int64_t rowBegin, int64_t rowEnd);

// Makes the `rank` columns of `x` (rows x rank, row-major, rank <= rows)
// orthonormal in place.
//
// Gram-Schmidt, as torch's hook does for rank <= 2 and for 16-bit types:
// each column is divided by (its norm + epsilon), so with epsilon == 0 a
// zero column becomes NaN, as in torch; a small epsilon (1e-8) avoids that.
template <typename T>
void gramSchmidt(T* x, int64_t rows, int64_t rank, double epsilon);

// Householder QR, keeping Q, as LAPACK's geqrf + orgqr (torch.linalg.qr,
// which torch's hook uses for rank > 2): same reflector and sign conventions,
// so the same Q up to rounding, including for zero columns (a unit vector,
// not NaN). Computed here rather than in LAPACK for bitwise reproducibility
// (MKL's results may depend on the CPU and on alignment) and to skip LAPACK's
// per-call overhead on many small matrices. `scratch` holds rows * rank + rank
// values of Acc<T>.
template <typename T>
void householderQ(T* x, int64_t rows, int64_t rank, Acc<T>* scratch);

// An uncompressed gradient on its way out: with error feedback grad += error
// in place; then the (new) gradient is copied into the wire.
template <typename T>
void packUncompressed(T* grad, const T* error, T* wire, int64_t n);

// And on its way back: avg = summed / worldSize goes into grad; with error
// feedback, error = (grad before) - avg, as torch computes it for the whole
// bucket. Where avg is not finite the error is left as it was (see
// PowerSgdCodec: a step with non-finite gradients does not poison the state).
template <typename T>
void unpackUncompressed(T* grad, T* error, const T* summed, int64_t n, int64_t worldSize);

// Orthonormalizes as torch's hook does: Gram-Schmidt for rank <= 2 and for
// the 16-bit types, Householder otherwise (where torch ignores epsilon).
template <typename T>
void orthonormalize(T* x, int64_t rows, int64_t rank, double epsilon);

// dst (rank x rows) = src (rows x rank) transposed.
template <typename T>
void transposeInto(T* dst, const T* src, int64_t rows, int64_t rank);

// dst[i] = src[i] / divisor, rounded as torch's Tensor.div_(int) rounds.
template <typename T>
void divideInto(T* dst, const T* src, int64_t n, int64_t divisor);

// True when all n values are finite.
template <typename T>
bool allFinite(const T* x, int64_t n);

}  // namespace xcomm::powersgd
