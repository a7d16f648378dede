#pragma once
// This process's host identity: two processes with equal identities can share
// memory (same kernel, /dev/shm and pid space). It is the hostname, the
// kernel's boot id, the inodes of the net, IPC and PID namespaces, the device
// and inode of /dev/shm, and XCOMM_SHM_HOST_TAG (which splits one machine
// into logical hosts, for tests). Two network namespaces on one machine (an
// emulated cluster's nodes) are different hosts.
#include <string>

namespace xcomm {

std::string hostIdentity();

}  // namespace xcomm
