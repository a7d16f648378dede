#pragma once
// The text of an error as a user should read it.
#include <chrono>
#include <exception>
#include <string>
#include <typeinfo>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

namespace xcomm {

// "torch.float32"-style dtype names, as users write them.
inline std::string dtypeName(at::ScalarType dtype) {
  return "torch." + std::string(c10::getDtypeNames(dtype).first);
}

// An error's message, without the C++ stack c10 appends to what().
inline std::string messageOf(const std::exception& e) {
  if (const auto* c10Error = dynamic_cast<const c10::Error*>(&e)) {
    return c10Error->what_without_backtrace();
  }
  return e.what();
}

// What happened to a peer whose message did not arrive within `limit`, in
// words: a wait that failed well before the limit ended with the connection
// (the peer died or left, and the transport said so), one that lasted the
// limit with silence. "rank 1 did not take part within 3000 ms" / "the
// connection to rank 1 was lost after 23 ms (of a 3000 ms limit)".
inline std::string peerFailure(const std::string& memberName, int peer,
                               std::chrono::milliseconds elapsed, std::chrono::milliseconds limit) {
  const std::string who = memberName + " " + std::to_string(peer);
  if (elapsed.count() * 10 < limit.count() * 9) {
    return "the connection to " + who + " was lost after " + std::to_string(elapsed.count()) +
           " ms (of a " + std::to_string(limit.count()) + " ms limit)";
  }
  return who + " did not take part within " + std::to_string(limit.count()) + " ms";
}

// What a transport raised for one of xcomm's ops, as an error that names the
// op: Gloo's own text (a socket's read error, "Operation timed out!") names
// neither the op nor that a peer is the likely cause: "xcomm.all_reduce failed
// in Gloo (a peer died, ...): <Gloo's text>". A typed c10 error (a
// DistBackendError, a ValueError from the ranks' agreement) already names its
// cause and passes unchanged, as does anything that is not a std::exception.
inline std::exception_ptr namedTransportFailure(const std::string& op, const std::string& where,
                                                const std::exception_ptr& raised) {
  auto named = [&](const std::exception& e) -> std::exception_ptr {
    try {
      C10_THROW_ERROR(
          DistBackendError,
          "xcomm." + op + " failed in " + where +
              " (a peer died, left, hangs, or was slower than the op's timeout): " + messageOf(e));
    } catch (...) {
      return std::current_exception();
    }
    return raised;  // not reached
  };
  try {
    std::rethrow_exception(raised);
  } catch (const c10::Error& e) {
    // A bare c10::Error is a transport's (torch's "Operation timed out!").
    return typeid(e) == typeid(c10::Error) ? named(e) : raised;
  } catch (const std::exception& e) {
    return named(e);
  } catch (...) {
    return raised;
  }
}

// A group's set-up failing in one of its inner groups (Gloo's connect, a
// store wait, NCCL's init), as an error that says so: Gloo's own text
// ("Connect timeout [none]") names neither the group nor that a peer is the
// likely cause. Typed c10 errors pass unchanged, as in namedTransportFailure.
[[noreturn]] inline void rethrowSetUpFailure(const std::string& innerGroup, int rank, int size,
                                             std::chrono::milliseconds timeout,
                                             const std::exception_ptr& raised) {
  auto named = [&](const std::exception& e) {
    std::string text = messageOf(e);
    // A Python factory's error carries its traceback ("\n\nAt:\n  file(line)"):
    // the text is what a user reads.
    if (const auto at = text.find("\n\nAt:\n"); at != std::string::npos) text.resize(at);
    C10_THROW_ERROR(DistBackendError,
                    "xcomm: setting up the group failed in " + innerGroup + " on rank " +
                        std::to_string(rank) + " of " + std::to_string(size) +
                        " (a peer died, left, or did not reach the set-up within the group "
                        "timeout of " +
                        std::to_string(timeout.count()) + " ms): " + text);
  };
  try {
    std::rethrow_exception(raised);
  } catch (const c10::Error& e) {
    if (typeid(e) != typeid(c10::Error)) throw;
    named(e);
  } catch (const std::exception& e) {
    named(e);
  }
  std::rethrow_exception(raised);  // not a std::exception: as it came
}

}  // namespace xcomm
