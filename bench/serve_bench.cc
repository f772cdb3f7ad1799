// `mlarun bench serve` (serve_bench.h says what is measured).
//
// Threads: each client is a std::thread with a blocking stub (the sync API),
// issuing one streaming Generate at a time; clients share min(clients, 64)
// connections, so a thousand clients do not mean a thousand TCP connections
// and poller wake-ups on a two-core machine. A sampler thread polls GetStats
// while the load runs. The in-process coordinator runs on gRPC's callback
// threads and the simulated groups on RunSimWorker's (two per group).
#include "bench/serve_bench.h"

#include <grpcpp/grpcpp.h>
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <ostream>
#include <random>
#include <sstream>
#include <thread>

#include "bench/http_bench.h"
#include "bench/sim_target.h"
#include "bench/timing.h"
#include "bench/workload.h"
#include "mlarun.grpc.pb.h"
#include "serving/client/grpc_util.h"
#include "serving/coordinator/coordinator.h"
#include "serving/link/link_server.h"
#include "serving/sim/sim_worker.h"

namespace mlarun {

namespace {

namespace v1 = ::mlarun::v1;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using serve_bench::BenchRequest;
using serve_bench::CallGenerate;
using serve_bench::CheckEnd;
using serve_bench::CheckToken;
using serve_bench::Expect;
using serve_bench::GetStats;
using serve_bench::InProcessTarget;
using serve_bench::kCallTimeout_s;
using serve_bench::kSimThreadName;
using serve_bench::kStartTimeout_s;
using serve_bench::MeanOfFinite;
using serve_bench::MsSince;
using serve_bench::Outcome;
using serve_bench::Percentile;
using serve_bench::Sampling;
using serve_bench::SimOptions;
using serve_bench::WaitForGroups;
// MakeChannel gives each channel its own connection (not shared with other
// channels of this process), so clients spread over several connections
// really do.
using client_internal::AwaitConnection;
using client_internal::ConnectChannel;
using client_internal::MakeChannel;

constexpr int64_t kVocabSize = serve_bench::kSimVocabSize;
constexpr int64_t kBlockSize = serve_bench::kSimBlockSize;
// Prompts of the load rows: uniform lengths, so requests differ in cost (a
// policy that ignores cost shows it in the imbalance).
constexpr int64_t kPromptMin = 16, kPromptMax = 256;
// Load rows: at least this many clients per group, and this many requests
// per client. With fewer clients than groups max/mean is at least
// groups/clients whatever the policy, which would measure nothing.
constexpr int kClientsPerGroup = 4;
constexpr int64_t kRequestsPerClient = 8;
constexpr int kMaxConnections = 64;
constexpr auto kSamplePeriod = std::chrono::milliseconds(25);
// The prefix workload (SGLang's router benchmark shape, scaled down): 8
// groups whose caches (24 blocks) cannot hold all 8 system prompts (32
// blocks), so where each prompt goes decides whether it stays cached.
constexpr int kPrefixGroups = 8;
constexpr int64_t kPrefixCacheBlocks = 24;
constexpr int kSystemPrompts = 8;
constexpr int64_t kSystemPromptBlocks = 4;

Json P50P99(const std::vector<double>& v) {
  return {{"p50", OrNull(Percentile(v, 50))}, {"p99", OrNull(Percentile(v, 99))}};
}

// CPU time of this whole process (clients, coordinator and groups together).
double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  return s(u.ru_utime) + s(u.ru_stime);
}

// Thread names, so CPU time can be attributed by thread (/proc/self/task);
// InProcessTarget names its simulated groups' threads kSimThreadName.
constexpr char kClientThreadName[] = "sb-client";

double ThisThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// CPU seconds so far of each live thread of this process named `name`, by
// tid. From schedstat (the scheduler's run time in ns): the tick-sampled
// utime/stime of /proc/.../stat miss most of a thread that runs in bursts of
// microseconds, as a simulated group does.
std::map<int, double> NamedThreadsCpuSeconds(const std::string& name) {
  std::map<int, double> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::ifstream comm(e.path() / "comm"), sched(e.path() / "schedstat");
    std::string thread_name;
    double run_ns = 0;
    if (!std::getline(comm, thread_name) || thread_name != name || !(sched >> run_ns))
      continue;  // or it exited meanwhile
    out[std::atoi(e.path().filename().c_str())] = run_ns * 1e-9;
  }
  return out;
}

// CPU seconds the threads named `name` used since `before` (threads that
// started since count from zero).
double CpuSince(const std::map<int, double>& before, const std::string& name) {
  double sum = 0;
  for (const auto& [tid, s] : NamedThreadsCpuSeconds(name)) {
    auto it = before.find(tid);
    sum += s - (it == before.end() ? 0.0 : it->second);
  }
  return sum;
}

// ---- Workloads -------------------------------------------------------------

// Independent prompts of kPromptMin..kPromptMax random tokens (no shared
// prefixes: prefix_affinity falls back to least loaded on them).
std::vector<BenchRequest> MixedRequests(int64_t n, int64_t max_tokens, uint64_t seed) {
  return serve_bench::RandomRequests(n, max_tokens, kVocabSize, seed, kPromptMin, kPromptMax);
}

// ---- Direct path: the benchmark as the group's WorkerLink peer -------------

