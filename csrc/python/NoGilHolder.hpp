#pragma once
// The pybind11 holder of xcomm's backend classes: an intrusive_ptr that lets
// go of the GIL while it drops its reference.
//
// A backend's destructor stops and joins its threads (the shm worker, the
// completion pool, the int8 worker). Those threads may need the GIL: the last
// reference to a tensor that has a Python object is dropped under the GIL
// (torch 2.14's TensorImpl::decref_pyobject), and a future callback may be
// Python. Since torch 2.14 a c10d::Backend is owned through its Python object
// (PyObjectSlot), so ~ProcessGroup destroys it from that object's dealloc,
// with the GIL held: joining there waits for a thread that waits for the GIL
// (issue 16). torch binds its own backends with such a holder for the same
// reason.
#include <torch/csrc/utils/pybind.h>

namespace xcomm::python {

template <typename T>
class NoGilHolder {
 public:
  NoGilHolder() = default;
  NoGilHolder(const NoGilHolder&) = default;
  NoGilHolder(NoGilHolder&&) noexcept = default;
  NoGilHolder& operator=(const NoGilHolder&) = default;
  NoGilHolder& operator=(NoGilHolder&&) noexcept = default;
  // NOLINTNEXTLINE(google-explicit-constructor): pybind11 converts returned intrusive_ptrs
  NoGilHolder(c10::intrusive_ptr<T> impl) : impl_(std::move(impl)) {}
  explicit NoGilHolder(T* impl) : impl_(c10::intrusive_ptr<T>::unsafe_steal_from_new(impl)) {}

  ~NoGilHolder() {
    if (impl_ && PyGILState_Check()) {
      pybind11::gil_scoped_release noGil;
      impl_.reset();
    }
  }

  T* get() const noexcept { return impl_.get(); }
  T& operator*() const noexcept { return *impl_; }
  T* operator->() const noexcept { return impl_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(impl_); }

 private:
  // The only member: pybind11 copies a returned c10::intrusive_ptr<T> into
  // this holder as if it were one (the layout is the same).
  c10::intrusive_ptr<T> impl_;
};

}  // namespace xcomm::python

PYBIND11_DECLARE_HOLDER_TYPE(T, ::xcomm::python::NoGilHolder<T>, true);
