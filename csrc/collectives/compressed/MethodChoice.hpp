#pragma once
// The one rule every auto chooses a method by (the backend's AutoCompression,
// and through the bindings the DDP hook's and FSDP2's MethodChoices in
// hooks/_measure.py): the least predicted time, ties to the earlier method
// (the method table's order, cheapest codec first); a key that has a method
// keeps it unless another is predicted `switchMargin` faster, so noise does
// not flip it, but never keeps one predicted slower than sending the data
// uncompressed (with observed costs, "predicted" is what it was seen to take).
#include <cstddef>
#include <vector>

namespace xcomm {

// The index of the method to run, of `seconds` (each candidate's predicted
// seconds, in the table's order). `current`: the key's method's index, or -1
// when it has none (or is no longer a candidate). `noneIndex`: the
// uncompressed method's index, or -1 when it is not a candidate.
// `switchMargin` in [0, 1). A prediction that is not a number counts as the
// slowest. ValueError for no candidate or an index out of range.
size_t chooseMethod(const std::vector<double>& seconds, int current, double switchMargin,
                    int noneIndex);

}  // namespace xcomm