// One request straight down the worker link, verified like CallGenerate: one
// simulated group dials a LinkEndpoint of the benchmark's own as it would dial
// a coordinator, and the benchmark's thread routes requests to it and reads
// the answers itself (the same worker link and group logic as behind the
// coordinator, without the coordinator). `next` is the index of the group's
// next message on the stream.
Outcome CallDirect(LinkPeer& peer, size_t& next, const BenchRequest& rq, const std::string& id, const Expect& ex) {
  v1::CoordinatorMessage m;
  v1::RouteRequest* route = m.mutable_route();
  route->set_request_id(id);
  route->mutable_prompt_ids()->Add(rq.prompt.begin(), rq.prompt.end());
  *route->mutable_sampling() = Sampling(rq);
  Outcome o;
  std::string error, finish_reason;
  bool finished = false;
  int64_t completion_tokens = -1;
  const Clock::time_point t0 = Clock::now();
  Clock::time_point last = t0;
  if (!peer.Send(std::move(m))) error = "the direct link broke";
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(kCallTimeout_s * 1e3));
  while (error.empty() && !finished) {
    const std::optional<v1::WorkerMessage> read = peer.Read(next, timeout);
    if (!read.has_value()) break;
    ++next;
    const v1::WorkerMessage& in = *read;
    const Clock::time_point now = Clock::now();
    if (in.has_tokens()) {
      for (const v1::TokenEvent& e : in.tokens().events()) {
        if (e.request_id() != id || !error.empty()) continue;
        error = CheckToken(rq, ex, o.tokens, e.token_id(), e.logprob());
        o.Token(t0, last, now);
      }
    } else if (in.has_done() && in.done().request_id() == id) {
      const v1::RequestDone& d = in.done();
      if (d.error_code() != 0)
        error = internal::StrCat("the group rejected it: ", StatusCodeName(static_cast<StatusCode>(d.error_code())),
                                 ": ", d.error_message());
      finished = true;
      finish_reason = d.finish_reason();
      // RequestDone carries no counts: the tokens are the completion, the
      // prompt is what was sent.
      completion_tokens = o.tokens;
      o.prompt_tokens = static_cast<int64_t>(rq.prompt.size());
      o.prefix_hit_tokens = d.prefix_hit_tokens();
      o.total_ms = MsSince(t0, now);
    }
    // WorkerStats (every 200 ms) are not part of the exchange.
  }
  if (error.empty() && !finished)
    error = peer.ended() ? "the direct link broke" : "no answer on the direct link in time";
  CheckEnd(rq, std::move(error), finished, finish_reason, completion_tokens, o);
  return o;
}

// ---- The client load ----------------------------------------------------------

struct LoadSpec {
  std::string address;
  int clients = 1;
  const std::vector<BenchRequest>* requests = nullptr;
  Expect expect;
  ClientSecurity security;  // an external deployment's TLS and token
};

struct LoadRun {
  std::vector<Outcome> outcomes;  // by request index
  double wall_s = 0;
  // CPU seconds over the run: the whole process, the client threads, the
  // simulated groups' threads and the sampler; the rest is the coordinator
  // and gRPC's own threads.
  double cpu_s = 0, client_cpu_s = 0, sim_cpu_s = 0, sampler_cpu_s = 0;
  int connections = 0;
  std::vector<double> imbalance;  // one per busy GetStats sample
  int64_t idle_samples = 0;       // samples with nothing queued (skipped)
  v1::GetStatsResponse before, after;
};

// Imbalance of one GetStats sample over the connected groups.
double SampleImbalance(const v1::GetStatsResponse& s) {
  std::vector<int64_t> queued;
  for (const v1::GroupStats& g : s.groups())
    if (g.connected()) queued.push_back(g.queued_tokens());
  return serve_bench::LoadImbalance(queued);
}

// Runs spec.requests with spec.clients threads, each issuing its next request
// as soon as the previous one ended. While requests remain to be issued (every
// client has work), a sampler records the imbalance every kSamplePeriod; the
// ramp-down at the end, when clients run out of work, is not sampled.
StatusOr<LoadRun> RunLoad(const LoadSpec& spec) {
  const std::vector<BenchRequest>& requests = *spec.requests;
  const int64_t n = static_cast<int64_t>(requests.size());
  LoadRun run;
  run.outcomes.resize(requests.size());
  run.connections = std::min(spec.clients, kMaxConnections);
  std::vector<std::unique_ptr<v1::Mlarun::Stub>> stubs;
  for (int c = 0; c < run.connections; ++c) {
    auto channel = MakeChannel(spec.address, spec.security.tls);
    // Connect before the clock starts, so no request pays the handshake.
    if (!AwaitConnection(*channel, 10)) return UnavailableError("cannot connect to the coordinator at ", spec.address);
    stubs.push_back(v1::Mlarun::NewStub(channel));
  }
  auto control = v1::Mlarun::NewStub(ConnectChannel(spec.address, spec.security.tls));
  MLARUN_ASSIGN_OR_RETURN(run.before, GetStats(*control, spec.security));

  std::atomic<int64_t> next{0};
  std::mutex cpu_mu;
  const std::map<int, double> sim_cpu0 = NamedThreadsCpuSeconds(kSimThreadName);
  const Clock::time_point t0 = Clock::now();
  const double cpu0 = ProcessCpuSeconds();
  std::vector<std::thread> clients;
  for (int c = 0; c < spec.clients; ++c) {
    clients.emplace_back([&, stub = stubs[static_cast<size_t>(c % run.connections)].get()] {
      pthread_setname_np(pthread_self(), kClientThreadName);
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1))
        run.outcomes[static_cast<size_t>(i)] =
            CallGenerate(*stub, requests[static_cast<size_t>(i)], spec.expect, spec.security);
      const double cpu = ThisThreadCpuSeconds();
      std::lock_guard lock(cpu_mu);
      run.client_cpu_s += cpu;
    });
  }
  std::thread sampler([&] {
    while (next.load() < n) {
      auto s = GetStats(*control, spec.security);
      if (s.ok()) {
        const double v = SampleImbalance(*s);
        if (std::isfinite(v)) {
          run.imbalance.push_back(v);
        } else {
          ++run.idle_samples;
        }
      }
      std::this_thread::sleep_for(kSamplePeriod);
    }
    run.sampler_cpu_s = ThisThreadCpuSeconds();
  });
  for (auto& t : clients) t.join();
  run.wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  sampler.join();
  run.cpu_s = ProcessCpuSeconds() - cpu0;
  run.sim_cpu_s = CpuSince(sim_cpu0, kSimThreadName);
  MLARUN_ASSIGN_OR_RETURN(run.after, GetStats(*control, spec.security));
  return run;
}

