#include "transport/ShmTransport.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <iomanip>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

namespace xcomm {

struct alignas(64) ShmTransport::RankControl {
  std::atomic<uint32_t> arrived;   // barriers passed by this rank: the futex word
  std::atomic<uint32_t> sleepers;  // peers asleep on `arrived`: wake only if any
  std::atomic<uint32_t> departed;  // 1 once the rank left the group (ShmTransport::depart)
  int32_t pid;
  int32_t groupRank;   // the rank's number in its user's group (Config::groupRank)
  uint64_t startTime;  // with pid: tells a reused pid from the original process
  // Descriptor of the op, by the parity of the barrier that checks it: a
  // fast rank writes the next op's while slow ones still check this one's.
  uint64_t what[2];
  uint64_t bytes[2];
};

namespace {

static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free,
              "the futex word must be a plain 32-bit integer");

constexpr size_t kPage = 4096;
// Recheck the deadline and whether the peer still lives: a SIGKILLed peer is
// noticed this late at most (plus a /proc read, ~20 us, per slice).
constexpr auto kSleepSlice = std::chrono::milliseconds(10);
constexpr int kPureSpinMicros = 20;

size_t roundUp(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

std::string errnoText(int err) {
  return std::string(std::strerror(err));
}

// What /proc/<pid>/stat says of a process: its start time in clock ticks
// (field 22), its state letter, and whether it is exiting (PF_EXITING in
// field 9: set as a killed process starts tearing down, before its sockets
// close, and well before it is a zombie). 0 / '?' when it does not exist.
struct ProcessStat {
  uint64_t startTime = 0;
  char state = '?';
  bool exiting = false;
};

ProcessStat processStat(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  ProcessStat stat;
  if (close == std::string::npos) return stat;
  std::istringstream fields(text.substr(close + 2));
  fields >> stat.state;
  std::string field;
  for (int i = 4; i <= 21 && fields >> field; ++i) {
    if (i == 9) stat.exiting = (std::strtoull(field.c_str(), nullptr, 10) & 0x4) != 0;
  }
  fields >> stat.startTime;
  return stat;
}

bool processAlive(int pid, uint64_t startTime) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  const ProcessStat stat = processStat(pid);
  // A zombie, a process on its way out (its peers may see its sockets close
  // first), or a new process that reuses the pid, is not the peer.
  return stat.state != '?' && stat.state != 'Z' && stat.state != 'X' && !stat.exiting &&
         stat.startTime == startTime;
}

// A segment's name says who created it: "/xcomm-shm-<pid namespace>-<pid>-
// <start time>-<128 random bits>". The random part keeps the name unguessable;
// the rest lets a later rank on the host recognise a segment whose creator
// died before unlinking it (killed while its peers were still mapping it).
constexpr const char* kNamePrefix = "xcomm-shm-";

struct SegmentCreator {
  uint64_t pidNamespace = 0;
  int pid = 0;
  uint64_t startTime = 0;
};

// The inode of this process's pid namespace: pids mean something only within it.
uint64_t pidNamespace() {
  char link[64] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", link, sizeof(link) - 1);  // "pid:[4026531836]"
  if (n <= 0) return 0;
  const char* open = std::strchr(link, '[');
  return open ? std::strtoull(open + 1, nullptr, 10) : 0;
}

std::string newSegmentName() {
  std::random_device rd;
  std::ostringstream name;
  name << "/" << kNamePrefix << pidNamespace() << "-" << ::getpid() << "-"
       << processStat(::getpid()).startTime << "-" << std::hex;
  for (int i = 0; i < 4; ++i) {
    name << std::setw(8) << std::setfill('0') << rd();  // 128 bits from the OS entropy source
  }
  return name.str();
}

// The creator named in a segment name (with or without the leading '/'), or
// nothing when the name is not one newSegmentName makes.
std::optional<SegmentCreator> creatorOf(std::string name) {
  if (!name.empty() && name[0] == '/') name.erase(0, 1);
  if (name.rfind(kNamePrefix, 0) != 0) return std::nullopt;
  std::istringstream fields(name.substr(std::strlen(kNamePrefix)));
  SegmentCreator c;
  char dash1 = 0, dash2 = 0, dash3 = 0;
  std::string random;
  if (!(fields >> c.pidNamespace >> dash1 >> c.pid >> dash2 >> c.startTime >> dash3 >> random) ||
      dash1 != '-' || dash2 != '-' || dash3 != '-' || c.pid <= 0 || random.size() != 32 ||
      random.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return std::nullopt;
  }
  return c;
}

}  // namespace

