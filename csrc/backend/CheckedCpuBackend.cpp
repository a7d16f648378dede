#include "backend/CheckedCpuBackend.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "backend/TensorLists.hpp"
#include "collectives/reduce/ReduceKernels.hpp"
#include "common/ErrorText.hpp"
#include "common/OpNames.hpp"

namespace xcomm {
namespace {

using Clock = std::chrono::steady_clock;
// Point-to-point tags of the checks group: one per kind of row.
constexpr int kDescriptorTag = 1;
constexpr int kPairsTag = 2;
// ...and of the data of ops sent as messages (DirectExchange).
constexpr int kTransferTag = 3;
// Up to this many ranks, descriptor rows also carry an all-to-all's per-pair
// sizes (2 x ranks int64s): one exchange instead of two.
constexpr int kInlinePairsMaxRanks = 16;
// A descriptor row, in int64s: the call (kFields, compared between ranks),
// whether this rank can carry the op, the bytes it carries; then the pair
// sizes when inline, then the carried bytes, padded to whole int64s.
constexpr int64_t kFields = 6;
constexpr int64_t kCarryFlag = 6;  // bit 0: can carry the op; bit 1: takes DirectExchange
constexpr int64_t kCarriedBytes = 7;
constexpr int64_t kHeaderWords = 8;
// A descriptor row whose op field is this: its rank left the group (shutdown).
constexpr int64_t kDepartedOp = -1;

int64_t wordsFor(int64_t bytes) {
  return (bytes + 7) / 8;
}

// Where a row's carried bytes start, in int64s (after the pair sizes when
// they travel inline).
int64_t payloadOffset(int size) {
  return kHeaderWords + (size <= kInlinePairsMaxRanks ? 2 * size : 0);
}

// The longest row a peer's receive expects: the header, the pair sizes, and
// the most a carried op may hold. Every row sent on kDescriptorTag (a
// departure's too) is at most this long.
int64_t descriptorCapacity(int size, int64_t carryBytes) {
  return payloadOffset(size) + carryBytes / 8;
}

void putCall(int64_t* row, const CheckedCpuBackend::Call& c) {
  row[0] = static_cast<int64_t>(c.type);
  row[1] = static_cast<int64_t>(c.dtype);
  row[2] = c.redOp;
  row[3] = c.root;
  row[4] = c.bytes;
  row[5] = c.tensors;
}

// "all_reduce(SUM, Float, 400 bytes)" and the like, from a row's call fields.
std::string render(const int64_t* r) {
  const auto type = static_cast<c10d::OpType>(r[0]);
  const auto dtype = static_cast<at::ScalarType>(r[1]);
  std::ostringstream out;
  out << opName(type, r[2]) << "(";
  if (type == c10d::OpType::BARRIER) return out.str() + ")";
  if (type == c10d::OpType::ALLTOALL_BASE || type == c10d::OpType::ALLTOALL) {
    return out.str() + c10::toString(dtype) + ")";  // sizes are checked pair by pair
  }
  if (r[2] >= 0) out << reduceOpName(static_cast<c10d::ReduceOp::RedOpType>(r[2])) << ", ";
  if (r[3] >= 0) out << "root=" << r[3] << ", ";
  if (dtype != at::ScalarType::Undefined) out << c10::toString(dtype) << ", ";
  if (r[5] > 1) out << r[5] << " tensors, ";
  out << r[4] << " bytes";
  // CheckedCpuBackend::alltoallForReduceScatter's route.
  if (type == c10d::OpType::_REDUCE_SCATTER_BASE && r[5] == 0) out << ", as an all_to_all";
  out << ")";
  return out.str();
}

CheckedCpuBackend::Call callOf(c10d::OpType type, const std::vector<at::Tensor>& ts,
                               int64_t root = -1) {
  CheckedCpuBackend::Call c;
  c.type = type;
  c.dtype = dtypeOf(ts);
  c.root = root;
  c.bytes = static_cast<int64_t>(denseBytes(ts));
  c.tensors = static_cast<int64_t>(ts.size());
  return c;
}

// A reduction as its caller made it: the caller's dtype and bytes, also
// where the tensors travel as MinMaxLowering's keys.
CheckedCpuBackend::Call callOf(c10d::OpType type, const std::vector<at::Tensor>& ts,
                               const c10d::ReduceOp& op, int64_t root = -1) {
  auto c = callOf(type, ts, root);
  c.dtype = dtypeOf(ts, op);
  c.redOp = op.op_;
  c.bytes = static_cast<int64_t>(denseBytes(ts, op));
  return c;
}

// Past any op's size: asks the carried-op builders whether Gloo would take
// an op's tensors at all, whatever their size. An op that moves as
// DirectExchange messages must be one Gloo takes, so that one it refuses
// still gets Gloo's error.
constexpr int64_t kAnyBytes = int64_t{1} << 50;

// Whether an op's tensors can move as DirectExchange messages: dense,
// contiguous CPU tensors (what XcommBackend's staging hands over).
bool direct(const std::vector<at::Tensor>& ts) {
  return std::all_of(ts.begin(), ts.end(), [](const at::Tensor& t) {
    return t.defined() && t.layout() == at::kStrided && t.device().is_cpu() && t.is_contiguous();
  });
}

// Bytes of each of `size` pieces of `t` along dim 0 (`splits` empty: even).
std::vector<int64_t> pieceBytes(const at::Tensor& t, const std::vector<int64_t>& splits, int size) {
  const int64_t rowBytes = t.dim() == 0 || t.size(0) == 0
                               ? 0
                               : t.numel() * static_cast<int64_t>(t.element_size()) / t.size(0);
  std::vector<int64_t> bytes(size);
  for (int r = 0; r < size; ++r) {
    bytes[r] = splits.empty() ? t.numel() * static_cast<int64_t>(t.element_size()) / size
                              : splits[r] * rowBytes;
  }
  return bytes;
}

// Twice the op's timeout and a second: past the inner backend's own limit.
std::chrono::milliseconds backstop(std::chrono::milliseconds timeout) {
  return 2 * timeout + std::chrono::seconds(1);
}

}  // namespace

CheckedCpuBackend::CheckedCpuBackend(c10::intrusive_ptr<c10d::Backend> inner,
                                     c10::intrusive_ptr<c10d::Backend> checks,
                                     std::chrono::milliseconds timeout, int64_t carryBytes,
                                     std::string memberName, bool directExchange)
    : Backend(inner ? inner->getRank() : 0, inner ? inner->getSize() : 0),
      inner_(std::move(inner)),
      checks_(std::move(checks)),
      carryBytes_(carryBytes / 8 * 8),
      memberName_(std::move(memberName)),
      direct_(checks_, kTransferTag, rank_, size_),
      directEnabled_(directExchange),
      timeoutMs_(timeout.count()) {
  TORCH_CHECK(inner_ && checks_,
              "xcomm: the checked CPU backend needs an inner and a checks backend");
  TORCH_CHECK(checks_->getRank() == rank_ && checks_->getSize() == size_,
              "xcomm: the checks backend's rank/size differ from the group's");
  TORCH_CHECK(carryBytes_ >= 0, "xcomm: carryBytes must be >= 0, got ", carryBytes);
}

CheckedCpuBackend::~CheckedCpuBackend() = default;

void CheckedCpuBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeoutMs_ = timeout.count();
  inner_->setTimeout(timeout);
  checks_->setTimeout(timeout);
}

