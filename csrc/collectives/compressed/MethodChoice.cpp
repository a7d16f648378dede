#include "collectives/compressed/MethodChoice.hpp"

#include <cmath>
#include <limits>

#include <c10/util/Exception.h>

namespace xcomm {

size_t chooseMethod(const std::vector<double>& seconds, int current, double switchMargin,
                    int noneIndex) {
  const int n = static_cast<int>(seconds.size());
  TORCH_CHECK_VALUE(n > 0, "xcomm: auto has no method to choose from");
  TORCH_CHECK_VALUE(current >= -1 && current < n, "xcomm: auto's current method ", current,
                    " is not one of its ", n, " candidates");
  TORCH_CHECK_VALUE(noneIndex >= -1 && noneIndex < n, "xcomm: auto's uncompressed method ",
                    noneIndex, " is not one of its ", n, " candidates");
  TORCH_CHECK_VALUE(switchMargin >= 0.0 && switchMargin < 1.0,
                    "xcomm: auto's switch margin must be in [0, 1), got ", switchMargin);
  // A prediction that is not a number (a corrupt input) counts as the slowest.
  const auto at = [&](int i) {
    const double t = seconds[i];
    return std::isnan(t) ? std::numeric_limits<double>::infinity() : t;
  };
  int best = 0;
  for (int i = 1; i < n; ++i) {
    if (at(i) < at(best)) best = i;  // strictly less: ties keep the earlier
  }
  if (current < 0) return static_cast<size_t>(best);
  const double kept = at(current);
  const bool slowerThanNone = noneIndex >= 0 && kept > at(noneIndex);
  if (!slowerThanNone && at(best) >= (1.0 - switchMargin) * kept) {
    return static_cast<size_t>(current);
  }
  return static_cast<size_t>(best);
}

}  // namespace xcomm
