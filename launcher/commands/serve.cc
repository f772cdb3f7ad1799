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
#include "launcher/worker/worker.h"
#include "parallel/layout.h"

namespace mlarun::commands {
namespace {

struct ServeFlags {
  ServeOptions sv;
  std::string policy = "prefix_affinity", auth_tokens;
  int threads = 0;
  // vLLM's spellings, mapped onto the flags above.
  std::string model_arg, host, api_key;
  int port = 0, tensor_parallel = 0, data_parallel = 0;
  bool dp_attention = false;
  CLI::Option *http = nullptr, *parallel = nullptr;
  // vLLM's engine flags, given to the workers as theirs (EngineWorkerArgs).
  std::string kv_cache_dtype;
  int64_t max_num_seqs = 0, max_num_batched_tokens = 0;
  bool prefix_caching = true;
  CLI::Option* prefix_caching_opt = nullptr;
  // The worker flags serve takes under their own names (checked here as the
  // worker checks them, passed on as given) and the worker's defaults.
  std::vector<CLI::Option*> worker_flags;
  WorkerOptions worker;
};

// --kv-cache-dtype's value as the worker's --kv-dtype ("" for auto: the
// model's), or the usage error.
std::string WorkerKvDtype(const std::string& v, std::string* error) {
  if (v.empty() || v == "auto") return "";
  if (v == "bf16" || v == "bfloat16") return "bf16";
  if (v == "fp32" || v == "float32" || v == "float") return "fp32";
  if (v.starts_with("fp8"))
    *error = "--kv-cache-dtype " + v + ": mlarun's latent cache holds bf16 or fp32, not fp8 (use auto or bfloat16)";
  else
    *error = "--kv-cache-dtype " + v + ": expected auto, bfloat16 (bf16) or float32 (fp32)";
  return "";
}

// The engine flags as `mlarun worker` flags, before --worker-arg's (which
// may not repeat one of them). Returns the usage error, or "".
std::string EngineWorkerArgs(ServeFlags& f) {
  std::vector<std::pair<std::string, std::string>> mapped;  // (serve flag, worker flag)
  std::vector<std::string> args;
  std::string error;
  if (const std::string kv = WorkerKvDtype(f.kv_cache_dtype, &error); !kv.empty()) {
    args.insert(args.end(), {"--kv-dtype", kv});
    mapped.emplace_back("--kv-cache-dtype", "--kv-dtype");
  }
  if (!error.empty()) return error;
  if (f.max_num_seqs > 0) {
    args.insert(args.end(), {"--max-num-seqs", std::to_string(f.max_num_seqs)});
    mapped.emplace_back("--max-num-seqs", "--max-num-seqs");
  }
  if (f.max_num_batched_tokens > 0) {
    args.insert(args.end(), {"--max-batched-tokens", std::to_string(f.max_num_batched_tokens)});
    mapped.emplace_back("--max-num-batched-tokens", "--max-batched-tokens");
  }
  if (f.prefix_caching_opt->count() > 0) {
    args.push_back(f.prefix_caching ? "--enable-prefix-caching" : "--no-enable-prefix-caching");
    mapped.emplace_back("--[no-]enable-prefix-caching", "--[no-]enable-prefix-caching");
  }
  for (const CLI::Option* opt : f.worker_flags) {
    if (opt->count() == 0) continue;
    const std::string flag = "--" + opt->get_lnames().front();
    args.insert(args.end(), {flag, opt->results().back()});
    mapped.emplace_back(flag, flag);
  }
  for (const auto& [serve_flag, worker_flag] : mapped) {
    for (const std::string& a : f.sv.worker_args) {
      const bool same = worker_flag.starts_with("--[no-]")
                            ? a.starts_with("--enable-prefix-caching") || a.starts_with("--no-enable-prefix-caching")
                            : a == worker_flag || a.starts_with(worker_flag + "=");
      if (same) return serve_flag + " and --worker-arg=" + a + ": give one";
    }
  }
  f.sv.worker_args.insert(f.sv.worker_args.begin(), args.begin(), args.end());
  return "";
}

// vLLM's flags as serve's own: MODEL, --host/--port, -tp/-dp with
// --enable-dp-attention. Returns the usage error, or "".
std::string ApplyVllmFlags(ServeFlags& f) {
  ServeOptions& sv = f.sv;
  if (!f.model_arg.empty()) {
    if (!sv.model.empty() && sv.model != f.model_arg)
      return "MODEL '" + f.model_arg + "' and --model '" + sv.model + "' differ: give one";
    sv.model = f.model_arg;
  }
  if (!f.host.empty() || f.port != 0) {
    if (f.http->count() > 0) return "--http or --host/--port, not both";
    const std::string host = f.host.empty() ? "127.0.0.1" : f.host;
    const bool v6 = host.find(':') != std::string::npos && !host.starts_with("[");
    sv.coordinator.http_listen = (v6 ? "[" + host + "]" : host) + ":" + std::to_string(f.port != 0 ? f.port : 8000);
  }
  const int tp = f.tensor_parallel, dp = f.data_parallel;
  if (tp == 0 && dp == 0) {
    if (f.dp_attention) return "--enable-dp-attention needs --data-parallel-size (-dp)";
    return "";
  }
  if (f.parallel->count() > 0) return "--parallel or --tensor-parallel-size/--data-parallel-size, not both";
  // Every DP group of mlarun is DP attention: the MLP and experts are
  // sharded over all ranks, so there are no independent replicas.
  if (dp > 1 && !f.dp_attention)
    return "--data-parallel-size " + std::to_string(dp) +
           " without --enable-dp-attention: mlarun's DP groups share the MLP and experts (DP attention); add "
           "--enable-dp-attention, or run one serve per replica";
  sv.parallel = "dp=" + std::to_string(std::max(dp, 1)) + ",attn_tp=" + std::to_string(std::max(tp, 1));
  return "";
}

// An API key given as a flag (or MLARUN_API_KEY): one more client token.
std::string AddApiKey(const std::string& key, CoordinatorOptions& co) {
  constexpr size_t kMinKey = 16;
  if (key.size() < kMinKey) return "--api-key: at least 16 characters (make one with `openssl rand -hex 32`)";
  for (const char c : key) {
    if (c <= ' ' || c > '~') return "--api-key: printable ASCII without spaces";
  }
  std::vector<Principal> principals = co.auth_tokens.principals();
  for (const Principal& p : principals) {
    if (p.token == key) return "--api-key: the same token as " + p.name + " of --auth-token-file";
  }
  principals.push_back(Principal{.token = key, .name = "api-key"});
  co.auth_tokens = AuthTokens(std::move(principals));
  return "";
}

int RunServeCommand(ServeFlags& f) {
  TuneMallocForServer();
  ServeOptions& sv = f.sv;
  for (const std::string& e : {ApplyVllmFlags(f), EngineWorkerArgs(f)}) {
    if (e.empty()) continue;
    std::fprintf(stderr, "mlarun serve: %s\n", e.c_str());
    return 2;
  }
  if (!ResolveChatTemplate("serve", sv.coordinator)) return 2;
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
  if (!f.api_key.empty()) {
    if (const std::string e = AddApiKey(f.api_key, sv.coordinator); !e.empty()) {
      std::fprintf(stderr, "mlarun serve: %s\n", e.c_str());
      return 2;
    }
  }
  if (sv.coordinator.allow_unauthenticated_http) WarnIfOpenHttp("serve", sv.coordinator);
  int threads = f.threads;
  if (threads == 0) {
    auto layout = ParseParallelLayout(sv.parallel);
    int ranks = layout.ok() ? layout->world() : 1;
    if (!sv.prefill_parallel.empty()) {
      auto prefill = ParseParallelLayout(sv.prefill_parallel);
      ranks += prefill.ok() ? prefill->world() : 0;
    }
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
    std::fprintf(stderr, "mlarun serve: SIG%s: shutting down on request\n", sigabbrev_np(sig));
    stop = true;
  }).detach();
  return RunServe(sv, &stop, std::cerr);
}

}  // namespace

