// `mlarun sim-worker` inside a test: RunSimWorker on its own thread, stopped
// and joined on destruction (or by Stop, which returns its exit code).
#pragma once

#include <atomic>
#include <sstream>
#include <string>
#include <thread>

#include "serving/sim/sim_worker.h"

namespace mlarun {

class SimWorkerThread {
 public:
  explicit SimWorkerThread(const SimWorkerOptions& o) : thread_([this, o] { rc_ = RunSimWorker(o, &stop_, log_); }) {}
  ~SimWorkerThread() { Stop(); }
  SimWorkerThread(const SimWorkerThread&) = delete;
  SimWorkerThread& operator=(const SimWorkerThread&) = delete;
  int Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    return rc_;
  }
  std::string log() const { return log_.str(); }

 private:
  std::atomic<bool> stop_{false};
  int rc_ = -1;
  std::ostringstream log_;
  std::thread thread_;
};

}  // namespace mlarun
