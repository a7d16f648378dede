#include "compress/PowerSgdKernels.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace xcomm::powersgd {
namespace {

// Independent partial sums per dot product. 16 fills the vector registers of
// any x86 level without spilling; fixed so results do not depend on the ISA.
constexpr int64_t kLanes = 16;

// Columns handled per pass of reconstructRows (a tile that stays in L1).
constexpr int64_t kTile = 512;

// Columns per tile of projectColumns: its rank * kColumnTile accumulators
// stay in L1 (8 KiB of doubles at rank 4).
constexpr int64_t kColumnTile = 256;
// Rows folded per accumulator load/store in projectColumns.
constexpr int64_t kRowBlock = 8;

template <typename A>
A sumLanes(A* lane) {
  // Pairwise, in a fixed order.
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) lane[l] += lane[l + width];
  }
  return lane[0];
}

template <typename T, typename A = Acc<T>>
A dot(const T* x, const T* y, int64_t n) {
  A lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lane[l] += A(x[j + l]) * A(y[j + l]);
  }
  for (int64_t l = 0; j + l < n; ++l) lane[l] += A(x[j + l]) * A(y[j + l]);
  return sumLanes(lane);
}

// Same, over column `col` of a row-major rows x stride matrix.
template <typename A>
A dotColumns(const A* x, const A* y, int64_t n, int64_t stride) {
  A lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lane[l] += x[(i + l) * stride] * y[(i + l) * stride];
  }
  for (int64_t l = 0; i + l < n; ++l) lane[l] += x[(i + l) * stride] * y[(i + l) * stride];
  return sumLanes(lane);
}

// Contiguous dot product in the accumulation type (Householder's columns).
template <typename A>
A dotAcc(const A* x, const A* y, int64_t n) {
  return dotColumns(x, y, n, 1);
}

}  // namespace

template <typename T>
void projectRows(T* mat, const T* error, int64_t cols, const T* qT, int64_t rank, T* p,
                 int64_t rowBegin, int64_t rowEnd) {
  for (int64_t row = rowBegin; row < rowEnd; ++row) {
    T* m = mat + row * cols;
    if (error != nullptr) {
      // Rounded to T, as torch's input_tensor.add_(error).
      const T* e = error + row * cols;
      for (int64_t j = 0; j < cols; ++j) m[j] = m[j] + e[j];
    }
    // The row is now in L1 (or L2 for very wide rows); reading it once per
    // rank is cheaper than juggling rank * kLanes accumulators.
    for (int64_t k = 0; k < rank; ++k) p[row * rank + k] = T(dot(m, qT + k * cols, cols));
  }
}

template <typename T>
void projectColumns(const T* mat, int64_t rows, int64_t cols, const T* p, int64_t rank, T* q,
                    int64_t colBegin, int64_t colEnd) {
  using A = Acc<T>;
  // One accumulator per output, summed over rows in order: neither the column
  // range a thread owns nor the tiling changes which values an output adds,
  // or in which order. Tiles of kColumnTile columns keep the rank * tile
  // accumulators in L1 while every row streams past (with whole rows, 2048
  // columns at rank 4 is 64 KiB of doubles, re-read from L2 for every row).
  std::vector<A> acc(static_cast<size_t>(std::min(kColumnTile, colEnd - colBegin) * rank));
  for (int64_t t0 = colBegin; t0 < colEnd; t0 += kColumnTile) {
    const int64_t width = std::min(kColumnTile, colEnd - t0);
    std::fill(acc.begin(), acc.begin() + width * rank, A(0));
    // Blocks of kRowBlock rows: an accumulator is loaded and stored once per
    // block instead of once per row; inside, the rows are still added one
    // after the other, in order.
    int64_t row = 0;
    for (; row + kRowBlock <= rows; row += kRowBlock) {
      const T* m[kRowBlock];
      for (int64_t r = 0; r < kRowBlock; ++r) m[r] = mat + (row + r) * cols + t0;
      for (int64_t k = 0; k < rank; ++k) {
        A pk[kRowBlock];
        for (int64_t r = 0; r < kRowBlock; ++r) pk[r] = A(p[(row + r) * rank + k]);
        A* a = acc.data() + k * width;
        for (int64_t j = 0; j < width; ++j) {
          A x = a[j];
          for (int64_t r = 0; r < kRowBlock; ++r) x += A(m[r][j]) * pk[r];
          a[j] = x;
        }
      }
    }
    for (; row < rows; ++row) {
      const T* m = mat + row * cols + t0;
      for (int64_t k = 0; k < rank; ++k) {
        const A pk = A(p[row * rank + k]);
        A* a = acc.data() + k * width;
        for (int64_t j = 0; j < width; ++j) a[j] += A(m[j]) * pk;
      }
    }
    for (int64_t j = 0; j < width; ++j) {
      for (int64_t k = 0; k < rank; ++k) q[(t0 + j) * rank + k] = T(acc[k * width + j]);
    }
  }
}

