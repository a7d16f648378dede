#pragma once
// Checks of what a rank can verify locally before an op starts, with
// messages that name the op and the problem. A check that fails here is a
// Python exception instead of a hang, a crash, or a wrong result.
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "common/ErrorText.hpp"

namespace xcomm::checks {

using xcomm::dtypeName;  // common/ErrorText.hpp

// A non-empty list of dense tensors of one device and one dtype that xcomm
// can move. `what` names the list in messages ("input", "output").
void tensorList(const char* op, const std::vector<at::Tensor>& ts, const char* what = "tensor");
void tensorListOfLists(const char* op, const std::vector<std::vector<at::Tensor>>& ts,
                       const char* what);
void sameDeviceAndDtype(const char* op, const at::Tensor& a, const at::Tensor& b, const char* whatA,
                        const char* whatB);
void rank(const char* op, int64_t r, int size, const char* what);
void reduceOp(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType dtype);
// `lists` must hold `size` tensors, each with `numel` elements.
void listForEveryRank(const char* op, const std::vector<at::Tensor>& list, int size, int64_t numel,
                      const char* what);
void allgatherBase(const at::Tensor& output, const at::Tensor& input, int size);
void reduceScatterBase(const at::Tensor& output, const at::Tensor& input, int size);
// Split sizes for all_to_all_single: empty means equal splits.
void splits(const char* op, const std::vector<int64_t>& splits, const at::Tensor& t, int size,
            const char* what);

}  // namespace xcomm::checks
