#include "launcher/worker/worker.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <span>
#include <sstream>
#include <vector>

#include "base/cpu_isa.h"
#include "base/cuda_device.h"
#include "launcher/serve/serve.h"
#include "launcher/worker/transfer_agent.h"
#include "parallel/mpi/mpi_world.h"
#include "runtime/engine/rank_runner.h"
#include "runtime/grammar/grammar.h"
#include "runtime/model/memory_plan.h"
#include "runtime/rank/bootstrap.h"
#include "serving/client/grpc_util.h"
#include "serving/link/worker_link_client.h"
#include "serving/proto/proto_sampling.h"

namespace mlarun {
namespace {

std::atomic<bool> g_stop{false};
std::atomic<int> g_stop_signal{0};
extern "C" void OnSignal(int sig) {
  g_stop_signal = sig;
  g_stop = true;
}

// This process's resident set (Linux /proc/self/statm); 0 where unavailable.
int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

// One rank of a `mlarun worker` job, after BootstrapRank: Start (the cache,
// the runner, the ranks' facts, a leader's link), Run (the step loop until a
// stop vote), Stop. Every member runs on the calling thread; the link's
// stream has a thread of its own inside WorkerLinkClient (one consumer: the
// step loop drains and sends). An error a rank cannot recover from ends the
// job through MpiSession::Abort, which does not return.
class Worker {
 public:
  // `o`, `session` and `boot` must outlive the Worker.
  Worker(const WorkerOptions& o, MpiSession& session, BootstrappedRank& boot)
      : o_(o),
        session_(session),
        boot_(boot),
        layout_(boot.layout),
        groups_(boot.groups),
        model_(*boot.loaded.model),
        rank_name_(boot.name) {}

  // Sizes the cache, creates the runner, exchanges the ranks' facts and (a
  // leader) opens the link; a start-up error ends the job with exit code 2.
  void Start();
  // The step loop, on every rank, until the ranks vote to stop (a signal on
  // any of them). A failed computation fails its step's requests only; an
  // error the ranks cannot recover from ends the job with exit code 1.
  void Run();
  // Closes the link (a leader's) and says so on rank 0.
  void Stop();

 private:
  // A request of this leader's group, as the stream knows it.
  struct Live {
    std::string request_id;
    size_t sent = 0;         // tokens sent (of those generated here)
    size_t prompt_sent = 0;  // prompt logprobs sent
    size_t before = 0;       // tokens it generated elsewhere (RouteRequest.generated_ids)
  };

  // Start-up, in this order.
  void SizeCache();
  void SayLoaded() const;
  // A start-up failure of this rank: reported to serve (if it started the
  // job), then the job ends (exit code 2).
  [[noreturn]] void AbortStart(const std::string& why) const {
    ReportStartFailure(rank_name_ + ": " + why);
    session_.Abort(why, 2);
  }
  v1::RankStats OwnFacts() const;
  void ExchangeFacts(const v1::RankStats& me);
  // Each rank's transfer descriptor to every rank; the leader keeps its
  // group's, by attn_tp rank, for its registration.
  void ExchangeDescriptors();
  void OpenLink();
  // The group's ranks as GetStats reports them: the facts of the start-up
  // exchange with the changing fields filled in.
  google::protobuf::RepeatedPtrField<v1::RankStats> GroupRankStats(double tokens_per_s);

  // The link (leaders), before each step: what the coordinator sent.
  void DrainLink();
  void OnRoute(const v1::RouteRequest& route);
  void OnCancel(const std::string& request_id);
  // MigrateOut: the request leaves this group now, between two steps (its
  // tokens are all sent), and the coordinator hears how many it has.
  void OnMigrateOut(const std::string& request_id);
  void OnReleaseExported(const std::string& request_id);
  // ExportPrefix: pins what the prefix cache holds of the tokens for another
  // group to fetch, and answers PrefixExported.
  void OnExportPrefix(const v1::ExportPrefix& ask);
  void OnReleasePrefix(uint64_t export_id);
  void OnStreamEnded(const WorkerLinkEvent& e);
  // The link (leaders), after each step: new tokens, completions, stats.
  void Report();
  void SendPromptLogprobs(Live& l, const GenerationOutput& out);
  void SendDone(const std::vector<int64_t>& done);
  void SendStatsWhenDue();