template <typename T>
void reconstructRows(T* mat, T* error, int64_t cols, const T* p, const T* qT, int64_t rank,
                     int64_t rowBegin, int64_t rowEnd) {
  using A = Acc<T>;
  A d[kTile];
  for (int64_t row = rowBegin; row < rowEnd; ++row) {
    T* m = mat + row * cols;
    T* e = error != nullptr ? error + row * cols : nullptr;
    const T* pr = p + row * rank;
    for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const int64_t w = std::min(kTile, cols - j0);
      // Sum over k in order: with rank 1 this is the single product torch's
      // bmm computes, rounded once, so the bits match torch's.
      const A p0 = A(pr[0]);
      const T* q0 = qT + j0;
      for (int64_t j = 0; j < w; ++j) d[j] = p0 * A(q0[j]);
      for (int64_t k = 1; k < rank; ++k) {
        const A pk = A(pr[k]);
        const T* qk = qT + k * cols + j0;
        for (int64_t j = 0; j < w; ++j) d[j] += pk * A(qk[j]);
      }
      T* mt = m + j0;
      if (e != nullptr) {
        T* et = e + j0;
        for (int64_t j = 0; j < w; ++j) {
          const T dj = T(d[j]);
          et[j] = mt[j] - dj;  // rounded as torch's input_tensor_cp - input_tensor
          mt[j] = dj;
        }
      } else {
        for (int64_t j = 0; j < w; ++j) mt[j] = T(d[j]);
      }
    }
  }
}

template <typename T>
void gramSchmidt(T* x, int64_t rows, int64_t rank, double epsilon) {
  using A = Acc<T>;
  // Work in the accumulation type and round once at the end.
  std::vector<A> w(static_cast<size_t>(rows * rank));
  for (int64_t i = 0; i < rows * rank; ++i) w[i] = A(x[i]);
  for (int64_t c = 0; c < rank; ++c) {
    A* col = w.data() + c;
    const A norm = std::sqrt(dotColumns(col, col, rows, rank));
    const A denom = epsilon == 0 ? norm : norm + A(epsilon);
    for (int64_t i = 0; i < rows; ++i) col[i * rank] /= denom;
    for (int64_t o = c + 1; o < rank; ++o) {
      A* other = w.data() + o;
      const A proj = dotColumns(col, other, rows, rank);
      for (int64_t i = 0; i < rows; ++i) other[i * rank] -= proj * col[i * rank];
    }
  }
  for (int64_t i = 0; i < rows * rank; ++i) x[i] = T(w[i]);
}

template <typename T>
void householderQ(T* x, int64_t rows, int64_t rank, Acc<T>* scratch) {
  using A = Acc<T>;
  // Column-major copy: each reflector works down one contiguous column.
  A* a = scratch;
  A* tau = scratch + rows * rank;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < rank; ++c) a[c * rows + i] = A(x[i * rank + c]);
  }
  // Applies I - t v v^T, v = (1, col[k+1:]), to rows k.. of column `other`.
  auto reflect = [rows](const A* col, A t, int64_t k, A* other) {
    if (t == 0) return;
    const A s = t * (other[k] + dotAcc(col + k + 1, other + k + 1, rows - k - 1));
    other[k] -= s;
    for (int64_t i = k + 1; i < rows; ++i) other[i] -= s * col[i];
  };
  // geqr2: reflector k maps column k below the diagonal to zero.
  for (int64_t k = 0; k < rank; ++k) {
    A* col = a + k * rows;
    const int64_t below = rows - k - 1;
    const A xnorm = below > 0 ? std::sqrt(dotAcc(col + k + 1, col + k + 1, below)) : A(0);
    if (below <= 0 || xnorm == 0) {
      tau[k] = 0;  // already reduced: H = I, as LAPACK's larfg
    } else {
      const A alpha = col[k];
      const A beta = -std::copysign(std::hypot(alpha, xnorm), alpha);
      tau[k] = (beta - alpha) / beta;
      const A scale = A(1) / (alpha - beta);
      for (int64_t i = k + 1; i < rows; ++i) col[i] *= scale;
      col[k] = beta;
    }
    for (int64_t c = k + 1; c < rank; ++c) reflect(col, tau[k], k, a + c * rows);
  }
  // org2r: Q = H_0 ... H_{rank-1} applied to the first rank unit vectors,
  // built in place from the last reflector back.
  for (int64_t k = rank - 1; k >= 0; --k) {
    A* col = a + k * rows;
    for (int64_t c = k + 1; c < rank; ++c) reflect(col, tau[k], k, a + c * rows);
    for (int64_t i = k + 1; i < rows; ++i) col[i] *= -tau[k];
    col[k] = A(1) - tau[k];
    for (int64_t i = 0; i < k; ++i) col[i] = 0;
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < rank; ++c) x[i * rank + c] = T(a[c * rows + i]);
  }
}

