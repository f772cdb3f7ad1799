#include "serving/http/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <array>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "mlarun.pb.h"

namespace mlarun {
namespace {

using Buckets = prometheus::Histogram::BucketBoundaries;

// vLLM's boundaries, with finer ones below them: a simulated group or a
// small model on CPU answers in well under a millisecond per token.
const Buckets kTtftBuckets = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,   0.25, 0.5,
                              0.75,   1.0,   2.5,    5.0,   7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0};
const Buckets kItlBuckets = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2,
                             0.3,    0.4,     0.5,    0.75,  1.0,    2.5,   5.0,  7.5,   10.0, 20.0,  40.0, 80.0};
const Buckets kE2eBuckets = {0.001, 0.005, 0.01, 0.025, 0.05, 0.1,  0.3,  0.5,  0.8,   1.0,   1.5,   2.0,   2.5,
                             5.0,   10.0,  15.0, 20.0,  30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0};

// Finished reasons the protocol allows (dispatcher.cc checks them).
constexpr std::array<std::string_view, 2> kFinishReasons = {"length", "stop"};
constexpr int kCodes = 17;  // gRPC status codes 0..16

// The HTTP API's paths (a model's card is "/v1/models/{id}", whatever the
// id, so clients cannot grow the label set; anything else is "other").
constexpr std::string_view kModelCard = "/v1/models/{id}";
constexpr std::array<std::string_view, 10> kHttpPaths = {"/v1/completions", "/v1/chat/completions",
                                                         "/v1/models",      kModelCard,
                                                         "/tokenize",       "/detokenize",
                                                         "/version",        "/health",
                                                         "/metrics",        "other"};

}  // namespace

struct Metrics::Impl {
  explicit Impl(std::string p) : policy(std::move(p)) {}
  const std::string policy;
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();

  prometheus::Family<prometheus::Counter>& success =
      prometheus::BuildCounter()
          .Name("mlarun:request_success_total")
          .Help(
              "Requests that finished, by finish reason (length: max_tokens; stop: eos, a stop id "
              "or a stop string)")
          .Register(*registry);
  prometheus::Family<prometheus::Counter>& errors =
      prometheus::BuildCounter()
          .Name("mlarun:request_error_total")
          .Help(
              "Requests that ended without finishing (rejected, cancelled, failed), by gRPC status "
              "code")
          .Register(*registry);
  prometheus::Family<prometheus::Counter>& prompt_tokens =
      prometheus::BuildCounter()
          .Name("mlarun:prompt_tokens_total")
          .Help("Prompt tokens of the requests routed to a DP group, counted when they end")
          .Register(*registry);
  prometheus::Family<prometheus::Counter>& generation_tokens = prometheus::BuildCounter()
                                                                   .Name("mlarun:generation_tokens_total")
                                                                   .Help("Generated tokens sent to clients")
                                                                   .Register(*registry);
  prometheus::Family<prometheus::Counter>& prefix_queries =
      prometheus::BuildCounter()
          .Name("mlarun:prefix_cache_queries_total")
          .Help("Prompt tokens of finished requests (the denominator of the prefix-cache hit rate)")
          .Register(*registry);
  prometheus::Family<prometheus::Counter>& prefix_hits =
      prometheus::BuildCounter()
          .Name("mlarun:prefix_cache_hits_total")
          .Help("Prompt tokens of finished requests whose latent cache a DP group reused")
          .Register(*registry);
  prometheus::Family<prometheus::Counter>& routing =
      prometheus::BuildCounter()
          .Name("mlarun:routing_decisions_total")
          .Help("Requests routed, by routing policy and DP group (re-routings included)")
          .Register(*registry);
  prometheus::Family<prometheus::Counter>& http = prometheus::BuildCounter()
                                                      .Name("mlarun:http_requests_total")
                                                      .Help("HTTP exchanges answered, by path and HTTP status")
                                                      .Register(*registry);
  prometheus::Family<prometheus::Histogram>& ttft =
      prometheus::BuildHistogram()
          .Name("mlarun:time_to_first_token_seconds")
          .Help("From a request's arrival at the coordinator to its first token leaving it")
          .Register(*registry);
  prometheus::Family<prometheus::Histogram>& itl =
      prometheus::BuildHistogram()
          .Name("mlarun:inter_token_latency_seconds")
          .Help("Between consecutive tokens of a request as they leave the coordinator")
          .Register(*registry);
  prometheus::Family<prometheus::Histogram>& e2e =
      prometheus::BuildHistogram()
          .Name("mlarun:e2e_request_latency_seconds")
          .Help("From a request's arrival to its end, for requests that finished")
          .Register(*registry);
  prometheus::Family<prometheus::Histogram>& queue_time =
      prometheus::BuildHistogram()
          .Name("mlarun:request_queue_time_seconds")
          .Help("From a request's arrival to its routing to a DP group, for requests that finished")
          .Register(*registry);