// Everything a load row reports, from a LoadRun.
struct LoadRow {
  int groups = 0;
  std::string policy;
  int clients = 0;
  int64_t requests = 0, completed = 0, failed = 0, tokens = 0;
  std::string first_error;
  bool verified = false;
  double capacity_tokens_per_s = NAN;  // simulated: groups x tokens_per_s
  Json json;
};

// `in_process`: the coordinator and groups are this process's (its counters
// count only this run's requests, and its CPU time is split by thread).
LoadRow Summarize(const LoadRun& run, const LoadSpec& spec, int groups, const std::string& policy, double capacity,
                  bool in_process) {
  LoadRow row;
  row.groups = groups;
  row.policy = policy;
  row.clients = spec.clients;
  row.requests = static_cast<int64_t>(run.outcomes.size());
  row.capacity_tokens_per_s = capacity;
  std::vector<double> ttft, itl, total;
  for (const Outcome& o : run.outcomes) {
    if (!o.ok) {
      ++row.failed;
      if (row.first_error.empty()) row.first_error = o.error;
      continue;
    }
    ++row.completed;
    row.tokens += o.tokens;
    ttft.push_back(o.ttft_ms);
    total.push_back(o.total_ms);
    itl.insert(itl.end(), o.gaps_ms.begin(), o.gaps_ms.end());
  }
  const v1::CoordinatorStats &c0 = run.before.coordinator(), &c1 = run.after.coordinator();
  int64_t routed = 0;
  for (const v1::GroupStats& g : run.after.groups()) routed += g.requests_routed();
  for (const v1::GroupStats& g : run.before.groups()) routed -= g.requests_routed();
  const int64_t received = c1.requests_received() - c0.requests_received();
  const int64_t completed = c1.requests_completed() - c0.requests_completed();
  // Exactly once: every request verified on the client, and (where this
  // benchmark is the coordinator's only client) the coordinator received and
  // completed each exactly once.
  row.verified = row.failed == 0 && (!in_process || (received == row.requests && completed == row.requests));
  if (row.verified == false && row.failed == 0 && row.first_error.empty())
    row.first_error = internal::StrCat("the coordinator counted ", received, " received and ", completed,
                                       " completed for ", row.requests, " requests");
  const double req_s = static_cast<double>(row.completed) / run.wall_s;
  // Everything but the client, group and sampler threads: the coordinator's
  // reactors and dispatcher, and gRPC's own threads (for every connection).
  const double rest_cpu_s = std::max(0.0, run.cpu_s - run.client_cpu_s - run.sim_cpu_s - run.sampler_cpu_s);
  auto per_request = [&](double cpu_s) {
    return 1e3 * cpu_s / static_cast<double>(std::max<int64_t>(row.requests, 1));
  };
  const double tok_s = static_cast<double>(row.tokens) / run.wall_s;
  row.json = {{"groups", groups},
              {"policy", policy},
              {"clients", spec.clients},
              {"connections", run.connections},
              {"requests", row.requests},
              {"completed", row.completed},
              {"failed", row.failed},
              {"verified", row.verified},
              {"first_error", row.first_error.empty() ? Json(nullptr) : Json(row.first_error)},
              {"wall_s", run.wall_s},
              {"requests_per_s", req_s},
              {"tokens_per_s", tok_s},
              {"cpu_ms_per_request", in_process ? Json{{"process", per_request(run.cpu_s)},
                                                       {"clients", per_request(run.client_cpu_s)},
                                                       {"simulated_groups", per_request(run.sim_cpu_s)},
                                                       {"coordinator_and_grpc", per_request(rest_cpu_s)}}
                                                : Json{{"process", per_request(run.cpu_s)}}},  // the clients only
              {"process_cpu_cores", run.cpu_s / run.wall_s},
              {"simulated_capacity_tokens_per_s", OrNull(capacity)},
              {"ttft_ms", P50P99(ttft)},
              {"itl_ms", P50P99(itl)},
              {"latency_ms", P50P99(total)},
              {"imbalance",
               {{"mean", OrNull(MeanOfFinite(run.imbalance))},
                {"max", run.imbalance.empty() ? Json(nullptr)
                                              : Json(*std::max_element(run.imbalance.begin(), run.imbalance.end()))},
                {"samples", run.imbalance.size()},
                {"idle_samples_skipped", run.idle_samples},
                {"period_ms", kSamplePeriod.count()}}},
              {"coordinator",
               {{"received", received},
                {"completed", completed},
                {"routed", routed},
                {"rerouted", c1.requests_rerouted() - c0.requests_rerouted()},
                {"failed", c1.requests_failed() - c0.requests_failed()},
                {"rejected", c1.requests_rejected() - c0.requests_rejected()}}}};
  return row;
}

void PrintLoadHeader(std::ostream& t) {
  t << "  groups  policy           clients  requests     req/s      tok/s  of capacity  TTFT p50/p99 ms  ITL p50/p99 ms"
       "  imbalance  CPU ms/req all/coord  cores  verified\n";
}

// j[key] as a number; NaN when absent or null.
double Number(const Json& j, const char* key) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : NAN;
}

