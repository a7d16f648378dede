#include "transport/HostIdentity.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

namespace xcomm {
namespace {

std::string firstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "?";
  return line;
}

std::string namespaceInode(const std::string& kind) {
  struct stat st {};
  if (::stat(("/proc/self/ns/" + kind).c_str(), &st) != 0) return kind + ":?";
  return kind + ":" + std::to_string(st.st_ino);
}

// The tmpfs behind /dev/shm (not the mount namespace: `ip netns exec` gives
// every process its own mount namespace over the same /dev/shm).
std::string shmMount() {
  struct stat st {};
  if (::stat("/dev/shm", &st) != 0) return "shm:?";
  return "shm:" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
}

}  // namespace

std::string hostIdentity() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) name[0] = '?';
  const char* tag = std::getenv("XCOMM_SHM_HOST_TAG");
  std::string id = name;
  id += "|" + firstLine("/proc/sys/kernel/random/boot_id");
  for (const char* kind : {"net", "ipc", "pid"}) id += "|" + namespaceInode(kind);
  id += "|" + shmMount();
  id += "|" + std::string(tag ? tag : "");
  return id;
}

}  // namespace xcomm