void CheckedCpuBackend::shutdown() {
  runner_.shutdown();
  announceDeparture();
  inner_->shutdown();
  checks_->shutdown();
}

void CheckedCpuBackend::announceDeparture() {
  // A peer waiting in a check for this rank's row gets this one instead and
  // raises at once, naming this rank; without it, it learns only when this
  // process's connections close, late in its teardown (120-190 ms on a busy
  // host), or at its timeout. A peer that gets here too never receives it:
  // the send stays pending and ends with the group. Fire and forget: the
  // worker is stopped, so no other thread is using the checks group.
  if (size_ < 2) return;
  try {
    // As long as the row a peer's receive expects (run's capacity): a
    // transport may refuse a message of another size.
    at::Tensor row = at::zeros({descriptorCapacity(size_, carryBytes_)}, at::kLong);
    row.data_ptr<int64_t>()[0] = kDepartedOp;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      std::vector<at::Tensor> out{row};
      departureSends_.push_back(checks_->send(out, r, kDescriptorTag));
    }
  } catch (const std::exception&) {
    // A peer already gone: nothing to tell it.
  }
}

void CheckedCpuBackend::abort() {
  // The worker may be waiting in a check: the checks group's abort ends it.
  checks_->abort();
  inner_->abort();
  // Not joined: the worker may be blocked in Gloo (whose abort does nothing)
  // until its op's timeout, and abort()'s caller must not wait for that.
  runner_.stop();
}