int ShmTransport::removeOrphanedSegments() {
  const uint64_t myNamespace = pidNamespace();
  if (myNamespace == 0) return 0;  // cannot tell whose pids the names hold
  std::unique_ptr<DIR, int (*)(DIR*)> dir(::opendir("/dev/shm"), ::closedir);
  if (!dir) return 0;
  int removed = 0;
  while (const dirent* entry = ::readdir(dir.get())) {
    const std::string name = entry->d_name;
    const auto creator = creatorOf(name);
    // Another pid namespace's pids cannot be checked from here: left alone.
    if (!creator || creator->pidNamespace != myNamespace) continue;
    if (processAlive(creator->pid, creator->startTime)) continue;
    struct stat st;
    if (::stat(("/dev/shm/" + name).c_str(), &st) != 0 || st.st_uid != ::geteuid()) continue;
    if (::shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  return removed;
}

namespace {

long futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr,
                 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Reached `target`, with wrap-around of the 32-bit counter.
inline bool reached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

std::vector<uint8_t> bytesOf(const std::string& s) {
  return {s.begin(), s.end()};
}

std::string stringOf(const std::vector<uint8_t>& v) {
  return {v.begin(), v.end()};
}

// Unmaps on scope exit unless released.
struct Mapping {
  void* base = MAP_FAILED;
  size_t bytes = 0;
  ~Mapping() {
    if (base != MAP_FAILED) ::munmap(base, bytes);
  }
  void* release() {
    void* b = base;
    base = MAP_FAILED;
    return b;
  }
};

// Reserves the segment's pages in [offset, offset + bytes): a full /dev/shm
// must fail here, not SIGBUS later. Returns an error text, or empty.
std::string reservePages(const std::string& name, size_t offset, size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return "shm_open(" + name + ") failed: " + errnoText(errno);
  const int err = ::posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  ::close(fd);
  if (err != 0)
    return "posix_fallocate of " + std::to_string(bytes) + " bytes failed: " + errnoText(err);
  return {};
}

// Maps the segment: creates it when `create` (rank 0), else opens it. The
// creator reserves only the first `reserveBytes` (the control lines every
// rank writes before the set-up's verdict); each rank reserves its own slots
// with reservePages.
// Returns an error text, or empty on success.
std::string mapSegment(const std::string& name, bool create, size_t bytes, size_t reserveBytes,
                       Mapping& mapping) {
  const int fd = create ? ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                        : ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return "shm_open(" + name + ") failed: " + errnoText(errno);
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  if (create) {
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      return "ftruncate failed: " + errnoText(errno);
    }
    if (int err = ::posix_fallocate(fd, 0, static_cast<off_t>(reserveBytes)); err != 0) {
      return "posix_fallocate of " + std::to_string(reserveBytes) +
             " bytes failed: " + errnoText(err);
    }
    // Exactly 0600 whatever the umask: peers refuse anything else.
    if (::fchmod(fd, 0600) != 0) return "fchmod failed: " + errnoText(errno);
  } else {
    struct stat st;
    if (::fstat(fd, &st) != 0) return "fstat(" + name + ") failed: " + errnoText(errno);
    // The store is unauthenticated: another local user can write the name.
    // Only a segment this user alone can read is rank 0's (the same user
    // could read this process's memory anyway).
    if (st.st_uid != ::geteuid() || (st.st_mode & 07777) != 0600) {
      std::ostringstream why;
      why << "refusing segment " << name << ": it belongs to uid " << st.st_uid << " with mode 0"
          << std::oct << (st.st_mode & 07777) << std::dec << ", where rank 0's belongs to uid "
          << ::geteuid() << " with mode 0600 (another local user may have written this group's "
          << "key in the store)";
      return why.str();
    }
    if (static_cast<size_t>(st.st_size) != bytes) return "the segment has an unexpected size";
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return "mmap failed: " + errnoText(errno);
  mapping.base = base;
  mapping.bytes = bytes;
  return {};
}

}  // namespace

// A set-up under way: what begin() made, what finish() completes.
struct ShmTransport::Setup::State {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int size = 0;
  Config config;
  size_t slotBytes = 0;
  size_t controlBytes = 0;
  size_t mapBytes = 0;
  std::string name;
  Mapping mapping;
  std::string error;  // this rank's, so far
  // Rank 0's reservation of its own slots' pages, running meanwhile.
  std::future<std::string> reservation;
  // The name this rank removes when the set-up ends, whichever way: every
  // rank that mapped the segment does (rank 0 may be killed before it does).
  std::string unlinkName;
  bool finished = false;

  // This rank's share of the pages to reserve: its own two slots (the last
  // rank's run to the end of the segment). Each rank reserves its own, all
  // at once: zeroing a few MiB costs milliseconds.
  std::pair<size_t, size_t> ownSlots() const {
    const size_t offset = controlBytes + static_cast<size_t>(rank) * 2 * slotBytes;
    return {offset, rank == size - 1 ? mapBytes - offset : 2 * slotBytes};
  }
  void unlinkNow() {
    if (!unlinkName.empty()) ::shm_unlink(unlinkName.c_str());
    unlinkName.clear();
  }
  std::string reserved() {
    if (!reservation.valid()) return {};
    return reservation.get();
  }
};

std::unique_ptr<ShmTransport::Setup> ShmTransport::Setup::begin(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, Config config) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "xcomm shm: bad rank ", rank, " of ", size);
  TORCH_CHECK(config.slotBytes >= 64, "xcomm shm: slotBytes must be at least 64");
  auto state = std::make_unique<State>();
  state->store = store;
  state->rank = rank;
  state->size = size;
  state->config = config;
  // reduce_scatter puts one piece per rank in a slot: at least 64 bytes each.
  state->slotBytes = roundUp(std::max<size_t>(config.slotBytes, 64 * size), 64);
  state->controlBytes = roundUp(sizeof(RankControl) * size, kPage);
  state->mapBytes = state->controlBytes + roundUp(state->slotBytes * 2 * size, kPage);
  std::unique_ptr<Setup> setup(new Setup(std::move(state)));
  State& st = *setup->state_;
  if (rank == 0) {
    removeOrphanedSegments();  // earlier groups' creators killed mid-set-up
    st.name = newSegmentName();
    st.unlinkName = st.name;
    st.error = mapSegment(st.name, /*create=*/true, st.mapBytes, st.controlBytes, st.mapping);
    store->set("name", bytesOf(st.error.empty() ? st.name : std::string()));
    if (st.error.empty()) {
      // Its slots' pages are reserved while the caller connects the group's
      // other transports; nobody touches a slot before finish() agreed that
      // every rank has the segment.
      const auto [offset, bytes] = st.ownSlots();
      st.reservation = std::async(std::launch::async, reservePages, st.name, offset, bytes);
    }
  }
  return setup;
}

