// The subcommands of `mlarun`, one file each (launcher/commands/*.cc), and
// the flag helpers they share.
//
// Each file provides a registration function, Add<Name>Command, that adds its
// CLI11 subcommand to the app, binds the flags to an options struct the
// command owns (kept alive by its run function), and records the run
// function in a CommandTable. main() registers every command in the order
// `mlarun --help` lists them, parses, and runs the one that parsed.
#pragma once

#include <CLI/CLI.hpp>
#include <csignal>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "runtime/request/sampling_params.h"
#include "serving/client/client.h"
#include "serving/coordinator/coordinator.h"
#include "serving/security/security.h"

namespace mlarun::commands {

// The process's arguments, for the commands that start MPI (MPI_Init may
// take its own out of them).
struct ProcessArgs {
  int* argc;
  char*** argv;
};

// A parsed subcommand's work, run once after parsing and the environment
// overrides (launcher/env.h): returns the process exit code.
using RunFunction = std::function<int(ProcessArgs args)>;

// The leaf subcommands and what each runs. Not thread-safe; used by main()
// alone. The CLI::App pointers are owned by the app they were added to.
class CommandTable {
 public:
  void Add(CLI::App* cmd, RunFunction run) { commands_.emplace_back(cmd, std::move(run)); }
  // The run function of the subcommand that parsed; null when none did.
  const RunFunction* Parsed() const {
    for (const auto& [cmd, run] : commands_)
      if (cmd->parsed()) return &run;
    return nullptr;
  }

 private:
  std::vector<std::pair<CLI::App*, RunFunction>> commands_;
};

// The registration functions, in the order of `mlarun --help`.
void AddBenchCommands(CLI::App& app, CommandTable& table);  // bench and its subcommands
void AddGenerateCommand(CLI::App& app, CommandTable& table);
void AddMemoryCommand(CLI::App& app, CommandTable& table);
void AddCoordinatorCommand(CLI::App& app, CommandTable& table);
void AddWorkerCommand(CLI::App& app, CommandTable& table);
void AddSimWorkerCommand(CLI::App& app, CommandTable& table);
void AddSubmitCommand(CLI::App& app, CommandTable& table);
void AddStatsCommand(CLI::App& app, CommandTable& table);
void AddMigrateCommand(CLI::App& app, CommandTable& table);
void AddTokenizeCommand(CLI::App& app, CommandTable& table);
void AddServeCommand(CLI::App& app, CommandTable& table);
void AddQuantizeCommand(CLI::App& app, CommandTable& table);
// `mlarun serve`'s vLLM spellings -tp and -dp (CLI11 takes one-letter short
// names only) as --tensor-parallel-size and --data-parallel-size.
void SpellOutServeShortFlags(std::vector<std::string>& words);

// ---- Flags several commands share, with one help text each (common.cc) ----

// The sampling flags `generate` and `submit` share (vLLM's SamplingParams names).
void AddSamplingFlags(CLI::App* cmd, SamplingParams& p);
void AddWeightsFlag(CLI::App* app, std::string& weights);
void AddDeviceFlag(CLI::App* app, std::string& device);
void AddFp8WeightsFlag(CLI::App* app, std::string& fp8);
void AddLmHeadFlag(CLI::App* app, std::string& lm_head);
void AddAttentionThresholdsFlag(CLI::App* app, std::string& path);

// The coordinator's flags that `coordinator` and `serve` share, one
// definition each: the request queue's (--max-queued, --queue-timeout-s,
// --lost-group-wait-s, --stall-timeout-s) and the HTTP API's
// (--served-model-name, --http-threads, --http-max-body-bytes,
// --http-request-timeout-s, --allow-unauthenticated). --http and --model are
// each command's own: their defaults differ.
void AddQueueFlags(CLI::App* cmd, CoordinatorOptions& co);
void AddHttpFlags(CLI::App* cmd, CoordinatorOptions& co);
// The coordinator's traffic log: --disable-log-requests and
// --log-stats-interval (both on by default, as in vLLM).
void AddLogFlags(CLI::App* cmd, CoordinatorOptions& co);
// --max-model-len: the longest prompt + max_tokens the coordinator takes.
void AddMaxModelLenFlag(CLI::App* cmd, CoordinatorOptions& co);
// --chat-template as vLLM takes it: a file's path, or the template itself
// (text with '{' or a newline). Replaces co.http_chat_template by the
// template's text; false, with the reason printed, when it is neither.
bool ResolveChatTemplate(const char* cmd, CoordinatorOptions& co);
// A warning on stderr when the HTTP API is to listen beyond loopback without
// client tokens (which the coordinator allows only with
// --allow-unauthenticated).
void WarnIfOpenHttp(const char* cmd, const CoordinatorOptions& co);

// The security flags of the serving commands: file paths, read after parsing
// (secrets never travel on the command line).
struct SecurityFlags {
  std::string worker_secret_file, auth_token_file;
  TlsFiles tls;
};
enum class SecurityRole { kCoordinator, kWorker, kClient };
void AddSecurityFlags(CLI::App* cmd, SecurityFlags& f, SecurityRole role);
// --prefix-cache-shared-across-principals of `coordinator` and `serve`.
void AddPrefixCacheSharingFlag(CLI::App* cmd, CoordinatorOptions& co);
// Reads what the flags name (`worker_secret`: null for clients, which have no
// such flag; `client` or `coordinator`: the side's); false, with the reason
// printed, when a file cannot be used.
bool LoadSecurity(const char* cmd, const SecurityFlags& f, SecurityRole role, std::string* worker_secret,
                  ClientSecurity* client, CoordinatorOptions* coordinator);

// The deployment file of --config (configs/deploy/*.yaml) into `dc`; an empty
// path leaves it default. False, with the reason printed, when it does not load.
bool LoadDeploymentFile(const std::string& path, DeploymentConfig* dc);
// A deployment file fills what the flags left unset: `target` takes `from`
// when `opt` was not given and `from` is not empty.
void FillUnset(const CLI::Option* opt, std::string& target, const std::string& from);

// Blocks SIGINT and SIGTERM in the calling thread (and so in the threads it
// starts afterwards) and returns that set, for one thread to sigwait on:
// what a stop does is not something a signal handler may call.
sigset_t BlockStopSignals();

// A command's exit status: 0 when `st` is OK, else `st` on stderr and 2 for
// bad input (InvalidArgument), 1 for anything else.
int ExitStatus(const char* cmd, const Status& st);

}  // namespace mlarun::commands
