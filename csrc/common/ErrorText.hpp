#pragma once
// The text of an error as a user should read it.
#include <exception>
#include <string>

#include <c10/util/Exception.h>

namespace xcomm {

// An error's message, without the C++ stack c10 appends to what().
inline std::string messageOf(const std::exception& e) {
  if (const auto* c10Error = dynamic_cast<const c10::Error*>(&e)) {
    return c10Error->what_without_backtrace();
  }
  return e.what();
}

}  // namespace xcomm
