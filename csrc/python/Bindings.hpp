#pragma once
// Each layer binds its own classes in its own file under csrc/python/ and
// registers the binding function here, so adding a binding edits no shared
// file:
//
//   static void bindCast(pybind11::module_& m) { ... }
//   XCOMM_REGISTER_BINDINGS(cast, bindCast);
//
// Module.cpp runs them, in name order, after the backend classes are bound.
#include <torch/csrc/utils/pybind.h>

namespace xcomm::python {

using BindFn = void (*)(pybind11::module_&);

struct BindingRegistrar {
  BindingRegistrar(const char* name, BindFn fn);
};

void bindAll(pybind11::module_& m);

}  // namespace xcomm::python

#define XCOMM_REGISTER_BINDINGS(name, fn) \
  static ::xcomm::python::BindingRegistrar xcommBindingRegistrar_##name(#name, fn)