  const WorkerOptions& o_;
  MpiSession& session_;
  BootstrappedRank& boot_;
  const ParallelLayout& layout_;
  ProcessGroups& groups_;
  Model& model_;
  const std::string& rank_name_;

  // Set by Start.
  EngineConfig engine_;
  int64_t memory_bytes_ = 0;  // --memory-gib in bytes; 0: not given
  PrefillWorkspace workspace_;
  WeightBytes weights_;
  std::unique_ptr<RankRunner> runner_;
  // --transfer; nullptr: off. Declared after runner_, so it lets go of the
  // pool (and stops its thread) before the pool goes.
  std::unique_ptr<TransferAgent> transfer_;
  std::string worker_id_;                   // one for the job: rank 0's host:pid
  std::vector<v1::RankStats> group_ranks_;  // this DP group's ranks' static facts

  // The leader's end of the WorkerLink stream, on the link's own thread: the
  // step loop drains what arrived and sends (one consumer, one writer).
  std::unique_ptr<WorkerLinkClient> link_;
  std::string last_refusal_;  // the coordinator's last refusal, logged once
  // Attempts that never registered since the last registration (or the
  // start), and when that wait was last said: a worker started before its
  // coordinator says so every 10 s.
  int64_t unregistered_attempts_ = 0;
  std::chrono::steady_clock::time_point waiting_said_;