  prometheus::Family<prometheus::Histogram>& migration_pause =
      prometheus::BuildHistogram()
          .Name("mlarun:migration_pause_seconds")
          .Help("A moved request's last token from its old DP group to its first from the new one")
          .Register(*registry);

  std::array<prometheus::Counter*, kFinishReasons.size()> success_by_reason{};
  std::array<prometheus::Counter*, kCodes> error_by_code{};
  prometheus::Counter* prompt = &prompt_tokens.Add({});
  prometheus::Counter* generated = &generation_tokens.Add({});
  prometheus::Counter* queries = &prefix_queries.Add({});
  prometheus::Counter* hits = &prefix_hits.Add({});
  prometheus::Histogram* ttft_h = &ttft.Add({}, kTtftBuckets);
  prometheus::Histogram* itl_h = &itl.Add({}, kItlBuckets);
  prometheus::Histogram* e2e_h = &e2e.Add({}, kE2eBuckets);
  prometheus::Histogram* queue_h = &queue_time.Add({}, kE2eBuckets);
  prometheus::Histogram* pause_h = &migration_pause.Add({}, kItlBuckets);

  // Worker aliases and the routing counters' cache, under mu (a lock of its
  // own: OnRouted runs under the dispatcher's mutex, Render does not).
  std::mutex mu;
  std::map<std::string, std::string, std::less<>> alias;  // worker id -> "worker-<k>"
  std::map<std::pair<std::string, int32_t>, prometheus::Counter*> routed;
  std::map<std::pair<std::string, int>, prometheus::Counter*> http_counters;

  const std::string& Alias(std::string_view worker_id) {  // REQUIRES mu
    auto it = alias.find(worker_id);
    if (it == alias.end()) it = alias.emplace(std::string(worker_id), "worker-" + std::to_string(alias.size())).first;
    return it->second;
  }
};

Metrics::Metrics(std::string policy) : impl_(std::make_unique<Impl>(std::move(policy))) {
  for (size_t i = 0; i < kFinishReasons.size(); ++i)
    impl_->success_by_reason[i] = &impl_->success.Add({{"finished_reason", std::string(kFinishReasons[i])}});
  for (int c = 1; c < kCodes; ++c)
    impl_->error_by_code[c] = &impl_->errors.Add({{"code", std::string(StatusCodeName(static_cast<StatusCode>(c)))}});
}

Metrics::~Metrics() = default;

void Metrics::OnRouted(std::string_view worker_id, int32_t dp_group) {
  std::lock_guard lock(impl_->mu);
  const std::string& alias = impl_->Alias(worker_id);
  auto [it, fresh] = impl_->routed.try_emplace({alias, dp_group}, nullptr);
  if (fresh) {
    it->second =
        &impl_->routing.Add({{"policy", impl_->policy}, {"worker", alias}, {"dp_group", std::to_string(dp_group)}});
  }
  it->second->Increment();
}

void Metrics::OnToken(bool first, double since_s) {
  impl_->generated->Increment();
  (first ? impl_->ttft_h : impl_->itl_h)->Observe(since_s);
}

void Metrics::OnEnd(const coord::RequestEnd& end) {
  if (end.queued_s >= 0) impl_->prompt->Increment(static_cast<double>(end.prompt_tokens));
  if (end.status_code != 0) {
    if (end.status_code > 0 && end.status_code < kCodes) impl_->error_by_code[end.status_code]->Increment();
    return;
  }
  for (size_t i = 0; i < kFinishReasons.size(); ++i) {
    if (end.finish_reason == kFinishReasons[i]) impl_->success_by_reason[i]->Increment();
  }
  impl_->queries->Increment(static_cast<double>(end.prompt_tokens));
  impl_->hits->Increment(static_cast<double>(end.prefix_hit_tokens));
  impl_->e2e_h->Observe(end.total_s);
  if (end.queued_s >= 0) impl_->queue_h->Observe(end.queued_s);
}

