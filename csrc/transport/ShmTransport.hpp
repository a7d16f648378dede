#pragma once
// ShmTransport: one POSIX shared-memory segment per process group, mapped by
// every rank of the group (all on one host).
//
// Layout: a control line per rank (its arrival counter, which doubles as a
// futex word, its pid and an op descriptor), then two data slots per rank
// (double buffering: a slot is rewritten only after a barrier that every
// reader of its previous contents has passed, so no trailing barrier).
//
// Safety: the segment is created O_EXCL with mode 0600 under a random name
// that only the group's store knows, and unlinked as soon as every rank has
// mapped it. Peers map only a segment of their own uid with mode 0600 (the
// store is unauthenticated: another local user could plant a name). The
// name holds its creator's pid, so a segment whose creator was SIGKILLed
// before unlinking it is removed by the next set-up on the host, or by the
// creator's peers as their set-up fails: nothing stays in /dev/shm.
// Waiting spins briefly, then sleeps on a futex; it fails at the op's
// deadline, as soon as a peer process is found dead, or as soon as a peer
// marks itself departed (it shut down or destroyed its group).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace xcomm {

class ShmTransport {
 public:
  struct Config {
    size_t slotBytes = 1 << 20;  // bytes per rank per buffer
    int spinMicros = -1;         // spin before sleeping; -1: pick from the core count
    // This rank's number in the group its user sees, which names it in the
    // peers' errors (a hierarchical group's hosts each hold a segment of
    // their own ranks); -1: its rank in the segment.
    int groupRank = -1;
  };

  // Removes this user's segments in /dev/shm whose creator, in this pid
  // namespace, is gone (killed between creating a segment and unlinking it
  // once every peer mapped it). Every set-up runs it: rank 0 before it
  // creates one, every rank when set-up fails. Returns how many it removed.
  static int removeOrphanedSegments();

  // A segment's set-up in two halves, both collective over the store:
  // begin() has rank 0 create the segment and publish its name, then
  // reserve its own slots' pages (zeroing them: milliseconds per MiB on a
  // busy host) on a thread of its own while the caller connects the group's
  // other transports; finish() maps it on every rank, each reserving its
  // own slots at once, and agrees on the outcome. A set-up dropped unfinished
  // (the caller's other set-up threw) removes what it made.
  class Setup {
   public:
    static std::unique_ptr<Setup> begin(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                        int size, Config config);
    // Null on every rank when any rank could not create or map the segment;
    // `whyNot` then says why (on the rank that failed).
    std::unique_ptr<ShmTransport> finish(std::string* whyNot = nullptr);
    ~Setup();
    Setup(const Setup&) = delete;
    Setup& operator=(const Setup&) = delete;

   private:
    struct State;
    explicit Setup(std::unique_ptr<State> state);
    std::unique_ptr<State> state_;
  };

  // Both halves at once: collective over `store` (every rank calls it).
  // Returns null on every rank when any rank could not create or map the
  // segment; `whyNot` then says why (on the rank that failed).
  static std::unique_ptr<ShmTransport> create(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size, Config config,
                                              std::string* whyNot = nullptr);
  ~ShmTransport();
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t slotBytes() const { return slotBytes_; }

  // The buffer of `rank` with parity `parity` (0 or 1).
  uint8_t* slot(int rank, int parity) const;
  // The parity of the next use of the slots (alternates per use).
  int nextParity() { return parity_ ^= 1; }

  // Before this rank writes shared state (its slot, its descriptor) for its
  // next barrier k: waits until every rank reached barrier k-1, i.e. has
  // finished reading what was written for barrier k-2 (same parity). A no-op
  // after a full barrier; needed after a one-sided wait (waitForRoot).
  void prepareWrite(std::chrono::steady_clock::time_point deadline, const char* op);

  // What a rank published for one barrier: which op (the collectives layer
  // packs it) and its size in bytes.
  struct Descriptor {
    uint64_t what = 0;
    uint64_t bytes = 0;
    bool operator==(const Descriptor& o) const { return what == o.what && bytes == o.bytes; }
    bool operator!=(const Descriptor& o) const { return !(*this == o); }
  };
  // What the caller is about to do, read by the others after the next
  // barrier (calls prepareWrite).
  void publishDescriptor(std::chrono::steady_clock::time_point deadline, const char* op,
                         Descriptor descriptor);
  // After a barrier (or, for the root, after waitForRoot): what `rank`
  // published for it. Every rank sees the same descriptors.
  Descriptor descriptorOf(int rank) const;

  // Arrive and wait until every rank arrived, or raise at `deadline` or when
  // a peer died. `op` names the collective in errors.
  void barrier(std::chrono::steady_clock::time_point deadline, const char* op);
  // Arrive; a rank other than `root` then waits for `root` only, and `root`
  // does not wait (one-to-all ops: the readers need only the root's data).
  void arriveAndWaitForRoot(int root, std::chrono::steady_clock::time_point deadline,
                            const char* op);

  // Makes waits in progress (on any thread) and later ones fail at once
  // (Backend::abort); the ranks are out of step afterwards.
  void requestAbort() { aborted_.store(true); }

  // Marks this rank as gone from the group (shutdown, abort, or the
  // transport's end) and wakes the peers waiting for it: a peer that waits
  // for an arrival this rank never made fails at once, naming it, instead of
  // at its timeout. Arrivals made before still count.
  void depart();

  // The error that broke this transport, or empty. Once a wait failed the
  // ranks are out of step, so every later op raises this at once.
  const std::string& brokenBy() const { return brokenBy_; }

 private:
  struct alignas(64) RankControl;
  ShmTransport(int rank, int size, size_t slotBytes, int spinMicros, void* base, size_t mapBytes);
  RankControl& control(int rank) const;
  void waitFor(int peer, uint32_t target, std::chrono::steady_clock::time_point deadline,
               const char* op);
  [[noreturn]] void fail(std::string message);
  // "rank R (pid P)": `peer` as its user knows it.
  std::string describePeer(int peer) const;

  int rank_;
  int size_;
  size_t slotBytes_;
  int spinMicros_;
  void* base_;
  size_t mapBytes_;
  void arrive();
  void throwIfBroken(const char* op) const;

  uint32_t arrivals_ = 0;    // barriers this rank has arrived at
  uint32_t allReached_ = 0;  // a barrier count every rank is known to have reached
  int parity_ = 1;
  std::string brokenBy_;
  std::atomic<bool> aborted_{false};
};

}  // namespace xcomm
