// A LibTorch program that uses xcomm without Python.
//
// Start one process per rank; rank 0 hosts the TCPStore:
//   xcomm_allreduce_example <rank> <world_size> [port]
// Each rank all-reduces a tensor holding its rank + 1 and checks the sum.
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "backend/XcommBackend.hpp"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: " << argv[0] << " <rank> <world_size> [port]\n";
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int size = std::atoi(argv[2]);
  c10d::TCPStoreOptions storeOpts;
  storeOpts.port = argc > 3 ? static_cast<uint16_t>(std::atoi(argv[3])) : 29533;
  storeOpts.isServer = rank == 0;
  storeOpts.numWorkers = size;
  storeOpts.timeout = std::chrono::seconds(30);
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", storeOpts);

  auto backend = xcomm::XcommBackend::createWithStore(
      store, rank, size, xcomm::XcommOptions::create(std::chrono::seconds(30)));

  std::vector<at::Tensor> tensors{at::full({1024}, rank + 1.0)};
  backend->allreduce(tensors)->wait();
  const double expected = size * (size + 1) / 2.0;
  const bool ok = at::equal(tensors[0], at::full({1024}, expected));

  std::vector<std::vector<at::Tensor>> gathered(1);
  for (int r = 0; r < size; ++r) gathered[0].push_back(at::zeros({2}, at::kLong));
  std::vector<at::Tensor> mine{at::full({2}, rank, at::kLong)};
  backend->allgather(gathered, mine)->wait();
  bool gatherOk = true;
  for (int r = 0; r < size; ++r) gatherOk &= gathered[0][r][0].item<int64_t>() == r;

  backend->barrier()->wait();
  backend->shutdown();
  // Rank 0 hosts the store: it leaves only when every rank is done with it.
  store->add("example/done", 1);
  const auto deadline = std::chrono::steady_clock::now() + storeOpts.timeout;
  while (rank == 0 && store->add("example/done", 0) < size &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::cout << "rank " << rank << ": allreduce sum " << tensors[0][0].item<double>()
            << (ok ? " (correct)" : " (WRONG)") << ", allgather "
            << (gatherOk ? "correct" : "WRONG") << "\n";
  return ok && gatherOk ? 0 : 1;
}