void Metrics::OnMigrated(double pause_s) { impl_->pause_h->Observe(pause_s); }

Metrics::Totals Metrics::totals() const {
  auto count = [](const prometheus::Counter* c) { return static_cast<int64_t>(c->Value()); };
  return Totals{.prompt_tokens = count(impl_->prompt),
                .generation_tokens = count(impl_->generated),
                .prefix_queries = count(impl_->queries),
                .prefix_hits = count(impl_->hits)};
}

void Metrics::OnHttp(std::string_view path, int status) {
  std::string_view label = path.starts_with("/v1/models/") ? kModelCard : kHttpPaths.back();
  for (std::string_view p : kHttpPaths) {
    if (p == path) label = p;
  }
  std::lock_guard lock(impl_->mu);
  auto [it, fresh] = impl_->http_counters.try_emplace({std::string(label), status}, nullptr);
  if (fresh) it->second = &impl_->http.Add({{"path", std::string(label)}, {"status", std::to_string(status)}});
  it->second->Increment();
}

std::string Metrics::Render(const v1::GetStatsResponse& stats, int64_t live_requests, bool details) {
  // The gauges are read now, into a registry of this scrape only: groups and
  // ranks that are gone are simply absent.
  prometheus::Registry now;
  auto gauge = [&](const std::string& name, const std::string& help) -> prometheus::Family<prometheus::Gauge>& {
    return prometheus::BuildGauge().Name(name).Help(help).Register(now);
  };
  auto& queued = gauge("mlarun:num_requests_queued",
                       "Requests waiting in the coordinator's queue for a DP group (no group "
                       "connected, or all full)");
  auto& live = gauge("mlarun:num_requests_live", "Requests accepted and not ended (queued or routed)");
  auto& connected = gauge("mlarun:dp_groups_connected", "DP groups registered and connected");
  auto& in_flight = gauge("mlarun:num_requests_in_flight", "Requests routed to the DP group and not ended");
  auto& running = gauge("mlarun:num_requests_running", "Requests running in the DP group, as its leader last reported");
  auto& waiting = gauge("mlarun:num_requests_waiting",
                        "Requests waiting inside the DP group for cache blocks, as its leader last reported");
  auto& queued_tokens =
      gauge("mlarun:group_queued_tokens", "Prompt + max_tokens of the requests routed to the DP group and not ended");
  auto& free_blocks = gauge("mlarun:group_free_blocks", "Free (or evictable) cache blocks the DP group last reported");
  auto& blocks_used = gauge("mlarun:cache_blocks_used", "Latent cache blocks in use on the rank, as last reported");
  auto& blocks_total = gauge("mlarun:cache_blocks_total", "Latent cache blocks of the rank");
  auto& usage = gauge("mlarun:cache_usage_perc", "Fraction of the rank's latent cache blocks in use (0 to 1)");
  auto counter = [&now](const char* name, const char* help) -> prometheus::Family<prometheus::Counter>& {
    return prometheus::BuildCounter().Name(name).Help(help).Register(now);
  };
  auto& transfer_fetches =
      counter("mlarun:transfer_fetches_total", "Block fetches from other DP groups' pools that landed on the rank");
  auto& transfer_bytes =
      counter("mlarun:transfer_bytes_total", "Bytes of cache blocks the rank fetched from other DP groups' pools");
  auto& transfer_failures = counter("mlarun:transfer_failures_total",
                                    "Block fetches of the rank that failed (their requests computed instead)");
  auto& received =
      counter("mlarun:requests_received_total", "Generate requests received by the coordinator (gRPC and HTTP)");
  auto& rerouted = counter("mlarun:requests_rerouted_total",
                           "Requests re-queued for another DP group after theirs went away (those with tokens resume "
                           "from them)");
  auto& migrated =
      counter("mlarun:requests_migrated_total", "Running requests moved to another DP group (Migrate) that run there");
  auto& rebalanced = counter("mlarun:rebalance_moves_total",
                             "Moves the coordinator started to even out its DP groups (--rebalance-threshold, "
                             "--rebalance-cache-fraction)");
  auto& migrations_failed = counter("mlarun:migrations_failed_total",
                                    "Moves that did not happen: the request ended first, or no group took it");
  auto& prefix_fetches = counter("mlarun:prefix_fetches_total",
                                 "Requests whose DP group fetched a cached prompt prefix from another group instead of "
                                 "computing it");
  auto& prefix_fetch_tokens =
      counter("mlarun:prefix_fetch_tokens_total", "Prompt tokens whose cache rows were fetched from another DP group");

  queued.Add({}).Set(static_cast<double>(stats.coordinator().requests_queued()));
  live.Add({}).Set(static_cast<double>(live_requests));
  received.Add({}).Increment(static_cast<double>(stats.coordinator().requests_received()));
  rerouted.Add({}).Increment(static_cast<double>(stats.coordinator().requests_rerouted()));
  migrated.Add({}).Increment(static_cast<double>(stats.coordinator().requests_migrated()));
  rebalanced.Add({}).Increment(static_cast<double>(stats.coordinator().rebalance_moves()));
  migrations_failed.Add({}).Increment(static_cast<double>(stats.coordinator().migrations_failed()));
  prefix_fetches.Add({}).Increment(static_cast<double>(stats.coordinator().prefix_fetches()));
  prefix_fetch_tokens.Add({}).Increment(static_cast<double>(stats.coordinator().prefix_fetch_tokens()));
  int64_t n_connected = 0;
  std::map<std::string, std::string> shown;  // alias -> worker id, for worker_info
  {
    std::lock_guard lock(impl_->mu);
    for (const v1::GroupStats& g : stats.groups()) {
      if (!g.connected()) continue;
      ++n_connected;
      const std::string& alias = impl_->Alias(g.worker_id());
      shown.emplace(alias, g.worker_id());
      const prometheus::Labels labels = {{"worker", alias}, {"dp_group", std::to_string(g.dp_group())}};
      in_flight.Add(labels).Set(static_cast<double>(g.requests_in_flight()));
      queued_tokens.Add(labels).Set(static_cast<double>(g.queued_tokens()));
      free_blocks.Add(labels).Set(static_cast<double>(g.free_blocks()));
      for (const v1::RankStats& r : stats.ranks()) {
        if (r.worker_id() != g.worker_id() || r.dp_group() != g.dp_group()) continue;
        if (r.attn_tp_rank() == 0) {
          running.Add(labels).Set(static_cast<double>(r.requests_running()));
          waiting.Add(labels).Set(static_cast<double>(r.requests_waiting()));
        }
        const prometheus::Labels rank_labels = {
            {"worker", alias}, {"dp_group", std::to_string(r.dp_group())}, {"rank", std::to_string(r.rank())}};
        blocks_used.Add(rank_labels).Set(static_cast<double>(r.cache_blocks_used()));
        transfer_fetches.Add(rank_labels).Increment(static_cast<double>(r.transfer_fetches()));
        transfer_bytes.Add(rank_labels).Increment(static_cast<double>(r.transfer_bytes()));
        transfer_failures.Add(rank_labels).Increment(static_cast<double>(r.transfer_failures()));
        blocks_total.Add(rank_labels).Set(static_cast<double>(r.cache_blocks_total()));
        usage.Add(rank_labels)
            .Set(r.cache_blocks_total() > 0
                     ? static_cast<double>(r.cache_blocks_used()) / static_cast<double>(r.cache_blocks_total())
                     : 0.0);
      }
    }
  }
  connected.Add({}).Set(static_cast<double>(n_connected));
  if (details) {
    auto& info = gauge("mlarun:worker_info", "1 for each connected worker job: its alias and its id (leader host:pid)");
    for (const auto& [alias, id] : shown) info.Add({{"worker", alias}, {"worker_id", id}}).Set(1);
  }

  std::vector<prometheus::MetricFamily> families = impl_->registry->Collect();
  std::vector<prometheus::MetricFamily> gauges = now.Collect();
  families.insert(families.end(), std::make_move_iterator(gauges.begin()), std::make_move_iterator(gauges.end()));
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace mlarun
