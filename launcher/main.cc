// mlarun: the command-line entry point. The only place that exits.
//
// Each subcommand registers its flags and its run function from a file of its
// own (launcher/commands/); this parses the command line and runs the one
// subcommand it names.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "launcher/cli_typos.h"
#include "launcher/commands/commands.h"
#include "launcher/env.h"

int main(int argc, char** argv) {
  namespace commands = mlarun::commands;
  CLI::App app{"mlarun: a runtime for DeepSeek-style Multi-head Latent Attention models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", MLARUN_VERSION);
  // In the order `mlarun --help` lists them.
  commands::CommandTable table;
  commands::AddBenchCommands(app, table);
  commands::AddGenerateCommand(app, table);
  commands::AddMemoryCommand(app, table);
  commands::AddCoordinatorCommand(app, table);
  commands::AddWorkerCommand(app, table);
  commands::AddSimWorkerCommand(app, table);
  commands::AddSubmitCommand(app, table);
  commands::AddStatsCommand(app, table);
  commands::AddMigrateCommand(app, table);
  commands::AddTokenizeCommand(app, table);
  commands::AddServeCommand(app, table);
  commands::AddQuantizeCommand(app, table);

  std::vector<std::string> words(argv, argv + argc);
  commands::SpellOutServeShortFlags(words);
  std::vector<char*> spelled;
  for (std::string& w : words) spelled.push_back(w.data());
  spelled.push_back(nullptr);
  argv = spelled.data();
  if (const auto typo = mlarun::FindTypo(app, argc, argv)) {
    std::fprintf(stderr, "mlarun %s\nRun with --help for more information.\n", typo->c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help is 0; every usage error is 2
  }
  if (const mlarun::Status env = mlarun::ApplyEnvironmentOverrides(); !env.ok()) {
    std::fprintf(stderr, "mlarun: %s\n", env.ToString().c_str());
    return 2;
  }
  const commands::RunFunction* run = table.Parsed();
  return run == nullptr ? 0 : (*run)(commands::ProcessArgs{&argc, &argv});
}
