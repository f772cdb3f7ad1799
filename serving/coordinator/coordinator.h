// The coordinator: the gRPC service that takes requests from clients, routes
// each to exactly one DP group of the registered workers, and streams the
// tokens back (serving/proto/mlarun.proto documents every message).
//
// Start() binds and serves on its own threads; the object is thread-safe.
// No gRPC header is visible here.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "serving/security/security.h"

namespace mlarun {
namespace text {
class Tokenizer;
}

enum class RoutingPolicy : uint8_t {
  kRoundRobin = 0,
  kLeastLoaded = 1,     // fewest queued tokens, then most free blocks
  kPrefixAffinity = 2,  // longest cached prompt prefix, unless too loaded
};
std::string_view RoutingPolicyName(RoutingPolicy p);
StatusOr<RoutingPolicy> ParseRoutingPolicy(std::string_view name);  // round_robin | least_loaded | prefix_affinity

struct CoordinatorOptions {
  // host:port; port 0 picks a free port (see Coordinator::address()).
  std::string listen = "127.0.0.1:50051";
  RoutingPolicy policy = RoutingPolicy::kPrefixAffinity;
  // Requests accepted but not yet routed (no group registered, or all groups
  // full); more are RESOURCE_EXHAUSTED. Default 4096.
  int64_t max_queued = 4096;
  // Requests routed and not finished, per group; beyond this they wait in the
  // coordinator's queue. Default 256.
  int64_t max_in_flight_per_group = 256;
  // prefix_affinity: take the group with the longest cached prefix unless its
  // queued tokens exceed the least loaded group's by more than this many
  // tokens (SGLang's router uses a similar absolute-plus-relative threshold).
  int64_t balance_abs_tokens = 2048;
  double balance_rel = 1.5;  // ... and by more than this factor
  // The queue timeout: a request that finds no DP group connected waits at
  // most this long (from its arrival, or less when its own deadline is
  // nearer) for one to register, then fails with UNAVAILABLE saying that none
  // did, or which group went away before and why. It bounds only the wait for
  // a group: a request routed to a group runs as long as it takes (or until
  // its own deadline), and one waiting for room in connected groups waits
  // for them. Default 30 s (`--queue-timeout-s`).
  double queue_timeout_s = 30;
  // The longest prompt + max_tokens taken, below the model's own context
  // (`--max-model-len`); 0: the model's.
  int64_t max_model_len = 0;
  // When the last connected group goes away, the requests left waiting (those
  // it had not answered yet, re-routed, and those queued for room) wait this
  // much longer for a group to (re)register, at most until their own
  // deadline, then fail with UNAVAILABLE saying which group went away and
  // why. Default 5 s (`--lost-group-wait-s`): a worker whose link broke
  // reconnects within its 2 s back-off, and a client without a deadline
  // learns of the loss within 10 s.
  double lost_group_wait_s = 5;
  // A group with requests in flight that sends nothing at all (no token, no
  // completion, no stats; a live worker reports stats every 0.5 s from its
  // step loop) for this long is taken as stalled, and so is an idle group
  // that reported stats on its stream before (a step that never ends, a rank
  // stopped or stuck in a collective): its stream is closed with UNAVAILABLE
  // and it is treated as gone (its requests re-routed, those with tokens
  // resuming from them). A worker that was only slow reconnects and
  // registers again. Default 30 s (`--stall-timeout-s`).
  double stall_timeout_s = 30;
  // Rebalancing (`--rebalance-threshold`): when the busiest connected group
  // that takes moved requests (mixed or decode) runs at least this many
  // more requests than the least busy one, the coordinator moves one
  // running request from the first to the second (the one with the most
  // tokens left), at most one move at a time, at most one every
  // rebalance_period_s; a request that moved is not moved again for
  // rebalance_cooldown_s, so it is not bounced. With least_loaded or
  // prefix_affinity routing, never a move that leaves the target with more
  // queued tokens than the source (routing would undo it). 0: off.
  int64_t rebalance_threshold = 0;
  double rebalance_period_s = 0.5;
  double rebalance_cooldown_s = 30;
  // Rebalancing by cache use (`--rebalance-cache-fraction`): when the
  // fullest such group's latent cache (blocks in use over its blocks, as
  // last reported) is fuller than the emptiest one's by at least this
  // fraction, the running request holding the most rows moves from the
  // first to the second, unless that would leave the second fuller than
  // the first; the same period, one move at a time and cooldown. 0: off.
  double rebalance_cache_fraction = 0;
  // Prefix fetch (`--prefix-fetch-min-tokens`): when a request goes to a
  // group that moves blocks, and another such group's prefix index holds at
  // least this many more leading tokens of its prompt, the coordinator asks
  // that group to pin them (ExportPrefix) and routes the request with them
  // as its move source: its group fetches those rows instead of computing
  // them. Costs the source group's answer (its current step) before the
  // route goes. 0: off.
  int64_t prefix_fetch_min_tokens = 256;
  // DP groups the coordinator remembers (connected, and gone ones for
  // GetStats and the messages of requests that lost them). When a new group
  // registers into a full registry, the one that went away first is
  // forgotten; only if all are connected is it refused (RESOURCE_EXHAUSTED).
  // Default 1024.
  int64_t max_known_groups = 1024;
  // prefix_affinity: block hashes remembered per group (least recently routed
  // forgotten first; about 40 B each). Default 100,000 (~4 MB per group).
  int64_t prefix_hashes_per_group = 100000;
  // The worker link's shared secret (`--worker-secret-file`, trimmed): a
  // worker's Connect must carry it (or a client certificate, below), or it
  // ends with UNAUTHENTICATED before its registration is read. With neither
  // a secret nor a client-certificate CA the link is open, which Start
  // allows only when `listen` is a loopback address (127.0.0.0/8, [::1],
  // localhost) or `open_worker_link_off_loopback` is set.
  std::string worker_secret;
  // Lets a coordinator bound beyond loopback run with an open worker link
  // (any process that reaches the port can then register as a worker).
  bool open_worker_link_off_loopback = false;
  // TLS on the port (both services) when tls.cert is set (LoadServerTls).
  // With tls.ca, workers may authenticate with a client certificate signed
  // by it instead of the secret.
  TlsPem tls;
  // The client API's principals (`--auth-token-file`). Set: Generate, Cancel
  // and GetStats need `authorization: Bearer TOKEN` with one of the tokens
  // (UNAUTHENTICATED otherwise), and a principal sees and cancels only its
  // own requests. Empty: the client API is open; GetStats then tells the
  // ranks' hosts, model paths and worker ids only to callers on loopback.
  // Health is always open (for probes).
  AuthTokens auth_tokens;
  // With auth_tokens, a request reuses cached prompt prefixes only of its own
  // principal's requests (the principal salts the cache's hash chain, so
  // another principal's hits and timings tell nothing of its prompts).
  // Set (`--prefix-cache-shared-across-principals`, for a single tenant's
  // deployment): all principals share it, as without tokens. A request's
  // cache_salt narrows sharing either way (docs/security.md).
  bool prefix_cache_shared_across_principals = false;

