#include "collectives/reduce/VectorReduce.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "collectives/reduce/ReduceKernels.hpp"

namespace xcomm {
namespace {

using RedOp = c10d::ReduceOp::RedOpType;

// Elements folded per block: the accumulator stays in L1.
constexpr int64_t kBlock = 1024;

// The type an element is accumulated in: float for the 16-bit floats, the
// unsigned twin for integer SUM/PRODUCT (defined wrap-around), else itself.
template <typename T, RedOp Op>
struct AccumOf {
  using type = T;
};
template <RedOp Op>
struct AccumOf<c10::Half, Op> {
  using type = float;
};
template <RedOp Op>
struct AccumOf<c10::BFloat16, Op> {
  using type = float;
};
#define XCOMM_UNSIGNED_ACCUM(T)           \
  template <>                             \
  struct AccumOf<T, RedOp::SUM> {         \
    using type = std::make_unsigned_t<T>; \
  };                                      \
  template <>                             \
  struct AccumOf<T, RedOp::PRODUCT> {     \
    using type = std::make_unsigned_t<T>; \
  };
XCOMM_UNSIGNED_ACCUM(int8_t)
XCOMM_UNSIGNED_ACCUM(int16_t)
XCOMM_UNSIGNED_ACCUM(int32_t)
XCOMM_UNSIGNED_ACCUM(int64_t)
#undef XCOMM_UNSIGNED_ACCUM

template <RedOp Op, typename A>
inline A combine(A a, A b) {
  // Small unsigned types would be promoted to (signed) int: widen them to
  // unsigned first so wrap-around stays defined.
  using W = std::conditional_t<std::is_integral_v<A>, std::common_type_t<A, unsigned>, A>;
  if constexpr (Op == RedOp::SUM) {
    return static_cast<A>(static_cast<W>(a) + static_cast<W>(b));
  } else if constexpr (Op == RedOp::PRODUCT) {
    return static_cast<A>(static_cast<W>(a) * static_cast<W>(b));
  } else if constexpr (Op == RedOp::MIN) {
    return (a < b || a != a) ? a : b;  // a NaN wins, as in torch.minimum
  } else if constexpr (Op == RedOp::MAX) {
    return (a > b || a != a) ? a : b;
  } else if constexpr (Op == RedOp::BAND) {
    return static_cast<A>(a & b);
  } else if constexpr (Op == RedOp::BOR) {
    return static_cast<A>(a | b);
  } else {
    return static_cast<A>(a ^ b);
  }
}

template <typename T, RedOp Op>
void reduceTyped(void* dstRaw, void* copyRaw, const void* const* srcsRaw, int n, int64_t count) {
  using A = typename AccumOf<T, Op>::type;
  auto* dst = static_cast<T*>(dstRaw);
  auto* copy = static_cast<T*>(copyRaw);
  A acc[kBlock];
  for (int64_t base = 0; base < count; base += kBlock) {
    const int64_t len = std::min(kBlock, count - base);
    const T* first = static_cast<const T*>(srcsRaw[0]) + base;
    for (int64_t i = 0; i < len; ++i) acc[i] = static_cast<A>(first[i]);
    for (int k = 1; k < n; ++k) {
      const T* src = static_cast<const T*>(srcsRaw[k]) + base;
      for (int64_t i = 0; i < len; ++i) acc[i] = combine<Op, A>(acc[i], static_cast<A>(src[i]));
    }
    T* out = dst + base;
    for (int64_t i = 0; i < len; ++i) out[i] = static_cast<T>(acc[i]);
    // The block is still in L1: a second copy costs far less than a later pass.
    if (copy) std::memcpy(copy + base, out, len * sizeof(T));
  }
}

// Bool is stored as bytes 0/1: SUM is or, PRODUCT and, MIN and, MAX or.
RedOp boolOp(RedOp op) {
  switch (op) {
    case RedOp::SUM:
    case RedOp::AVG:
    case RedOp::PREMUL_SUM:
    case RedOp::MAX:
      return RedOp::BOR;
    case RedOp::PRODUCT:
    case RedOp::MIN:
      return RedOp::BAND;
    default:
      return op;
  }
}

template <typename T>
void reduceWithOp(void* dst, void* copy, const void* const* srcs, int n, int64_t count, RedOp op) {
  switch (op) {
    case RedOp::SUM:
    case RedOp::AVG:
    case RedOp::PREMUL_SUM:
      return reduceTyped<T, RedOp::SUM>(dst, copy, srcs, n, count);
    case RedOp::PRODUCT:
      return reduceTyped<T, RedOp::PRODUCT>(dst, copy, srcs, n, count);
    case RedOp::MIN:
      return reduceTyped<T, RedOp::MIN>(dst, copy, srcs, n, count);
    case RedOp::MAX:
      return reduceTyped<T, RedOp::MAX>(dst, copy, srcs, n, count);
    case RedOp::BAND:
    case RedOp::BOR:
    case RedOp::BXOR:
      if constexpr (std::is_integral_v<T>) {
        if (op == RedOp::BAND) return reduceTyped<T, RedOp::BAND>(dst, copy, srcs, n, count);
        if (op == RedOp::BOR) return reduceTyped<T, RedOp::BOR>(dst, copy, srcs, n, count);
        return reduceTyped<T, RedOp::BXOR>(dst, copy, srcs, n, count);
      }
      [[fallthrough]];
    default:
      TORCH_CHECK(false, "xcomm shm: reduce op ", reduceOpName(op),
                  " is not defined for this dtype");
  }
}

}  // namespace

bool vectorReduceSupports(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kShort:
    case at::kInt:
    case at::kLong:
    case at::kBool:
      return true;
    default:
      return false;
  }
}

void reduceBuffers(void* dst, const void* const* srcs, int n, int64_t count, at::ScalarType dtype,
                   RedOp op, void* copy) {
  TORCH_CHECK(n >= 1, "xcomm shm: a reduction needs at least one source");
  if (count == 0) return;
  switch (dtype) {
    case at::kFloat:
      return reduceWithOp<float>(dst, copy, srcs, n, count, op);
    case at::kDouble:
      return reduceWithOp<double>(dst, copy, srcs, n, count, op);
    case at::kHalf:
      return reduceWithOp<c10::Half>(dst, copy, srcs, n, count, op);
    case at::kBFloat16:
      return reduceWithOp<c10::BFloat16>(dst, copy, srcs, n, count, op);
    case at::kChar:
      return reduceWithOp<int8_t>(dst, copy, srcs, n, count, op);
    case at::kByte:
      return reduceWithOp<uint8_t>(dst, copy, srcs, n, count, op);
    case at::kShort:
      return reduceWithOp<int16_t>(dst, copy, srcs, n, count, op);
    case at::kInt:
      return reduceWithOp<int32_t>(dst, copy, srcs, n, count, op);
    case at::kLong:
      return reduceWithOp<int64_t>(dst, copy, srcs, n, count, op);
    case at::kBool:
      return reduceWithOp<uint8_t>(dst, copy, srcs, n, count, boolOp(op));
    default:
      TORCH_CHECK(false, "xcomm shm: dtype ", c10::toString(dtype), " has no reduction kernel");
  }
}

}  // namespace xcomm