ShmTransport::Setup::Setup(std::unique_ptr<State> state) : state_(std::move(state)) {}

ShmTransport::Setup::~Setup() {
  if (!state_ || state_->finished) return;
  // Not finished (the caller's other set-up threw): wait for the
  // reservation, and remove the name and whatever a dead creator left.
  try {
    state_->reserved();
  } catch (...) {
  }
  state_->unlinkNow();
  removeOrphanedSegments();
}

std::unique_ptr<ShmTransport> ShmTransport::Setup::finish(std::string* whyNot) {
  State& st = *state_;
  TORCH_CHECK(!st.finished, "xcomm shm: a segment's set-up was finished twice");
  // Should anything below throw (a peer that never reports may be rank 0,
  // killed before it unlinked the segment), the destructor removes the name
  // and whatever a dead creator left.
  std::string firstError;
  {
    if (st.rank == 0) {
      const std::string reserved = st.reserved();
      if (st.error.empty()) st.error = reserved;
    } else {
      st.name = stringOf(st.store->get("name"));
      if (st.name.empty()) {
        st.error = "rank 0 could not create the segment";
      } else if (!creatorOf(st.name) || st.name[0] != '/') {
        st.error = "refusing segment name '" + st.name.substr(0, 120) +
                   "' from the store: not one xcomm makes (another process may have written this "
                   "group's key in the store)";
      } else {
        st.error = mapSegment(st.name, /*create=*/false, st.mapBytes, 0, st.mapping);
        if (st.error.empty()) {
          st.unlinkName = st.name;
          const auto [offset, bytes] = st.ownSlots();
          st.error = reservePages(st.name, offset, bytes);
        }
      }
    }
    if (st.error.empty()) {
      auto* ctl = reinterpret_cast<RankControl*>(static_cast<uint8_t*>(st.mapping.base) +
                                                 sizeof(RankControl) * st.rank);
      ctl->pid = static_cast<int32_t>(::getpid());
      ctl->groupRank = st.config.groupRank >= 0 ? st.config.groupRank : st.rank;
      ctl->startTime = processStat(::getpid()).startTime;
    }
    // Every rank reports; all agree on the outcome, so no rank is left alone on
    // a path the others do not take.
    st.store->set("status/" + std::to_string(st.rank), bytesOf(st.error.empty() ? "ok" : st.error));
    std::vector<std::string> keys;
    for (int r = 0; r < st.size; ++r) keys.push_back("status/" + std::to_string(r));
    const auto statuses = st.store->multiGet(keys);  // one request where the store has one
    for (int r = 0; r < st.size; ++r) {
      const auto status = stringOf(statuses[r]);
      if (status != "ok" && firstError.empty())
        firstError = "rank " + std::to_string(r) + ": " + status;
    }
  }
  st.finished = true;
  // Every rank has mapped it (or given up): the name is no longer needed.
  st.unlinkNow();
  if (!firstError.empty()) {
    removeOrphanedSegments();
    if (whyNot) *whyNot = firstError;
    return nullptr;
  }
  const int spin =
      st.config.spinMicros >= 0
          ? st.config.spinMicros
          // Polling (with yields) beats a futex wake-up, which
          // costs tens of microseconds on a busy VM; with more
          // ranks than cores, sleep sooner.
          : (st.size > static_cast<int>(std::thread::hardware_concurrency()) ? 50 : 300);
  return std::unique_ptr<ShmTransport>(
      new ShmTransport(st.rank, st.size, st.slotBytes, spin, st.mapping.release(), st.mapBytes));
}

