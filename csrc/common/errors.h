// Typed errors of the native core. Each maps to one Python class in kog.errors
// (csrc/bindings/bind_errors.cpp); a throw never leaves a structure half-changed.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace kog {

enum class ErrorKind {
  kInvalidArgument,   // -> kog.InvalidRequest (a ValueError)
  kKVCacheFull,       // -> kog.KVCacheFull
  kUnknownSequence,   // -> kog.UnknownSequence (a KeyError)
  kInvalidOperation,  // -> kog.InvalidOperation
  kBackend,           // -> kog.BackendError (a GPU runtime failure, a missing backend)
  kInternal,          // -> kog.errors.InternalError: a broken invariant of Kog itself (HTTP 500)
  kTransport,         // -> kog.errors.TransportError: a tensor-parallel peer died or hung
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  append(os, args...);
  return os.str();
}
}  // namespace detail

template <typename... Args>
[[noreturn]] void throw_error(ErrorKind kind, const Args&... args) {
  throw Error(kind, detail::str_cat(args...));
}

}  // namespace kog

// KOG_CHECK(cond, "message ", value, ...) throws kog::Error(kInvalidArgument): the caller passed
// a bad argument (-> kog.InvalidRequest, HTTP 400). Use it for what a caller can get wrong.
#define KOG_CHECK(cond, ...)                                                            \
  do {                                                                                  \
    if (!(cond)) ::kog::throw_error(::kog::ErrorKind::kInvalidArgument, __VA_ARGS__);   \
  } while (0)

#define KOG_CHECK_KIND(cond, kind, ...)                                                 \
  do {                                                                                  \
    if (!(cond)) ::kog::throw_error(::kog::ErrorKind::kind, __VA_ARGS__);               \
  } while (0)

// KOG_ASSERT(cond, "message ", value, ...) throws kog::Error(kInternal): an invariant Kog itself
// maintains is broken (a bug, not a bad request: -> kog.errors.InternalError, HTTP 500). Checked
// in release builds too; use it for what no caller input can cause.
#define KOG_ASSERT(cond, ...)                                                                   \
  do {                                                                                          \
    if (!(cond)) ::kog::throw_error(::kog::ErrorKind::kInternal, "internal error: ", __VA_ARGS__); \
  } while (0)
