// Maps kog::Error kinds to the Python classes of kog.errors (one hierarchy, defined in Python).
#include <pybind11/pybind11.h>

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
  }
  return "KogError";
}

}  // namespace

void bind_errors(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kog::Error& e) {
      py::object cls = py::module_::import("kog.errors").attr(python_class(e.kind()));
      PyErr_SetString(cls.ptr(), e.what());
    }
  });
}
