#pragma once
// OrderedRunner: how every xcomm route runs a group's ops. One worker runs
// them one at a time in the order they were submitted (every rank must issue
// a group's collectives in the same order), and a completion pool finishes
// their works off that worker: a future's callback may wait for the group's
// next op (torch's powerSGD_hook does), which needs the worker free.
//
// The one choice a route makes is whether a synchronous op may run on its
// caller's thread when nothing is queued or running (`CallerThread`): that
// keeps the order and saves two thread hand-offs per small op. The
// shared-memory route does (its steps touch only the segment); the checked
// Gloo route does not: on torch 2.14.1 a process that profiled checked ops
// run on the caller's thread aborted at exit in about half the runs (glibc
// "unaligned tcache chunk"; 0 of 10 with them on the worker).
#include <atomic>
#include <functional>
#include <mutex>
#include <string>

#include "runtime/CompletionPool.hpp"
#include "runtime/OpQueue.hpp"

namespace xcomm {

class OrderedRunner {
 public:
  enum class CallerThread { kNever, kWhenIdle };
  // What finishes an op (marks its work): run off the worker, or where the
  // step ran when that was the caller's thread. Empty: something else
  // finishes it (an inner op's future).
  using Completion = std::function<void()>;
  // An op's body, run in its turn. It must not throw: it reports errors
  // through its Completion (see finishing() in backend/XcommWork.hpp).
  using Step = std::function<Completion()>;

  OrderedRunner(std::string name, CallerThread callerThread);
  ~OrderedRunner();
  OrderedRunner(const OrderedRunner&) = delete;
  OrderedRunner& operator=(const OrderedRunner&) = delete;

  // Runs `step` after every step submitted before it. `synchronous`: the
  // caller waits for it at once (c10d's asyncOp=false), so it may run on the
  // caller's thread where the route allows. Throws once shut down.
  void submit(Step step, bool synchronous = false);

  // Runs `task` on the completion pool, out of turn: for a step that posts
  // its transfers and leaves waiting for them to a thread that is not the
  // worker, so the next step can start.
  void aside(Completion task) { completions_.run(std::move(task)); }

  // Runs what is queued, then stops the worker; idempotent. The completion
  // pool finishes what it was handed when the runner is destroyed.
  void shutdown();
  // shutdown() without waiting for the worker (OpQueue::stop): for abort().
  void stop();

 private:
  const std::string name_;
  const CallerThread callerThread_;
  std::mutex submitMutex_;
  bool stopped_ = false;         // guarded by submitMutex_       // a step's turn is taken under it
  std::atomic<int> pending_{0};  // steps queued or running on the worker
  CompletionPool completions_;   // before queue_: it outlives the worker that feeds it
  OpQueue queue_;
};

}  // namespace xcomm
