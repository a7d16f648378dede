#include "compress/kernels/CodecKernels.hpp"

#include <cstdlib>
#include <string>

#include <c10/util/Exception.h>

namespace xcomm {
namespace kernels {

// One table per instruction set, each from its own compile of CodecKernelsImpl.cpp.
namespace isa_default {
extern const CodecKernels kKernels;
}
#ifdef XCOMM_KERNELS_X86
namespace isa_avx2 {
extern const CodecKernels kKernels;
}
namespace isa_avx512 {
extern const CodecKernels kKernels;
}
#endif

namespace {

bool cpuHas(const std::string& isa) {
#ifdef XCOMM_KERNELS_X86
  __builtin_cpu_init();
  if (isa == "avx2") return __builtin_cpu_supports("avx2");
  if (isa == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
#endif
  return isa == "default";
}

const CodecKernels* tableFor(const std::string& isa) {
  if (isa == "default") return &isa_default::kKernels;
#ifdef XCOMM_KERNELS_X86
  if (isa == "avx2") return &isa_avx2::kKernels;
  if (isa == "avx512") return &isa_avx512::kKernels;
#endif
  return nullptr;
}

const CodecKernels& choose() {
  static const char* kOrder[] = {"avx512", "avx2", "default"};
  const char* cap = std::getenv("XCOMM_CPU_CAPABILITY");
  bool allowed = cap == nullptr || *cap == '\0';
  if (!allowed) {
    const std::string want(cap);
    TORCH_CHECK_VALUE(want == "default" || want == "avx2" || want == "avx512",
                      "xcomm: XCOMM_CPU_CAPABILITY must be one of default, avx2, avx512; got '",
                      want, "'");
  }
  for (const char* isa : kOrder) {
    allowed = allowed || std::string(isa) == cap;
    if (allowed && cpuHas(isa) && tableFor(isa)) return *tableFor(isa);
  }
  return isa_default::kKernels;
}

}  // namespace

const CodecKernels& codecKernels() {
  static const CodecKernels& chosen = choose();
  return chosen;
}

const CodecKernels* codecKernelsFor(const char* isa) {
  const std::string name(isa);
  return cpuHas(name) ? tableFor(name) : nullptr;
}

}  // namespace kernels
}  // namespace xcomm
