// The deployment file, `mlarun submit` and `mlarun stats`.
#include "serving/client/client.h"

#include <google/protobuf/util/json_util.h>
#include <yaml-cpp/yaml.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <set>
#include <sstream>
#include <thread>

#include "mlarun.grpc.pb.h"
#include "runtime/request/request.h"
#include "serving/client/grpc_util.h"
#include "serving/client/table.h"
#include "serving/proto/proto_sampling.h"

namespace mlarun {
namespace {

namespace v1 = ::mlarun::v1;
using client_internal::CheckAddress;
using client_internal::GrpcCodeName;
using client_internal::SetDeadline;
using Json = nlohmann::json;

// A stub on a fresh channel to `address`, once it has connected (ConnectChannel).
std::unique_ptr<v1::Mlarun::Stub> Connect(const std::string& address, const TlsPem& tls, double timeout_s) {
  return v1::Mlarun::NewStub(client_internal::ConnectChannel(address, tls, timeout_s));
}

// Usage checks shared by submit and stats; the message goes to `err` as
// "mlarun <cmd>: ...".
bool CheckCommon(const char* cmd, const std::string& coordinator, double timeout_s, std::ostream& err) {
  if (Status s = CheckAddress(coordinator); !s.ok()) {
    err << "mlarun " << cmd << ": --coordinator: " << s.message() << "\n";
    return false;
  }
  if (!(timeout_s > 0)) {
    err << "mlarun " << cmd << ": --timeout must be positive, got " << timeout_s << "\n";
    return false;
  }
  return true;
}

void PrintGrpcError(const char* cmd, const grpc::Status& st, std::ostream& err) {
  err << "mlarun " << cmd << ": " << GrpcCodeName(st.error_code()) << ": " << st.error_message() << "\n";
}

std::string MiB(int64_t bytes) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / (1 << 20);
  return s.str();
}

std::string Fixed1(double x) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(1) << x;
  return s.str();
}

void PrintStatsTable(const v1::GetStatsResponse& r, std::ostream& out) {
  out << "ranks (weights and cache in MiB)\n";
  std::vector<std::vector<std::string>> rows;
  for (const v1::RankStats& k : r.ranks()) {
    rows.push_back({k.worker_id(), std::to_string(k.rank()), std::to_string(k.dp_group()),
                    std::to_string(k.attn_tp_rank()), k.host(), MiB(k.attention_weight_bytes()),
                    MiB(k.moe_weight_bytes()), MiB(k.dense_mlp_weight_bytes()), MiB(k.embedding_head_weight_bytes()),
                    MiB(k.cache_bytes_capacity()), MiB(k.cache_bytes_used()), MiB(k.cache_bytes_peak()),
                    std::to_string(k.requests_running()), std::to_string(k.requests_waiting()),
                    Fixed1(k.tokens_per_s())});
  }
  PrintTable(out,
             {"worker", "rank", "dp", "tp", "host", "attn", "moe", "mlp", "emb+head", "cache", "used", "peak",
              "running", "waiting", "tok/s"},
             {true, false, false, false, true, false, false, false, false, false, false, false, false, false, false},
             rows);
  out << "\ngroups\n";
  rows.clear();
  for (const v1::GroupStats& g : r.groups()) {
    rows.push_back({g.worker_id(), std::to_string(g.dp_group()), g.connected() ? "yes" : "no",
                    std::to_string(g.requests_routed()), std::to_string(g.requests_completed()),
                    std::to_string(g.requests_in_flight()), std::to_string(g.tokens_generated()),
                    std::to_string(g.free_blocks()), std::to_string(g.queued_tokens())});
  }
  PrintTable(
      out, {"worker", "dp", "connected", "routed", "completed", "in flight", "tokens", "free blocks", "queued tokens"},
      {true, false, true, false, false, false, false, false, false}, rows);
  for (const v1::GroupStats& g : r.groups()) {
    if (!g.connected() && !g.disconnect_reason().empty())
      out << "  group " << g.dp_group() << " of " << g.worker_id() << " went away: " << g.disconnect_reason() << "\n";
  }
  // Each rank's own CPU (ranks of one job may run on different machines).
  out << "\ncpus\n";
  rows.clear();
  for (const v1::RankStats& k : r.ranks()) {
    rows.push_back({k.worker_id(), std::to_string(k.rank()), k.host(), k.cpu_isa().empty() ? "?" : k.cpu_isa(),
                    k.cpu_model_name().empty() ? "?" : k.cpu_model_name(), k.cpu_flags()});
  }
  PrintTable(out, {"worker", "rank", "host", "kernels", "model", "flags"}, {true, false, true, true, true, true}, rows);
  const v1::CoordinatorStats& c = r.coordinator();
  out << "\ncoordinator: policy " << (c.policy().empty() ? "?" : c.policy()) << ", received " << c.requests_received()
      << ", completed " << c.requests_completed() << ", rejected " << c.requests_rejected() << ", failed "
      << c.requests_failed() << ", cancelled " << c.requests_cancelled() << ", queued " << c.requests_queued()
      << ", rerouted " << c.requests_rerouted() << ", migrated " << c.requests_migrated() << " (failed "
      << c.migrations_failed() << "), prefix fetches " << c.prefix_fetches() << " (" << c.prefix_fetch_tokens()
      << " tokens)\n";
}

}  // namespace