void SpellOutServeShortFlags(std::vector<std::string>& words) {
  if (words.size() < 2 || words[1] != "serve") return;
  for (size_t i = 2; i < words.size() && words[i] != "--"; ++i) {
    for (const auto& [shorter, longer] : {std::pair<std::string, std::string>{"-tp", "--tensor-parallel-size"},
                                          std::pair<std::string, std::string>{"-dp", "--data-parallel-size"}}) {
      if (words[i] == shorter || words[i].starts_with(shorter + "="))
        words[i] = longer + words[i].substr(shorter.size());
    }
  }
}

namespace {

// The worker flags that matter to a one-machine deployment, as serve's
// own: the same names, help and checks as `mlarun worker`'s.
void AddWorkerFlags(CLI::App* cmd, ServeFlags& f) {
  WorkerOptions& wo = f.worker;
  AddDeviceFlag(cmd, wo.deployment.device);
  AddWeightsFlag(cmd, wo.deployment.weights);
  AddFp8WeightsFlag(cmd, wo.deployment.fp8_weights);
  AddLmHeadFlag(cmd, wo.deployment.lm_head);
  AddAttentionThresholdsFlag(cmd, wo.deployment.attention_thresholds);
  for (const char* name : {"--device", "--weights", "--fp8-weights", "--lm-head", "--attention-thresholds"})
    f.worker_flags.push_back(cmd->get_option(name));
  f.worker_flags.push_back(
      cmd->add_option("--block-size", wo.engine.block_size, "Tokens per cache block (the workers' --block-size)")
          ->capture_default_str()
          ->check(CLI::PositiveNumber));
  CLI::Option* cache_bytes =
      cmd->add_option("--cache-bytes", wo.engine.cache_budget_bytes, "Latent cache budget per rank (the workers')")
          ->capture_default_str()
          ->check(CLI::PositiveNumber);
  f.worker_flags.push_back(cache_bytes);
  f.worker_flags.push_back(cmd->add_option("--memory-gib", wo.memory_gib,
                                           "Memory per rank: the cache gets what the weights and the prefill "
                                           "workspace leave (the workers'; as mlarun memory predicts)")
                               ->check(CLI::PositiveNumber)
                               ->excludes(cache_bytes));
}

}  // namespace

