// The build without CUDA kernels (no CUDA toolkit, or a CPU torch): the
// codecs see codecsBuilt() == false and never call the others.
#include <c10/util/Exception.h>

#include "compress/cuda/CudaCodecs.hpp"

namespace xcomm {
namespace cuda {
namespace {

[[noreturn]] void missing(const char* what) {
  TORCH_CHECK(false, "xcomm: ", what,
              " on a CUDA tensor needs xcomm built with its CUDA kernels (a CUDA torch and a "
              "CUDA toolkit at build time); this build has none");
}

}  // namespace

bool codecsBuilt() {
  return false;
}
void int8Encode(const at::Tensor&, const at::Tensor&, int64_t, int, int64_t, int64_t, int64_t,
                at::Tensor&) {
  missing("int8 encoding");
}
void int8Reduce(const at::Tensor&, int64_t, int64_t, float, const at::Tensor&, const at::Tensor&) {
  missing("int8 reduction");
}
void int8Decode(const at::Tensor&, int64_t, int64_t, int64_t, const at::Tensor&) {
  missing("int8 decoding");
}
void randomkPositions(uint64_t, int64_t, const at::Tensor&) {
  missing("random-k positions");
}
void addInto(const at::Tensor&, const at::Tensor&) {
  missing("error feedback");
}
void gatherPositions(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) {
  missing("random-k encoding");
}
void scatterPositions(const at::Tensor&, const at::Tensor&, float, const at::Tensor&) {
  missing("random-k decoding");
}
void topkEncode(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&) {
  missing("top-k encoding");
}
void topkDecode(const at::Tensor&, int64_t, float, const at::Tensor&) {
  missing("top-k decoding");
}

bool gramSchmidt(const at::Tensor&, double) {
  return false;  // the caller's ATen route
}
bool gramSchmidtBatch(const std::vector<at::Tensor>&, double, const at::Tensor&) {
  return false;
}

bool powersgdReconstruct(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&) {
  return false;  // the caller's ATen route
}

bool powersgdUnpackUncompressed(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, int64_t) {
  return false;  // the caller's ATen route
}

bool powersgdProject(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  return false;  // the caller's at::mm
}

bool powersgdProjectBack(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&) {
  return false;  // the caller's at::mm
}

}  // namespace cuda
}  // namespace xcomm
