// The open-loop benchmarks' shared parts (open_loop.h).
//
// Threads: DriveOpenLoop's caller sends each request at its arrival time to
// a pool of client threads that grows whenever none is idle, so no request
// waits for a thread (open loop); each client thread runs one streaming
// Generate at a time with a blocking stub. A sampler thread polls GetStats.
#include "bench/open_loop.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <iomanip>
#include <latch>
#include <mutex>
#include <ostream>
#include <thread>

#include "bench/timing.h"
#include "serving/client/grpc_util.h"

namespace mlarun {
namespace serve_bench {

namespace {

using Json = nlohmann::json;

constexpr int kConnections = 8;

// Runs each job on an idle thread, or on a new one when none is idle, so a
// job never waits for another to end. The destructor joins every thread
// once the jobs handed to it have run.
class ClientPool {
 public:
  ClientPool() = default;
  ClientPool(const ClientPool&) = delete;
  ClientPool& operator=(const ClientPool&) = delete;
  ~ClientPool() {
    {
      std::lock_guard lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  void Run(std::function<void()> job) {
    std::lock_guard lock(mu_);
    // Each queued job will be taken by one idle thread: the idle threads not
    // yet claimed are idle_ - jobs_.size().
    const bool spawn = idle_ <= jobs_.size();
    jobs_.push_back(std::move(job));
    if (spawn) {
      threads_.emplace_back([this] { Loop(); });
    } else {
      cv_.notify_one();
    }
  }
  size_t threads() const { return threads_.size(); }  // from the thread that calls Run

 private:
  void Loop() {
    std::unique_lock lock(mu_);
    while (true) {
      ++idle_;
      cv_.wait(lock, [this] { return !jobs_.empty() || closed_; });
      --idle_;
      if (jobs_.empty()) return;  // closed
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  size_t idle_ = 0;
  bool closed_ = false;
  std::vector<std::thread> threads_;  // touched by Run's caller and the destructor only
};

// "median" or "median (min..max)" cells are this wide.
int CellWidth(int rounds) { return rounds > 1 ? 24 : 12; }

int SideWidth(const PairTable& t) {
  size_t w = std::max(t.side_key.size(), t.ratio.size());
  for (const std::string& s : t.sides) w = std::max(w, s.size());
  return static_cast<int>(w);
}

}  // namespace

StatusOr<OpenLoopLoad> DriveOpenLoop(const std::string& address, const std::vector<TimedRequest>& work,
                                     const StatsSampler& sample, std::chrono::milliseconds sample_period) {
  const size_t n = work.size();
  std::vector<std::unique_ptr<v1::Mlarun::Stub>> stubs;
  for (int c = 0; c < kConnections; ++c) {
    auto channel = client_internal::MakeChannel(address);
    // Connect before the clock starts, so no request pays the handshake.
    if (!client_internal::AwaitConnection(*channel, 10))
      return UnavailableError("cannot connect to the coordinator at ", address);
    stubs.push_back(v1::Mlarun::NewStub(channel));
  }
  auto control = v1::Mlarun::NewStub(client_internal::MakeChannel(address));
  OpenLoopLoad load;
  MLARUN_ASSIGN_OR_RETURN(load.before, GetStats(*control));
  load.outcomes.resize(n);
  load.sent_at.resize(n);
  std::atomic<bool> sampling{sample != nullptr};
  std::thread sampler([&] {
    while (sampling.load()) {
      auto s = GetStats(*control);
      if (s.ok()) sample(*s);
      std::this_thread::sleep_for(sample_period);
    }
  });
  std::latch done(static_cast<std::ptrdiff_t>(n));
  {
    ClientPool pool;
    const Clock::time_point t0 = Clock::now();
    for (size_t i = 0; i < n; ++i) {
      const Clock::time_point due =
          t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(work[i].arrival_s));
      std::this_thread::sleep_until(due);
      load.max_late_ms = std::max(load.max_late_ms, MsSince(due, Clock::now()));
      pool.Run([&, i, stub = stubs[i % stubs.size()].get()] {
        load.sent_at[i] = Clock::now();
        load.outcomes[i] = CallGenerate(*stub, work[i].request, {.sim_tokens = true});
        done.count_down();
      });
    }
    load.client_threads = pool.threads();
    done.wait();
  }
  sampling = false;
  sampler.join();
  MLARUN_ASSIGN_OR_RETURN(load.after, GetStats(*control));
  return load;
}

LoadFigures SummarizeLoad(const OpenLoopLoad& load) {
  LoadFigures r;
  r.requests = static_cast<int64_t>(load.outcomes.size());
  std::vector<double> itl, ttft;
  Clock::time_point first = Clock::time_point::max(), last = Clock::time_point::min();
  for (size_t i = 0; i < load.outcomes.size(); ++i) {
    const Outcome& o = load.outcomes[i];
    first = std::min(first, load.sent_at[i]);
    if (!o.ok) {
      ++r.failed;
      if (r.first_error.empty()) r.first_error = o.error;
      continue;
    }
    r.tokens += o.tokens;
    ttft.push_back(o.ttft_ms);
    itl.insert(itl.end(), o.gaps_ms.begin(), o.gaps_ms.end());
    last = std::max(last, o.finished_at);
  }
  const v1::CoordinatorStats &c0 = load.before.coordinator(), &c1 = load.after.coordinator();
  const int64_t received = c1.requests_received() - c0.requests_received();
  const int64_t completed = c1.requests_completed() - c0.requests_completed();
  // Exactly once: every request verified on the client, and the coordinator
  // (this load its only client) received and completed each once.
  r.verified = r.failed == 0 && received == r.requests && completed == r.requests;
  if (!r.verified && r.first_error.empty())
    r.first_error = internal::StrCat("the coordinator counted ", received, " received and ", completed,
                                     " completed for ", r.requests, " requests");
  if (r.failed < r.requests) {
    r.span_s = std::chrono::duration<double>(last - first).count();
    r.decode_tokens_per_s = static_cast<double>(r.tokens) / r.span_s;
  }
  r.itl_p50_ms = Percentile(itl, 50);
  r.itl_p99_ms = Percentile(itl, 99);
  r.ttft_p50_ms = Percentile(ttft, 50);
  r.ttft_p99_ms = Percentile(ttft, 99);
  r.migrated = c1.requests_migrated() - c0.requests_migrated();
  r.migrations_failed = c1.migrations_failed() - c0.migrations_failed();
  r.client_threads = static_cast<int64_t>(load.client_threads);
  r.max_dispatch_late_ms = load.max_late_ms;
  return r;
}

void AddFiguresJson(const LoadFigures& f, Json& j) {
  j["requests"] = f.requests;
  j["failed"] = f.failed;
  j["verified"] = f.verified;
  j["first_error"] = f.first_error.empty() ? Json(nullptr) : Json(f.first_error);
  j["tokens"] = f.tokens;
  j["span_s"] = OrNull(f.span_s);
  j["decode_tokens_per_s"] = OrNull(f.decode_tokens_per_s);
  j["itl_p50_ms"] = OrNull(f.itl_p50_ms);
  j["itl_p99_ms"] = OrNull(f.itl_p99_ms);
  j["ttft_p50_ms"] = OrNull(f.ttft_p50_ms);
  j["ttft_p99_ms"] = OrNull(f.ttft_p99_ms);
  j["requests_migrated"] = f.migrated;
  j["migrations_failed"] = f.migrations_failed;
  j["client_threads"] = f.client_threads;
  j["max_dispatch_late_ms"] = f.max_dispatch_late_ms;
}

Json LoopbackMachineJson() {
  return {{"cpu", CpuModel()},
          {"cores", std::thread::hardware_concurrency()},
          {"network", "loopback (127.0.0.1)"},
          {"load_average_1min_at_start", OrNull(LoadAverage())}};
}

std::string LoopbackMachineLine() {
  return internal::StrCat("in-process coordinator and simulated groups, over loopback (127.0.0.1); ", CpuModel(), ", ",
                          std::thread::hardware_concurrency(),
                          " cores shared by clients, coordinator and groups; load average ", Fmt(LoadAverage(), 1),
                          " at start; ", Today());
}

Spread SpreadOf(const std::vector<double>& v) {
  std::vector<double> finite;
  for (double x : v)
    if (std::isfinite(x)) finite.push_back(x);
  if (finite.empty()) return {};
  const auto [lo, hi] = std::minmax_element(finite.begin(), finite.end());
  return {.median = Median(finite), .min = *lo, .max = *hi};
}

Json ToJson(const Spread& s) { return {{"median", OrNull(s.median)}, {"min", OrNull(s.min)}, {"max", OrNull(s.max)}}; }

std::string Cell(const Spread& s, int precision, bool spread) {
  if (!spread || !std::isfinite(s.median)) return Fmt(s.median, precision);
  return Fmt(s.median, precision) + " (" + Fmt(s.min, precision) + ".." + Fmt(s.max, precision) + ")";
}

void PrintPairHeader(const PairTable& t, std::ostream& out) {
  out << "  " << std::setw(t.case_width) << t.case_header << "  " << std::left << std::setw(SideWidth(t)) << t.side_key
      << std::right << "  requests";
  for (const PairMetric& m : t.metrics) out << "  " << std::setw(CellWidth(t.rounds)) << m.header;
  out << "  verified\n";
}

void ReportPair(const PairTable& t, const std::string& case_label, const Json& fields, const std::vector<PairRun>& runs,
                std::ostream& out, Json& doc) {
  const bool spread = t.rounds > 1;
  const int w = CellWidth(t.rounds), side_w = SideWidth(t);
  for (int side : {0, 1}) {
    Json row = fields;
    row[t.side_key] = t.sides[static_cast<size_t>(side)];
    row["rounds"] = t.rounds;
    int64_t requests = 0;
    bool verified = true;
    for (const PairRun& r : runs)
      if (r.side == side) requests = r.requests, verified = verified && r.verified;
    row["requests"] = requests;
    row["verified"] = verified;
    out << "  " << std::setw(t.case_width) << case_label << "  " << std::left << std::setw(side_w)
        << t.sides[static_cast<size_t>(side)] << std::right << "  " << std::setw(8) << requests;
    for (size_t m = 0; m < t.metrics.size(); ++m) {
      std::vector<double> v;
      for (const PairRun& r : runs)
        if (r.side == side) v.push_back(r.values[m]);
      const Spread s = SpreadOf(v);
      row[t.metrics[m].key] = ToJson(s);
      out << "  " << std::setw(w) << Cell(s, t.metrics[m].precision, spread);
    }
    out << "  " << (verified ? "yes" : "NO") << "\n";
    doc["rows"].push_back(row);
  }
  Json ratio = fields;
  ratio["rounds"] = t.rounds;
  out << "  " << std::setw(t.case_width) << case_label << "  " << std::left << std::setw(side_w) << t.ratio
      << std::right << "  " << std::setw(8) << "";
  for (size_t m = 0; m < t.metrics.size(); ++m) {
    if (!t.metrics[m].ratio) continue;  // the last columns
    std::vector<double> v;
    for (const PairRun& b : runs) {
      if (b.side != 1) continue;
      for (const PairRun& a : runs)
        if (a.side == 0 && a.round == b.round) v.push_back(b.values[m] / a.values[m]);
    }
    const Spread s = SpreadOf(v);
    ratio[t.metrics[m].key] = ToJson(s);
    out << "  " << std::setw(w) << Cell(s, 3, spread);
  }
  out << "\n";
  doc["ratios"].push_back(ratio);
}

}  // namespace serve_bench
}  // namespace mlarun