void AddServeCommand(CLI::App& app, CommandTable& table) {
  auto f = std::make_shared<ServeFlags>();
  ServeOptions& sv = f->sv;
  sv.coordinator.listen = "127.0.0.1:0";
  auto* serve_cmd = app.add_subcommand(
      "serve", "One machine: the coordinator here and the workers as a supervised mpirun job, until SIGINT/SIGTERM");
  serve_cmd->set_version_flag("--version", MLARUN_VERSION);
  serve_cmd->add_option("MODEL", f->model_arg, "The model, as --model (vLLM's positional form)");
  serve_cmd->add_option("--model", sv.model, "Checkpoint directory or configs/models/*.yaml");
  f->parallel = serve_cmd->add_option("--parallel", sv.parallel, "The worker job's layout: dp=D,attn_tp=T[,moe=...]")
                    ->capture_default_str();
  serve_cmd->add_option("--prefill-parallel", sv.prefill_parallel,
                        "Disaggregate: a prefill job of this layout beside the decode job (--parallel), blocks "
                        "handed over UCX (the workers' --role and --transfer)");
  serve_cmd->add_option("--tensor-parallel-size", f->tensor_parallel, "-tp N: attention TP over N ranks (--parallel)")
      ->check(CLI::Range(1, 4096));
  serve_cmd->add_option("--data-parallel-size", f->data_parallel, "-dp D: D DP-attention groups (--parallel dp=D)")
      ->check(CLI::Range(1, 4096));
  serve_cmd->add_flag("--enable-dp-attention", f->dp_attention, "With -dp: DP attention, the only DP mlarun has");
  sv.coordinator.http_listen = "127.0.0.1:8000";
  f->http = serve_cmd
                ->add_option("--http", sv.coordinator.http_listen,
                             "host:port of the OpenAI-compatible HTTP API (loopback by default; \"\" turns it off)")
                ->capture_default_str();
  serve_cmd->add_option("--host", f->host, "The HTTP API's host, as --http HOST:PORT (default 127.0.0.1)");
  serve_cmd->add_option("--port", f->port, "The HTTP API's port, as --http HOST:PORT (default 8000)")
      ->check(CLI::Range(1, 65535));
  AddMaxModelLenFlag(serve_cmd, sv.coordinator);
  AddHttpFlags(serve_cmd, sv.coordinator);
  AddLogFlags(serve_cmd, sv.coordinator);
  serve_cmd->add_option("--kv-cache-dtype", f->kv_cache_dtype,
                        "The latent cache's dtype: auto (the model's), bfloat16 or float32 (the workers' --kv-dtype)");
  serve_cmd
      ->add_option("--max-num-seqs", f->max_num_seqs, "Running requests per DP group (the workers' --max-num-seqs)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  serve_cmd
      ->add_option("--max-num-batched-tokens", f->max_num_batched_tokens,
                   "Tokens per engine step (the workers' --max-batched-tokens)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  AddWorkerFlags(serve_cmd, *f);
  f->prefix_caching_opt = serve_cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", f->prefix_caching,
                                              "Reuse cached prompt prefixes (default on; the workers' flag)");
  serve_cmd->add_option("--grpc", sv.coordinator.listen, "host:port of the gRPC client API (port 0: a free one)")
      ->capture_default_str();
  serve_cmd->add_option("--policy", f->policy, "round_robin | least_loaded | prefix_affinity")->capture_default_str();
  AddQueueFlags(serve_cmd, sv.coordinator);
  serve_cmd->add_option("--auth-token-file", f->auth_tokens,
                        "Client tokens (TOKEN [NAME] per line): the client API then needs Authorization: Bearer TOKEN");
  serve_cmd
      ->add_option("--api-key", f->api_key,
                   "One more client token (as vLLM's; visible in ps: --auth-token-file or MLARUN_API_KEY is safer)")
      ->envname("MLARUN_API_KEY");
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
