#include "collectives/store/FlatCollectives.hpp"

#include <c10/util/Exception.h>

#include "collectives/reduce/ReduceKernels.hpp"

namespace xcomm::flat {
namespace {

size_t bytesOf(const at::Tensor& t) {
  return t.numel() * t.element_size();
}

void sendTensor(StoreTransport& t, int dst, const std::string& channel, const at::Tensor& x) {
  t.send(dst, channel, x.data_ptr(), bytesOf(x));
}

void recvTensor(StoreTransport& t, int src, const std::string& channel, at::Tensor& x,
                Millis timeout) {
  t.recv(src, channel, x.data_ptr(), bytesOf(x), timeout);
}

// Receives every other rank's version of `like` into a list indexed by rank;
// the entry for this rank is `mine`.
std::vector<at::Tensor> collectFromAll(StoreTransport& t, const std::string& channel,
                                       const at::Tensor& mine, Millis timeout) {
  std::vector<at::Tensor> parts(t.size());
  for (int src = 0; src < t.size(); ++src) {
    if (src == t.rank()) {
      parts[src] = mine;
    } else {
      parts[src] = at::empty_like(mine);
      recvTensor(t, src, channel, parts[src], timeout);
    }
  }
  return parts;
}

// Folds parts in rank order: the same order, so the same bits, on every rank.
void foldInto(at::Tensor& out, const std::vector<at::Tensor>& parts, RedOp op) {
  at::Tensor acc = parts[0].clone();
  for (size_t i = 1; i < parts.size(); ++i) {
    reduceInto(acc, parts[i], op);
  }
  finishReduction(acc, op, static_cast<int>(parts.size()));
  out.copy_(acc);
}

}  // namespace

void allreduce(StoreTransport& t, const std::string& channel, at::Tensor& tensor, RedOp op,
               Millis timeout) {
  for (int dst = 0; dst < t.size(); ++dst) {
    if (dst != t.rank()) sendTensor(t, dst, channel, tensor);
  }
  foldInto(tensor, collectFromAll(t, channel, tensor, timeout), op);
}

void reduce(StoreTransport& t, const std::string& channel, at::Tensor& tensor, int root, RedOp op,
            Millis timeout) {
  if (t.rank() != root) {
    sendTensor(t, root, channel, tensor);
    return;
  }
  foldInto(tensor, collectFromAll(t, channel, tensor, timeout), op);
}

void broadcast(StoreTransport& t, const std::string& channel, at::Tensor& tensor, int root,
               Millis timeout) {
  if (t.rank() == root) {
    for (int dst = 0; dst < t.size(); ++dst) {
      if (dst != root) sendTensor(t, dst, channel, tensor);
    }
  } else {
    recvTensor(t, root, channel, tensor, timeout);
  }
}

void allgather(StoreTransport& t, const std::string& channel, const at::Tensor& input,
               std::vector<at::Tensor>& outputs, Millis timeout) {
  for (int dst = 0; dst < t.size(); ++dst) {
    if (dst != t.rank()) sendTensor(t, dst, channel, input);
  }
  for (int src = 0; src < t.size(); ++src) {
    if (src == t.rank()) {
      outputs[src].copy_(input);
    } else {
      recvTensor(t, src, channel, outputs[src], timeout);
    }
  }
}

void gather(StoreTransport& t, const std::string& channel, const at::Tensor& input,
            std::vector<at::Tensor>& outputs, int root, Millis timeout) {
  if (t.rank() != root) {
    sendTensor(t, root, channel, input);
    return;
  }
  for (int src = 0; src < t.size(); ++src) {
    if (src == root) {
      outputs[src].copy_(input);
    } else {
      recvTensor(t, src, channel, outputs[src], timeout);
    }
  }
}

void scatter(StoreTransport& t, const std::string& channel, at::Tensor& output,
             const std::vector<at::Tensor>& inputs, int root, Millis timeout) {
  if (t.rank() != root) {
    recvTensor(t, root, channel, output, timeout);
    return;
  }
  for (int dst = 0; dst < t.size(); ++dst) {
    if (dst != root) sendTensor(t, dst, channel, inputs[dst]);
  }
  output.copy_(inputs[root]);
}

void reduceScatter(StoreTransport& t, const std::string& channel, at::Tensor& output,
                   const std::vector<at::Tensor>& inputs, RedOp op, Millis timeout) {
  for (int dst = 0; dst < t.size(); ++dst) {
    if (dst != t.rank()) sendTensor(t, dst, channel, inputs[dst]);
  }
  foldInto(output, collectFromAll(t, channel, inputs[t.rank()], timeout), op);
}

void alltoall(StoreTransport& t, const std::string& channel, std::vector<at::Tensor>& outputs,
              const std::vector<at::Tensor>& inputs, Millis timeout) {
  for (int dst = 0; dst < t.size(); ++dst) {
    if (dst != t.rank()) sendTensor(t, dst, channel, inputs[dst]);
  }
  for (int src = 0; src < t.size(); ++src) {
    if (src == t.rank()) {
      outputs[src].copy_(inputs[src]);
    } else {
      recvTensor(t, src, channel, outputs[src], timeout);
    }
  }
}

void barrier(StoreTransport& t, const std::string& channel, Millis timeout) {
  const uint8_t token = 1;
  for (int dst = 0; dst < t.size(); ++dst) {
    if (dst != t.rank()) t.send(dst, channel, &token, 1);
  }
  for (int src = 0; src < t.size(); ++src) {
    uint8_t got = 0;
    if (src != t.rank()) t.recv(src, channel, &got, 1, timeout);
  }
}

}  // namespace xcomm::flat