  // Log to stderr when a DP group registers or goes away (and why), with
  // the count of connected groups. `mlarun coordinator` and `mlarun serve`
  // set it; tests and benchmarks leave it off.
  bool log_groups = false;
  // The traffic log to stderr (serving/coordinator/server_log.h): a line
  // per ended request (`--disable-log-requests` turns it off) and a stats
  // line every log_stats_interval_s when something happened
  // (`--log-stats-interval`; 0: none). The commands turn both on; tests and
  // benchmarks leave them off.
  bool log_requests = false;
  double log_stats_interval_s = 0;

  // ---- The OpenAI-compatible HTTP API and /metrics (docs/http-api.md) ----
  // host:port of the HTTP API (`--http`); empty (the default): off. Its
  // bearer tokens are `auth_tokens`; /health is open. Beyond loopback it
  // needs auth_tokens or `allow_unauthenticated_http`: Start refuses it
  // otherwise.
  std::string http_listen;
  // Lets the HTTP API bind beyond loopback without client tokens
  // (`--allow-unauthenticated`): anyone who reaches the port may then use
  // the model.
  bool allow_unauthenticated_http = false;
  // The model whose tokenizer (and chat template) and name the HTTP API
  // uses (`--model`): a configs/models/*.yaml with a `tokenizer:` key, a
  // checkpoint directory or a tokenizer directory. Required with
  // http_listen unless http_tokenizer is given.
  std::string http_model;
  // The name requests must give as `model` (`--served-model-name`); empty:
  // http_model's (else http_tokenizer_path's) last path component without ".yaml".
  std::string served_model_name;
  // A tokenizer already loaded (tests); when set, http_model is not read.
  std::shared_ptr<const text::Tokenizer> http_tokenizer;
  // The tokenizer's directory when not http_model's (`--tokenizer`): a
  // directory with tokenizer.json (and tokenizer_config.json).
  std::string http_tokenizer_path;
  // A chat template in place of the tokenizer's (`--chat-template`, the
  // template's text); empty: the tokenizer's.
  std::string http_chat_template;
  // No tokenizer at all (`--skip-tokenizer-init`): the HTTP API takes and
  // answers token ids only (HttpApiOptions::skip_tokenizer_init).
  bool http_skip_tokenizer_init = false;
  // HTTP handler threads (each generation request or stream holds one;
  // beyond them, 503). Default 512.
  int http_threads = 512;
  // Larger request bodies get 413. Default 32 MiB.
  int64_t http_max_body_bytes = int64_t{32} << 20;
  // Each HTTP request's deadline (504 when it passes); 0 (default): none.
  double http_request_timeout_s = 0;
  // The rest of HttpServerOptions (http_server.h) and HttpApiOptions
  // (openai_server.h), defaults and meaning alike: header size, deadlines,
  // connection limits, CORS and Host names.
  int64_t http_max_header_bytes = int64_t{64} << 10;
  double http_header_timeout_s = 10;
  double http_body_timeout_s = 60;
  int http_max_connections = 8192;
  int http_max_connections_per_peer = 256;
  std::vector<std::string> http_allowed_origins;
  std::vector<std::string> http_allowed_hosts;
  std::string http_reasoning_parser;  // HttpApiOptions::reasoning_parser
  std::string http_tool_call_parser;  // HttpApiOptions::tool_call_parser
  bool http_enable_auto_tool_choice = false;
};

// Whether `listen` (host:port) binds only the loopback interface:
// 127.0.0.0/8, [::1] (or ::1) or localhost (0.0.0.0 and [::] are not).
bool IsLoopbackListenAddress(const std::string& listen);

// The HTTP API's model name for a model path: its last component without
// ".yaml" ("configs/models/tiny.yaml" -> "tiny", "/ckpt/DeepSeek-V3/" ->
// "DeepSeek-V3").
std::string DefaultServedModelName(const std::string& model_path);

class Coordinator {
 public:
  // Binds `listen` and starts serving. INVALID_ARGUMENT for a bad address or
  // an open link or API beyond loopback (see worker_secret and
  // http_listen), UNAVAILABLE if the port cannot be bound.
  static StatusOr<std::unique_ptr<Coordinator>> Start(const CoordinatorOptions& options);
  virtual ~Coordinator() = default;

  // The bound address (host:port, with the real port when 0 was asked).
  virtual std::string address() const = 0;
  // The HTTP API's bound address; "" when it is off.
  virtual std::string http_address() const = 0;
  // Stops accepting, ends every stream (clients get UNAVAILABLE), returns when
  // the server is down.
  virtual void Shutdown() = 0;
  // Blocks until Shutdown() (or a signal handler calling it).
  virtual void Wait() = 0;
};

}  // namespace mlarun