namespace {

// The outcome of one Generate call.
struct SubmitResult {
  grpc::Status status;
  std::string request_id;
  std::vector<int64_t> tokens;
  std::vector<double> logprobs;
  std::vector<std::vector<TokenLogprob>> top_logprobs;  // per token, when asked for
  std::vector<LogprobEntry> prompt_logprobs;
  std::optional<v1::Finished> finished;
};

// Runs one Generate call to completion. `on_token` (may be empty) sees each
// token as it arrives. A stream that breaks the contract (tokens out of order,
// after the end, no end) is reported as INTERNAL.
SubmitResult SubmitOne(v1::Mlarun::Stub& stub, const v1::GenerateRequest& req, double timeout_s,
                       const ClientSecurity& security, const std::function<void(const v1::Token&)>& on_token) {
  SubmitResult r;
  grpc::ClientContext ctx;
  SetDeadline(ctx, timeout_s);
  client_internal::AddCredentials(ctx, security);
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub.Generate(&ctx, req);
  std::string protocol_error;
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    if (!protocol_error.empty()) continue;  // drain until the cancellation lands
    if (r.request_id.empty()) r.request_id = resp.request_id();
    if (resp.has_token()) {
      const v1::Token& t = resp.token();
      if (r.finished || t.index() != static_cast<int64_t>(r.tokens.size())) {
        protocol_error = r.finished ? "a token arrived after the finished message"
                                    : "token index " + std::to_string(t.index()) + " arrived at position " +
                                          std::to_string(r.tokens.size());
        ctx.TryCancel();
        continue;
      }
      r.tokens.push_back(t.token_id());
      r.logprobs.push_back(t.logprob());
      if (req.sampling().logprobs() > 0) r.top_logprobs.push_back(LogprobEntryFrom(t).top);
      if (on_token) on_token(t);
    } else if (resp.has_prompt_logprobs()) {
      const v1::PromptLogprobs& lp = resp.prompt_logprobs();
      if (r.finished || !r.tokens.empty() || lp.start() != static_cast<int64_t>(r.prompt_logprobs.size()) + 1) {
        protocol_error = "prompt logprobs from token " + std::to_string(lp.start()) + " arrived after " +
                         std::to_string(r.prompt_logprobs.size()) + " of them and " + std::to_string(r.tokens.size()) +
                         " tokens";
        ctx.TryCancel();
        continue;
      }
      for (const v1::PromptTokenLogprob& e : lp.entries()) r.prompt_logprobs.push_back(LogprobEntryFrom(e));
    } else if (resp.has_finished()) {
      r.finished = resp.finished();
    }
  }
  r.status = reader->Finish();
  if (!protocol_error.empty()) {
    r.status = grpc::Status(grpc::StatusCode::INTERNAL, protocol_error);
  } else if (r.status.ok() && !r.finished) {
    r.status = grpc::Status(grpc::StatusCode::INTERNAL, "the stream ended without a finished message");
  }
  return r;
}