std::unique_ptr<ShmTransport> ShmTransport::create(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int rank, int size, Config config,
                                                   std::string* whyNot) {
  return Setup::begin(store, rank, size, config)->finish(whyNot);
}

ShmTransport::ShmTransport(int rank, int size, size_t slotBytes, int spinMicros, void* base,
                           size_t mapBytes)
    : rank_(rank),
      size_(size),
      slotBytes_(slotBytes),
      spinMicros_(spinMicros),
      base_(base),
      mapBytes_(mapBytes) {}

ShmTransport::~ShmTransport() {
  depart();
  ::munmap(base_, mapBytes_);
}

void ShmTransport::depart() {
  auto& me = control(rank_);
  if (me.departed.exchange(1, std::memory_order_seq_cst) == 0) futexWakeAll(&me.arrived);
}

ShmTransport::RankControl& ShmTransport::control(int rank) const {
  return reinterpret_cast<RankControl*>(base_)[rank];
}

uint8_t* ShmTransport::slot(int rank, int parity) const {
  const size_t controlBytes = roundUp(sizeof(RankControl) * size_, kPage);
  return static_cast<uint8_t*>(base_) + controlBytes +
         (static_cast<size_t>(rank) * 2 + parity) * slotBytes_;
}

void ShmTransport::throwIfBroken(const char* op) const {
  if (!brokenBy_.empty()) {
    C10_THROW_ERROR(DistBackendError,
                    std::string("xcomm shm: ") + op +
                        ": the group is broken by an earlier failure: " + brokenBy_);
  }
}

void ShmTransport::prepareWrite(std::chrono::steady_clock::time_point deadline, const char* op) {
  throwIfBroken(op);
  if (allReached_ == arrivals_) return;
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) waitFor(r, arrivals_, deadline, op);
  }
  allReached_ = arrivals_;
}

void ShmTransport::publishDescriptor(std::chrono::steady_clock::time_point deadline, const char* op,
                                     Descriptor descriptor) {
  prepareWrite(deadline, op);
  auto& me = control(rank_);
  const uint32_t next = (arrivals_ + 1) & 1;
  me.what[next] = descriptor.what;
  me.bytes[next] = descriptor.bytes;
}

