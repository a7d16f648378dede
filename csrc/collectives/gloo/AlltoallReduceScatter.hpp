#pragma once
// Reduce-scatter as one all-to-all plus a local reduction: rank j receives
// row j of every rank's input and folds the rows in rank order.
//
// Gloo has no reduce-scatter of its own for one flat tensor: its
// _reduce_scatter_base allreduces the whole input and keeps one row, so each
// rank puts 2 (n-1)/n of the input on its link. The all-to-all puts (n-1)/n,
// half as much, and the result is the same sum (in rank order, so the same
// bits on every rank and every run; with two ranks the same bits as Gloo's).
// This is FSDP2's gradient reduction on a CPU group that spans hosts.
#include <cstdint>
#include <functional>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "runtime/Route.hpp"

namespace xcomm {

class AlltoallReduceScatter {
 public:
  explicit AlltoallReduceScatter(int size) : size_(size) {}

  // Whether it takes this reduce-scatter: a non-empty contiguous dense CPU
  // input of a dtype the vector reductions handle, under SUM, AVG (floating
  // point: FSDP2 asks for it), MAX, MIN or PRODUCT, in a group of 2 or more.
  bool applies(const at::Tensor& output, const at::Tensor& input,
               const c10d::ReduceScatterOptions& opts) const;

  // Issues the all-to-all on `transport` as this reduce-scatter (Op::
  // asReduceScatter: a route that checks the ranks' calls checks it as the
  // reduce-scatter it is) and returns its work; `finalize` (run once it
  // succeeded) reduces the received rows into `output`.
  c10::intrusive_ptr<c10d::Work> start(Route& transport, const at::Tensor& output,
                                       const at::Tensor& input,
                                       const c10d::ReduceScatterOptions& opts,
                                       std::function<void()>& finalize) const;

 private:
  int size_;
};

}  // namespace xcomm
