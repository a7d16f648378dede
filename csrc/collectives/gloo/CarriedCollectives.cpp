#include "collectives/gloo/CarriedCollectives.hpp"

#include <algorithm>
#include <memory>

#include "collectives/reduce/ReduceKernels.hpp"
#include "collectives/reduce/VectorReduce.hpp"

namespace xcomm {
namespace {

using RedOp = c10d::ReduceOp::RedOpType;

// 128 KiB: a carried op beat checking and then running Gloo at every size
// measured, 64 and 128 KiB included (docs/benchmarks.md, carried ops).
constexpr int64_t kMaxCarryBytes = 128 * 1024;
constexpr int64_t kCarryBudgetBytes = 256 * 1024;  // sent by one rank per op, all peers together

// The dtypes Gloo reduces and moves: shared memory's, but int16 (torch
// converts complex tensors to real views first).
bool carriedDtype(at::ScalarType dtype) {
  return vectorReduceSupports(dtype) && dtype != at::kShort;
}

// A reduce op Gloo runs as itself on `dtype` (AVG as a SUM and a division,
// where `avg` says Gloo takes it; PREMUL_SUM reaches Gloo lowered to SUM).
bool carriedReduceOp(RedOp red, at::ScalarType dtype, bool avg) {
  const bool known = red == RedOp::SUM || (avg && red == RedOp::AVG) || red == RedOp::PRODUCT ||
                     red == RedOp::MIN || red == RedOp::MAX || red == RedOp::BAND ||
                     red == RedOp::BOR || red == RedOp::BXOR;
  return known && reduceOpSupports(red, dtype);
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

// `t`'s bytes for every peer, made once, when the op runs.
std::function<at::Tensor(int)> sameBytesForAll(const at::Tensor& t) {
  auto made = std::make_shared<at::Tensor>();
  return [t, made](int) {
    if (!made->defined()) *made = bytesView(t);
    return *made;
  };
}

// A tensor of `like`'s dtype and device, the rest as Gloo checks it.
bool sameKind(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() && t.layout() == at::kStrided && t.device().is_cpu() &&
         t.scalar_type() == like.scalar_type();
}

// Rows per piece of `t` along dim 0 for `size` peers (empty `splits`: even),
// or empty when Gloo would refuse them.
std::vector<int64_t> piecesOf(const at::Tensor& t, const std::vector<int64_t>& splits, int size) {
  if (t.dim() == 0) return {};
  const int64_t rows = t.size(0);
  if (splits.empty()) {
    if (rows % size != 0) return {};
    return std::vector<int64_t>(size, rows / size);
  }
  if (static_cast<int>(splits.size()) != size) return {};
  int64_t sum = 0;
  for (const auto s : splits) {
    if (s < 0) return {};
    sum += s;
  }
  return sum == rows ? splits : std::vector<int64_t>{};
}

// Rank r's bytes as a flat tensor of `like`'s dtype.
at::Tensor asElements(const at::Tensor& bytes, const at::Tensor& like) {
  return bytes.view(like.scalar_type());
}

// `out` = every rank's bytes folded in rank order: the same rows in the same
// order on every rank, so the same bits everywhere.
void foldInto(const at::Tensor& out, const std::vector<at::Tensor>& rows, RedOp red, int size) {
  at::Tensor acc = out.is_contiguous() ? out.view({-1}) : at::empty({out.numel()}, out.options());
  acc.copy_(asElements(rows[0], out));
  for (size_t r = 1; r < rows.size(); ++r) reduceInto(acc, asElements(rows[r], out), red);
  finishReduction(acc, red, size);
  if (!out.is_contiguous()) out.copy_(acc.view(out.sizes()));
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
  // An op Gloo refuses stays Gloo's to refuse.
  if (tensors.size() != 1 || !carriedTensor(tensors[0], capacityBytes) ||
      !carriedReduceOp(red, tensors[0].scalar_type(), /*avg=*/true)) {
    return carried;
  }
  const at::Tensor t = tensors[0];
  carried.capable = true;
  carried.payload = sameBytesForAll(t);
  carried.finish = [t, red, size](const std::vector<at::Tensor>& rows) {
    foldInto(t, rows, red, size);
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
    carried.payload = [t](int) { return bytesView(t); };
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
  carried.payload = sameBytesForAll(in);
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
  carried.payload = sameBytesForAll(in);
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

CarriedOp carriedReduceScatter(const std::vector<at::Tensor>& outputs,
                               const std::vector<std::vector<at::Tensor>>& inputs,
                               const c10d::ReduceOp& op, int size, int64_t capacityBytes) {
  CarriedOp carried;
  const RedOp red = op.op_;
  // AVG stays Gloo's to do or refuse.
  if (outputs.size() != 1 || inputs.size() != 1 || static_cast<int>(inputs[0].size()) != size ||
      !carriedTensor(outputs[0], capacityBytes) ||
      !carriedReduceOp(red, outputs[0].scalar_type(), /*avg=*/false)) {
    return carried;
  }
  const at::Tensor out = outputs[0];
  for (const auto& in : inputs[0]) {
    if (!sameKind(in, out) || in.sizes() != out.sizes()) return carried;
  }
  const std::vector<at::Tensor> pieces = inputs[0];
  carried.capable = true;
  carried.payload = [pieces](int peer) { return bytesView(pieces[peer]); };
  carried.finish = [out, red, size](const std::vector<at::Tensor>& rows) {
    foldInto(out, rows, red, size);
  };
  return carried;
}

CarriedOp carriedGather(const std::vector<std::vector<at::Tensor>>& outputs,
                        const std::vector<at::Tensor>& inputs, int root, int rank, int size,
                        int64_t capacityBytes) {
  CarriedOp carried;
  if (inputs.size() != 1 || !carriedTensor(inputs[0], capacityBytes)) return carried;
  const at::Tensor in = inputs[0];
  if (rank != root) {
    if (!outputs.empty()) return carried;  // Gloo: no output list off the root
    carried.capable = true;
    carried.payload = [in, root](int peer) { return peer == root ? bytesView(in) : at::Tensor(); };
    carried.finish = [](const std::vector<at::Tensor>&) {};
    return carried;
  }
  if (outputs.size() != 1 || static_cast<int>(outputs[0].size()) != size) return carried;
  for (const auto& out : outputs[0]) {
    if (!sameKind(out, in) || out.sizes() != in.sizes()) return carried;
  }
  const std::vector<at::Tensor> outs = outputs[0];
  carried.capable = true;
  carried.payload = [in, rank](int peer) { return peer == rank ? bytesView(in) : at::Tensor(); };
  carried.finish = [outs](const std::vector<at::Tensor>& rows) {
    for (size_t r = 0; r < outs.size(); ++r) {
      outs[r].copy_(asElements(rows[r], outs[r]).view(outs[r].sizes()));
    }
  };
  return carried;
}

CarriedOp carriedScatter(const std::vector<at::Tensor>& outputs,
                         const std::vector<std::vector<at::Tensor>>& inputs, int root, int rank,
                         int size, int64_t capacityBytes) {
  CarriedOp carried;
  if (outputs.size() != 1 || !carriedTensor(outputs[0], capacityBytes)) return carried;
  const at::Tensor out = outputs[0];
  std::vector<at::Tensor> pieces;
  if (rank == root) {
    if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != size) return carried;
    for (const auto& in : inputs[0]) {
      if (!sameKind(in, out) || in.sizes() != out.sizes()) return carried;
    }
    pieces = inputs[0];
  } else if (!inputs.empty()) {
    return carried;  // Gloo: no input list off the root
  }
  carried.capable = true;
  carried.payload = [pieces](int peer) {
    return pieces.empty() ? at::Tensor() : bytesView(pieces[peer]);
  };
  carried.finish = [out, root](const std::vector<at::Tensor>& rows) {
    out.copy_(asElements(rows[root], out).view(out.sizes()));
  };
  return carried;
}

CarriedOp carriedAlltoallBase(const at::Tensor& output, const at::Tensor& input,
                              const std::vector<int64_t>& outputSplits,
                              const std::vector<int64_t>& inputSplits, int size,
                              int64_t capacityBytes) {
  CarriedOp carried;
  if (!carriedTensor(input, capacityBytes * size) || !sameKind(output, input)) return carried;
  const auto sent = piecesOf(input, inputSplits, size);
  const auto got = piecesOf(output, outputSplits, size);
  if (sent.empty() || got.empty()) return carried;
  const int64_t inRow = input.numel() == 0 ? 0 : input.numel() / input.size(0);
  const int64_t element = static_cast<int64_t>(input.element_size());
  for (int r = 0; r < size; ++r) {
    if (sent[r] * inRow * element > capacityBytes) return carried;
  }
  std::vector<int64_t> sentAt(size, 0), gotAt(size, 0);
  for (int r = 1; r < size; ++r) {
    sentAt[r] = sentAt[r - 1] + sent[r - 1];
    gotAt[r] = gotAt[r - 1] + got[r - 1];
  }
  const at::Tensor in = input;
  const at::Tensor out = output;
  carried.capable = true;
  carried.payload = [in, sent, sentAt](int peer) {
    return bytesView(in.narrow(0, sentAt[peer], sent[peer]));
  };
  // The pair sizes were checked before: rank r's bytes fill piece r exactly.
  carried.finish = [out, got, gotAt](const std::vector<at::Tensor>& rows) {
    for (size_t r = 0; r < rows.size(); ++r) {
      at::Tensor piece = out.narrow(0, gotAt[r], got[r]);
      piece.copy_(asElements(rows[r], out).view(piece.sizes()));
    }
  };
  return carried;
}

CarriedOp carriedAlltoall(const std::vector<at::Tensor>& outputs,
                          const std::vector<at::Tensor>& inputs, int size, int64_t capacityBytes) {
  CarriedOp carried;
  if (static_cast<int>(inputs.size()) != size || static_cast<int>(outputs.size()) != size) {
    return carried;
  }
  // Gloo's requirement: every tensor of both lists shaped as the first input.
  for (int r = 0; r < size; ++r) {
    if (!carriedTensor(inputs[r], capacityBytes) || !sameKind(outputs[r], inputs[0]) ||
        inputs[r].sizes() != inputs[0].sizes() || outputs[r].sizes() != inputs[0].sizes()) {
      return carried;
    }
  }
  const std::vector<at::Tensor> ins = inputs;
  const std::vector<at::Tensor> outs = outputs;
  carried.capable = true;
  carried.payload = [ins](int peer) { return bytesView(ins[peer]); };
  carried.finish = [outs](const std::vector<at::Tensor>& rows) {
    for (size_t r = 0; r < outs.size(); ++r) {
      outs[r].copy_(asElements(rows[r], outs[r]).view(outs[r].sizes()));
    }
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
