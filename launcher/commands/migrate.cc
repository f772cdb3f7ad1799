// `mlarun migrate`: moves a running request to another DP group
// (serving/client/).
#include <iostream>
#include <memory>

#include "launcher/commands/commands.h"

namespace mlarun::commands {

void AddMigrateCommand(CLI::App& app, CommandTable& table) {
  struct Flags {
    MigrateOptions mo;
    std::string config_path;
    SecurityFlags security;
    CLI::Option* coordinator = nullptr;  // owned by the app
  };
  auto f = std::make_shared<Flags>();
  MigrateOptions& mo = f->mo;
  auto* migrate =
      app.add_subcommand("migrate", "Move a running request to another DP group; returns once it runs there");
  f->coordinator = migrate->add_option("--coordinator", mo.coordinator, "Coordinator host:port")->capture_default_str();
  migrate->add_option("--request-id", mo.request_id, "The request to move (its id as submitted)")->required();
  migrate->add_option("--to-group", mo.to_group, "The DP group to move it to (default: the coordinator picks)")
      ->check(CLI::NonNegativeNumber);
  migrate->add_option("--to-worker-id", mo.to_worker_id,
                      "The worker job of --to-group, where several jobs have that DP group");
  migrate->add_option("--timeout", mo.timeout_s, "Deadline in seconds")->capture_default_str();
  migrate->add_option("--config", f->config_path, "Deployment file (configs/deploy/*.yaml); flags override it");
  AddSecurityFlags(migrate, f->security, SecurityRole::kClient);
  table.Add(migrate, [f](ProcessArgs) {
    DeploymentConfig dc;
    if (!LoadDeploymentFile(f->config_path, &dc)) return 2;
    FillUnset(f->coordinator, f->mo.coordinator, dc.coordinator);
    if (!LoadSecurity("migrate", f->security, SecurityRole::kClient, nullptr, &f->mo.security, nullptr)) return 2;
    return RunMigrate(f->mo, std::cout, std::cerr);
  });
}

}  // namespace mlarun::commands
