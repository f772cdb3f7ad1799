#include "launcher/worker/worker.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "base/cpu_isa.h"
#include "base/cuda_device.h"
#include "parallel/mpi/mpi_world.h"
#include "runtime/engine/rank_runner.h"
#include "runtime/model/memory_plan.h"
#include "runtime/rank/bootstrap.h"
#include "serving/client/grpc_util.h"
#include "serving/link/worker_link_client.h"
#include "serving/proto/proto_sampling.h"

namespace mlarun {
namespace {

std::atomic<bool> g_stop{false};
extern "C" void OnSignal(int) { g_stop = true; }

// This process's resident set (Linux /proc/self/statm); 0 where unavailable.
int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

}  // namespace

int RunWorker(const WorkerOptions& o, MpiSession& session) {
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  // Every rank returns here with the same outcome: a start-up error ends the
  // job on every rank with exit code 2, rank 0 says why.
  auto boot = BootstrapRank(o.deployment, session, std::cerr, "mlarun worker");
  if (!boot.ok()) {
    if (session.rank() == 0) std::cerr << "mlarun worker: " << boot.status().ToString() << "\n" << std::flush;
    return 2;
  }
  const std::string& rank_name = boot->name;
  const ParallelLayout& layout = boot->layout;
  ProcessGroups& groups = boot->groups;
  const ModelOptions& mo = boot->loaded.options;
  Model& model = *boot->loaded.model;
  if (mo.fail_forward_call >= 0)
    std::cerr << "mlarun worker: " + rank_name + ": fault injection: model step " +
                     std::to_string(mo.fail_forward_call) + " will fail\n"
              << std::flush;
  // The cache budget: given, or what the memory per rank leaves after the
  // weights this rank loaded and the prefill workspace.
  EngineConfig engine = o.engine;
  engine.commit_cache_memory = true;  // fail at start-up, not under load; and show in the RSS
  const ModelConfig& mc = model.config();
  const PrefillWorkspace workspace = PredictPrefillWorkspace(mc, layout.attn_tp, mo.attention.expand_chunk_rows);
  const WeightBytes weights = model.weight_bytes();
  int64_t memory_bytes = 0;
  if (o.memory_gib > 0) {
    memory_bytes = static_cast<int64_t>(o.memory_gib * double(int64_t{1} << 30));
    engine.cache_budget_bytes = memory_bytes - weights.total() - workspace.total();
    const LatentCacheConfig cache_config = CacheConfigFor(mc, engine.cache_budget_bytes, engine.block_size);
    const int64_t block_bytes = cache_config.block_bytes();
    if (cache_config.num_blocks() == 0)
      session.Abort("--memory-gib " + std::to_string(o.memory_gib) + ": " + std::to_string(memory_bytes) +
                        " B per rank minus weights (" + std::to_string(weights.total()) +
                        " B) and prefill workspace (" + std::to_string(workspace.total()) + " B) leaves " +
                        std::to_string(engine.cache_budget_bytes) + " B, less than one cache block (" +
                        std::to_string(block_bytes) + " B)",
                    2);
  }
  auto runner_or = RankRunner::Create(model, engine, groups, rank_name);
  if (!runner_or.ok()) session.Abort(runner_or.status().ToString(), 2);
  RankRunner& runner = **runner_or;
  Communicator& world = *groups.world;

  // Every rank's static facts, as GetStats reports them (the changing
  // fields are filled in at each report), and one worker id for the job.
  const LatentCacheStats own = runner.cache_stats().now;
  std::ostringstream layout_os;
  layout_os << layout;
  const std::string layout_text = layout_os.str();
  v1::RankStats me;
  me.set_rank(session.rank());
  me.set_dp_group(groups.dp_rank());
  me.set_attn_tp_rank(groups.attn_tp_rank());
  me.set_host(session.host());
  me.set_attention_weight_bytes(weights.attention);
  me.set_attention_replicated_weight_bytes(weights.attention_replicated);
  me.set_moe_weight_bytes(weights.moe);
  me.set_dense_mlp_weight_bytes(weights.dense_mlp);
  me.set_embedding_head_weight_bytes(weights.embedding_and_head);
  me.set_cache_bytes_per_token(own.bytes_per_token);
  me.set_cache_block_bytes(own.block_bytes);
  me.set_cache_blocks_total(own.blocks_total);
  me.set_cache_bytes_capacity(own.blocks_total * own.block_bytes);
  me.set_memory_budget_bytes(memory_bytes);
  me.set_cache_budget_bytes(engine.cache_budget_bytes);
  me.set_workspace_bytes(workspace.total());
  me.set_block_size(engine.block_size);
  me.set_model(o.deployment.model);
  me.set_num_layers(mc.num_hidden_layers);
  me.set_weight_dtype(std::string(DTypeName(mc.weight_dtype)));
  me.set_kv_dtype(std::string(DTypeName(mc.kv_dtype)));
  if (model.holds_fp8_projections()) me.set_projection_dtype(std::string(DTypeName(DType::kF8E4M3)));
  me.set_parallel(layout_text);
  me.set_resident_bytes(ResidentBytes());
  me.set_cpu_model_name(HostCpu().model_name);
  me.set_cpu_flags(HostCpu().FlagList());
  me.set_cpu_isa(std::string(CpuIsaName(ActiveCpuIsa())));
  if (boot->cuda_device >= 0) {
    std::string name;
    if (auto devices = CudaDevices(); devices.ok())
      for (const CudaDevice& d : *devices)
        if (d.index == boot->cuda_device) name = d.name;
    me.set_device("cuda:" + std::to_string(boot->cuda_device) + (name.empty() ? "" : " " + name));
    me.set_device_allocated_bytes(model.memory().live_bytes());
    if (auto info = CurrentCudaMemory(); info.ok()) {
      me.set_device_free_bytes(info->free_bytes);
      me.set_device_total_bytes(info->total_bytes);
    }
  } else {
    me.set_device("cpu");
  }
  auto infos = AllGatherStrings(world, me.SerializeAsString());
  if (!infos.ok()) session.Abort("start-up exchange failed: " + infos.status().ToString(), 2);
  std::string worker_id = session.host() + ":" + std::to_string(getpid());
  auto ids = AllGatherStrings(world, session.rank() == 0 ? worker_id : std::string());
  if (!ids.ok()) session.Abort("start-up exchange failed", 2);
  worker_id = (*ids)[0];
  std::vector<v1::RankStats> group_ranks;
  for (const std::string& bytes : *infos) {
    v1::RankStats r;
    if (!r.ParseFromString(bytes)) session.Abort("start-up exchange: a rank's facts do not parse", 2);
    if (r.dp_group() == groups.dp_rank()) group_ranks.push_back(std::move(r));
  }

  auto rank_stats = [&](double tokens_per_s) {
    google::protobuf::RepeatedPtrField<v1::RankStats> out;
    const LatentCacheStats& cs = runner.cache_stats().now;
    for (const v1::RankStats& r : group_ranks) {
      v1::RankStats* s = out.Add();
      *s = r;
      s->set_worker_id(worker_id);
      // Each rank's cache use from the last lockstep exchange (the leader's
      // own numbers before the first).
      const bool seen = static_cast<size_t>(r.rank()) < runner.world_cache().size();
      const RankCacheSnapshot snap = seen ? runner.world_cache()[static_cast<size_t>(r.rank())]
                                          : RankCacheSnapshot{cs.blocks_used, cs.blocks_used, cs.blocks_retired};
      s->set_cache_blocks_used(snap.blocks_used);
      s->set_cache_bytes_used(snap.blocks_used * r.cache_block_bytes());
      s->set_cache_bytes_peak(snap.peak_blocks_used * r.cache_block_bytes());
      s->set_cache_blocks_peak(snap.peak_blocks_used);
      s->set_cache_blocks_retired(snap.blocks_retired);
      s->set_requests_running(runner.engine()->num_running());
      s->set_requests_waiting(runner.engine()->num_waiting());
      s->set_tokens_per_s(tokens_per_s);
    }
    return out;
  };

  // The leader's end of the WorkerLink stream, on the link's own thread: the
  // step loop drains what arrived and sends (one consumer, one writer).
  std::unique_ptr<WorkerLinkClient> link;
  std::string last_refusal;  // the coordinator's last refusal, logged once
  // Attempts that never registered since the last registration (or the
  // start), and when that wait was last said: a worker started before its
  // coordinator says so every 10 s.
  int64_t unregistered_attempts = 0;
  const auto waiting_since = std::chrono::steady_clock::now();
  auto waiting_said = waiting_since;
  if (runner.is_leader()) {
    v1::Register reg;
    reg.set_worker_id(worker_id);
    reg.set_dp_group(groups.dp_rank());
    reg.set_dp(layout.dp);
    reg.set_attn_tp(layout.attn_tp);
    reg.set_vocab_size(mc.vocab_size);
    reg.set_max_position_embeddings(mc.max_position_embeddings);
    reg.set_block_size(engine.block_size);
    reg.set_cache_blocks_total(runner.cache_stats().now.blocks_total);
    *reg.mutable_ranks() = rank_stats(0);
    link = std::make_unique<WorkerLinkClient>(WorkerLinkClient::Options{
        .coordinator = o.coordinator, .registration = reg, .secret = o.worker_secret, .tls = o.tls});
  }
  if (session.rank() == 0)
    std::cerr << "mlarun worker " << worker_id << ": " << layout << ", " << o.deployment.model << ", coordinator "
              << o.coordinator << "\n";

  // The step loop, on every rank.
  struct Live {
    std::string request_id;
    size_t sent = 0;         // tokens sent
    size_t prompt_sent = 0;  // prompt logprobs sent
  };
  std::map<int64_t, Live> live;  // engine id -> request (leaders)
  std::map<std::string, int64_t> by_request_id;
  auto last_stats = std::chrono::steady_clock::now();
  int64_t tokens_since_stats = 0;
  bool stats_dirty = false;  // requests arrived or ended since the last stats
  constexpr auto kMinIdleSleep = std::chrono::microseconds(500), kMaxIdleSleep = std::chrono::microseconds(5000);
  auto idle_sleep = kMinIdleSleep;
  for (;;) {
    if (link) {
      for (WorkerLinkEvent& e : link->Drain()) {
        if (e.message.has_registered()) {
          std::cerr << "mlarun worker " << worker_id << ": " << rank_name << ": DP group " << groups.dp_rank()
                    << " registered with the coordinator at " << o.coordinator << "\n";
          unregistered_attempts = 0;
        } else if (e.message.has_route()) {
          const v1::RouteRequest& route = e.message.route();
          const std::string rid = route.request_id();
          GenerationRequest req{.prompt = std::vector<int32_t>(route.prompt_ids().begin(), route.prompt_ids().end()),
                                .sampling = FromProto(route.sampling())};
          auto id = runner.Add(std::move(req));
          if (!id.ok()) {
            v1::WorkerMessage m;
            v1::RequestDone* d = m.mutable_done();
            d->set_request_id(rid);
            d->set_error_code(static_cast<int32_t>(id.status().code()));
            d->set_error_message(id.status().message());
            link->Send(m);
            continue;
          }
          live[*id] = Live{rid, 0};
          by_request_id[rid] = *id;
          stats_dirty = true;
        } else if (e.message.has_cancel()) {
          auto it = by_request_id.find(e.message.cancel().request_id());
          if (it == by_request_id.end()) continue;
          (void)runner.engine()->Cancel(it->second);
          (void)runner.engine()->TakeOutput(it->second);  // forget it
          live.erase(it->second);
          by_request_id.erase(it);
        } else if (e.ended) {  // the stream broke: the coordinator has ended or re-routed these
          // A refusal (wrong or missing --worker-secret-file, a registration
          // out of range, the group held by another stream) repeats at every
          // retry of the back-off: said once per distinct answer.
          const grpc::StatusCode code = e.status.error_code();
          if (!e.registered &&
              (code == grpc::StatusCode::UNAUTHENTICATED || code == grpc::StatusCode::INVALID_ARGUMENT ||
               code == grpc::StatusCode::ALREADY_EXISTS)) {
            std::string why = std::string(client_internal::GrpcCodeName(code)) + ": " + e.status.error_message();
            if (why != last_refusal)
              std::cerr << "mlarun worker " << worker_id << ": " << rank_name << ": the coordinator at "
                        << o.coordinator << " refused the registration (" << why << "); retrying\n";
            last_refusal = std::move(why);
          } else if (e.registered) {
            last_refusal.clear();
            std::cerr << "mlarun worker " << worker_id << ": " << rank_name << ": the link to the coordinator at "
                      << o.coordinator << " ended (" << client_internal::GrpcCodeName(code) << ": "
                      << e.status.error_message() << "); reconnecting\n";
            waiting_said = std::chrono::steady_clock::now();
          }
          if (!e.registered && ++unregistered_attempts > 0 &&
              std::chrono::steady_clock::now() - waiting_said >= std::chrono::seconds(10)) {
            waiting_said = std::chrono::steady_clock::now();
            std::cerr << "mlarun worker " << worker_id << ": " << rank_name << ": still waiting for the coordinator at "
                      << o.coordinator << " (" << unregistered_attempts
                      << " attempts; last: " << client_internal::GrpcCodeName(code) << ": " << e.status.error_message()
                      << ")\n";
          }
          for (const auto& [id, l] : live) {
            (void)runner.engine()->Cancel(id);
            (void)runner.engine()->TakeOutput(id);
          }
          live.clear();
          by_request_id.clear();
        }
      }
    }
    auto step = runner.StepOrStop(g_stop.load());
    if (!step.ok()) {
      // The ranks are out of lockstep: the job ends. A leader first tells the
      // coordinator why, so its clients learn it now and with the reason.
      const std::string reason = rank_name + " cannot continue: step failed: " + step.status().ToString();
      if (link && !link->Leave(reason, /*timeout_s=*/2.0))
        std::cerr << "mlarun worker: " + rank_name + ": could not tell the coordinator that the group is leaving\n";
      session.Abort(reason, 1);
    }
    if (*step == RankRunner::StepResult::kStop) break;
    if (link) {
      // New tokens, completions, and the requests of a failed step.
      v1::WorkerMessage tokens;
      std::vector<int64_t> done;
      for (auto& [id, l] : live) {
        const GenerationOutput* out = runner.Output(id);
        // The prompt's logprobs first, in messages of their own (a long
        // prompt's would not fit in one): all are recorded by the step that
        // draws the first token, so they precede it on the stream.
        while (l.prompt_sent < out->prompt_logprobs.size()) {
          constexpr size_t kPerMessage = 1024;
          v1::WorkerMessage m;
          v1::PromptLogprobsEvent* e = m.mutable_tokens()->add_prompt_logprobs();
          e->set_request_id(l.request_id);
          e->mutable_logprobs()->set_start(static_cast<int64_t>(l.prompt_sent) + 1);
          for (size_t end = std::min(out->prompt_logprobs.size(), l.prompt_sent + kPerMessage); l.prompt_sent < end;
               ++l.prompt_sent) {
            const LogprobEntry& p = out->prompt_logprobs[l.prompt_sent];
            v1::PromptTokenLogprob* entry = e->mutable_logprobs()->add_entries();
            entry->set_token_id(p.token.token);
            entry->set_logprob(p.token.logprob);
            AddTopLogprobs(p.top, entry);
          }
          link->Send(m);
        }
        for (; l.sent < out->tokens.size(); ++l.sent) {
          v1::TokenEvent* t = tokens.mutable_tokens()->add_events();
          t->set_request_id(l.request_id);
          t->set_token_id(out->tokens[l.sent]);
          t->set_logprob(out->logprobs[l.sent]);
          if (l.sent < out->top_logprobs.size()) AddTopLogprobs(out->top_logprobs[l.sent], t);
          ++tokens_since_stats;
        }
        if (out->finish_reason == FinishReason::kLength || out->finish_reason == FinishReason::kStop ||
            out->finish_reason == FinishReason::kError)
          done.push_back(id);
      }
      if (tokens.tokens().events_size() > 0) link->Send(tokens);
      if (!runner.last_step_failure().ok()) {
        int64_t failed = 0;
        for (int64_t id : done) failed += runner.Output(id)->finish_reason == FinishReason::kError;
        std::cerr << "mlarun worker: " + rank_name + ": DP group " + std::to_string(groups.dp_rank()) +
                         ": a step failed; its " + std::to_string(failed) +
                         " requests end with the error, the group goes on: " + runner.last_step_failure().ToString() +
                         "\n"
                  << std::flush;
      }
      for (int64_t id : done) {
        const GenerationOutput* out = runner.Output(id);
        v1::WorkerMessage m;
        v1::RequestDone* d = m.mutable_done();
        d->set_request_id(live[id].request_id);
        if (out->finish_reason == FinishReason::kError) {
          // The step's Status: its code (INTERNAL, RESOURCE_EXHAUSTED, ...)
          // and a message naming the rank that failed and why.
          d->set_error_code(static_cast<int32_t>(out->error.code()));
          d->set_error_message(out->error.message());
        } else {
          d->set_finish_reason(std::string(FinishReasonName(out->finish_reason)));
        }
        d->set_prefix_hit_tokens(out->prefix_hit_tokens);
        link->Send(m);
        by_request_id.erase(live[id].request_id);
        live.erase(id);
        (void)runner.engine()->TakeOutput(id);  // sent: the engine forgets it
      }
      // Stats go out every stats_period_s, and soon (50 ms at most, so a
      // burst of completions is one message) after the set of requests
      // changed: `mlarun stats` right after the last answer arrived shows
      // them done, not running.
      if (!done.empty()) stats_dirty = true;
      const auto now = std::chrono::steady_clock::now();
      const double since = std::chrono::duration<double>(now - last_stats).count();
      if (since >= o.stats_period_s || (stats_dirty && since >= 0.05)) {
        stats_dirty = false;
        v1::WorkerMessage m;
        v1::WorkerStats* ws = m.mutable_stats();
        ws->set_free_blocks(runner.cache_stats().now.blocks_allocatable());
        *ws->mutable_ranks() = rank_stats(static_cast<double>(tokens_since_stats) / since);
        link->UpdateRanks(ws->ranks());
        link->Send(m);
        tokens_since_stats = 0;
        last_stats = now;
      }
    }
    if (*step == RankRunner::StepResult::kIdle) {
      // Nobody has work. A leader waits for a request (woken as one arrives),
      // at most a few ms so the other groups' leaders meet it at the next
      // exchange soon; members just enter that exchange, whose wait sleeps.
      if (link) link->WaitUntil(WorkerLinkClient::Clock::now() + idle_sleep);
      idle_sleep = std::min(kMaxIdleSleep, idle_sleep * 2);
    } else {
      idle_sleep = kMinIdleSleep;
    }
  }
  link.reset();
  if (session.rank() == 0) std::cerr << "mlarun worker " << worker_id << ": stopped\n";
  return 0;
}

}  // namespace mlarun
