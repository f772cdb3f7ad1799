// `mlarun submit`: requests to a coordinator (serving/client/).
#include <cstdio>
#include <iostream>
#include <memory>

#include "launcher/commands/commands.h"

namespace mlarun::commands {

void AddSubmitCommand(CLI::App& app, CommandTable& table) {
  struct Flags {
    SubmitOptions sub;
    std::string config_path;
    SecurityFlags security;
    CLI::Option* coordinator = nullptr;  // owned by the app
  };
  auto f = std::make_shared<Flags>();
  SubmitOptions& sub = f->sub;
  auto* submit = app.add_subcommand("submit", "Send one request to a coordinator");
  f->coordinator = submit->add_option("--coordinator", sub.coordinator, "Coordinator host:port")->capture_default_str();
  auto* s_ids = submit->add_option("--prompt-ids", sub.prompt_ids, "Prompt token ids: 1,2,3")->delimiter(',');
  auto* s_file = submit->add_option("--prompts", sub.prompts_path, "JSON lines, sent --concurrency at a time");
  s_ids->excludes(s_file);
  submit->add_option("--concurrency", sub.concurrency, "Requests in flight at once (with --prompts)")
      ->capture_default_str();
  AddSamplingFlags(submit, sub.sampling);
  submit->add_option("--request-id", sub.request_id, "Request id (default: the coordinator picks one)")
      ->excludes(s_file);
  submit->add_flag("--stream", sub.stream, "Print each token as it arrives")->excludes(s_file);
  submit->add_flag("--json", sub.json, "The object mlarun generate prints, plus dp_group");
  submit->add_option("--timeout", sub.timeout_s, "Deadline in seconds")->capture_default_str();
  submit->add_option("--config", f->config_path, "Deployment file (configs/deploy/*.yaml); flags override it");
  AddSecurityFlags(submit, f->security, SecurityRole::kClient);
  table.Add(submit, [f](ProcessArgs) {
    DeploymentConfig dc;
    if (!LoadDeploymentFile(f->config_path, &dc)) return 2;
    FillUnset(f->coordinator, f->sub.coordinator, dc.coordinator);
    if (!LoadSecurity("submit", f->security, SecurityRole::kClient, nullptr, &f->sub.security, nullptr)) return 2;
    if (f->sub.prompt_ids.empty() && f->sub.prompts_path.empty()) {
      std::fprintf(stderr, "mlarun submit: give --prompt-ids or --prompts\n");
      return 2;
    }
    return RunSubmit(f->sub, std::cout, std::cerr);
  });
}

}  // namespace mlarun::commands
