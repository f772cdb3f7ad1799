// `mlarun stats`: a coordinator's GetStats (serving/client/).
#include <iostream>
#include <memory>

#include "launcher/commands/commands.h"

namespace mlarun::commands {

void AddStatsCommand(CLI::App& app, CommandTable& table) {
  struct Flags {
    StatsOptions st;
    std::string config_path;
    SecurityFlags security;
    CLI::Option* coordinator = nullptr;  // owned by the app
  };
  auto f = std::make_shared<Flags>();
  StatsOptions& st = f->st;
  auto* stats = app.add_subcommand("stats", "Per-rank memory and load, per-group routing, from a coordinator");
  f->coordinator = stats->add_option("--coordinator", st.coordinator, "Coordinator host:port")->capture_default_str();
  stats->add_flag("--json", st.json, "The GetStats response as JSON");
  stats->add_option("--timeout", st.timeout_s, "Deadline in seconds")->capture_default_str();
  stats->add_option("--config", f->config_path, "Deployment file (configs/deploy/*.yaml); flags override it");
  AddSecurityFlags(stats, f->security, SecurityRole::kClient);
  table.Add(stats, [f](ProcessArgs) {
    DeploymentConfig dc;
    if (!LoadDeploymentFile(f->config_path, &dc)) return 2;
    FillUnset(f->coordinator, f->st.coordinator, dc.coordinator);
    if (!LoadSecurity("stats", f->security, SecurityRole::kClient, nullptr, &f->st.security, nullptr)) return 2;
    return RunStats(f->st, std::cout, std::cerr);
  });
}

}  // namespace mlarun::commands
