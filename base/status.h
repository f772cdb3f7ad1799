// Status and StatusOr: the error convention of every mlarun library layer.
//
// Library code never exits or throws on a recoverable error; it returns a Status
// naming what was wrong. Codes follow the gRPC canonical codes so the
// coordinator can forward them unchanged. Only launcher/ turns a Status into an
// exit code.
#pragma once

#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace mlarun {

// Values are frozen: they travel over the wire later.
enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status Ok() { return Status(); }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  // Empty for OK.
  const std::string& message() const;
  // "INVALID_ARGUMENT: message", or "OK".
  std::string ToString() const;

  // Prepends context: "context: message". No-op on OK.
  Status WithContext(std::string_view context) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  // nullptr means OK, so the common path costs one pointer.
  std::shared_ptr<const Rep> rep_;
};

std::ostream& operator<<(std::ostream& os, const Status& s);

namespace internal {
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace internal

template <typename... Args>
Status InvalidArgumentError(const Args&... args) {
  return Status(StatusCode::kInvalidArgument, internal::StrCat(args...));
}
template <typename... Args>
Status ResourceExhaustedError(const Args&... args) {
  return Status(StatusCode::kResourceExhausted, internal::StrCat(args...));
}
template <typename... Args>
Status NotFoundError(const Args&... args) {
  return Status(StatusCode::kNotFound, internal::StrCat(args...));
}
template <typename... Args>
Status FailedPreconditionError(const Args&... args) {
  return Status(StatusCode::kFailedPrecondition, internal::StrCat(args...));
}
template <typename... Args>
Status OutOfRangeError(const Args&... args) {
  return Status(StatusCode::kOutOfRange, internal::StrCat(args...));
}
template <typename... Args>
Status UnimplementedError(const Args&... args) {
  return Status(StatusCode::kUnimplemented, internal::StrCat(args...));
}
template <typename... Args>
Status InternalError(const Args&... args) {
  return Status(StatusCode::kInternal, internal::StrCat(args...));
}
template <typename... Args>
Status UnavailableError(const Args&... args) {
  return Status(StatusCode::kUnavailable, internal::StrCat(args...));
}

// A value or the Status explaining why there is none.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(const Status& status) : v_(status) {  // NOLINT: implicit by design
    if (status.ok()) v_ = InternalError("StatusOr constructed from OK status without a value");
  }
  StatusOr(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return v_.index() == 1; }
  Status status() const { return ok() ? Status::Ok() : std::get<0>(v_); }

  // REQUIRES: ok().
  T& value() & { return std::get<1>(v_); }
  const T& value() const& { return std::get<1>(v_); }
  T&& value() && { return std::get<1>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<Status, T> v_;
};

}  // namespace mlarun

#define MLARUN_STATUS_CONCAT_INNER(a, b) a##b
#define MLARUN_STATUS_CONCAT(a, b) MLARUN_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` is not OK.
#define MLARUN_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::mlarun::Status mlarun_status_ = (expr);        \
    if (!mlarun_status_.ok()) return mlarun_status_; \
  } while (0)

// `lhs = value of expr`, or returns its Status.
#define MLARUN_ASSIGN_OR_RETURN(lhs, expr) \
  MLARUN_ASSIGN_OR_RETURN_IMPL(MLARUN_STATUS_CONCAT(mlarun_statusor_, __LINE__), lhs, expr)
#define MLARUN_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
