// What the subcommands share: flags, their loading, exit codes (commands.h).
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "launcher/commands/commands.h"

namespace mlarun::commands {

void AddSamplingFlags(CLI::App* cmd, SamplingParams& p) {
  cmd->add_option("--max-tokens", p.max_tokens, "Tokens to generate at most")->capture_default_str();
  cmd->add_option("--temperature", p.temperature, "0: greedy")->capture_default_str();
  cmd->add_option("--top-p", p.top_p, "Nucleus sampling mass")->capture_default_str();
  cmd->add_option("--top-k", p.top_k, "Keep the k most likely tokens (0: off)")->capture_default_str();
  cmd->add_option("--seed", p.seed, "Per-request random seed")->capture_default_str();
  cmd->add_option("--stop-token-ids", p.stop_token_ids, "Stop at any of these ids")->delimiter(',');
  cmd->add_flag("--ignore-eos", p.ignore_eos, "Do not stop at the model's eos_token_id");
  cmd->add_option("--logprobs", p.logprobs, "Also report the N most likely tokens of each step (0-20)")
      ->capture_default_str();
  cmd->add_option("--prompt-logprobs", p.prompt_logprobs,
                  "Also report each prompt token's logprob and its position's N most likely tokens (0-20; -1: off)")
      ->capture_default_str();
}

void AddWeightsFlag(CLI::App* app, std::string& weights) {
  app->add_option("--weights", weights, "Checkpoint weights: mapped (read in place) or copied (huge-page copies)")
      ->capture_default_str();
}
void AddDeviceFlag(CLI::App* app, std::string& device) {
  app->add_option("--device", device,
                  "Where the model runs: cpu, or cuda (one GPU per rank: the rank on its node picks it; NCCL between "
                  "ranks)")
      ->capture_default_str();
}
void AddFp8WeightsFlag(CLI::App* app, std::string& fp8) {
  app->add_option("--fp8-weights", fp8,
                  "Checkpoints whose projections are F8_E4M3 (DeepSeek-V3's release): keep them fp8 in memory, or "
                  "dequantize to the config's dtype at load")
      ->capture_default_str();
}
void AddLmHeadFlag(CLI::App* app, std::string& lm_head) {
  app->add_option("--lm-head", lm_head,
                  "The output layer: keep (as stored), or int8 (per channel) / int4 (groups of 128) quantized at "
                  "load where the checkpoint stores it unquantized")
      ->capture_default_str();
}
void AddAttentionThresholdsFlag(CLI::App* app, std::string& path) {
  app->add_option(
      "--attention-thresholds", path,
      "Absorbed/expanded dispatch thresholds measured on this machine (bench attention --write-thresholds)");
}

void AddQueueFlags(CLI::App* cmd, CoordinatorOptions& co) {
  cmd->add_option("--max-queued", co.max_queued, "Requests waiting for a group before RESOURCE_EXHAUSTED")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--queue-timeout-s", co.queue_timeout_s,
                  "Longest wait of a request for a DP group to register when none is connected")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--lost-group-wait-s", co.lost_group_wait_s,
                  "After the last group went away, how long its unanswered requests wait for one to come back")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--stall-timeout-s", co.stall_timeout_s,
                  "A group with requests in flight that sends nothing this long is taken as stalled and dropped")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--rebalance-threshold", co.rebalance_threshold,
                  "Move a running request from the busiest DP group to the least busy one when they differ by at "
                  "least this many requests (0: never)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--rebalance-cache-fraction", co.rebalance_cache_fraction,
                  "Move the running request holding the most cache rows from the DP group whose cache is fullest to "
                  "the emptiest one when their cache use differs by at least this fraction (0: never)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--rebalance-period-s", co.rebalance_period_s, "At most one rebalancing move this often")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--rebalance-cooldown-s", co.rebalance_cooldown_s,
                  "A request that moved is not moved again by rebalancing for this long")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--prefix-fetch-min-tokens", co.prefix_fetch_min_tokens,
                  "Fetch a prompt prefix another DP group caches (both with --transfer) when it holds at least this "
                  "many more tokens of it than the request's own group (0: never)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
}