ShmTransport::Descriptor ShmTransport::descriptorOf(int rank) const {
  const auto& ctl = control(rank);
  const uint32_t i = arrivals_ & 1;
  return {ctl.what[i], ctl.bytes[i]};
}

void ShmTransport::fail(std::string message) {
  brokenBy_ = message;
  C10_THROW_ERROR(DistBackendError, message);
}

void ShmTransport::arrive() {
  const uint32_t target = ++arrivals_;
  auto& me = control(rank_);
  // seq_cst store then load of `sleepers`, against the sleeper's increment
  // then load of `arrived`: one of the two sides sees the other.
  me.arrived.store(target, std::memory_order_seq_cst);
  if (me.sleepers.load(std::memory_order_seq_cst) != 0) futexWakeAll(&me.arrived);
}

void ShmTransport::barrier(std::chrono::steady_clock::time_point deadline, const char* op) {
  throwIfBroken(op);
  arrive();
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) waitFor(r, arrivals_, deadline, op);
  }
  allReached_ = arrivals_;
}

void ShmTransport::arriveAndWaitForRoot(int root, std::chrono::steady_clock::time_point deadline,
                                        const char* op) {
  throwIfBroken(op);
  arrive();
  if (rank_ != root) waitFor(root, arrivals_, deadline, op);
}

void ShmTransport::waitFor(int peer, uint32_t target,
                           std::chrono::steady_clock::time_point deadline, const char* op) {
  auto& ctl = control(peer);
  if (reached(ctl.arrived.load(std::memory_order_acquire), target)) return;
  using Clock = std::chrono::steady_clock;
  // Spin on the word for a few microseconds, then keep polling but yield the
  // core between polls (a descheduled peer may need it), then sleep.
  const auto start = Clock::now();
  const auto pureUntil = start + std::chrono::microseconds(std::min(spinMicros_, kPureSpinMicros));
  const auto spinUntil = start + std::chrono::microseconds(spinMicros_);
  for (int i = 0;; ++i) {
    if (reached(ctl.arrived.load(std::memory_order_acquire), target)) return;
    if ((i & 63) != 63) {
      cpuRelax();
      continue;
    }
    const auto now = Clock::now();
    if (now >= spinUntil) break;
    if (now >= pureUntil) sched_yield();
  }
  auto nextLivenessCheck = Clock::now() + kSleepSlice;
  while (true) {
    ctl.sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = ctl.arrived.load(std::memory_order_seq_cst);
    if (!reached(seen, target) && ctl.departed.load(std::memory_order_seq_cst) == 0) {
      futexWait(&ctl.arrived, seen, kSleepSlice);
    }
    ctl.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(ctl.arrived.load(std::memory_order_acquire), target)) return;
    // A peer that made its arrival and then left is no failure: its arrival
    // was written before its mark, so the check above saw it.
    if (ctl.departed.load(std::memory_order_acquire) != 0) {
      fail(std::string("xcomm shm: ") + op + " failed: " + describePeer(peer) +
           " left the group (it shut down, aborted or destroyed its process group) before "
           "reaching this collective");
    }
    if (aborted_.load()) {
      fail(std::string("xcomm shm: ") + op + " was aborted (the process group was aborted)");
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      fail(std::string("xcomm shm: ") + op + " timed out waiting for " + describePeer(peer) +
           "; it has not reached the collective. Raise the process group's timeout if it is "
           "merely slow.");
    }
    if (now >= nextLivenessCheck) {
      nextLivenessCheck = now + kSleepSlice;
      // A peer that arrived and then exited (its part done) is no failure:
      // its arrival was written before it exited, so look once more.
      if (!processAlive(ctl.pid, ctl.startTime) &&
          !reached(ctl.arrived.load(std::memory_order_acquire), target)) {
        fail(std::string("xcomm shm: ") + op + " failed: " + describePeer(peer) + " died");
      }
    }
  }
}

std::string ShmTransport::describePeer(int peer) const {
  const RankControl& ctl = control(peer);
  return "rank " + std::to_string(ctl.groupRank) + " (pid " + std::to_string(ctl.pid) + ")";
}

}  // namespace xcomm
