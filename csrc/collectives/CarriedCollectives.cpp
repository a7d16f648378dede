#include "collectives/CarriedCollectives.hpp"

#include <algorithm>

#include "collectives/ReduceKernels.hpp"

namespace xcomm {
namespace {

using RedOp = c10d::ReduceOp::RedOpType;

constexpr int64_t kMaxCarryBytes = 32 * 1024;
constexpr int64_t kCarryBudgetBytes = 256 * 1024;  // sent by one rank per op, all peers together

// The dtypes Gloo reduces and moves (torch converts complex tensors to real views first).
bool carriedDtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
    case at::kBool:
      return true;
    default:
      return false;
  }
}

int64_t bytesOf(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

bool carriedTensor(const at::Tensor& t, int64_t capacityBytes) {
  return t.defined() && t.layout() == at::kStrided && t.device().is_cpu() &&
         carriedDtype(t.scalar_type()) && bytesOf(t) <= capacityBytes;
}

// `t`'s bytes, contiguous.
at::Tensor bytesView(const at::Tensor& t) {
  return t.contiguous().reshape({-1}).view(at::kByte);
}

// Rank r's bytes as a flat tensor of `like`'s dtype.
at::Tensor asElements(const at::Tensor& bytes, const at::Tensor& like) {
  return bytes.view(like.scalar_type());
}

}  // namespace

int64_t carryCapacityBytes(int size) {
  if (size < 2) return 0;
  const int64_t spread = kCarryBudgetBytes / (size - 1);
  return std::min(kMaxCarryBytes, spread / 8 * 8);
}

CarriedOp carriedAllreduce(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op,
                           int size, int64_t capacityBytes) {
  CarriedOp carried;
  const RedOp red = op.op_;
  // PREMUL_SUM reaches Gloo lowered to SUM; an op Gloo refuses stays Gloo's to refuse.
  const bool knownOp = red == RedOp::SUM || red == RedOp::AVG || red == RedOp::PRODUCT ||
                       red == RedOp::MIN || red == RedOp::MAX || red == RedOp::BAND ||
                       red == RedOp::BOR || red == RedOp::BXOR;
  if (tensors.size() != 1 || !carriedTensor(tensors[0], capacityBytes) || !knownOp ||
      !reduceOpSupports(red, tensors[0].scalar_type())) {
    return carried;
  }
  const at::Tensor t = tensors[0];
  carried.capable = true;
  carried.payload = [t] { return bytesView(t); };
  carried.finish = [t, red, size](const std::vector<at::Tensor>& rows) {
    // Every rank folds the same rows in the same order: the same bits everywhere.
    at::Tensor acc = t.is_contiguous() ? t.view({-1}) : at::empty({t.numel()}, t.options());
    acc.copy_(asElements(rows[0], t));
    for (size_t r = 1; r < rows.size(); ++r) reduceInto(acc, asElements(rows[r], t), red);
    finishReduction(acc, red, size);
    if (!t.is_contiguous()) t.copy_(acc.view(t.sizes()));
  };
  return carried;
}

CarriedOp carriedBroadcast(const std::vector<at::Tensor>& tensors, int root, int rank,
                           int64_t capacityBytes) {
  CarriedOp carried;
  if (tensors.size() != 1 || !carriedTensor(tensors[0], capacityBytes)) return carried;
  const at::Tensor t = tensors[0];
  carried.capable = true;
  if (rank == root) {
    carried.payload = [t] { return bytesView(t); };
    carried.finish = [](const std::vector<at::Tensor>&) {};
  } else {
    carried.finish = [t, root](const std::vector<at::Tensor>& rows) {
      t.copy_(asElements(rows[root], t).view(t.sizes()));
    };
  }
  return carried;
}

CarriedOp carriedAllgather(const std::vector<std::vector<at::Tensor>>& outputs,
                           const std::vector<at::Tensor>& inputs, int size, int64_t capacityBytes) {
  CarriedOp carried;
  if (inputs.size() != 1 || outputs.size() != 1 || static_cast<int>(outputs[0].size()) != size ||
      !carriedTensor(inputs[0], capacityBytes)) {
    return carried;
  }
  const at::Tensor in = inputs[0];
  for (const auto& out : outputs[0]) {
    // Gloo's own requirement: every output shaped and typed as the input.
    if (!out.defined() || out.layout() != at::kStrided || !out.device().is_cpu() ||
        out.scalar_type() != in.scalar_type() || out.sizes() != in.sizes()) {
      return carried;
    }
  }
  const std::vector<at::Tensor> outs = outputs[0];
  carried.capable = true;
  carried.payload = [in] { return bytesView(in); };
  carried.finish = [outs](const std::vector<at::Tensor>& rows) {
    for (size_t r = 0; r < outs.size(); ++r) {
      outs[r].copy_(asElements(rows[r], outs[r]).view(outs[r].sizes()));
    }
  };
  return carried;
}

CarriedOp carriedAllgatherBase(const at::Tensor& output, const at::Tensor& input, int size,
                               int64_t capacityBytes) {
  CarriedOp carried;
  if (!carriedTensor(input, capacityBytes) || !output.defined() ||
      output.layout() != at::kStrided || !output.device().is_cpu() || output.dim() == 0 ||
      output.scalar_type() != input.scalar_type()) {
    return carried;
  }
  // Gloo's requirement: the output's `size` chunks along dim 0 each shaped as the input.
  const auto chunks = output.chunk(size);
  if (static_cast<int>(chunks.size()) != size) return carried;
  for (const auto& c : chunks) {
    if (c.sizes() != input.sizes()) return carried;
  }
  const at::Tensor in = input;
  const at::Tensor out = output;
  carried.capable = true;
  carried.payload = [in] { return bytesView(in); };
  carried.finish = [out, n = in.numel()](const std::vector<at::Tensor>& rows) {
    at::Tensor flat =
        out.is_contiguous() ? out.view({-1}) : at::empty({out.numel()}, out.options());
    for (size_t r = 0; r < rows.size(); ++r) {
      flat.narrow(0, static_cast<int64_t>(r) * n, n).copy_(asElements(rows[r], out));
    }
    if (!out.is_contiguous()) out.copy_(flat.view(out.sizes()));
  };
  return carried;
}

CarriedOp carriedBarrier() {
  CarriedOp carried;
  carried.capable = true;
  carried.drainFirst = true;
  carried.finish = [](const std::vector<at::Tensor>&) {};
  return carried;
}

}  // namespace xcomm