std::chrono::milliseconds CheckedCpuBackend::limit(std::chrono::milliseconds timeout) const {
  return timeout == c10d::kUnsetTimeout ? std::chrono::milliseconds(timeoutMs_.load()) : timeout;
}

std::vector<at::Tensor> CheckedCpuBackend::exchange(const char* title,
                                                    const std::vector<at::Tensor>& outgoing,
                                                    int64_t capacity, int tag,
                                                    std::chrono::milliseconds timeout) {
  // Point-to-point, every rank to every rank: Gloo posts sends and receives
  // on the calling thread, where its collectives hop through its worker
  // threads and cost several times more for a few bytes. Only one thread at
  // a time uses the checks group, and every receive of one tag has the same
  // size, at least any row sent with it: Gloo takes a message shorter than
  // the receive's buffer, and aborts the process on a longer one.
  std::vector<at::Tensor> rows(size_);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<int> peers;  // of each work
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) {
      rows[r] = outgoing[r];
      continue;
    }
    rows[r] = at::empty({capacity}, at::kLong);
    std::vector<at::Tensor> in{rows[r]};
    works.push_back(checks_->recv(in, r, tag));
    peers.push_back(r);
  }
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    std::vector<at::Tensor> out{outgoing[r]};
    works.push_back(checks_->send(out, r, tag));
    peers.push_back(r);
  }
  // Gloo's point-to-point waits take their limit from wait(): together
  // they end at `timeout`.
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  const size_t receives = works.size() / 2;  // posted first
  for (size_t i = 0; i < works.size(); ++i) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    try {
      works[i]->wait(std::max(left, std::chrono::milliseconds(1)));
    } catch (const std::exception& e) {
      const auto elapsed =
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
      C10_THROW_ERROR(
          DistBackendError,
          c10::str("xcomm.", title, ": ", peerFailure(memberName_, peers[i], elapsed, timeout),
                   " in checking that every rank called the same collective (it "
                   "died, left, hangs, or skipped this collective): ",
                   messageOf(e)));
    }
    // A peer that left sent its departure instead of its row (announceDeparture):
    // raise now, not when its connection closes and our send to it fails.
    if (i < receives && tag == kDescriptorTag &&
        rows[peers[i]].data_ptr<int64_t>()[0] == kDepartedOp) {
      C10_THROW_ERROR(
          DistBackendError,
          c10::str(
              "xcomm.", title, ": ", memberName_, " ", peers[i],
              " left the group (it shut down or destroyed its process group) "
              "before this collective, after ",
              std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count(),
              " ms; every rank must issue the same collectives before "
              "destroying the group"));
    }
  }
  return rows;
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::issueDirect(
    const char* title, c10d::OpType type, std::vector<at::Tensor> outputs,
    std::chrono::milliseconds timeout, const std::function<DirectExchange::Posted()>& post) {
  const auto limit = this->limit(timeout);
  const auto deadline = Clock::now() + limit;
  auto posted = std::make_shared<DirectExchange::Posted>(post());
  directOps_++;
  auto work = c10::make_intrusive<FutureWork>(rank_, type, nullptr, c10::IValue(std::move(outputs)),
                                              tensorListType());
  // A pool thread waits for the messages: the worker goes on to the next
  // op's check meanwhile. The task holds no pointer to this backend, which
  // may be gone before the messages are.
  runner_.aside([posted, work, title = std::string(title), member = memberName_, deadline, limit] {
    try {
      DirectExchange::waitAll(*posted, title, member, deadline, limit);
      work->markSucceeded();
    } catch (...) {
      work->markFailed(std::current_exception());
    }
  });
  return work;
}