void PrintLoadRow(std::ostream& t, const LoadRow& r) {
  const Json& j = r.json;
  auto pair = [&](const char* key) { return Fmt(Number(j[key], "p50"), 2) + " / " + Fmt(Number(j[key], "p99"), 2); };
  const double tok_s = j["tokens_per_s"].get<double>();
  const double imb = Number(j["imbalance"], "mean");
  t << "  " << std::setw(6) << r.groups << "  " << std::left << std::setw(15) << r.policy << std::right << "  "
    << std::setw(7) << r.clients << "  " << std::setw(8) << r.requests << "  " << std::setw(8)
    << Fmt(j["requests_per_s"].get<double>(), 0) << "  " << std::setw(9) << Fmt(tok_s, 0) << "  " << std::setw(11)
    << (std::isfinite(r.capacity_tokens_per_s) ? Fmt(100 * tok_s / r.capacity_tokens_per_s, 0) + "%" : "-") << "  "
    << std::setw(15) << pair("ttft_ms") << "  " << std::setw(14) << pair("itl_ms") << "  " << std::setw(9)
    << Fmt(imb, 2) << "  " << std::setw(20)
    << Fmt(Number(j["cpu_ms_per_request"], "process"), 2) + " / " +
           Fmt(Number(j["cpu_ms_per_request"], "coordinator_and_grpc"), 2)
    << "  " << std::setw(5) << Fmt(j["process_cpu_cores"].get<double>(), 1) << "  "
    << (r.verified ? "yes" : "NO: " + r.first_error) << "\n";
}

// ---- Options -------------------------------------------------------------------

struct Resolved {
  int clients;
  int64_t requests, max_tokens, overhead_requests, prefix_requests;
  std::vector<int> groups;
  std::vector<RoutingPolicy> policies;
};

StatusOr<Resolved> Resolve(const ServeBenchOptions& o) {
  Resolved r;
  if (o.clients < 0) return InvalidArgumentError("--clients must be >= 1, got ", o.clients);
  if (o.requests < 0) return InvalidArgumentError("--requests must be >= 1, got ", o.requests);
  if (o.max_tokens < 0 || o.max_tokens > 1024)
    return InvalidArgumentError("--max-tokens must be in [1, 1024], got ", o.max_tokens);
  if (!(o.tokens_per_s >= 0)) return InvalidArgumentError("--tokens-per-s must be >= 0, got ", o.tokens_per_s);
  r.clients = o.clients > 0 ? o.clients : (o.quick ? 8 : 64);
  r.requests = o.requests > 0 ? o.requests : (o.quick ? 64 : 512);
  r.max_tokens = o.max_tokens > 0 ? o.max_tokens : (o.quick ? 8 : 16);
  r.overhead_requests = o.quick ? 64 : std::max<int64_t>(r.requests, 512);
  r.prefix_requests = o.quick ? 128 : std::max<int64_t>(r.requests, 512);
  r.groups = !o.groups.empty() ? o.groups : (o.quick ? std::vector<int>{4, 16} : std::vector<int>{4, 64, 256});
  for (int g : r.groups)
    if (g < 1 || g > 1024) return InvalidArgumentError("--groups: each must be in [1, 1024], got ", g);
  bool all = o.policies.empty();
  for (const std::string& p : o.policies) all = all || p == "all";
  if (all) {
    r.policies = {RoutingPolicy::kRoundRobin, RoutingPolicy::kLeastLoaded, RoutingPolicy::kPrefixAffinity};
  } else {
    for (const std::string& p : o.policies) {
      MLARUN_ASSIGN_OR_RETURN(RoutingPolicy parsed, ParseRoutingPolicy(p));
      r.policies.push_back(parsed);
    }
  }
  return r;
}

// ---- Sections --------------------------------------------------------------------

// The overhead section's requests: kOverheadWarmUp first, then the timed
// ones in kOverheadRounds rounds.
constexpr int kOverheadRounds = 4, kOverheadWarmUp = 32;

// The overhead section's latencies after the warm-up: through the
// coordinator, straight down the worker link, and inside the coordinator (its
// Timings, for the requests through it); and the requests that failed.
struct OverheadLatencies {
  std::vector<double> via, straight, inside;
  std::string first_error;
  int64_t failed = 0;
};

