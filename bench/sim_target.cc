// The serving benchmarks' shared gRPC parts (sim_target.h).
#include "bench/sim_target.h"

#include <grpcpp/grpcpp.h>
#include <pthread.h>

#include <utility>

#include "serving/client/grpc_util.h"

namespace mlarun {
namespace serve_bench {

using client_internal::GrpcCodeName;
using client_internal::MakeChannel;
using client_internal::SetDeadline;

double MsSince(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

void Outcome::Token(Clock::time_point t0, Clock::time_point& last, Clock::time_point now) {
  if (tokens == 0) {
    ttft_ms = MsSince(t0, now);
  } else {
    gaps_ms.push_back(MsSince(last, now));
  }
  last = now;
  ++tokens;
}

std::string CheckToken(const BenchRequest& rq, const Expect& ex, int64_t index, int64_t token, double logprob) {
  if (!ex.sim_tokens) return "";
  const SimToken want = SimWorkerToken(rq.prompt, rq.seed, index, kSimVocabSize);
  if (want.token == token && want.logprob == logprob) return "";
  return internal::StrCat("token ", index, " is ", token, " (logprob ", logprob, "), the simulated group makes ",
                          want.token, " (", want.logprob, ")");
}

v1::SamplingParams Sampling(const BenchRequest& rq) {
  v1::SamplingParams s;
  s.set_seed(rq.seed);
  s.set_max_tokens(rq.max_tokens);
  s.set_ignore_eos(true);  // every request makes exactly max_tokens tokens
  return s;
}

void CheckEnd(const BenchRequest& rq, std::string error, bool finished, const std::string& finish_reason,
              int64_t completion_tokens, Outcome& o) {
  if (error.empty() && !finished) error = "no finished message";
  if (error.empty() && o.tokens != rq.max_tokens)
    error = internal::StrCat(o.tokens, " tokens, expected max_tokens = ", rq.max_tokens);
  if (error.empty() && completion_tokens != o.tokens)
    error = internal::StrCat("finished says ", completion_tokens, " completion tokens, ", o.tokens, " arrived");
  if (error.empty() && o.prompt_tokens != static_cast<int64_t>(rq.prompt.size()))
    error = internal::StrCat("finished says ", o.prompt_tokens, " prompt tokens, the prompt has ", rq.prompt.size());
  if (error.empty() && finish_reason != "length") error = "finish_reason '" + finish_reason + "', expected 'length'";
  o.ok = error.empty();
  o.error = std::move(error);
}

Outcome CallGenerate(v1::Mlarun::Stub& stub, const BenchRequest& rq, const Expect& ex, const ClientSecurity& security) {
  v1::GenerateRequest req;
  req.mutable_prompt_ids()->Add(rq.prompt.begin(), rq.prompt.end());
  *req.mutable_sampling() = Sampling(rq);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(static_cast<int64_t>(kCallTimeout_s)));
  client_internal::AddCredentials(ctx, security);
  Outcome o;
  std::string error, finish_reason;
  bool finished = false;
  int64_t completion_tokens = -1;
  const Clock::time_point t0 = Clock::now();
  Clock::time_point last = t0;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub.Generate(&ctx, req);
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    const Clock::time_point now = Clock::now();
    if (!error.empty()) continue;  // drain until the cancellation lands
    if (resp.has_token()) {
      const v1::Token& t = resp.token();
      if (finished || t.index() != o.tokens) {
        error = finished ? "a token after the finished message"
                         : internal::StrCat("token index ", t.index(), " at position ", o.tokens);
      } else {
        error = CheckToken(rq, ex, t.index(), t.token_id(), t.logprob());
      }
      if (!error.empty()) {
        ctx.TryCancel();
        continue;
      }
      o.Token(t0, last, now);
    } else if (resp.has_finished()) {
      if (finished) {
        error = "two finished messages";
        ctx.TryCancel();
        continue;
      }
      const v1::Finished& f = resp.finished();
      finished = true;
      finish_reason = f.finish_reason();
      completion_tokens = f.completion_tokens();
      o.prompt_tokens = f.prompt_tokens();
      o.prefix_hit_tokens = f.prefix_hit_tokens();
      o.coordinator_total_ms = f.timings().total_ms();
      o.total_ms = MsSince(t0, now);
      o.finished_at = now;
    }
  }
  const grpc::Status st = reader->Finish();
  if (error.empty() && !st.ok()) error = internal::StrCat(GrpcCodeName(st.error_code()), ": ", st.error_message());
  CheckEnd(rq, std::move(error), finished, finish_reason, completion_tokens, o);
  return o;
}

StatusOr<v1::GetStatsResponse> GetStats(v1::Mlarun::Stub& stub, const ClientSecurity& security) {
  grpc::ClientContext ctx;
  SetDeadline(ctx, 10);
  client_internal::AddCredentials(ctx, security);
  v1::GetStatsResponse resp;
  const grpc::Status st = stub.GetStats(&ctx, v1::GetStatsRequest(), &resp);
  if (!st.ok()) return UnavailableError("GetStats: ", GrpcCodeName(st.error_code()), ": ", st.error_message());
  return resp;
}

StatusOr<int> WaitForGroups(v1::Mlarun::Stub& stub, int want, double timeout_s) {
  const Clock::time_point end =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  std::string last = "no answer";
  while (true) {
    grpc::ClientContext ctx;
    SetDeadline(ctx, 2);
    v1::HealthResponse resp;
    const grpc::Status st = stub.Health(&ctx, v1::HealthRequest(), &resp);
    if (st.ok() && resp.groups_connected() >= want) return resp.groups_connected();
    last = st.ok() ? internal::StrCat(resp.groups_connected(), " of ", want, " groups connected")
                   : internal::StrCat("Health: ", GrpcCodeName(st.error_code()), ": ", st.error_message());
    if (Clock::now() > end)
      return UnavailableError("the coordinator was not ready within ", timeout_s, " s (", last, ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

SimWorkerOptions SimOptions(int groups, double tokens_per_s, int64_t cache_blocks) {
  SimWorkerOptions s;
  s.worker_id = "serve-bench";
  s.groups = groups;
  s.tokens_per_s = tokens_per_s;
  s.vocab_size = kSimVocabSize;
  s.block_size = kSimBlockSize;
  s.cache_blocks = cache_blocks;
  return s;
}

StatusOr<std::unique_ptr<InProcessTarget>> InProcessTarget::Start(CoordinatorOptions co,
                                                                  std::vector<SimWorkerOptions> jobs) {
  std::unique_ptr<InProcessTarget> t(new InProcessTarget());
  co.listen = "127.0.0.1:0";
  MLARUN_ASSIGN_OR_RETURN(t->coordinator_, Coordinator::Start(co));
  int groups = 0;
  for (SimWorkerOptions& sim : jobs) {
    auto job = std::make_unique<Job>();
    job->options = std::move(sim);
    job->options.coordinator = t->coordinator_->address();
    groups += job->options.groups;
    job->thread = std::thread([j = job.get(), stop = &t->stop_] {
      pthread_setname_np(pthread_self(), kSimThreadName);
      j->rc = RunSimWorker(j->options, stop, j->log);
    });
    t->jobs_.push_back(std::move(job));
  }
  auto stub = v1::Mlarun::NewStub(MakeChannel(t->address()));
  const auto ready = WaitForGroups(*stub, groups, kStartTimeout_s);
  if (!ready.ok()) {
    t->Stop();  // the logs are ours to read once the simulated groups are joined
    std::string why;
    for (const auto& j : t->jobs_)
      why += internal::StrCat(why.empty() ? "" : "; ", j->options.worker_id, ": RunSimWorker returned ", j->rc,
                              ", log: ", j->log.str());
    return ready.status().WithContext(internal::StrCat("simulated groups (", why, ")"));
  }
  return t;
}

StatusOr<std::unique_ptr<InProcessTarget>> InProcessTarget::Start(CoordinatorOptions co, SimWorkerOptions sim) {
  std::vector<SimWorkerOptions> jobs;
  jobs.push_back(std::move(sim));
  return Start(std::move(co), std::move(jobs));
}

StatusOr<std::unique_ptr<InProcessTarget>> InProcessTarget::Start(RoutingPolicy policy, SimWorkerOptions sim) {
  CoordinatorOptions co;
  co.policy = policy;
  return Start(std::move(co), std::move(sim));
}

void InProcessTarget::Stop() {
  stop_ = true;
  for (auto& j : jobs_)
    if (j->thread.joinable()) j->thread.join();
  if (coordinator_ != nullptr) coordinator_->Shutdown();
}

}  // namespace serve_bench
}  // namespace mlarun