void CheckedCpuBackend::drain(std::chrono::milliseconds timeout) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  {
    std::lock_guard<std::mutex> lock(inflightMutex_);
    works.swap(inflight_);
  }
  for (const auto& w : works) {
    try {
      w->wait(timeout);
    } catch (...) {
      // An earlier op's error belongs to that op: its own work raised it (or
      // will). Only an op still running past the limit fails the barrier.
      if (!w->isCompleted()) throw;
    }
  }
}

CheckedCpuBackend::Outcome CheckedCpuBackend::run(const char* title, const Call& call,
                                                  const std::vector<int64_t>& pairs,
                                                  const CarriedOp& carry,
                                                  std::chrono::milliseconds wait,
                                                  const Issue& issue,
                                                  const c10::intrusive_ptr<FutureWork>& work) {
  try {
    if (carry.capable && carry.drainFirst) drain(backstop(wait));
    // In a small group every row has room for an all-to-all's sizes, so one
    // exchange checks it; rows of other ops carry zeros there.
    const bool inlinePairs = size_ <= kInlinePairsMaxRanks;
    const int64_t payloadAt = payloadOffset(size_);
    // One row per peer (the same tensor where the same bytes go to several):
    // the call, the pair sizes, the bytes carried to that peer.
    std::vector<at::Tensor> outgoing(size_);
    at::Tensor last;
    for (int peer = 0; peer < size_; ++peer) {
      at::Tensor payload;
      if (carry.capable && carry.payload) payload = carry.payload(peer);
      const int64_t payloadBytes = payload.defined() ? payload.numel() : 0;
      TORCH_CHECK(payloadBytes <= carryBytes_, "xcomm: a carried op of ", payloadBytes,
                  " bytes exceeds the group's ", carryBytes_);
      if (peer > 0 && payload.defined() == last.defined() &&
          (!payload.defined() ||
           (payload.data_ptr() == last.data_ptr() && payload.numel() == last.numel()))) {
        outgoing[peer] = outgoing[peer - 1];
        continue;
      }
      last = payload;
      at::Tensor mine = at::zeros({payloadAt + wordsFor(payloadBytes)}, at::kLong);
      auto* row = mine.data_ptr<int64_t>();
      putCall(row, call);
      row[kCarryFlag] = (carry.capable ? 1 : 0) | (directEnabled_ ? 2 : 0);
      row[kCarriedBytes] = payloadBytes;
      if (inlinePairs) std::copy(pairs.begin(), pairs.end(), row + kHeaderWords);
      if (payloadBytes > 0) {
        std::memcpy(row + payloadAt, payload.data_ptr(), static_cast<size_t>(payloadBytes));
      }
      outgoing[peer] = mine;
    }
    const auto rows =
        exchange(title, outgoing, descriptorCapacity(size_, carryBytes_), kDescriptorTag, wait);
    const int64_t* first = rows[0].data_ptr<int64_t>();
    bool carried = true;
    bool direct = true;
    for (int r = 0; r < size_; ++r) {
      const int64_t* other = rows[r].data_ptr<int64_t>();
      TORCH_CHECK_VALUE(std::equal(first, first + kFields, other), "xcomm.", title,
                        ": the ranks called different collectives (", memberName_,
                        " 0: ", render(first), "; ", memberName_, " ", r, ": ", render(other),
                        "); every rank must issue the same collectives, with the same root, "
                        "sizes, dtype and reduce op, in the same order");
      carried = carried && (other[kCarryFlag] & 1) != 0;
      direct = direct && (other[kCarryFlag] & 2) != 0;
    }
    if (!pairs.empty()) {
      std::vector<const int64_t*> sizes;
      std::vector<at::Tensor> pairRows;
      if (inlinePairs) {
        for (const auto& r : rows) sizes.push_back(r.data_ptr<int64_t>() + kHeaderWords);
      } else {
        pairRows = exchange(title, std::vector<at::Tensor>(size_, at::tensor(pairs, at::kLong)),
                            2 * size_, kPairsTag, wait);
        for (const auto& r : pairRows) sizes.push_back(r.data_ptr<int64_t>());
      }
      for (int s = 0; s < size_; ++s) {
        for (int d = 0; d < size_; ++d) {
          const int64_t sent = sizes[s][d];
          const int64_t expected = sizes[d][size_ + s];
          TORCH_CHECK_VALUE(sent == expected, "xcomm.", title, ": ", memberName_, " ", s, " sends ",
                            sent, " bytes to ", memberName_, " ", d, ", but ", memberName_, " ", d,
                            " expects ", expected, " bytes from ", memberName_, " ", s,
                            "; each rank's input split for a peer must equal that peer's "
                            "output split for it");
        }
      }
    }
    if (carried) {
      std::vector<at::Tensor> payloads;
      for (const auto& r : rows) {
        const int64_t bytes = r.data_ptr<int64_t>()[kCarriedBytes];
        TORCH_CHECK(bytes >= 0 && bytes <= carryBytes_, "xcomm.", title,
                    ": a peer's row says it carries ", bytes, " bytes, beyond the group's ",
                    carryBytes_, " (mismatched xcomm builds?)");
        payloads.push_back(r.view(at::kByte).narrow(0, payloadAt * 8, bytes));
      }
      carry.finish(payloads);
      carriedOps_++;
      return Outcome::complete();
    }
    directAgreed_ = direct;  // read by issue(), on this thread
    auto inner = issue();
    if (!inner) return Outcome::complete();  // a synchronous op that already ran
    c10::intrusive_ptr<c10::ivalue::Future> done;
    try {
      done = inner->getFuture();
    } catch (const c10::Error&) {
      // Gloo's reduce-scatters have no future: wait here (their own timeout bounds it).
    }
    if (!done) {
      inner->wait(backstop(wait));
      return Outcome::complete();
    }
    {
      std::lock_guard<std::mutex> lock(inflightMutex_);
      inflight_.erase(std::remove_if(inflight_.begin(), inflight_.end(),
                                     [](const auto& w) { return w->isCompleted(); }),
                      inflight_.end());
      inflight_.push_back(inner);
    }
    // Completes on the inner backend's thread, as the inner work's own
    // future would: the worker moves on to the next op's check.
    done->addCallback([work](c10::ivalue::Future& f) {
      if (f.hasError()) {
        work->markFailed(f.exception_ptr());
      } else {
        work->markSucceeded();
      }
    });
    return Outcome{};
  } catch (...) {
    return Outcome::failed(std::current_exception());
  }
}