// Sends `requests` (kOverheadWarmUp, then n in kOverheadRounds rounds) one at a time through
// an in-process coordinator and straight down a worker link of the
// benchmark's own, each to one simulated group as fast as it can go.
StatusOr<OverheadLatencies> TimeOverheadPaths(const std::vector<BenchRequest>& requests, int64_t n) {
  const Expect ex{.sim_tokens = true};

  MLARUN_ASSIGN_OR_RETURN(auto target, InProcessTarget::Start(RoutingPolicy::kPrefixAffinity, SimOptions(1, 0, 1024)));
  auto channel = MakeChannel(target->address());
  auto stub = v1::Mlarun::NewStub(channel);

  LinkEndpoint direct("serve-bench-direct");
  auto server = GrpcServer::Start("127.0.0.1:0", {&direct});
  if (!server.ok()) return server.status().WithContext("the direct link");
  SimWorkerOptions sim = SimOptions(1, 0, 1024);
  sim.coordinator = (*server)->address();
  std::atomic<bool> sim_stop{false};
  std::ostringstream sim_log;
  std::thread sim_thread([&] { RunSimWorker(sim, &sim_stop, sim_log); });
  auto cleanup = [&] {
    sim_stop = true;
    sim_thread.join();
    (*server)->Shutdown(std::chrono::seconds(1));
    target->Stop();
  };

  const std::shared_ptr<LinkPeer> peer =
      direct.WaitPeer(0, std::chrono::milliseconds(static_cast<int64_t>(kStartTimeout_s * 1e3)));
  if (peer == nullptr) {
    cleanup();
    return UnavailableError("the simulated group did not register with the direct link within ", kStartTimeout_s,
                            " s (log: ", sim_log.str(), ")");
  }
  size_t next = 0;
  auto direct_call = [&](size_t i) { return CallDirect(*peer, next, requests[i], "direct-" + std::to_string(i), ex); };
  OverheadLatencies m;
  std::vector<double>&via = m.via, &straight = m.straight, &inside = m.inside;
  std::string& first_error = m.first_error;
  int64_t& failed = m.failed;
  auto record = [&](const Outcome& o, std::vector<double>& into) {
    if (!o.ok) {
      ++failed;
      if (first_error.empty()) first_error = o.error;
      return;
    }
    into.push_back(o.total_ms);
    if (&into == &via) inside.push_back(o.coordinator_total_ms);
  };
  for (size_t i = 0; i < static_cast<size_t>(kOverheadWarmUp); ++i) {  // connections, allocators, caches
    record(direct_call(i), straight);
    record(CallGenerate(*stub, requests[i], ex), via);
  }
  via.clear(), straight.clear(), inside.clear();
  const int64_t chunk = (n + kOverheadRounds - 1) / kOverheadRounds;
  for (int round = 0; round < kOverheadRounds; ++round) {
    const int64_t begin = kOverheadWarmUp + round * chunk, end = std::min<int64_t>(kOverheadWarmUp + n, begin + chunk);
    for (int64_t i = begin; i < end; ++i) record(direct_call(static_cast<size_t>(i)), straight);
    for (int64_t i = begin; i < end; ++i) record(CallGenerate(*stub, requests[static_cast<size_t>(i)], ex), via);
  }
  cleanup();
  return m;
}

// For scale: the simulated group's token function alone (a prompt range
// check and SimWorkerToken), in process. Not the group's request path
// (no validation, cache, batching or stream writes), so it only shows how
// little of the direct path's latency is the token computation itself.
// Returns its median time per request in ms.
StatusOr<double> TimeTokenFunction(const std::vector<BenchRequest>& requests) {
  InitBenchmarkLibrary();
  size_t k = 0;
  int64_t sink = 0;
  MLARUN_ASSIGN_OR_RETURN(const double token_fn_ms, TimeMs(
                                                        "sim_token_function",
                                                        [&]() -> Status {
                                                          const BenchRequest& r = requests[k++ % requests.size()];
                                                          for (int32_t id : r.prompt)
                                                            if (id < 0 || id >= kVocabSize)
                                                              return InternalError("prompt id out of range");
                                                          sink += SimWorkerToken(r.prompt, r.seed, 0, kVocabSize).token;
                                                          return Status::Ok();
                                                        },
                                                        Timing{.repetitions = 3, .min_time_s = 0.05}));
  (void)sink;
  return token_fn_ms;
}

// The coordinator's own overhead: one simulated group as fast as it can go,
// max_tokens 1, one request at a time, through the coordinator and straight
// down a worker link, alternating in rounds so both paths see the same
// machine state.
StatusOr<Json> OverheadSection(int64_t n, std::ostream& t, bool* verified) {
  const std::vector<BenchRequest> requests = MixedRequests(n + kOverheadWarmUp, 1, 3);
  MLARUN_ASSIGN_OR_RETURN(const OverheadLatencies m, TimeOverheadPaths(requests, n));
  MLARUN_ASSIGN_OR_RETURN(const double token_fn_ms, TimeTokenFunction(requests));

  const double via50 = Percentile(m.via, 50), via99 = Percentile(m.via, 99);
  const double dir50 = Percentile(m.straight, 50), dir99 = Percentile(m.straight, 99);
  const double in50 = Percentile(m.inside, 50), in99 = Percentile(m.inside, 99);
  *verified = m.failed == 0;
  const bool meets = via50 - dir50 < 1.0;
  t << "\ncoordinator overhead (1 simulated group at full speed, max_tokens 1, one request at a time, " << n
    << " requests per path in " << kOverheadRounds << " alternating rounds after " << kOverheadWarmUp << " warm-up)\n";
  t << "  path                                                    p50 ms    p99 ms\n";
  t << "  through the coordinator (client -> coordinator -> group)  " << std::setw(7) << Fmt(via50, 3) << "  "
    << std::setw(8) << Fmt(via99, 3) << "\n";
  t << "  direct on the worker link (bench -> group)                " << std::setw(7) << Fmt(dir50, 3) << "  "
    << std::setw(8) << Fmt(dir99, 3) << "\n";
  t << "  coordinator's own overhead (difference)                   " << std::setw(7) << Fmt(via50 - dir50, 3) << "  "
    << std::setw(8) << Fmt(via99 - dir99, 3) << "\n";
  t << "  inside the coordinator (arrival -> finished, its Timings) " << std::setw(7) << Fmt(in50, 3) << "  "
    << std::setw(8) << Fmt(in99, 3) << "\n";
  t << "  token function only (range check + SimWorkerToken, in process, median): " << Fmt(token_fn_ms * 1e3, 2)
    << " us per request\n";
  t << "  goal: under 1 ms at p50: " << (meets ? "met" : "NOT met")
    << "; verified: " << (m.failed == 0 ? "yes" : "NO: " + m.first_error) << "\n";
  return Json{{"requests_per_path", n},
              {"rounds", kOverheadRounds},
              {"warm_up", kOverheadWarmUp},
              {"max_tokens", 1},
              {"groups", 1},
              {"tokens_per_s", 0},
              {"through_coordinator_ms", {{"p50", OrNull(via50)}, {"p99", OrNull(via99)}}},
              {"direct_ms", {{"p50", OrNull(dir50)}, {"p99", OrNull(dir99)}}},
              {"coordinator_overhead_ms", {{"p50", OrNull(via50 - dir50)}, {"p99", OrNull(via99 - dir99)}}},
              {"inside_coordinator_ms", {{"p50", OrNull(in50)}, {"p99", OrNull(in99)}}},
              {"sim_token_function_us", token_fn_ms * 1e3},
              {"goal_p50_ms", 1.0},
              {"meets_goal", meets},
              {"failed", m.failed},
              {"verified", m.failed == 0},
              {"first_error", m.first_error.empty() ? Json(nullptr) : Json(m.first_error)}};
}

