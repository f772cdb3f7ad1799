// `mlarun sim-worker`: simulated DP groups without a model (serving/sim/).
#include "serving/sim/sim_worker.h"

#include <atomic>
#include <csignal>
#include <iostream>
#include <memory>

#include "launcher/commands/commands.h"

namespace mlarun::commands {

void AddSimWorkerCommand(CLI::App& app, CommandTable& table) {
  struct Flags {
    SimWorkerOptions so;
    SecurityFlags security;
  };
  auto f = std::make_shared<Flags>();
  SimWorkerOptions& so = f->so;
  auto* sim = app.add_subcommand("sim-worker", "Simulated DP groups without a model (tests, examples, benchmarks)");
  sim->add_option("--coordinator", so.coordinator, "Coordinator host:port")->capture_default_str();
  sim->add_option("--groups", so.groups, "DP groups to simulate")->capture_default_str()->check(CLI::PositiveNumber);
  sim->add_option("--tokens-per-s", so.tokens_per_s, "Per group; 0: as fast as possible")->capture_default_str();
  sim->add_option("--step-ms", so.step_ms, "Fixed cost per step: a step of n tokens takes step-ms + n / tokens-per-s")
      ->capture_default_str();
  sim->add_option("--prefill-tokens-per-s", so.prefill_tokens_per_s,
                  "Per group: the cost of prompt tokens, computed in chunks of --max-batched-tokens per step; 0: "
                  "prompts are free")
      ->capture_default_str();
  sim->add_option("--max-batched-tokens", so.max_batched_tokens,
                  "Prompt tokens computed per step at most (with --prefill-tokens-per-s)")
      ->capture_default_str();
  sim->add_option("--role", so.role,
                  "What the groups serve: mixed, prefill (new requests, handed to a decode group after their first "
                  "token) or decode (requests handed over)")
      ->check(CLI::IsMember({"mixed", "prefill", "decode"}))
      ->capture_default_str();
  sim->add_option("--transfer-gbps", so.transfer_gbps,
                  "Simulated block moves between groups at this many Gbit/s (a moved request's blocks are fetched, "
                  "not computed); 0: off")
      ->capture_default_str();
  sim->add_option("--worker-id", so.worker_id, "Worker id to register with")->capture_default_str();
  sim->add_option("--vocab-size", so.vocab_size, "Vocabulary size")->capture_default_str();
  AddSecurityFlags(sim, f->security, SecurityRole::kWorker);
  sim->add_option("--block-size", so.block_size, "Tokens per cache block")->capture_default_str();
  sim->add_option("--cache-blocks", so.cache_blocks, "Simulated cache blocks per group")->capture_default_str();
  sim->add_option("--max-position-embeddings", so.max_position_embeddings, "Longest prompt + max_tokens accepted")
      ->capture_default_str();
  sim->add_option("--eos-token-id", so.eos_token_id, "Stop at this id unless ignore_eos (-1: never)")
      ->capture_default_str();
  sim->add_option("--script", so.script, "Every request's tokens, comma-separated (tests); it stops after the last")
      ->delimiter(',');
  table.Add(sim, [f](ProcessArgs) {
    ClientSecurity client;
    if (!LoadSecurity("sim-worker", f->security, SecurityRole::kWorker, &f->so.worker_secret, &client, nullptr))
      return 2;
    f->so.tls = client.tls;
    static std::atomic<bool> stop{false};
    std::signal(SIGINT, [](int) { stop = true; });
    std::signal(SIGTERM, [](int) { stop = true; });
    return RunSimWorker(f->so, &stop, std::cerr);
  });
}

}  // namespace mlarun::commands