template <typename T>
void orthonormalize(T* x, int64_t rows, int64_t rank, double epsilon) {
  if (rank <= 2 || !std::is_same_v<Acc<T>, double>) {
    gramSchmidt(x, rows, rank, epsilon);
    return;
  }
  std::vector<Acc<T>> scratch(static_cast<size_t>(rows * rank + rank));
  householderQ(x, rows, rank, scratch.data());
}

template <typename T>
void transposeInto(T* dst, const T* src, int64_t rows, int64_t rank) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t k = 0; k < rank; ++k) dst[k * rows + i] = src[i * rank + k];
  }
}

template <typename T>
void packUncompressed(T* grad, const T* error, T* wire, int64_t n) {
  if (error != nullptr) {
    for (int64_t i = 0; i < n; ++i) grad[i] = grad[i] + error[i];
  }
  std::copy(grad, grad + n, wire);
}

template <typename T>
void unpackUncompressed(T* grad, T* error, const T* summed, int64_t n, int64_t worldSize) {
  if (error == nullptr) {
    divideInto(grad, summed, n, worldSize);
    return;
  }
  using Op = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const Op d = Op(worldSize);
  for (int64_t i = 0; i < n; ++i) {
    // grad still holds gradient + old error: the error comes first.
    const T avg = T(Op(summed[i]) / d);
    if (std::isfinite(static_cast<double>(avg))) error[i] = grad[i] - avg;
    grad[i] = avg;
  }
}

template <typename T>
void divideInto(T* dst, const T* src, int64_t n, int64_t divisor) {
  using Op = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const Op d = Op(divisor);
  for (int64_t i = 0; i < n; ++i) dst[i] = T(Op(src[i]) / d);
}

template <typename T>
bool allFinite(const T* x, int64_t n) {
  // x - x is 0 for finite x and NaN otherwise; one branch-free pass.
  using A = Acc<T>;
  A probe = 0;
  for (int64_t i = 0; i < n; ++i) probe += A(x[i]) - A(x[i]);
  return probe == 0;
}

#define XCOMM_POWERSGD_INSTANTIATE(T)                                                           \
  template void projectRows<T>(T*, const T*, int64_t, const T*, int64_t, T*, int64_t, int64_t); \
  template void projectColumns<T>(const T*, int64_t, int64_t, const T*, int64_t, T*, int64_t,   \
                                  int64_t);                                                     \
  template void reconstructRows<T>(T*, T*, int64_t, const T*, const T*, int64_t, int64_t,       \
                                   int64_t);                                                    \
  template void gramSchmidt<T>(T*, int64_t, int64_t, double);                                   \
  template void householderQ<T>(T*, int64_t, int64_t, Acc<T>*);                                 \
  template void orthonormalize<T>(T*, int64_t, int64_t, double);                                \
  template void transposeInto<T>(T*, const T*, int64_t, int64_t);                               \
  template void packUncompressed<T>(T*, const T*, T*, int64_t);                                 \
  template void unpackUncompressed<T>(T*, T*, const T*, int64_t, int64_t);                      \
  template void divideInto<T>(T*, const T*, int64_t, int64_t);                                  \
  template bool allFinite<T>(const T*, int64_t);

XCOMM_POWERSGD_INSTANTIATE(float)
XCOMM_POWERSGD_INSTANTIATE(double)
XCOMM_POWERSGD_INSTANTIATE(c10::Half)
XCOMM_POWERSGD_INSTANTIATE(c10::BFloat16)

#undef XCOMM_POWERSGD_INSTANTIATE

}  // namespace xcomm::powersgd
