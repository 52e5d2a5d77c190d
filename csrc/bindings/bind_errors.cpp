// Maps kog::Error kinds to the Python classes of kog.errors (one hierarchy, defined in Python).
#include <pybind11/pybind11.h>

#include <string>

#include "common/errors.h"

namespace py = pybind11;

namespace {

const char* python_class(kog::ErrorKind kind) {
  switch (kind) {
    case kog::ErrorKind::kInvalidArgument: return "InvalidRequest";
    case kog::ErrorKind::kKVCacheFull: return "KVCacheFull";
    case kog::ErrorKind::kUnknownSequence: return "UnknownSequence";
    case kog::ErrorKind::kInvalidOperation: return "InvalidOperation";
    case kog::ErrorKind::kBackend: return "BackendError";
    case kog::ErrorKind::kInternal: return "InternalError";
    case kog::ErrorKind::kTransport: return "TransportError";
  }
  return "KogError";
}

}  // namespace

void bind_errors(py::module_& m) {
  // Test hook: raises what a failed KOG_CHECK ("check") or KOG_ASSERT ("assert") raises, so
  // tests/cpu/test_error_kinds.py checks the C++ -> Python -> HTTP mapping of both.
  m.def("raise_native_error_for_test", [](const std::string& which) {
    KOG_CHECK(which != "check", "a bad argument (KOG_CHECK)");
    KOG_ASSERT(which != "assert", "a broken invariant (KOG_ASSERT)");
  }, py::arg("which"));
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kog::Error& e) {
      py::object cls = py::module_::import("kog.errors").attr(python_class(e.kind()));
      PyErr_SetString(cls.ptr(), e.what());
    }
  });
}
