#include "backend/CheckedRoute.hpp"

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

// The checks route, which the exchange's messages need before anything runs.
InnerRoute& checked(const std::shared_ptr<InnerRoute>& checks) {
  TORCH_CHECK(checks, "xcomm: the checked route needs a checks route");
  return *checks;
}

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

void putCall(int64_t* row, const CheckedRoute::Call& c) {
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
  // An all_to_all_single that runs a reduce_scatter_tensor (Op::asReduceScatter).
  if (type == c10d::OpType::_REDUCE_SCATTER_BASE && r[5] == 0) out << ", as an all_to_all";
  out << ")";
  return out.str();
}

CheckedRoute::Call callOf(c10d::OpType type, const std::vector<at::Tensor>& ts, int64_t root = -1) {
  CheckedRoute::Call c;
  c.type = type;
  c.dtype = dtypeOf(ts);
  c.root = root;
  c.bytes = static_cast<int64_t>(denseBytes(ts));
  c.tensors = static_cast<int64_t>(ts.size());
  return c;
}

// A reduction as its caller made it: the caller's dtype and bytes, also
// where the tensors travel as MinMaxLowering's keys.
CheckedRoute::Call callOf(c10d::OpType type, const std::vector<at::Tensor>& ts,
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

CheckedRoute::CheckedRoute(std::shared_ptr<InnerRoute> inner, std::shared_ptr<InnerRoute> checks,
                           std::chrono::milliseconds timeout, int64_t carryBytes,
                           std::string memberName, bool directExchange)
    : Route(inner ? inner->rank() : 0, inner ? inner->size() : 0),
      inner_(std::move(inner)),
      checks_(std::move(checks)),
      carryBytes_(carryBytes / 8 * 8),
      memberName_(std::move(memberName)),
      direct_(checked(checks_), kTransferTag),
      directEnabled_(directExchange),
      timeoutMs_(timeout.count()) {
  TORCH_CHECK(inner_, "xcomm: the checked route needs an inner route");
  TORCH_CHECK(checks_->rank() == rank_ && checks_->size() == size_,
              "xcomm: the checks route's rank and size (", checks_->rank(), " of ", checks_->size(),
              ") differ from the group's (", rank_, " of ", size_, ")");
  TORCH_CHECK(carryBytes_ >= 0, "xcomm: carryBytes must be >= 0, got ", carryBytes);
}

CheckedRoute::~CheckedRoute() = default;

void CheckedRoute::setTimeout(std::chrono::milliseconds timeout) {
  timeoutMs_ = timeout.count();
  inner_->setTimeout(timeout);
  checks_->setTimeout(timeout);
}

void CheckedRoute::shutdown() {
  runner_.shutdown();
  announceDeparture();
  inner_->shutdown();
  checks_->shutdown();
}

void CheckedRoute::announceDeparture() {
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

void CheckedRoute::abort() {
  // The worker may be waiting in a check: the checks group's abort ends it.
  checks_->abort();
  inner_->abort();
  // Not joined: the worker may be blocked in Gloo (whose abort does nothing)
  // until its op's timeout, and abort()'s caller must not wait for that.
  runner_.stop();
}

std::chrono::milliseconds CheckedRoute::limit(std::chrono::milliseconds timeout) const {
  return timeout == c10d::kUnsetTimeout ? std::chrono::milliseconds(timeoutMs_.load()) : timeout;
}

std::vector<at::Tensor> CheckedRoute::exchange(const char* title,
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

c10::intrusive_ptr<c10d::Work> CheckedRoute::issueDirect(
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

void CheckedRoute::drain(std::chrono::milliseconds timeout) {
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

CheckedRoute::Outcome CheckedRoute::runTurn(const char* title, const Call& call,
                                            const std::vector<int64_t>& pairs,
                                            const CarriedOp& carry, std::chrono::milliseconds wait,
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
      try {
        inner->wait(backstop(wait));
      } catch (...) {
        return Outcome::failed(namedTransportFailure(title, "Gloo", std::current_exception()));
      }
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
    done->addCallback([work, title = std::string(title)](c10::ivalue::Future& f) {
      if (f.hasError()) {
        work->markFailed(namedTransportFailure(title, "Gloo", f.exception_ptr()));
      } else {
        work->markSucceeded();
      }
    });
    return Outcome{};
  } catch (...) {
    return Outcome::failed(std::current_exception());
  }
}

void CheckedRoute::Outcome::mark(FutureWork& work) const {
  if (error) {
    work.markFailed(error);
  } else {
    work.markSucceeded();
  }
}

c10::intrusive_ptr<c10d::Work> CheckedRoute::submit(const char* title, Call call,
                                                    std::vector<int64_t> pairs,
                                                    std::vector<at::Tensor> outputs,
                                                    std::chrono::milliseconds timeout,
                                                    bool withFuture, Issue issue, CarriedOp carry) {
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
  runner_.submit([this, work, title, call, pairs = std::move(pairs), carry = std::move(carry), wait,
                  issue = std::move(issue)]() -> OrderedRunner::Completion {
    const auto outcome = runTurn(title, call, pairs, carry, wait, issue, work);
    if (!outcome.done) return {};
    return [work, outcome] { outcome.mark(*work); };
  });
  return work;
}

CheckedRoute::Checked CheckedRoute::describe(const Op& op) const {
  Checked c;
  const auto& in = op.inputs;
  const auto& out = op.outputs;
  const int root = static_cast<int>(op.root);
  switch (op.kind) {
    case OpKind::kBroadcast:
      c.call = callOf(op.type, in, op.root * static_cast<int64_t>(in.size()) + op.rootTensor);
      if (op.rootTensor == 0) c.carry = carriedBroadcast(in, root, rank_, carryBytes_);
      break;
    case OpKind::kAllreduce:
      c.call = callOf(op.type, in, op.reduceOp);
      c.carry = carriedAllreduce(in, op.reduceOp, size_, carryBytes_);
      break;
    case OpKind::kAllreduceCoalesced:
      c.call = callOf(op.type, in, op.reduceOp);
      break;
    case OpKind::kReduce:
      c.call = callOf(op.type, in, op.reduceOp, op.root);
      break;
    case OpKind::kAllgather:
      c.call = callOf(op.type, in);
      c.carry = carriedAllgather(op.outputLists, in, size_, carryBytes_);
      if (carriedAllgather(op.outputLists, in, size_, kAnyBytes).capable && direct(in) &&
          direct(op.outputLists[0])) {
        c.direct = [this, output = op.outputLists[0], input = in[0]] {
          return direct_.postAllgather(output, input);
        };
      }
      break;
    case OpKind::kAllgatherBase:
      c.call = callOf(op.type, in);
      c.carry = carriedAllgatherBase(out[0], in[0], size_, carryBytes_);
      if (carriedAllgatherBase(out[0], in[0], size_, kAnyBytes).capable &&
          direct({out[0], in[0]})) {
        c.direct = [this, output = out[0], input = in[0]] {
          return direct_.postAllgather(output, input);
        };
      }
      break;
    case OpKind::kAllgatherIntoTensorCoalesced:
    case OpKind::kAllgatherCoalesced:
      c.call = callOf(op.type, in);
      break;
    case OpKind::kGather:
      c.call = callOf(op.type, in, op.root);
      c.carry = carriedGather(op.outputLists, in, root, rank_, size_, carryBytes_);
      break;
    case OpKind::kScatter:
      c.call = callOf(op.type, out, op.root);
      c.carry = carriedScatter(out, op.inputLists, root, rank_, size_, carryBytes_);
      break;
    case OpKind::kReduceScatter:
      c.call = callOf(op.type, out, op.reduceOp);
      c.carry = carriedReduceScatter(out, op.inputLists, op.reduceOp, size_, carryBytes_);
      break;
    case OpKind::kReduceScatterBase:
      c.call = callOf(op.type, {out[0]}, op.reduceOp);
      break;
    case OpKind::kReduceScatterTensorCoalesced:
      c.call = callOf(op.type, out, op.reduceOp);
      break;
    case OpKind::kAlltoallBase: {
      const auto& output = out[0];
      const auto& input = in[0];
      if (op.asReduceScatter) {
        // Every rank's output has the same size; tensors = 0 tells this
        // route from Gloo's reduce-scatter (callOf: 1), which a rank could
        // take for the same call.
        c.call.type = c10d::OpType::_REDUCE_SCATTER_BASE;
        c.call.redOp = *op.asReduceScatter;
        c.call.bytes = static_cast<int64_t>(output.numel() / size_ * output.element_size());
      } else {
        // Sizes may differ between ranks: only op and dtype in the
        // descriptor, then every pair's sizes.
        c.call.type = op.type;
      }
      c.call.dtype = input.scalar_type();
      auto sendBytes = pieceBytes(input, op.inputSplits, size_);
      auto recvBytes = pieceBytes(output, op.outputSplits, size_);
      c.pairs = sendBytes;
      c.pairs.insert(c.pairs.end(), recvBytes.begin(), recvBytes.end());
      c.carry =
          carriedAlltoallBase(output, input, op.outputSplits, op.inputSplits, size_, carryBytes_);
      if (carriedAlltoallBase(output, input, op.outputSplits, op.inputSplits, size_, kAnyBytes)
              .capable &&
          direct({output, input})) {
        c.direct = [this, output, input, sendBytes, recvBytes] {
          return direct_.postAlltoall(output, input, sendBytes, recvBytes);
        };
      }
      break;
    }
    case OpKind::kAlltoall:
      c.call.type = op.type;
      c.call.dtype = dtypeOf(in);
      if (static_cast<int>(in.size()) == size_ && static_cast<int>(out.size()) == size_) {
        for (const auto& t : in) c.pairs.push_back(static_cast<int64_t>(denseBytes({t})));
        for (const auto& t : out) c.pairs.push_back(static_cast<int64_t>(denseBytes({t})));
      } else {
        c.call.tensors = static_cast<int64_t>(in.size());  // Gloo raises on the list's length
      }
      c.carry = carriedAlltoall(out, in, size_, carryBytes_);
      if (carriedAlltoall(out, in, size_, kAnyBytes).capable && direct(in) && direct(out)) {
        c.direct = [this, out, in] { return direct_.postAlltoall(out, in); };
      }
      break;
    case OpKind::kBarrier:
      c.call.type = op.type;
      c.carry = carriedBarrier();
      break;
  }
  return c;
}

c10::intrusive_ptr<c10d::Work> CheckedRoute::run(Op op) {
  auto checked = describe(op);
  const char* title = op.title;
  const c10d::OpType type = op.type;
  const auto timeout = op.timeout;
  const bool withFuture = op.withFuture;
  auto result = op.result;
  Issue issue = [this, op = std::move(op), direct = std::move(checked.direct), title, type,
                 timeout]() mutable -> c10::intrusive_ptr<c10d::Work> {
    if (directAgreed_ && direct) return issueDirect(title, type, op.result, timeout, direct);
    return inner_->run(std::move(op));
  };
  return submit(title, checked.call, std::move(checked.pairs), std::move(result), timeout,
                withFuture, std::move(issue), std::move(checked.carry));
}

c10::intrusive_ptr<c10d::Work> CheckedRoute::agree(const Op& op) {
  // Never carried (no CarriedOp): the rows hold the call alone, and issue()
  // has nothing to run.
  return submit(op.title, describe(op).call, {}, op.result, op.timeout, true,
                []() { return c10::intrusive_ptr<c10d::Work>(); });
}

void CheckedRoute::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
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

}  // namespace xcomm
