// What the serving benchmarks (`mlarun bench serve`, `mlarun bench
// rebalance`) share to drive a coordinator over gRPC: an in-process target
// (a Coordinator on 127.0.0.1:0 and RunSimWorker's simulated groups), the
// GetStats and Health calls, and one streaming Generate call, verified and
// timed on the client.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/block_size.h"
#include "base/status.h"
#include "bench/workload.h"
#include "mlarun.grpc.pb.h"
#include "serving/coordinator/coordinator.h"
#include "serving/security/security.h"
#include "serving/sim/sim_worker.h"

namespace mlarun {
namespace serve_bench {

using Clock = std::chrono::steady_clock;

// The simulated groups' vocabulary and block size: the tiny model's
// vocabulary (configs/models/tiny.yaml), so the same prompts are valid
// against a real deployment of it, and the engine's default block size.
constexpr int64_t kSimVocabSize = 512;
constexpr int64_t kSimBlockSize = kDefaultBlockSize;
constexpr double kCallTimeout_s = 120;  // one Generate call, queueing included
constexpr double kStartTimeout_s = 60;  // every group registered
// The name of the thread InProcessTarget runs RunSimWorker on; the groups'
// threads inherit it, so their CPU time can be told apart by thread.
constexpr char kSimThreadName[] = "sb-sim";

double MsSince(Clock::time_point a, Clock::time_point b);

// What the client saw of one request, and whether it passed verification.
struct Outcome {
  bool ok = false;
  std::string error;  // why not
  double ttft_ms = NAN, total_ms = NAN;
  std::vector<double> gaps_ms;  // between consecutive tokens
  int64_t tokens = 0;
  int64_t prompt_tokens = 0, prefix_hit_tokens = 0;
  double coordinator_total_ms = NAN;  // Finished.timings.total_ms: arrival to finished, inside the coordinator
  Clock::time_point finished_at{};    // when the Finished message arrived (CallGenerate)

  // A token arrived at `now`, for a request sent at `t0`; `last` is the
  // previous token's arrival (t0 before the first).
  void Token(Clock::time_point t0, Clock::time_point& last, Clock::time_point now);
};

// Whether token values are checked: against simulated groups they must be
// SimWorkerToken's (vocabulary kSimVocabSize); a real model's are only
// checked for count and order.
struct Expect {
  bool sim_tokens = false;
};

// "" when token `index` of `rq` is what `ex` expects, else what is wrong.
std::string CheckToken(const BenchRequest& rq, const Expect& ex, int64_t index, int64_t token, double logprob);

// The request's sampling: its seed and max_tokens, ignore_eos (every request
// makes exactly max_tokens tokens).
v1::SamplingParams Sampling(const BenchRequest& rq);

// Common end-of-request checks; `error` is the first problem seen so far.
// Sets o.ok and o.error.
void CheckEnd(const BenchRequest& rq, std::string error, bool finished, const std::string& finish_reason,
              int64_t completion_tokens, Outcome& o);

// One streaming Generate call through the coordinator, verified: every token
// in order (and with `ex.sim_tokens` the simulated group's), one Finished
// with finish_reason "length" and the counts of what arrived.
Outcome CallGenerate(v1::Mlarun::Stub& stub, const BenchRequest& rq, const Expect& ex,
                     const ClientSecurity& security = ClientSecurity{});

StatusOr<v1::GetStatsResponse> GetStats(v1::Mlarun::Stub& stub, const ClientSecurity& security = ClientSecurity{});

// Polls Health until at least `want` groups are connected; returns how many are.
StatusOr<int> WaitForGroups(v1::Mlarun::Stub& stub, int want, double timeout_s);

// `groups` simulated groups of kSimVocabSize and kSimBlockSize at
// `tokens_per_s` each (0: as fast as possible).
SimWorkerOptions SimOptions(int groups, double tokens_per_s, int64_t cache_blocks);

// A Coordinator on 127.0.0.1:0 and one RunSimWorker per simulated worker
// job (each of its own worker_id: a prefill job and a decode job, say),
// whose groups have all registered. Stop() (or the destructor) stops the
// groups, then the coordinator.
class InProcessTarget {
 public:
  // `co` as given but for its listen address (127.0.0.1:0).
  static StatusOr<std::unique_ptr<InProcessTarget>> Start(CoordinatorOptions co, std::vector<SimWorkerOptions> jobs);
  static StatusOr<std::unique_ptr<InProcessTarget>> Start(CoordinatorOptions co, SimWorkerOptions sim);
  static StatusOr<std::unique_ptr<InProcessTarget>> Start(RoutingPolicy policy, SimWorkerOptions sim);
  ~InProcessTarget() { Stop(); }
  std::string address() const { return coordinator_->address(); }
  void Stop();

 private:
  // One RunSimWorker on its own thread.
  struct Job {
    SimWorkerOptions options;
    std::thread thread;
    // Written by the job's group threads (whole lines, under their logger's
    // lock); read only after `thread` is joined.
    std::ostringstream log;
    int rc = 0;  // RunSimWorker's exit code; read after `thread` is joined
  };
  InProcessTarget() = default;
  std::unique_ptr<Coordinator> coordinator_;
  // RunSimWorker's stop flag (a signal-handler style plain flag it polls), shared by the jobs.
  std::atomic<bool> stop_{false};
  std::vector<std::unique_ptr<Job>> jobs_;
};

}  // namespace serve_bench
}  // namespace mlarun