// External deployment: latency at concurrency 1, max_tokens 1, and the
// coordinator's own account of it (its groups dial it, so no direct path).
StatusOr<Json> ExternalLatencySection(const std::string& address, const ClientSecurity& security, int64_t n,
                                      std::ostream& t, bool* verified) {
  const std::vector<BenchRequest> requests = MixedRequests(n + 32, 1, 3);
  auto stub = v1::Mlarun::NewStub(ConnectChannel(address, security.tls));
  std::vector<double> via, inside;
  int64_t failed = 0;
  std::string first_error;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Outcome o = CallGenerate(*stub, requests[i], Expect{}, security);
    if (i < 32) continue;  // warm-up
    if (!o.ok) {
      ++failed;
      if (first_error.empty()) first_error = o.error;
      continue;
    }
    via.push_back(o.total_ms);
    inside.push_back(o.coordinator_total_ms);
  }
  *verified = failed == 0;
  t << "\nlatency at concurrency 1, max_tokens 1 (" << n
    << " requests; the deployment's groups dial the coordinator, so "
    << "there is no direct path to compare with)\n";
  t << "  through the coordinator p50/p99 ms: " << Fmt(Percentile(via, 50), 3) << " / " << Fmt(Percentile(via, 99), 3)
    << "; inside the coordinator (its Timings): " << Fmt(Percentile(inside, 50), 3) << " / "
    << Fmt(Percentile(inside, 99), 3) << "; verified: " << (failed == 0 ? "yes" : "NO: " + first_error) << "\n";
  return Json{{"requests_per_path", n},
              {"max_tokens", 1},
              {"through_coordinator_ms", P50P99(via)},
              {"direct_ms", nullptr},
              {"coordinator_overhead_ms", nullptr},
              {"inside_coordinator_ms", P50P99(inside)},
              {"failed", failed},
              {"verified", failed == 0},
              {"first_error", first_error.empty() ? Json(nullptr) : Json(first_error)}};
}

// What the sections of one `mlarun bench serve` share: the options and what
// they resolve to, whether the target is an external deployment, the table,
// the JSON document the sections add to, and whether every request so far
// passed verification.
struct ServeRun {
  const ServeBenchOptions& o;
  const Resolved& r;
  bool external = false;
  std::ostream& t;
  Json doc;
  bool all_verified = true;
};

// --http: the HTTP API against gRPC (bench/http_bench.h) instead of the
// sections below.
Status HttpComparison(const ServeBenchOptions& o, const Resolved& r, std::ostream& out, std::ostream& t) {
  t << "mlarun bench serve --http: in-process coordinator and simulated groups, over loopback (127.0.0.1); "
    << CpuModel() << ", " << std::thread::hardware_concurrency() << " cores; load average " << Fmt(LoadAverage(), 1)
    << " at start; " << Today() << "\n";
  bool verified = false;
  MLARUN_ASSIGN_OR_RETURN(Json http, RunHttpBench(HttpBenchOptions{.clients = r.clients,
                                                                   .requests = r.requests,
                                                                   .max_tokens = r.max_tokens,
                                                                   .groups = o.groups.empty() ? 4 : r.groups.front(),
                                                                   .tokens_per_s = o.tokens_per_s,
                                                                   .overhead_requests = r.overhead_requests},
                                                  t, &verified));
  Json doc = {{"benchmark", "serve-http"},
              {"date", Today()},
              {"machine", {{"cpu", CpuModel()}, {"cores", std::thread::hardware_concurrency()}}},
              {"http", http},
              {"all_verified", verified}};
  if (o.json) out << doc.dump(2) << std::endl;
  if (!verified) return InternalError("some requests failed verification (see the tables)");
  return Status::Ok();
}

// The machine, the target and the configuration: the document's leading
// fields and the table's first line.
void Describe(ServeRun& run) {
  const ServeBenchOptions& o = run.o;
  const Resolved& r = run.r;
  const bool external = run.external;
  Json& doc = run.doc;
  doc["benchmark"] = "serve";
  doc["date"] = Today();
  doc["machine"] = {{"cpu", CpuModel()},
                    {"cores", std::thread::hardware_concurrency()},
                    {"network", "loopback (127.0.0.1)"},
                    {"grpc", grpc::Version()},
                    // Before this process starts its own threads, which the load average then counts.
                    {"load_average_1min_at_start", OrNull(LoadAverage())}};
  doc["target"] = external ? Json{{"kind", "external"}, {"address", o.coordinator}}
                           : Json{{"kind", "in-process"}, {"address", "127.0.0.1:0"}};
  doc["config"] = {{"clients", r.clients},
                   {"requests", r.requests},
                   {"max_tokens", r.max_tokens},
                   {"tokens_per_s", o.tokens_per_s},
                   {"groups", r.groups},
                   {"quick", o.quick},
                   {"prompt_tokens", {{"min", kPromptMin}, {"max", kPromptMax}}},
                   {"vocab_size", kVocabSize},
                   {"block_size", kBlockSize}};
  run.t << "mlarun bench serve: "
        << (external ? "the deployment at " + o.coordinator : "in-process coordinator and simulated groups")
        << ", over loopback (127.0.0.1); " << CpuModel() << ", " << std::thread::hardware_concurrency()
        << " cores shared by clients, coordinator and groups; load average " << Fmt(LoadAverage(), 1)
        << " at start; gRPC " << grpc::Version() << "; " << Today() << "\n";
}