// The object of `mlarun generate --json` (nlohmann orders keys, as there), plus dp_group.
std::string JsonResult(const SubmitResult& r) {
  Json j{{"tokens", r.tokens},
         {"logprobs", r.logprobs},
         {"finish_reason", r.finished->finish_reason()},
         {"dp_group", r.finished->dp_group()}};
  AddLogprobFields(j, r.top_logprobs, r.prompt_logprobs);
  return j.dump();
}

int RunSubmitBatch(const SubmitOptions& o, std::ostream& out, std::ostream& err) {
  std::ifstream f(o.prompts_path);
  if (!f) {
    err << "mlarun submit: cannot read " << o.prompts_path << "\n";
    return 2;
  }
  if (o.concurrency < 1) {
    err << "mlarun submit: --concurrency must be >= 1\n";
    return 2;
  }
  std::vector<StatusOr<GenerationRequest>> parsed;
  std::string line;
  for (int64_t n = 1; std::getline(f, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto r = ParseRequestLine(line, o.sampling);
    parsed.push_back(
        r.ok() ? r : StatusOr<GenerationRequest>(r.status().WithContext(o.prompts_path + ":" + std::to_string(n))));
  }
  auto stub = Connect(o.coordinator, o.security.tls, o.timeout_s);
  std::vector<SubmitResult> results(parsed.size());
  std::atomic<size_t> next{0}, done{0}, tokens{0};
  auto work = [&] {
    for (size_t i; (i = next++) < parsed.size();) {
      if (parsed[i].ok()) {
        v1::GenerateRequest req;
        for (int32_t id : parsed[i]->prompt) req.add_prompt_ids(id);
        ToProto(parsed[i]->sampling, req.mutable_sampling());
        results[i] = SubmitOne(*stub, req, o.timeout_s, o.security, [&](const v1::Token&) { ++tokens; });
      }
      ++done;
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < std::min<int>(o.concurrency, static_cast<int>(std::max<size_t>(parsed.size(), 1))); ++t)
    threads.emplace_back(work);
  const auto t0 = std::chrono::steady_clock::now();
  while (done < parsed.size()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    err << "\rmlarun submit: " << done << "/" << parsed.size() << " requests done, " << tokens << " tokens, "
        << Fixed1(static_cast<double>(tokens) / std::max(s, 1e-3)) << " tokens/s" << std::flush;
  }
  for (std::thread& t : threads) t.join();
  if (!parsed.empty()) err << "\n";
  int code = 0;
  for (size_t i = 0; i < parsed.size(); ++i) {
    std::string error;
    if (!parsed[i].ok()) {
      error = parsed[i].status().ToString();
    } else if (!results[i].status.ok()) {
      error = std::string(GrpcCodeName(results[i].status.error_code())) + ": " + results[i].status.error_message();
    }
    if (!error.empty()) {
      code = 1;
      out << (o.json ? Json{{"error", error}}.dump() : "error: " + error) << "\n";
      continue;
    }
    if (o.json) {
      out << JsonResult(results[i]) << "\n";
    } else {
      out << "tokens:";
      for (int64_t t : results[i].tokens) out << " " << t;
      out << "  (finish: " << results[i].finished->finish_reason() << ", dp_group " << results[i].finished->dp_group()
          << ")\n";
    }
  }
  return code;
}

}  // namespace

int RunSubmit(const SubmitOptions& o, std::ostream& out, std::ostream& err) {
  if (!CheckCommon("submit", o.coordinator, o.timeout_s, err)) return 2;
  if (!o.prompts_path.empty()) return RunSubmitBatch(o, out, err);
  v1::GenerateRequest req;
  req.set_request_id(o.request_id);
  for (int64_t id : o.prompt_ids) {
    // The wire type is int32; a larger id cannot be sent at all, so it is a
    // usage error here rather than the server's INVALID_ARGUMENT.
    if (id < INT32_MIN || id > INT32_MAX) {
      err << "mlarun submit: --prompt-ids: " << id << " does not fit a 32-bit token id\n";
      return 2;
    }
    req.add_prompt_ids(static_cast<int32_t>(id));
  }
  ToProto(o.sampling, req.mutable_sampling());
  auto stub = Connect(o.coordinator, o.security.tls, o.timeout_s);
  auto print_token = [&](const v1::Token& t) {
    if (!o.stream) return;
    if (o.json) {
      out << Json{{"index", t.index()}, {"token", t.token_id()}, {"logprob", t.logprob()}}.dump() << "\n";
    } else {
      out << t.index() << " " << t.token_id() << " " << t.logprob() << "\n";
    }
    out.flush();  // the point of --stream: each token is visible as it arrives
  };
  const SubmitResult r = SubmitOne(*stub, req, o.timeout_s, o.security, print_token);
  if (!r.status.ok()) {
    PrintGrpcError("submit", r.status, err);
    return 1;
  }
  if (o.json) {
    out << JsonResult(r) << "\n";
  } else {
    out << "tokens:";
    for (int64_t t : r.tokens) out << " " << t;
    const v1::Timings& tm = r.finished->timings();
    out << "  (finish: " << r.finished->finish_reason() << ", request " << r.request_id << ", dp_group "
        << r.finished->dp_group() << ", prompt " << r.finished->prompt_tokens() << " tokens, prefix hit "
        << r.finished->prefix_hit_tokens() << ", queued " << Fixed1(tm.queued_ms()) << " ms, first token "
        << Fixed1(tm.first_token_ms()) << " ms, total " << Fixed1(tm.total_ms()) << " ms)\n";
  }
  return 0;
}

int RunStats(const StatsOptions& o, std::ostream& out, std::ostream& err) {
  if (!CheckCommon("stats", o.coordinator, o.timeout_s, err)) return 2;
  auto stub = Connect(o.coordinator, o.security.tls, o.timeout_s);
  grpc::ClientContext ctx;
  SetDeadline(ctx, o.timeout_s);
  client_internal::AddCredentials(ctx, o.security);
  v1::GetStatsResponse resp;
  const grpc::Status st = stub->GetStats(&ctx, v1::GetStatsRequest(), &resp);
  if (!st.ok()) {
    PrintGrpcError("stats", st, err);
    return 1;
  }
  if (o.json) {
    // The proto3 JSON mapping with the .proto's snake_case names. Fields at
    // their default value are printed too (a group with connected: false must
    // say so); int64 fields come out as strings, as that mapping prescribes.
    google::protobuf::util::JsonPrintOptions jo;
    jo.preserve_proto_field_names = true;
    jo.always_print_primitive_fields = true;
    std::string json;
    const auto js = google::protobuf::util::MessageToJsonString(resp, &json, jo);
    if (!js.ok()) {
      err << "mlarun stats: INTERNAL: cannot print the response as JSON: " << js.ToString() << "\n";
      return 1;
    }
    out << json << "\n";
  } else {
    PrintStatsTable(resp, out);
  }
  return 0;
}

int RunMigrate(const MigrateOptions& o, std::ostream& out, std::ostream& err) {
  if (!CheckCommon("migrate", o.coordinator, o.timeout_s, err)) return 2;
  if (o.request_id.empty()) {
    err << "mlarun migrate: --request-id: must not be empty\n";
    return 2;
  }
  auto stub = Connect(o.coordinator, o.security.tls, o.timeout_s);
  grpc::ClientContext ctx;
  SetDeadline(ctx, o.timeout_s);
  client_internal::AddCredentials(ctx, o.security);
  v1::MigrateRequest req;
  req.set_request_id(o.request_id);
  if (o.to_group >= 0) req.set_to_group(o.to_group);
  req.set_to_worker_id(o.to_worker_id);
  v1::MigrateResponse resp;
  const grpc::Status st = stub->Migrate(&ctx, req, &resp);
  if (!st.ok()) {
    PrintGrpcError("migrate", st, err);
    return 1;
  }
  char pause[32];
  std::snprintf(pause, sizeof pause, "%.1f", resp.pause_ms());
  out << "request '" << o.request_id << "' moved from DP group " << resp.from_group() << " of " << resp.from_worker_id()
      << " to DP group " << resp.to_group() << " of " << resp.to_worker_id() << " after " << resp.tokens_before()
      << " tokens; paused " << pause << " ms\n";
  return 0;
}

}  // namespace mlarun
