// `mlarun serve`: one machine, the coordinator here and the workers as a
// supervised mpirun job (launcher/serve/), until SIGINT/SIGTERM.
#include "launcher/serve/serve.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <thread>

#include "base/memory_tuning.h"
#include "launcher/commands/commands.h"
#include "parallel/layout.h"

namespace mlarun::commands {
namespace {

struct ServeFlags {
  ServeOptions sv;
  std::string policy = "prefix_affinity", auth_tokens;
  int threads = 0;
};

int RunServeCommand(ServeFlags& f) {
  TuneMallocForServer();
  ServeOptions& sv = f.sv;
  auto p = ParseRoutingPolicy(f.policy);
  if (!p.ok()) {
    std::fprintf(stderr, "mlarun serve: %s\n", p.status().ToString().c_str());
    return 2;
  }
  sv.coordinator.policy = *p;
  sv.coordinator.log_groups = true;
  if (!f.auth_tokens.empty()) {
    auto tokens = AuthTokens::ReadFile(f.auth_tokens);
    if (!tokens.ok()) {
      std::fprintf(stderr, "mlarun serve: %s\n", tokens.status().ToString().c_str());
      return 2;
    }
    sv.coordinator.auth_tokens = std::move(*tokens);
  }
  if (sv.coordinator.allow_unauthenticated_http) WarnIfOpenHttp("serve", sv.coordinator);
  int threads = f.threads;
  if (threads == 0) {
    auto layout = ParseParallelLayout(sv.parallel);
    const int ranks = layout.ok() ? layout->world() : 1;
    threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks);
  }
  sv.worker_args.insert(sv.worker_args.begin(), {"--threads", std::to_string(threads)});
  // As for the coordinator: SIGINT / SIGTERM go to one sigwait thread
  // (blocked before any thread starts; the worker job starts with them
  // unblocked).
  const sigset_t stop_signals = BlockStopSignals();
  static std::atomic<bool> stop{false};
  std::thread([stop_signals] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    std::fprintf(stderr, "mlarun serve: SIG%s: stopping\n", sigabbrev_np(sig));
    stop = true;
  }).detach();
  return RunServe(sv, &stop, std::cerr);
}

}  // namespace

void AddServeCommand(CLI::App& app, CommandTable& table) {
  auto f = std::make_shared<ServeFlags>();
  ServeOptions& sv = f->sv;
  sv.coordinator.listen = "127.0.0.1:0";
  auto* serve_cmd = app.add_subcommand(
      "serve", "One machine: the coordinator here and the workers as a supervised mpirun job, until SIGINT/SIGTERM");
  serve_cmd->add_option("--model", sv.model, "Checkpoint directory or configs/models/*.yaml")->required();
  serve_cmd->add_option("--parallel", sv.parallel, "The worker job's layout: dp=D,attn_tp=T[,moe=...]")
      ->capture_default_str();
  sv.coordinator.http_listen = "127.0.0.1:8000";
  serve_cmd
      ->add_option("--http", sv.coordinator.http_listen,
                   "host:port of the OpenAI-compatible HTTP API (loopback by default; \"\" turns it off)")
      ->capture_default_str();
  AddHttpFlags(serve_cmd, sv.coordinator);
  serve_cmd->add_option("--grpc", sv.coordinator.listen, "host:port of the gRPC client API (port 0: a free one)")
      ->capture_default_str();
  serve_cmd->add_option("--policy", f->policy, "round_robin | least_loaded | prefix_affinity")->capture_default_str();
  AddQueueFlags(serve_cmd, sv.coordinator);
  serve_cmd->add_option("--auth-token-file", f->auth_tokens,
                        "Client tokens (TOKEN [NAME] per line): the client API then needs Authorization: Bearer TOKEN");
  AddPrefixCacheSharingFlag(serve_cmd, sv.coordinator);
  serve_cmd->add_option("--threads", f->threads, "CPU threads per rank (default: the cores divided among the ranks)")
      ->check(CLI::NonNegativeNumber);
  serve_cmd->add_option("--worker-arg", sv.worker_args,
                        "One more `mlarun worker` argument, e.g. --worker-arg=--kv-dtype --worker-arg=fp32 (repeat)");
  serve_cmd->add_option("--mpirun-arg", sv.mpirun_args, "One more mpirun argument before -np (repeat)");
  serve_cmd->add_option("--ready-timeout-s", sv.ready_timeout_s, "The first job's groups must all register within this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve_cmd
      ->add_option("--restart-backoff-max-s", sv.restart_backoff_max_s,
                   "A job that died is started again after 1 s, doubling up to this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  table.Add(serve_cmd, [f](ProcessArgs) { return RunServeCommand(*f); });
}

}  // namespace mlarun::commands