void AddHttpFlags(CLI::App* cmd, CoordinatorOptions& co) {
  cmd->add_option("--served-model-name", co.served_model_name,
                  "HTTP API: the model name clients send (default: --model's basename without .yaml)");
  cmd->add_option("--http-threads", co.http_threads,
                  "HTTP API: handler threads (each generation request or stream holds one; beyond them, 503)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--http-max-header-bytes", co.http_max_header_bytes,
                  "HTTP API: a request's header block beyond this gets 431")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1024}, int64_t{1} << 30));
  cmd->add_option("--http-header-timeout-s", co.http_header_timeout_s,
                  "HTTP API: the whole header block must arrive within this long of its first byte (408)")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 86400.0));
  cmd->add_option("--http-body-timeout-s", co.http_body_timeout_s,
                  "HTTP API: the whole body must arrive within this long of the header (408)")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 86400.0));
  cmd->add_option("--http-max-connections", co.http_max_connections,
                  "HTTP API: open connections in all; beyond them a new one gets 503")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--http-max-connections-per-peer", co.http_max_connections_per_peer,
                  "HTTP API: open connections from one client address (loopback exempt); beyond them, 503")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--allowed-origins", co.http_allowed_origins,
                  "HTTP API: origins whose web pages may call it (CORS; '*' for any); others get 403")
      ->delimiter(',');
  cmd->add_option("--allowed-hosts", co.http_allowed_hosts,
                  "HTTP API without tokens: Host names answered besides IP addresses and localhost ('*': any)")
      ->delimiter(',');
  cmd->add_option("--http-max-body-bytes", co.http_max_body_bytes, "HTTP API: larger request bodies get 413")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1024}, int64_t{1} << 40));
  cmd->add_option("--http-request-timeout-s", co.http_request_timeout_s,
                  "HTTP API: each request's deadline (504 when it passes); 0: none")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--reasoning-parser", co.http_reasoning_parser,
                  "HTTP API: split chat answers' reasoning (up to </think>) into reasoning_content")
      ->check(CLI::IsMember({"deepseek_r1"}));
  cmd->add_option("--tool-call-parser", co.http_tool_call_parser,
                  "HTTP API: read the model's tool calls out of chat answers (with --enable-auto-tool-choice)")
      ->check(CLI::IsMember({"deepseek_v3"}));
  cmd->add_flag("--enable-auto-tool-choice", co.http_enable_auto_tool_choice,
                "HTTP API: chat requests with tools (tool_choice \"auto\") get the calls as message.tool_calls");
  cmd->add_option("--tokenizer", co.http_tokenizer_path,
                  "HTTP API: the tokenizer's directory (tokenizer.json, tokenizer_config.json) instead of --model's");
  cmd->add_option("--chat-template", co.http_chat_template,
                  "HTTP API: a chat template (a file, or the template itself) instead of the tokenizer's");
  cmd->add_flag("--skip-tokenizer-init", co.http_skip_tokenizer_init,
                "HTTP API without a tokenizer: completions of token-id prompts answered as token_ids, no text");
  cmd->add_flag("--allow-unauthenticated", co.allow_unauthenticated_http,
                "Let --http bind beyond loopback without --auth-token-file: anyone who reaches it may use the model");
}

void AddLogFlags(CLI::App* cmd, CoordinatorOptions& co) {
  co.log_requests = true;
  co.log_stats_interval_s = 10;
  cmd->add_flag(
      "--disable-log-requests{false}", co.log_requests,
      "No line per finished request (request id, token counts, TTFT, duration, finish reason; never the prompt)");
  cmd->add_option("--log-stats-interval", co.log_stats_interval_s,
                  "Seconds between stats lines (throughput, running and waiting requests, cache use, prefix-cache "
                  "hit rate), printed only when something happened; 0: none")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 86400.0));
}