  // The step loop's state.
  std::map<int64_t, Live> live_;  // engine id -> request (leaders)
  std::map<std::string, int64_t> by_request_id_;
  // Requests that moved away with their blocks held for the new group
  // (Engine::Export), until ReleaseExported: request id -> engine id.
  std::map<std::string, int64_t> exported_;
  std::map<uint64_t, int64_t> prefix_exports_;  // ExportPrefix.export_id -> Engine::ExportPrefix's handle
  std::vector<std::string> group_descriptors_;  // leaders: Register.transfer_descriptors
  std::chrono::steady_clock::time_point last_stats_;
  int64_t tokens_since_stats_ = 0;
  bool stats_dirty_ = false;  // requests arrived or ended since the last stats
  static constexpr auto kMinIdleSleep = std::chrono::microseconds(500), kMaxIdleSleep = std::chrono::microseconds(5000);
  std::chrono::microseconds idle_sleep_ = kMinIdleSleep;
};

void Worker::Start() {
  const ModelOptions& mo = boot_.loaded.options;
  if (mo.fail_forward_call >= 0)
    std::cerr << "mlarun worker: " + rank_name_ + ": fault injection: model step " +
                     std::to_string(mo.fail_forward_call) + " will fail\n"
              << std::flush;
  SizeCache();
  if (groups_.is_leader()) {
    // Structured output: the leader samples, so it alone needs the grammars.
    const ModelConfig& mc = model_.config();
    auto grammar = GrammarCompiler::ForModel(o_.deployment.model, mc.vocab_size, mc.eos_token_ids);
    if (grammar.ok()) {
      engine_.grammar = *grammar;
    } else if (grammar.status().code() != StatusCode::kNotFound) {
      std::cerr << "mlarun worker: " + rank_name_ + ": structured output is off: " + grammar.status().ToString() + "\n"
                << std::flush;
    }
  }
  if (o_.transfer != "off") {
    auto path = ParseTransferPath(o_.transfer);
    if (!path.ok()) AbortStart(path.status().ToString());
    transfer_ = std::make_unique<TransferAgent>(*path);  // RankRunner turns the scheduler's imports on
  }
  auto runner_or = RankRunner::Create(model_, engine_, groups_, rank_name_, transfer_.get());
  if (!runner_or.ok()) AbortStart(runner_or.status().ToString());
  runner_ = std::move(*runner_or);
  if (transfer_) {
    if (Status st = transfer_->Start(runner_->runner().pool()); !st.ok()) AbortStart(st.ToString());
  }
  SayLoaded();
  ExchangeFacts(OwnFacts());
  ExchangeDescriptors();
  waiting_said_ = std::chrono::steady_clock::now();
  if (runner_->is_leader()) OpenLink();
  if (session_.rank() == 0)
    std::cerr << "mlarun worker " << worker_id_ << ": " << layout_ << ", " << o_.deployment.model << ", coordinator "
              << o_.coordinator << "\n";
}

// One line per rank once it can serve, as vLLM's: the load time, the
// weights and what the cache holds (tokens, and requests of the model's
// full context at once).
void Worker::SayLoaded() const {
  const LatentCacheStats cache = runner_->cache_stats().now;
  const int64_t tokens = cache.blocks_total * engine_.block_size;
  const int64_t context = model_.config().max_position_embeddings;
  char seconds[32], concurrency[64];
  std::snprintf(seconds, sizeof seconds, "%.1f", boot_.load_seconds);
  std::snprintf(concurrency, sizeof concurrency, "%.2fx",
                context > 0 ? static_cast<double>(tokens) / static_cast<double>(context) : 0.0);
  std::cerr << "mlarun worker: " + rank_name_ + ": loaded in " + seconds +
                   " s: " + FormatBytes(static_cast<double>(weights_.total())) + " of weights; KV cache " +
                   std::to_string(tokens) + " tokens (" + std::to_string(cache.blocks_total) + " blocks of " +
                   std::to_string(engine_.block_size) + "); maximum concurrency for " + std::to_string(context) +
                   " tokens per request: " + concurrency + "\n"
            << std::flush;
}

// The cache budget: given, or what the memory per rank leaves after the
// weights this rank loaded and the prefill workspace.
void Worker::SizeCache() {
  engine_ = o_.engine;
  engine_.commit_cache_memory = true;  // fail at start-up, not under load; and show in the RSS
  const ModelConfig& mc = model_.config();
  workspace_ = PredictPrefillWorkspace(mc, layout_.attn_tp, boot_.loaded.options.attention.expand_chunk_rows);
  weights_ = model_.weight_bytes();
  if (o_.memory_gib > 0) {
    memory_bytes_ = static_cast<int64_t>(o_.memory_gib * double(int64_t{1} << 30));
    engine_.cache_budget_bytes = memory_bytes_ - weights_.total() - workspace_.total();
    const LatentCacheConfig cache_config = CacheConfigFor(mc, engine_.cache_budget_bytes, engine_.block_size);
    const int64_t block_bytes = cache_config.block_bytes();
    if (cache_config.num_blocks() == 0)
      AbortStart("--memory-gib " + std::to_string(o_.memory_gib) + ": " + std::to_string(memory_bytes_) +
                 " B per rank minus weights (" + std::to_string(weights_.total()) + " B) and prefill workspace (" +
                 std::to_string(workspace_.total()) + " B) leaves " + std::to_string(engine_.cache_budget_bytes) +
                 " B, less than one cache block (" + std::to_string(block_bytes) + " B)");
  }
}

// This rank's static facts, as GetStats reports them (the changing fields
// are filled in at each report).
v1::RankStats Worker::OwnFacts() const {
  const LatentCacheStats own = runner_->cache_stats().now;
  const ModelConfig& mc = model_.config();
  std::ostringstream layout_os;
  layout_os << layout_;
  v1::RankStats me;
  me.set_rank(session_.rank());
  me.set_dp_group(groups_.dp_rank());
  me.set_attn_tp_rank(groups_.attn_tp_rank());
  me.set_host(session_.host());
  me.set_attention_weight_bytes(weights_.attention);
  me.set_attention_replicated_weight_bytes(weights_.attention_replicated);
  me.set_moe_weight_bytes(weights_.moe);
  me.set_dense_mlp_weight_bytes(weights_.dense_mlp);
  me.set_embedding_head_weight_bytes(weights_.embedding_and_head);
  me.set_cache_bytes_per_token(own.bytes_per_token);
  me.set_cache_block_bytes(own.block_bytes);
  me.set_cache_blocks_total(own.blocks_total);
  me.set_cache_bytes_capacity(own.blocks_total * own.block_bytes);
  me.set_memory_budget_bytes(memory_bytes_);
  me.set_cache_budget_bytes(engine_.cache_budget_bytes);
  me.set_workspace_bytes(workspace_.total());
  me.set_block_size(engine_.block_size);
  me.set_model(o_.deployment.model);
  me.set_num_layers(mc.num_hidden_layers);
  me.set_weight_dtype(std::string(DTypeName(mc.weight_dtype)));
  me.set_kv_dtype(std::string(DTypeName(mc.kv_dtype)));
  // f8_e4m3, int8 or int4 where the projections are held so.
  if (const auto d = model_.weight_format().projection_dtype) me.set_projection_dtype(std::string(DTypeName(*d)));
  me.set_lm_head_dtype(std::string(DTypeName(model_.lm_head_dtype())));
  if (transfer_) me.set_transfer_path(std::string(TransferPathName(transfer_->path())));
  me.set_parallel(layout_os.str());
  me.set_resident_bytes(ResidentBytes());
  me.set_cpu_model_name(HostCpu().model_name);
  me.set_cpu_flags(HostCpu().FlagList());
  me.set_cpu_isa(std::string(CpuIsaName(ActiveCpuIsa())));
  if (boot_.cuda_device >= 0) {
    std::string name;
    if (auto devices = CudaDevices(); devices.ok())
      for (const CudaDevice& d : *devices)
        if (d.index == boot_.cuda_device) name = d.name;
    me.set_device("cuda:" + std::to_string(boot_.cuda_device) + (name.empty() ? "" : " " + name));
    me.set_device_allocated_bytes(model_.memory().live_bytes());
    if (auto info = CurrentCudaMemory(); info.ok()) {
      me.set_device_free_bytes(info->free_bytes);
      me.set_device_total_bytes(info->total_bytes);
    }
  } else {
    me.set_device("cpu");
  }
  return me;
}

// Every rank's facts to every rank (the leader keeps its group's), and one
// worker id for the job.
void Worker::ExchangeFacts(const v1::RankStats& me) {
  Communicator& world = *groups_.world;
  auto infos = AllGatherStrings(world, me.SerializeAsString());
  if (!infos.ok()) session_.Abort("start-up exchange failed: " + infos.status().ToString(), 2);
  worker_id_ = session_.host() + ":" + std::to_string(getpid());
  auto ids = AllGatherStrings(world, session_.rank() == 0 ? worker_id_ : std::string());
  if (!ids.ok()) session_.Abort("start-up exchange failed", 2);
  worker_id_ = (*ids)[0];
  for (const std::string& bytes : *infos) {
    v1::RankStats r;
    if (!r.ParseFromString(bytes)) session_.Abort("start-up exchange: a rank's facts do not parse", 2);
    if (r.dp_group() == groups_.dp_rank()) group_ranks_.push_back(std::move(r));
  }
}

void Worker::ExchangeDescriptors() {
  auto all = AllGatherStrings(*groups_.world, transfer_ ? transfer_->Descriptor() : std::string());
  if (!all.ok()) session_.Abort("start-up exchange failed: " + all.status().ToString(), 2);
  std::vector<const v1::RankStats*> ranks;
  for (const v1::RankStats& r : group_ranks_) ranks.push_back(&r);
  std::sort(ranks.begin(), ranks.end(), [](auto* a, auto* b) { return a->attn_tp_rank() < b->attn_tp_rank(); });
  for (const v1::RankStats* r : ranks) {
    const std::string& d = (*all)[static_cast<size_t>(r->rank())];
    if (d.empty()) {  // every rank has --transfer or none has
      group_descriptors_.clear();
      return;
    }
    group_descriptors_.push_back(d);
  }
}

google::protobuf::RepeatedPtrField<v1::RankStats> Worker::GroupRankStats(double tokens_per_s) {
  google::protobuf::RepeatedPtrField<v1::RankStats> out;
  const LatentCacheStats& cs = runner_->cache_stats().now;
  for (const v1::RankStats& r : group_ranks_) {
    v1::RankStats* s = out.Add();
    *s = r;
    s->set_worker_id(worker_id_);
    // Each rank's cache use from the last lockstep exchange (the leader's
    // own numbers before the first).
    const bool seen = static_cast<size_t>(r.rank()) < runner_->world_cache().size();
    const RankCacheSnapshot snap = seen ? runner_->world_cache()[static_cast<size_t>(r.rank())]
                                        : RankCacheSnapshot{cs.blocks_used, cs.blocks_used, cs.blocks_retired, {}};
    s->set_cache_blocks_used(snap.blocks_used);
    s->set_cache_bytes_used(snap.blocks_used * r.cache_block_bytes());
    s->set_cache_bytes_peak(snap.peak_blocks_used * r.cache_block_bytes());
    s->set_cache_blocks_peak(snap.peak_blocks_used);
    s->set_cache_blocks_retired(snap.blocks_retired);
    s->set_requests_running(runner_->engine()->num_running());
    s->set_requests_waiting(runner_->engine()->num_waiting());
    s->set_tokens_per_s(tokens_per_s);
    s->set_transfer_fetches(snap.imports.fetches);
    s->set_transfer_bytes(snap.imports.bytes);
    s->set_transfer_failures(snap.imports.failures);
  }
  return out;
}

void Worker::OpenLink() {
  const ModelConfig& mc = model_.config();
  v1::Register reg;
  reg.set_worker_id(worker_id_);
  reg.set_dp_group(groups_.dp_rank());
  reg.set_dp(layout_.dp);
  reg.set_attn_tp(layout_.attn_tp);
  reg.set_vocab_size(mc.vocab_size);
  reg.set_max_position_embeddings(mc.max_position_embeddings);
  reg.set_block_size(engine_.block_size);
  reg.set_cache_blocks_total(runner_->cache_stats().now.blocks_total);
  *reg.mutable_ranks() = GroupRankStats(0);
  reg.mutable_transfer_descriptors()->Assign(group_descriptors_.begin(), group_descriptors_.end());
  reg.set_role(o_.role);
  reg.set_exports_prefixes(!group_descriptors_.empty());
  link_ = std::make_unique<WorkerLinkClient>(WorkerLinkClient::Options{
      .coordinator = o_.coordinator, .registration = reg, .secret = o_.worker_secret, .tls = o_.tls});
}

// The step loop, on every rank.
void Worker::Run() {
  last_stats_ = std::chrono::steady_clock::now();
  for (;;) {
    if (link_) DrainLink();
    auto step = runner_->StepOrStop(g_stop.load() ? std::max(g_stop_signal.load(), 1) : 0);
    if (!step.ok()) {
      // The ranks are out of lockstep: the job ends. A leader first tells the
      // coordinator why, so its clients learn it now and with the reason.
      const std::string reason = rank_name_ + " cannot continue: step failed: " + step.status().ToString();
      if (link_ && !link_->Leave(reason, /*timeout_s=*/2.0))
        std::cerr << "mlarun worker: " + rank_name_ +
                         ": could not tell the coordinator that the group is "
                         "leaving\n";
      session_.Abort(reason, 1);
    }
    if (*step == RankRunner::StepResult::kStop) break;
    if (link_) Report();
    if (*step == RankRunner::StepResult::kIdle) {
      // Nobody has work. A leader waits for a request (woken as one arrives),
      // at most a few ms so the other groups' leaders meet it at the next
      // exchange soon; members just enter that exchange, whose wait sleeps.
      if (link_) link_->WaitUntil(WorkerLinkClient::Clock::now() + idle_sleep_);
      idle_sleep_ = std::min(kMaxIdleSleep, idle_sleep_ * 2);
    } else {
      idle_sleep_ = kMinIdleSleep;
    }
  }
}

void Worker::Stop() {
  // A stop asked for (serve's shutdown, a Ctrl-C): the coordinator hears it
  // from the group itself rather than as a stream that broke.
  // The signal may have reached another rank only (mpirun passes it on one
  // rank at a time): the agreed stop carries it.
  const int sig = g_stop_signal.load() != 0 ? g_stop_signal.load() : runner_ ? runner_->stop_code() : 0;
  if (link_ && sig != 0) {
    const char* name = sigabbrev_np(sig);
    link_->Leave(rank_name_ + ": stopping on request (SIG" + (name != nullptr ? name : "?") + ")", /*timeout_s=*/2.0);
  }
  link_.reset();
  if (session_.rank() == 0) std::cerr << "mlarun worker " << worker_id_ << ": stopped\n";
}

void Worker::DrainLink() {
  for (WorkerLinkEvent& e : link_->Drain()) {
    if (e.message.has_registered()) {
      std::cerr << "mlarun worker " << worker_id_ << ": " << rank_name_ << ": DP group " << groups_.dp_rank()
                << " registered with the coordinator at " << o_.coordinator << "\n";
      unregistered_attempts_ = 0;
    } else if (e.message.has_route()) {
      OnRoute(e.message.route());
    } else if (e.message.has_cancel()) {
      OnCancel(e.message.cancel().request_id());
    } else if (e.message.has_migrate_out()) {
      OnMigrateOut(e.message.migrate_out().request_id());
    } else if (e.message.has_release_exported()) {
      OnReleaseExported(e.message.release_exported().request_id());
    } else if (e.message.has_export_prefix()) {
      OnExportPrefix(e.message.export_prefix());
    } else if (e.message.has_release_prefix()) {
      OnReleasePrefix(e.message.release_prefix().export_id());
    } else if (e.ended) {
      OnStreamEnded(e);
    }
  }
}

void Worker::OnRoute(const v1::RouteRequest& route) {
  const std::string rid = route.request_id();
  GenerationRequest req{.prompt = std::vector<int32_t>(route.prompt_ids().begin(), route.prompt_ids().end()),
                        .sampling = FromProto(route.sampling()),
                        .generated = std::vector<int32_t>(route.generated_ids().begin(), route.generated_ids().end()),
                        .prefix_cache_salt = route.prefix_cache_salt()};
  if (transfer_ && route.has_move_source() && route.move_source().cached_tokens() > 0) {
    const v1::MoveSource& from = route.move_source();
    req.import = ImportSource{.descriptors = {from.descriptors().begin(), from.descriptors().end()},
                              .blocks = {from.block_ids().begin(), from.block_ids().end()},
                              .rows = from.cached_tokens()};
  }
  auto id = runner_->Add(std::move(req));
  if (!id.ok()) {
    v1::WorkerMessage m;
    v1::RequestDone* d = m.mutable_done();
    d->set_request_id(rid);
    d->set_error_code(static_cast<int32_t>(id.status().code()));
    d->set_error_message(id.status().message());
    link_->Send(m);
    return;
  }
  live_[*id] = Live{.request_id = rid, .before = static_cast<size_t>(route.generated_ids_size())};
  by_request_id_[rid] = *id;
  stats_dirty_ = true;
}

void Worker::OnCancel(const std::string& request_id) {
  auto it = by_request_id_.find(request_id);
  if (it == by_request_id_.end()) return;
  (void)runner_->engine()->Cancel(it->second);
  (void)runner_->engine()->TakeOutput(it->second);  // forget it
  live_.erase(it->second);
  by_request_id_.erase(it);
}

void Worker::OnMigrateOut(const std::string& request_id) {
  auto it = by_request_id_.find(request_id);
  if (it == by_request_id_.end()) return;  // ended: its RequestDone answers
  const Live& l = live_[it->second];
  v1::WorkerMessage m;
  v1::Exported* x = m.mutable_exported();
  x->set_request_id(request_id);
  x->set_tokens(static_cast<int64_t>(l.before + l.sent));
  Engine& engine = *runner_->engine();
  if (transfer_ && !group_descriptors_.empty()) {
    // Its blocks stay held for the new group to fetch, until ReleaseExported.
    auto held = engine.Export(it->second);
    if (!held.ok()) {
      (void)engine.Cancel(it->second);
    } else if (!held->blocks.empty()) {
      x->mutable_block_ids()->Assign(held->blocks.begin(), held->blocks.end());
      x->set_cached_tokens(held->rows);
      exported_[request_id] = it->second;
    }
  } else {
    (void)engine.Cancel(it->second);  // its blocks are free
  }
  (void)engine.TakeOutput(it->second);
  live_.erase(it->second);
  by_request_id_.erase(it);
  link_->Send(m);
  stats_dirty_ = true;
}

void Worker::OnReleaseExported(const std::string& request_id) {
  auto it = exported_.find(request_id);
  if (it == exported_.end()) return;
  (void)runner_->engine()->ReleaseExport(it->second);
  exported_.erase(it);
  stats_dirty_ = true;
}

void Worker::OnExportPrefix(const v1::ExportPrefix& ask) {
  v1::WorkerMessage m;
  v1::PrefixExported* x = m.mutable_prefix_exported();
  x->set_export_id(ask.export_id());
  OnReleasePrefix(ask.export_id());  // asked again: the newer ask holds
  if (transfer_ && !group_descriptors_.empty()) {
    auto held = runner_->engine()->ExportPrefix(
        std::span<const int32_t>(ask.token_ids().data(), static_cast<size_t>(ask.token_ids_size())),
        ask.prefix_cache_salt());
    if (held.ok() && held->handle >= 0) {
      x->mutable_block_ids()->Assign(held->held.blocks.begin(), held->held.blocks.end());
      x->set_cached_tokens(held->held.rows);
      prefix_exports_[ask.export_id()] = held->handle;
    }
  }
  link_->Send(m);
  stats_dirty_ = true;
}

void Worker::OnReleasePrefix(uint64_t export_id) {
  auto it = prefix_exports_.find(export_id);
  if (it == prefix_exports_.end()) return;
  (void)runner_->engine()->ReleaseExport(it->second);
  prefix_exports_.erase(it);
  stats_dirty_ = true;
}

// The stream broke: the coordinator has ended or re-routed its requests.
void Worker::OnStreamEnded(const WorkerLinkEvent& e) {
  // A refusal (wrong or missing --worker-secret-file, a registration
  // out of range, the group held by another stream) repeats at every
  // retry of the back-off: said once per distinct answer.
  const grpc::StatusCode code = e.status.error_code();
  if (!e.registered && (code == grpc::StatusCode::UNAUTHENTICATED || code == grpc::StatusCode::INVALID_ARGUMENT ||
                        code == grpc::StatusCode::ALREADY_EXISTS)) {
    std::string why = std::string(client_internal::GrpcCodeName(code)) + ": " + e.status.error_message();
    if (why != last_refusal_)
      std::cerr << "mlarun worker " << worker_id_ << ": " << rank_name_ << ": the coordinator at " << o_.coordinator
                << " refused the registration (" << why << "); retrying\n";
    last_refusal_ = std::move(why);
  } else if (e.registered) {
    last_refusal_.clear();
    std::cerr << "mlarun worker " << worker_id_ << ": " << rank_name_ << ": the link to the coordinator at "
              << o_.coordinator << " ended (" << client_internal::GrpcCodeName(code) << ": " << e.status.error_message()
              << "); reconnecting\n";
    waiting_said_ = std::chrono::steady_clock::now();
  }
  if (!e.registered && ++unregistered_attempts_ > 0 &&
      std::chrono::steady_clock::now() - waiting_said_ >= std::chrono::seconds(10)) {
    waiting_said_ = std::chrono::steady_clock::now();
    std::cerr << "mlarun worker " << worker_id_ << ": " << rank_name_ << ": still waiting for the coordinator at "
              << o_.coordinator << " (" << unregistered_attempts_
              << " attempts; last: " << client_internal::GrpcCodeName(code) << ": " << e.status.error_message()
              << ")\n";
  }
  for (const auto& [id, l] : live_) {
    (void)runner_->engine()->Cancel(id);
    (void)runner_->engine()->TakeOutput(id);
  }
  live_.clear();
  by_request_id_.clear();
  for (const auto& [rid, id] : exported_) (void)runner_->engine()->ReleaseExport(id);
  exported_.clear();
  for (const auto& [export_id, handle] : prefix_exports_) (void)runner_->engine()->ReleaseExport(handle);
  prefix_exports_.clear();
}

// New tokens, completions, and the requests of a failed step.
void Worker::Report() {
  v1::WorkerMessage tokens;
  std::vector<int64_t> done;
  for (auto& [id, l] : live_) {
    const GenerationOutput* out = runner_->Output(id);
    SendPromptLogprobs(l, *out);
    for (; l.sent < out->tokens.size(); ++l.sent) {
      v1::TokenEvent* t = tokens.mutable_tokens()->add_events();
      t->set_request_id(l.request_id);
      t->set_token_id(out->tokens[l.sent]);
      t->set_logprob(out->logprobs[l.sent]);
      if (l.sent < out->top_logprobs.size()) AddTopLogprobs(out->top_logprobs[l.sent], t);
      ++tokens_since_stats_;
    }
    if (out->finish_reason == FinishReason::kLength || out->finish_reason == FinishReason::kStop ||
        out->finish_reason == FinishReason::kError)
      done.push_back(id);
  }
  if (tokens.tokens().events_size() > 0) link_->Send(tokens);
  if (!runner_->last_step_failure().ok()) {
    int64_t failed = 0;
    for (int64_t id : done) failed += runner_->Output(id)->finish_reason == FinishReason::kError;
    std::cerr << "mlarun worker: " + rank_name_ + ": DP group " + std::to_string(groups_.dp_rank()) +
                     ": a step failed; its " + std::to_string(failed) +
                     " requests end with the error, the group goes on: " + runner_->last_step_failure().ToString() +
                     "\n"
              << std::flush;
  }
  SendDone(done);
  if (!done.empty()) stats_dirty_ = true;
  SendStatsWhenDue();
}

// The prompt's logprobs first, in messages of their own (a long prompt's
// would not fit in one): all are recorded by the step that draws the first
// token, so they precede it on the stream.
void Worker::SendPromptLogprobs(Live& l, const GenerationOutput& out) {
  while (l.prompt_sent < out.prompt_logprobs.size()) {
    constexpr size_t kPerMessage = 1024;
    v1::WorkerMessage m;
    v1::PromptLogprobsEvent* e = m.mutable_tokens()->add_prompt_logprobs();
    e->set_request_id(l.request_id);
    e->mutable_logprobs()->set_start(static_cast<int64_t>(l.prompt_sent) + 1);
    for (size_t end = std::min(out.prompt_logprobs.size(), l.prompt_sent + kPerMessage); l.prompt_sent < end;
         ++l.prompt_sent) {
      const LogprobEntry& p = out.prompt_logprobs[l.prompt_sent];
      v1::PromptTokenLogprob* entry = e->mutable_logprobs()->add_entries();
      entry->set_token_id(p.token.token);
      entry->set_logprob(p.token.logprob);
      AddTopLogprobs(p.top, entry);
    }
    link_->Send(m);
  }
}

void Worker::SendDone(const std::vector<int64_t>& done) {
  for (int64_t id : done) {
    const GenerationOutput* out = runner_->Output(id);
    v1::WorkerMessage m;
    v1::RequestDone* d = m.mutable_done();
    d->set_request_id(live_[id].request_id);
    if (out->finish_reason == FinishReason::kError) {
      // The step's Status: its code (INTERNAL, RESOURCE_EXHAUSTED, ...)
      // and a message naming the rank that failed and why.
      d->set_error_code(static_cast<int32_t>(out->error.code()));
      d->set_error_message(out->error.message());
    } else {
      d->set_finish_reason(std::string(FinishReasonName(out->finish_reason)));
    }
    d->set_prefix_hit_tokens(out->prefix_hit_tokens);
    link_->Send(m);
    by_request_id_.erase(live_[id].request_id);
    live_.erase(id);
    (void)runner_->engine()->TakeOutput(id);  // sent: the engine forgets it
  }
}

// Stats go out every stats_period_s, and soon (50 ms at most, so a burst of
// completions is one message) after the set of requests changed: `mlarun
// stats` right after the last answer arrived shows them done, not running.
void Worker::SendStatsWhenDue() {
  const auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_stats_).count();
  if (since < o_.stats_period_s && !(stats_dirty_ && since >= 0.05)) return;
  stats_dirty_ = false;
  v1::WorkerMessage m;
  v1::WorkerStats* ws = m.mutable_stats();
  ws->set_free_blocks(runner_->cache_stats().now.blocks_allocatable());
  *ws->mutable_ranks() = GroupRankStats(static_cast<double>(tokens_since_stats_) / since);
  link_->UpdateRanks(ws->ranks());
  link_->Send(m);
  tokens_since_stats_ = 0;
  last_stats_ = now;
}

}  // namespace

int RunWorker(const WorkerOptions& o, MpiSession& session) {
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  // Every rank returns here with the same outcome: a start-up error ends the
  // job on every rank with exit code 2, rank 0 says why.
  auto boot = BootstrapRank(o.deployment, session, std::cerr, "mlarun worker");
  if (!boot.ok()) {
    if (session.rank() == 0) {
      std::cerr << "mlarun worker: " << boot.status().ToString() << "\n" << std::flush;
      ReportStartFailure(boot.status().ToString());
    }
    return 2;
  }
  Worker worker(o, session, *boot);
  worker.Start();
  worker.Run();
  worker.Stop();
  return 0;
}

}  // namespace mlarun
