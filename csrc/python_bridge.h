// What the two Python-facing kernels (autograd.cpp, launch.cpp) share: owning a Python
// reference, re-raising a Python error through C++, an argument as a Python object,
// and a kernel registered at run time for one op and dispatch key.
#pragma once

#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>

#include "text.h"

#include <memory>
#include <string>
#include <vector>

namespace lycoris {

// The Python error that is set, thrown as torch's python_error (the caller gets it back unchanged).
[[noreturn]] inline void raise_python_error() {
  python_error err;
  err.persist();
  throw std::move(err);
}

// Owns one Python reference; a null one means a Python error is set.
struct PyRef {
  PyObject* p;
  explicit PyRef(PyObject* o) : p(o) {
    if (!p) raise_python_error();
  }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() { Py_XDECREF(p); }
};

// Per argument of a schema: is it a ScalarType (an int in the IValue, a torch.dtype in Python)?
inline std::vector<bool> dtype_arguments(const c10::FunctionSchema& schema) {
  std::vector<bool> out;
  for (const auto& a : schema.arguments()) {
    auto type = a.real_type();  // type() says int for a ScalarType
    if (type->kind() == c10::TypeKind::OptionalType) type = type->castRaw<c10::OptionalType>()->getElementType();
    out.push_back(type->kind() == c10::TypeKind::ScalarTypeType);
  }
  return out;
}

// A non-tensor argument as a new Python reference (a tensor one: THPVariable_Wrap).
inline PyObject* scalar_to_python(const c10::IValue& v, bool is_dtype) {
  if (v.isNone()) Py_RETURN_NONE;
  if (is_dtype && v.isInt()) {
    PyObject* d = reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(v.toInt())));
    Py_INCREF(d);
    return d;
  }
  if (v.isDouble()) return PyFloat_FromDouble(v.toDouble());
  if (v.isBool()) return PyBool_FromLong(v.toBool());
  if (v.isInt()) return PyLong_FromLongLong(v.toInt());
  if (v.isString()) return PyUnicode_FromString(v.toStringRef().c_str());
  if (v.isIntList()) {
    auto list = v.toIntList();
    PyObject* out = PyList_New(list.size());
    for (size_t i = 0; i < list.size(); ++i) PyList_SET_ITEM(out, i, PyLong_FromLongLong(list.get(i)));
    return out;
  }
  LYCORIS_CHECK(false, "lycoris: unsupported argument kind ", v.tagKind());
}

// A registration check: a Python ValueError through pybind11's own exception type, the
// message built without streams (text.h).
#define LYCORIS_REGISTRATION_CHECK(cond, ...) \
  do {                                         \
    if (!(cond)) throw pybind11::value_error(::lycoris::text(__VA_ARGS__)); \
  } while (0)

// A registration function bound with pybind11, a c10::Error from libtorch (an unknown
// op name) raised as a Python ValueError like its own checks.
template <class... Args>
auto value_errors(void (*f)(Args...)) {
  return [f](Args... args) {
    try {
      f(std::forward<Args>(args)...);
    } catch (const c10::Error& e) {
      throw pybind11::value_error(e.what_without_backtrace());
    }
  };
}

// Registers `kernel` for `qualname` ("namespace::op") and `key`; the registration lives
// as long as the process (the libraries are kept here).
inline void register_kernel(const std::string& qualname, c10::DispatchKey key, torch::CppFunction kernel) {
  static std::vector<std::unique_ptr<torch::Library>> libraries;
  auto sep = qualname.find("::");
  LYCORIS_REGISTRATION_CHECK(sep != std::string::npos, "qualname must be 'namespace::op', got ", qualname);
  auto lib = std::make_unique<torch::Library>(torch::Library::FRAGMENT, qualname.substr(0, sep), std::nullopt,
                                              __FILE__, __LINE__);
  lib->impl(qualname.substr(sep + 2).c_str(), torch::dispatch(key, std::move(kernel)));
  libraries.push_back(std::move(lib));
}

}  // namespace lycoris
