#pragma once
// Flat (single-level) collective algorithms over a point-to-point transport.
//
// Every rank exchanges directly with every other rank and folds contributions
// in rank order, so every rank computes bitwise the same result. Tensors are
// contiguous CPU tensors; `channel` names the op uniquely within the group
// (all ranks pass the same channel for the same collective call).
#include <chrono>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "transport/StoreTransport.hpp"

namespace xcomm::flat {

using Millis = std::chrono::milliseconds;
using RedOp = c10d::ReduceOp::RedOpType;

void allreduce(StoreTransport& t, const std::string& channel, at::Tensor& tensor, RedOp op,
               Millis timeout);
void reduce(StoreTransport& t, const std::string& channel, at::Tensor& tensor, int root, RedOp op,
            Millis timeout);
void broadcast(StoreTransport& t, const std::string& channel, at::Tensor& tensor, int root,
               Millis timeout);
void allgather(StoreTransport& t, const std::string& channel, const at::Tensor& input,
               std::vector<at::Tensor>& outputs, Millis timeout);
// `outputs` is used on the root only.
void gather(StoreTransport& t, const std::string& channel, const at::Tensor& input,
            std::vector<at::Tensor>& outputs, int root, Millis timeout);
// `inputs` is used on the root only.
void scatter(StoreTransport& t, const std::string& channel, at::Tensor& output,
             const std::vector<at::Tensor>& inputs, int root, Millis timeout);
// Rank r receives the reduction over all ranks of inputs[r].
void reduceScatter(StoreTransport& t, const std::string& channel, at::Tensor& output,
                   const std::vector<at::Tensor>& inputs, RedOp op, Millis timeout);
// Rank r sends inputs[d] to rank d and receives outputs[s] from rank s.
void alltoall(StoreTransport& t, const std::string& channel, std::vector<at::Tensor>& outputs,
              const std::vector<at::Tensor>& inputs, Millis timeout);
void barrier(StoreTransport& t, const std::string& channel, Millis timeout);

}  // namespace xcomm::flat
