// The first error of several threads (an OpenMP loop's iterations): each
// iteration reports its Status, the loop's caller returns the first that was
// not OK. Thread-safe.
#pragma once

#include <mutex>

#include "base/status.h"

namespace mlarun {

class FirstError {
 public:
  void Set(const Status& s) {
    if (s.ok()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = s;
  }
  Status Get() {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

 private:
  std::mutex mu_;
  Status status_;  // GUARDED_BY(mu_)
};

}  // namespace mlarun