// The load row of an external deployment: its groups and policy.
Status ExternalLoad(ServeRun& run) {
  const ServeBenchOptions& o = run.o;
  const Resolved& r = run.r;
  std::ostream& t = run.t;
  auto stub = v1::Mlarun::NewStub(ConnectChannel(o.coordinator, o.security.tls));
  MLARUN_ASSIGN_OR_RETURN(const int groups, WaitForGroups(*stub, 1, 10));
  MLARUN_ASSIGN_OR_RETURN(const v1::GetStatsResponse stats, GetStats(*stub, o.security));
  const std::vector<BenchRequest> requests = MixedRequests(r.requests, r.max_tokens, 1);
  const LoadSpec spec{
      .address = o.coordinator, .clients = r.clients, .requests = &requests, .expect = {}, .security = o.security};
  t << "\nclient load (" << r.clients << " clients, max_tokens " << r.max_tokens << ", prompts " << kPromptMin << "-"
    << kPromptMax << " tokens; imbalance = max/mean of queued tokens over groups, GetStats every "
    << kSamplePeriod.count() << " ms while every client has work; CPU: this process, i.e. the clients, only)\n";
  PrintLoadHeader(t);
  MLARUN_ASSIGN_OR_RETURN(const LoadRun load, RunLoad(spec));
  const LoadRow row = Summarize(load, spec, groups, stats.coordinator().policy(), NAN, /*in_process=*/false);
  PrintLoadRow(t, row);
  run.all_verified = run.all_verified && row.verified;
  run.doc["load"].push_back(row.json);
  return Status::Ok();
}

// The load rows in process: every group count under every policy.
Status InProcessLoad(ServeRun& run) {
  const ServeBenchOptions& o = run.o;
  const Resolved& r = run.r;
  std::ostream& t = run.t;
  t << "\nclient load and routing (simulated groups at " << Fmt(o.tokens_per_s, 0) << " tokens/s each, max_tokens "
    << r.max_tokens << ", prompts " << kPromptMin << "-" << kPromptMax << " random tokens; clients = max(" << r.clients
    << ", " << kClientsPerGroup << " per group), requests = max(" << r.requests << ", " << kRequestsPerClient
    << " per client); capacity = groups x tokens/s; imbalance = max/mean of queued tokens over groups, GetStats "
       "every "
    << kSamplePeriod.count() << " ms while every client has work, mean of the samples)\n";
  PrintLoadHeader(t);
  for (int groups : r.groups) {
    const int clients = std::max(r.clients, kClientsPerGroup * groups);
    const int64_t n = std::max(r.requests, kRequestsPerClient * clients);
    const std::vector<BenchRequest> requests = MixedRequests(n, r.max_tokens, static_cast<uint64_t>(groups));
    for (RoutingPolicy p : r.policies) {
      MLARUN_ASSIGN_OR_RETURN(auto target, InProcessTarget::Start(p, SimOptions(groups, o.tokens_per_s, 1024)));
      const LoadSpec spec{
          .address = target->address(), .clients = clients, .requests = &requests, .expect = {.sim_tokens = true}};
      auto load = RunLoad(spec);
      target->Stop();
      if (!load.ok()) return load.status();
      const double capacity = o.tokens_per_s > 0 ? groups * o.tokens_per_s : NAN;
      const LoadRow row =
          Summarize(*load, spec, groups, std::string(RoutingPolicyName(p)), capacity, /*in_process=*/true);
      PrintLoadRow(t, row);
      run.all_verified = run.all_verified && row.verified;
      run.doc["load"].push_back(row.json);
    }
  }
  return Status::Ok();
}

// The prefix workload: many requests sharing a few long "system prompts".
struct PrefixWorkload {
  serve_bench::SharedPrefixSpec spec;
  std::vector<BenchRequest> requests;
};

PrefixWorkload MakePrefixWorkload(const Resolved& r) {
  PrefixWorkload p{.spec = {.prefixes = kSystemPrompts,
                            .prefix_tokens = kSystemPromptBlocks * kBlockSize,
                            .requests = r.prefix_requests,
                            .suffix_min = 8,
                            .suffix_max = 56,
                            .vocab_size = kVocabSize,
                            .seed = 5}};
  const serve_bench::SharedPrefixWorkload w = serve_bench::MakeSharedPrefixWorkload(p.spec);
  for (size_t i = 0; i < w.prompts.size(); ++i)
    p.requests.push_back(BenchRequest{.prompt = w.prompts[i], .seed = 7000 + i, .max_tokens = r.max_tokens});
  return p;
}