void AddMaxModelLenFlag(CLI::App* cmd, CoordinatorOptions& co) {
  cmd->add_option("--max-model-len", co.max_model_len,
                  "Refuse requests whose prompt + max_tokens exceed this (default: the model's context)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
}

bool ResolveChatTemplate(const char* cmd, CoordinatorOptions& co) {
  std::string& value = co.http_chat_template;
  if (value.empty()) return true;
  std::error_code ec;
  if (std::filesystem::is_regular_file(value, ec)) {
    std::ifstream in(value, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    if (!in) {
      std::fprintf(stderr, "mlarun %s: --chat-template %s: cannot read it\n", cmd, value.c_str());
      return false;
    }
    value = text.str();
    return true;
  }
  if (value.find_first_of("{\n") != std::string::npos) return true;  // the template itself
  std::fprintf(stderr, "mlarun %s: --chat-template %s: no such file (nor a template: it has no '{')\n", cmd,
               value.c_str());
  return false;
}

void WarnIfOpenHttp(const char* cmd, const CoordinatorOptions& co) {
  if (co.http_listen.empty() || !co.auth_tokens.empty() || IsLoopbackListenAddress(co.http_listen)) return;
  std::fprintf(stderr,
               "mlarun %s: warning: the HTTP API on %s takes requests from anyone who reaches it "
               "(--allow-unauthenticated without --auth-token-file)\n",
               cmd, co.http_listen.c_str());
}

void AddSecurityFlags(CLI::App* cmd, SecurityFlags& f, SecurityRole role) {
  using R = SecurityRole;
  if (role == R::kCoordinator) {
    cmd->add_option("--worker-secret-file", f.worker_secret_file,
                    "File holding the worker link's shared secret (trimmed); workers must present it "
                    "(it or --tls-ca is required when --listen is beyond loopback)");
    cmd->add_option("--auth-token-file", f.auth_token_file,
                    "Client API tokens, one per line (TOKEN [NAME]): clients must send `authorization: Bearer TOKEN`");
    cmd->add_option("--tls-cert", f.tls.cert, "TLS: the coordinator's certificate chain (PEM)");
    cmd->add_option("--tls-key", f.tls.key, "TLS: its private key (PEM)");
    cmd->add_option("--tls-ca", f.tls.ca,
                    "TLS: workers with a client certificate signed by this CA (PEM) need no secret");
    return;
  }
  if (role == R::kWorker) {
    cmd->add_option("--worker-secret-file", f.worker_secret_file,
                    "File holding the coordinator's worker secret (as its --worker-secret-file)");
    cmd->add_option("--tls-cert", f.tls.cert, "TLS: this worker's client certificate (PEM; needs --tls-ca)");
    cmd->add_option("--tls-key", f.tls.key, "TLS: its private key (PEM)");
  } else {
    cmd->add_option(
        "--auth-token-file", f.auth_token_file,
        "File holding the client API token: its first line's token (a line of the coordinator's --auth-token-file)");
  }
  cmd->add_option("--tls-ca", f.tls.ca, "TLS to the coordinator, trusting the CA (PEM) that signed its certificate");
}

void AddPrefixCacheSharingFlag(CLI::App* cmd, CoordinatorOptions& co) {
  cmd->add_flag("--prefix-cache-shared-across-principals", co.prefix_cache_shared_across_principals,
                "With --auth-token-file: every principal reuses every other's cached prompt prefixes (a single "
                "tenant's deployment; by default each principal reuses only its own, see docs/security.md)");
}

bool LoadSecurity(const char* cmd, const SecurityFlags& f, SecurityRole role, std::string* worker_secret,
                  ClientSecurity* client, CoordinatorOptions* coordinator) {
  auto fail = [&](const Status& st) {
    std::fprintf(stderr, "mlarun %s: %s\n", cmd, st.ToString().c_str());
    return false;
  };
  if (!f.worker_secret_file.empty() && worker_secret != nullptr) {
    auto secret = ReadSecretFile("--worker-secret-file", f.worker_secret_file);
    if (!secret.ok()) return fail(secret.status());
    *worker_secret = *secret;
  }
  auto tls = role == SecurityRole::kCoordinator ? LoadServerTls(f.tls) : LoadClientTls(f.tls);
  if (!tls.ok()) return fail(tls.status());
  if (coordinator != nullptr) {
    coordinator->tls = *tls;
    if (!f.auth_token_file.empty()) {
      auto tokens = AuthTokens::ReadFile(f.auth_token_file);
      if (!tokens.ok()) return fail(tokens.status());
      coordinator->auth_tokens = std::move(*tokens);
    }
    return true;
  }
  client->tls = *tls;
  if (!f.auth_token_file.empty()) {
    auto token = ReadClientTokenFile(f.auth_token_file);
    if (!token.ok()) return fail(token.status());
    client->token = *token;
  }
  return true;
}

bool LoadDeploymentFile(const std::string& path, DeploymentConfig* dc) {
  if (path.empty()) return true;
  auto loaded = LoadDeploymentConfig(path);
  if (!loaded.ok()) {
    std::fprintf(stderr, "mlarun: %s\n", loaded.status().ToString().c_str());
    return false;
  }
  *dc = *loaded;
  return true;
}

void FillUnset(const CLI::Option* opt, std::string& target, const std::string& from) {
  if (opt->count() == 0 && !from.empty()) target = from;
}

sigset_t BlockStopSignals() {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  return stop_signals;
}

int ExitStatus(const char* cmd, const Status& st) {
  if (st.ok()) return 0;
  std::fprintf(stderr, "mlarun %s: %s\n", cmd, st.ToString().c_str());
  return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace mlarun::commands
