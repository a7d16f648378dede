// Errors as a user reads them: what a transport or an inner group raises is
// named (the op, or the group being set up, and the likely cause), while an
// error that already names its cause passes unchanged.
#include <stdexcept>

#include "common/ErrorText.hpp"

// After torch's headers: c10 defines a CHECK macro that must not replace Catch's.
#include <catch2/catch.hpp>

using Catch::Contains;

namespace {

// What `fail()` throws, caught.
template <typename Fail>
std::exception_ptr thrownBy(Fail fail) {
  try {
    fail();
  } catch (...) {
    return std::current_exception();
  }
  return {};
}

template <typename Error>
std::exception_ptr raised(const std::string& text) {
  return thrownBy([&] { throw Error(text); });
}

std::exception_ptr raisedC10(const std::string& text) {
  return thrownBy([&] { TORCH_CHECK(false, text); });
}

std::exception_ptr raisedValueError(const std::string& text) {
  return thrownBy([&] { TORCH_CHECK_VALUE(false, text); });
}

}  // namespace

TEST_CASE("a transport's bare error names the op; a typed one passes unchanged", "[errors]") {
  auto named =
      xcomm::namedTransportFailure("all_reduce", "Gloo", raisedC10("Operation timed out!"));
  CHECK_THROWS_AS(std::rethrow_exception(named), c10::DistBackendError);
  CHECK_THROWS_WITH(
      std::rethrow_exception(named),
      Contains("xcomm.all_reduce failed in Gloo (a peer died") && Contains("Operation timed out!"));
  auto socket = xcomm::namedTransportFailure("recv", "its transport",
                                             raised<std::runtime_error>("Connection reset"));
  CHECK_THROWS_AS(std::rethrow_exception(socket), c10::DistBackendError);

  auto typed = raisedValueError("ranks disagree");
  CHECK(xcomm::namedTransportFailure("all_reduce", "Gloo", typed) == typed);
}

TEST_CASE("a set-up that fails in an inner group names it, the rank and the cause", "[errors]") {
  const auto timeout = std::chrono::milliseconds(2000);
  // A Python factory's error: its text, then pybind's traceback.
  auto gloo = raised<std::runtime_error>(
      "RuntimeError: Gloo connectFullMesh failed with [pair.h:311] Connect timeout [none]\n\n"
      "At:\n  backend.py(109): _gloo\n");
  CHECK_THROWS_AS(xcomm::rethrowSetUpFailure("its Gloo group xcomm/gloo", 1, 2, timeout, gloo),
                  c10::DistBackendError);
  try {
    xcomm::rethrowSetUpFailure("its Gloo group xcomm/gloo", 1, 2, timeout, gloo);
  } catch (const c10::DistBackendError& e) {
    const std::string text = e.what_without_backtrace();
    CHECK_THAT(text, Contains("xcomm: setting up the group failed in its Gloo group xcomm/gloo "
                              "on rank 1 of 2 (a peer died"));
    CHECK_THAT(text, Contains("timeout of 2000 ms): RuntimeError: Gloo connectFullMesh failed"));
    CHECK_THAT(text, !Contains("At:"));
  }
  CHECK_THROWS_AS(xcomm::rethrowSetUpFailure("its NCCL group xcomm/nccl", 0, 2, timeout,
                                             raisedC10("NCCL error")),
                  c10::DistBackendError);

  // The store's own error already says what happened to the connection.
  std::exception_ptr store;
  try {
    C10_THROW_ERROR(DistNetworkError, "Failed to recv, got 0 bytes");
  } catch (...) {
    store = std::current_exception();
  }
  CHECK_THROWS_AS(xcomm::rethrowSetUpFailure("its Gloo group xcomm/gloo", 1, 2, timeout, store),
                  c10::DistNetworkError);
  CHECK_THROWS_WITH(xcomm::rethrowSetUpFailure("its Gloo group xcomm/gloo", 1, 2, timeout, store),
                    !Contains("setting up the group"));
}