// One prefix row: the workload at `address`, its hit rate printed and added
// to `prefix`. `exact`: an in-process target (simulated tokens, open); else
// the deployment at o.coordinator, with its security.
Status PrefixRow(ServeRun& run, const std::vector<BenchRequest>& prefix_requests, Json& prefix,
                 const std::string& address, int groups, const std::string& policy, bool exact) {
  std::ostream& t = run.t;
  const LoadSpec ls{.address = address,
                    .clients = run.r.clients,
                    .requests = &prefix_requests,
                    .expect = {.sim_tokens = exact},
                    .security = exact ? ClientSecurity{} : run.o.security};
  MLARUN_ASSIGN_OR_RETURN(const LoadRun load, RunLoad(ls));
  const LoadRow row = Summarize(load, ls, groups, policy, NAN, exact);
  std::vector<serve_bench::PrefixCounts> counts;
  for (const Outcome& oc : load.outcomes)
    if (oc.ok) counts.push_back({oc.prompt_tokens, oc.prefix_hit_tokens});
  int64_t prompt_tokens = 0, hit_tokens = 0;
  for (const auto& c : counts) prompt_tokens += c.prompt_tokens, hit_tokens += c.prefix_hit_tokens;
  const double rate = serve_bench::PrefixHitRate(counts);
  const Json& j = row.json;
  const double imb = Number(j["imbalance"], "mean");
  t << "  " << std::left << std::setw(15) << policy << std::right << "  " << std::setw(7) << Fmt(100 * rate, 1) << "%  "
    << std::setw(12) << hit_tokens << " / " << std::left << std::setw(12) << prompt_tokens << std::right << "  "
    << std::setw(8) << Fmt(j["requests_per_s"].get<double>(), 0) << "  " << std::setw(9) << Fmt(imb, 2) << "  "
    << (row.verified ? "yes" : "NO: " + row.first_error) << "\n";
  run.all_verified = run.all_verified && row.verified;
  Json out_row = row.json;
  out_row["hit_rate"] = OrNull(rate);
  out_row["prefix_hit_tokens"] = hit_tokens;
  out_row["prompt_tokens"] = prompt_tokens;
  prefix["rows"].push_back(out_row);
  return Status::Ok();
}

// ---- Prefix cache.
Status PrefixSection(ServeRun& run) {
  const ServeBenchOptions& o = run.o;
  const Resolved& r = run.r;
  std::ostream& t = run.t;
  const PrefixWorkload pw = MakePrefixWorkload(r);
  const serve_bench::SharedPrefixSpec& spec = pw.spec;
  Json prefix = {{"system_prompts", spec.prefixes},
                 {"system_prompt_tokens", spec.prefix_tokens},
                 {"suffix_tokens", {{"min", spec.suffix_min}, {"max", spec.suffix_max}}},
                 {"requests", spec.requests},
                 {"clients", r.clients},
                 {"rows", Json::array()}};
  if (run.external) {
    t << "\nprefix cache (the deployment's groups and policy; " << spec.requests << " requests = one of "
      << spec.prefixes << " system prompts of " << spec.prefix_tokens << " tokens + " << spec.suffix_min << "-"
      << spec.suffix_max << " unique tokens, random order; " << r.clients << " clients)\n";
  } else {
    prefix["groups"] = kPrefixGroups;
    prefix["cache_blocks_per_group"] = kPrefixCacheBlocks;
    prefix["tokens_per_s"] = o.tokens_per_s;
    t << "\nprefix cache (" << kPrefixGroups << " simulated groups of " << kPrefixCacheBlocks << " cache blocks of "
      << kBlockSize << " tokens; " << spec.requests << " requests = one of " << spec.prefixes << " system prompts of "
      << kSystemPromptBlocks << " blocks + " << spec.suffix_min << "-" << spec.suffix_max
      << " unique tokens, random order; " << r.clients
      << " clients; hit rate = sum prefix_hit_tokens / sum prompt tokens)\n";
  }
  t << "  policy           hit rate   hit tokens / prompt tokens     req/s  imbalance  verified\n";
  if (run.external) {
    auto stub = v1::Mlarun::NewStub(ConnectChannel(o.coordinator, o.security.tls));
    MLARUN_ASSIGN_OR_RETURN(const v1::GetStatsResponse stats, GetStats(*stub, o.security));
    int groups = 0;
    for (const auto& g : stats.groups()) groups += g.connected() ? 1 : 0;
    MLARUN_RETURN_IF_ERROR(
        PrefixRow(run, pw.requests, prefix, o.coordinator, groups, stats.coordinator().policy(), false));
  } else {
    for (RoutingPolicy p : r.policies) {
      MLARUN_ASSIGN_OR_RETURN(auto target,
                              InProcessTarget::Start(p, SimOptions(kPrefixGroups, o.tokens_per_s, kPrefixCacheBlocks)));
      const Status st = PrefixRow(run, pw.requests, prefix, target->address(), kPrefixGroups,
                                  std::string(RoutingPolicyName(p)), true);
      target->Stop();
      MLARUN_RETURN_IF_ERROR(st);
    }
  }
  run.doc["prefix"] = prefix;
  return Status::Ok();
}

}  // namespace

Status RunServeBench(const ServeBenchOptions& o, std::ostream& out, std::ostream& t) {
  MLARUN_ASSIGN_OR_RETURN(const Resolved r, Resolve(o));
  const bool external = !o.coordinator.empty();
  if (o.http) {
    if (external) return InvalidArgumentError("--http: in-process only (not with --coordinator)");
    return HttpComparison(o, r, out, t);
  }
  ServeRun run{.o = o, .r = r, .external = external, .t = t};
  Describe(run);

  // ---- Load (and routing at scale).
  run.doc["load"] = Json::array();
  MLARUN_RETURN_IF_ERROR(external ? ExternalLoad(run) : InProcessLoad(run));

  // ---- Coordinator overhead.
  bool verified = false;
  if (external) {
    MLARUN_ASSIGN_OR_RETURN(run.doc["overhead"],
                            ExternalLatencySection(o.coordinator, o.security, r.overhead_requests, t, &verified));
  } else {
    MLARUN_ASSIGN_OR_RETURN(run.doc["overhead"], OverheadSection(r.overhead_requests, t, &verified));
  }
  run.all_verified = run.all_verified && verified;

  MLARUN_RETURN_IF_ERROR(PrefixSection(run));
  run.doc["all_verified"] = run.all_verified;
  if (o.json) out << run.doc.dump(2) << std::endl;
  if (!run.all_verified) return InternalError("some requests failed verification (see the tables)");
  return Status::Ok();
}

}  // namespace mlarun