void CheckedCpuBackend::Outcome::mark(FutureWork& work) const {
  if (error) {
    work.markFailed(error);
  } else {
    work.markSucceeded();
  }
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::submit(
    const char* title, Call call, std::vector<int64_t> pairs, std::vector<at::Tensor> outputs,
    std::chrono::milliseconds timeout, bool withFuture, Issue issue, CarriedOp carry) {
  c10::intrusive_ptr<FutureWork> work;
  c10::IValue result(std::move(outputs));
  if (withFuture) {
    work = c10::make_intrusive<FutureWork>(rank_, call.type, nullptr, std::move(result),
                                           tensorListType());
  } else {
    work = c10::make_intrusive<FuturelessWork>(rank_, call.type, nullptr, std::move(result),
                                               tensorListType());
  }
  if (carryBytes_ == 0) carry = CarriedOp{};
  const auto wait = limit(timeout);
  std::lock_guard<std::mutex> lock(submitMutex_);
  seq_++;
  runner_.submit([this, work, title, call, pairs = std::move(pairs), carry = std::move(carry), wait,
                  issue = std::move(issue)]() -> OrderedRunner::Completion {
    const auto outcome = run(title, call, pairs, carry, wait, issue, work);
    if (!outcome.done) return {};
    return [work, outcome] { outcome.mark(*work); };
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                            const c10d::BroadcastOptions& opts) {
  const auto call = callOf(c10d::OpType::BROADCAST, tensors,
                           opts.rootRank * static_cast<int64_t>(tensors.size()) + opts.rootTensor);
  return submit(
      "broadcast", call, {}, tensors, opts.timeout, true,
      [this, tensors, opts]() mutable { return inner_->broadcast(tensors, opts); },
      opts.rootTensor == 0
          ? carriedBroadcast(tensors, static_cast<int>(opts.rootRank), rank_, carryBytes_)
          : CarriedOp{});
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceOptions& opts) {
  const auto call = callOf(c10d::OpType::ALLREDUCE, tensors, opts.reduceOp);
  return submit(
      "all_reduce", call, {}, tensors, opts.timeout, true,
      [this, tensors, opts]() mutable { return inner_->allreduce(tensors, opts); },
      carriedAllreduce(tensors, opts.reduceOp, size_, carryBytes_));
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::agreeOnAllreduce(
    const std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  const auto call = callOf(c10d::OpType::ALLREDUCE, tensors, opts.reduceOp);
  // Never carried (no CarriedOp): the rows hold the call alone, and issue()
  // has nothing to run.
  return submit("all_reduce", call, {}, tensors, opts.timeout, true,
                []() { return c10::intrusive_ptr<c10d::Work>(); });
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const auto call = callOf(c10d::OpType::ALLREDUCE_COALESCED, tensors, opts.reduceOp);
  return submit(
      "all_reduce_coalesced", call, {}, tensors, opts.timeout, true,
      [this, tensors, opts]() mutable { return inner_->allreduce_coalesced(tensors, opts); });
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::reduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::ReduceOptions& opts) {
  const auto call = callOf(c10d::OpType::REDUCE, tensors, opts.reduceOp, opts.rootRank);
  return submit("reduce", call, {}, tensors, opts.timeout, true,
                [this, tensors, opts]() mutable { return inner_->reduce(tensors, opts); });
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const auto call = callOf(c10d::OpType::ALLGATHER, inputs);
  return submit(
      "all_gather", call, {}, flatten(outputs), opts.timeout, true,
      [this, outputs, inputs, opts]() mutable {
        if (directAgreed_ && carriedAllgather(outputs, inputs, size_, kAnyBytes).capable &&
            direct(inputs) && direct(outputs[0])) {
          return issueDirect("all_gather", c10d::OpType::ALLGATHER, outputs[0], opts.timeout,
                             [&] { return direct_.postAllgather(outputs[0], inputs[0]); });
        }
        return inner_->allgather(outputs, inputs, opts);
      },
      carriedAllgather(outputs, inputs, size_, carryBytes_));
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const auto call = callOf(c10d::OpType::_ALLGATHER_BASE, {input});
  // The future holds each rank's piece, as Gloo's does.
  auto value = concatOf(output, input, size_) ? piecesPerRank(output, input, size_)
                                              : std::vector<at::Tensor>{output};
  return submit(
      "all_gather_into_tensor", call, {}, std::move(value), opts.timeout, true,
      [this, output, input, opts]() mutable {
        if (directAgreed_ && carriedAllgatherBase(output, input, size_, kAnyBytes).capable &&
            direct({output, input})) {
          return issueDirect("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, {output},
                             opts.timeout, [&] { return direct_.postAllgather(output, input); });
        }
        return inner_->_allgather_base(output, input, opts);
      },
      carriedAllgatherBase(output, input, size_, carryBytes_));
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const auto call = callOf(c10d::OpType::COALESCED, inputs);
  return submit("all_gather_into_tensor_coalesced", call, {}, outputs, opts.timeout, true,
                [this, outputs, inputs, opts]() mutable {
                  return inner_->allgather_into_tensor_coalesced(outputs, inputs, opts);
                });
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const auto call = callOf(c10d::OpType::ALLGATHER_COALESCED, inputs);
  return submit("all_gather_coalesced", call, {}, flatten(outputs), opts.timeout, true,
                [this, outputs, inputs, opts]() mutable {
                  return inner_->allgather_coalesced(outputs, inputs, opts);
                });
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const auto call = callOf(c10d::OpType::GATHER, inputs, opts.rootRank);
  return submit(
      "gather", call, {}, flatten(outputs), opts.timeout, true,
      [this, outputs, inputs, opts]() mutable { return inner_->gather(outputs, inputs, opts); },
      carriedGather(outputs, inputs, static_cast<int>(opts.rootRank), rank_, size_, carryBytes_));
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const auto call = callOf(c10d::OpType::SCATTER, outputs, opts.rootRank);
  return submit(
      "scatter", call, {}, outputs, opts.timeout, true,
      [this, outputs, inputs, opts]() mutable { return inner_->scatter(outputs, inputs, opts); },
      carriedScatter(outputs, inputs, static_cast<int>(opts.rootRank), rank_, size_, carryBytes_));
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const auto call = callOf(c10d::OpType::REDUCE_SCATTER, outputs, opts.reduceOp);
  return submit(
      "reduce_scatter", call, {}, outputs, opts.timeout, false,
      [this, outputs, inputs, opts]() mutable {
        return inner_->reduce_scatter(outputs, inputs, opts);
      },
      carriedReduceScatter(outputs, inputs, opts.reduceOp, size_, carryBytes_));
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const auto call = callOf(c10d::OpType::_REDUCE_SCATTER_BASE, {output}, opts.reduceOp);
  return submit("reduce_scatter_tensor", call, {}, {output}, opts.timeout, false,
                [this, output, input, opts]() mutable {
                  return inner_->_reduce_scatter_base(output, input, opts);
                });
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const auto call = callOf(c10d::OpType::COALESCED, outputs, opts.reduceOp);
  return submit("reduce_scatter_tensor_coalesced", call, {}, outputs, opts.timeout, false,
                [this, outputs, inputs, opts]() mutable {
                  return inner_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
                });
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::alltoall_base(at::Tensor& output,
                                                                at::Tensor& input,
                                                                std::vector<int64_t>& outputSplits,
                                                                std::vector<int64_t>& inputSplits,
                                                                const c10d::AllToAllOptions& opts) {
  // Sizes may differ between ranks: only op and dtype in the descriptor,
  // then every pair's sizes.
  Call call;
  call.type = c10d::OpType::ALLTOALL_BASE;
  call.dtype = input.scalar_type();
  return alltoallBase("all_to_all_single", call, output, input, outputSplits, inputSplits, opts);
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::alltoallForReduceScatter(
    at::Tensor& output, at::Tensor& input, int64_t redOp, const c10d::AllToAllOptions& opts) {
  // Every rank's output has the same size; tensors = 0 tells this route from
  // Gloo's reduce-scatter (callOf: 1), which a rank could take for the same call.
  Call call;
  call.type = c10d::OpType::_REDUCE_SCATTER_BASE;
  call.dtype = input.scalar_type();
  call.redOp = redOp;
  call.bytes = static_cast<int64_t>(output.numel() / size_ * output.element_size());
  std::vector<int64_t> even;
  return alltoallBase("reduce_scatter_tensor", call, output, input, even, even, opts);
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::alltoallBase(const char* title, Call call,
                                                               at::Tensor& output,
                                                               at::Tensor& input,
                                                               std::vector<int64_t>& outputSplits,
                                                               std::vector<int64_t>& inputSplits,
                                                               const c10d::AllToAllOptions& opts) {
  auto pairs = pieceBytes(input, inputSplits, size_);
  const auto sendBytes = pairs;
  const auto recvBytes = pieceBytes(output, outputSplits, size_);
  pairs.insert(pairs.end(), recvBytes.begin(), recvBytes.end());
  return submit(
      title, call, std::move(pairs), {output}, opts.timeout, true,
      [this, title, type = call.type, output, input, outputSplits, inputSplits, sendBytes,
       recvBytes, opts]() mutable {
        if (directAgreed_ &&
            carriedAlltoallBase(output, input, outputSplits, inputSplits, size_, kAnyBytes)
                .capable &&
            direct({output, input})) {
          return issueDirect(title, type, {output}, opts.timeout, [&] {
            return direct_.postAlltoall(output, input, sendBytes, recvBytes);
          });
        }
        return inner_->alltoall_base(output, input, outputSplits, inputSplits, opts);
      },
      carriedAlltoallBase(output, input, outputSplits, inputSplits, size_, carryBytes_));
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllToAllOptions& opts) {
  Call call;
  call.type = c10d::OpType::ALLTOALL;
  call.dtype = dtypeOf(inputs);
  std::vector<int64_t> pairs;
  if (static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_) {
    for (const auto& t : inputs) pairs.push_back(static_cast<int64_t>(denseBytes({t})));
    for (const auto& t : outputs) pairs.push_back(static_cast<int64_t>(denseBytes({t})));
  } else {
    call.tensors = static_cast<int64_t>(inputs.size());  // Gloo raises on the list's length
  }
  return submit(
      "all_to_all", call, std::move(pairs), outputs, opts.timeout, true,
      [this, outputs, inputs, opts]() mutable {
        if (directAgreed_ && carriedAlltoall(outputs, inputs, size_, kAnyBytes).capable &&
            direct(inputs) && direct(outputs)) {
          return issueDirect("all_to_all", c10d::OpType::ALLTOALL, outputs, opts.timeout,
                             [&] { return direct_.postAlltoall(outputs, inputs); });
        }
        return inner_->alltoall(outputs, inputs, opts);
      },
      carriedAlltoall(outputs, inputs, size_, carryBytes_));
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::barrier(const c10d::BarrierOptions& opts) {
  Call call;
  call.type = c10d::OpType::BARRIER;
  return submit(
      "barrier", call, {}, {}, opts.timeout, true,
      [this, opts]() mutable { return inner_->barrier(opts); }, carriedBarrier());
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::send(std::vector<at::Tensor>& tensors,
                                                       int dstRank, int tag) {
  seq_++;
  return inner_->send(tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::recv(std::vector<at::Tensor>& tensors,
                                                       int srcRank, int tag) {
  seq_++;
  return inner_->recv(tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> CheckedCpuBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                int tag) {
  seq_++;
  return inner_->recvAnysource(tensors, tag);
}

void CheckedCpuBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  // Runs on the worker, after every op queued before it was issued; its
  // error (the ranks that did not arrive) is rethrown here.
  auto work =
      c10::make_intrusive<FutureWork>(rank_, c10d::OpType::BARRIER, nullptr,
                                      c10::IValue(std::vector<at::Tensor>{}), tensorListType());
  {
    std::lock_guard<std::mutex> lock(submitMutex_);
    runner_.submit(finishing(work, [this, opts, waitAllRanks] {
      inner_->monitoredBarrier(opts, waitAllRanks);
      return -1;
    }));
  }
  work->wait();
}

void CheckedCpuBackend::setSequenceNumberForGroup() {
  inner_->setSequenceNumberForGroup();
  seq_ = 0;
}

uint64_t CheckedCpuBackend::getSequenceNumberForGroup() {
  return seq_.load();
}

}  // namespace xcomm
