// `mlarun coordinator`: the client API (gRPC, optionally HTTP) routing
// requests to the workers' DP groups, until SIGINT/SIGTERM.
#include <cstdio>
#include <memory>
#include <thread>

#include "base/memory_tuning.h"
#include "launcher/commands/commands.h"

namespace mlarun::commands {
namespace {

struct CoordinatorFlags {
  CoordinatorOptions co;
  std::string policy = "prefix_affinity";
  std::string config_path;
  SecurityFlags security;
  // Owned by the app: whether a flag was given, against the --config file.
  CLI::Option *listen = nullptr, *policy_opt = nullptr, *http = nullptr;
};

int RunCoordinatorCommand(CoordinatorFlags& f) {
  TuneMallocForServer();
  CoordinatorOptions& co = f.co;
  DeploymentConfig dc;
  if (!LoadDeploymentFile(f.config_path, &dc)) return 2;
  FillUnset(f.listen, co.listen, dc.listen);
  FillUnset(f.policy_opt, f.policy, dc.policy);
  auto p = ParseRoutingPolicy(f.policy);
  if (!p.ok()) {
    std::fprintf(stderr, "mlarun coordinator: %s\n", p.status().ToString().c_str());
    return 2;
  }
  co.policy = *p;
  co.log_groups = true;
  if (!ResolveChatTemplate("coordinator", co)) return 2;
  if (!LoadSecurity("coordinator", f.security, SecurityRole::kCoordinator, &co.worker_secret, nullptr, &co)) return 2;
  if (f.http->count() > 0 && co.http_listen.empty()) co.http_listen = "127.0.0.1:8000";
  // SIGINT / SIGTERM are taken by one thread with sigwait (blocked here,
  // before gRPC starts its threads, so they inherit the mask): Shutdown is
  // not something a signal handler may call.
  const sigset_t stop_signals = BlockStopSignals();
  auto server = Coordinator::Start(co);
  if (!server.ok()) return ExitStatus("coordinator", server.status());
  WarnIfOpenHttp("coordinator", co);
  std::fprintf(stderr, "mlarun coordinator: listening on %s, policy %s\n", (*server)->address().c_str(),
               std::string(RoutingPolicyName(co.policy)).c_str());
  if (f.http->count() > 0)
    std::fprintf(stderr, "mlarun coordinator: HTTP API on http://%s\n", (*server)->http_address().c_str());
  std::thread stopper([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    (*server)->Shutdown();
  });
  stopper.join();
  (*server)->Wait();
  return 0;
}

}  // namespace

void AddCoordinatorCommand(CLI::App& app, CommandTable& table) {
  auto f = std::make_shared<CoordinatorFlags>();
  CoordinatorOptions& co = f->co;
  auto* coord = app.add_subcommand("coordinator", "Serve the client API and route requests to the workers' DP groups");
  f->listen =
      coord->add_option("--listen", co.listen, "host:port to bind (loopback by default)")->capture_default_str();
  f->policy_opt =
      coord->add_option("--policy", f->policy, "round_robin | least_loaded | prefix_affinity")->capture_default_str();
  AddQueueFlags(coord, co);
  coord->add_option("--config", f->config_path, "Deployment file (configs/deploy/*.yaml); flags override it");
  f->http = coord
                ->add_option("--http", co.http_listen,
                             "Serve the OpenAI-compatible HTTP API and /metrics on host:port (off unless given; "
                             "127.0.0.1:8000 when given without a value)")
                ->expected(0, 1);
  coord->add_option("--model", co.http_model,
                    "With --http: the model (configs/models/*.yaml, checkpoint or tokenizer directory); only its "
                    "tokenizer, chat template and name are read");
  AddHttpFlags(coord, co);
  AddLogFlags(coord, co);
  AddMaxModelLenFlag(coord, co);
  AddSecurityFlags(coord, f->security, SecurityRole::kCoordinator);
  AddPrefixCacheSharingFlag(coord, co);
  table.Add(coord, [f](ProcessArgs) { return RunCoordinatorCommand(*f); });
}

}  // namespace mlarun::commands
