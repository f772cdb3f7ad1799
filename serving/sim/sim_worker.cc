// `mlarun sim-worker` (sim_worker.h says what it simulates).
//
// Threads: RunSimWorker's own thread only watches `*stop`; each group has one
// thread that owns all of the group's state (requests, simulated cache) and is
// the only sender on its link, plus the link's own thread
// (serving/link/worker_link_client.h), which connects, reconnects and moves
// incoming messages into the link's inbox. Keeping every state change on one
// thread is what lets a CancelRoute take effect between two steps without
// locks around the cache.
#include "serving/sim/sim_worker.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <thread>

#include "base/cpu_isa.h"
#include "base/hash.h"
#include "kv/latent_cache.h"
#include "runtime/request/request.h"
#include "serving/client/grpc_util.h"
#include "serving/link/worker_link_client.h"
#include "serving/proto/proto_sampling.h"

namespace mlarun {

SimToken SimWorkerToken(std::span<const int32_t> prompt, uint64_t seed, int64_t index, int64_t vocab_size) {
  uint64_t h = Mix64(seed ^ 0x73696d2d776f726bull);  // "sim-work"
  for (int32_t t : prompt) h = Mix64(h ^ static_cast<uint32_t>(t)) + kGoldenGamma;
  h = Mix64(h ^ (static_cast<uint64_t>(index) * 0xd1b54a32d192ed03ull + 1));
  return {.token = static_cast<int64_t>(h % static_cast<uint64_t>(std::max<int64_t>(vocab_size, 1))),
          .logprob = -8.0 * static_cast<double>(h >> 11) * 0x1p-53};
}

std::vector<TokenLogprob> SimWorkerTop(const SimToken& tok, int64_t n, int64_t vocab_size) {
  std::vector<TokenLogprob> top;
  for (int64_t j = 0; j < std::min(n, vocab_size); ++j) {
    if (j == 1) {
      top.push_back({.token = tok.token, .logprob = tok.logprob});
    } else {
      top.push_back({.token = (tok.token + std::max<int64_t>(j, 1)) % vocab_size,
                     .logprob = j == 0 ? tok.logprob / 2 : tok.logprob - static_cast<double>(j - 1)});
    }
  }
  return top;
}

SimToken SimWorkerPromptToken(std::span<const int32_t> prompt, int64_t i) {
  return {.token = prompt[static_cast<size_t>(i)], .logprob = -0.5 - 0.25 * static_cast<double>(i % 8)};
}

namespace {

namespace v1 = ::mlarun::v1;
using Clock = std::chrono::steady_clock;

// Synthetic per-rank numbers (a simulated group is one rank, attn_tp = 1).
// Round values, so `mlarun stats` output is recognizably simulated.
constexpr int64_t kSimAttentionWeightBytes = int64_t{16} << 20;
constexpr int64_t kSimMoeWeightBytes = int64_t{64} << 20;
constexpr int64_t kSimDenseMlpWeightBytes = int64_t{8} << 20;
constexpr int64_t kSimEmbeddingHeadWeightBytes = int64_t{4} << 20;
constexpr int64_t kSimCacheBytesPerToken = 1024;
// Running requests per group at most (vLLM's max_num_seqs default); more wait.
constexpr size_t kMaxRunning = 256;
constexpr auto kStatsPeriod = std::chrono::milliseconds(200);
// A step that ends later than planned starts the next one up to this much
// early, so short delays are caught up; longer ones (idling) are forgiven,
// so there is no burst.
constexpr auto kCatchUp = std::chrono::milliseconds(20);

// Log lines from every group thread, whole lines at a time.
class Logger {
 public:
  explicit Logger(std::ostream& os) : os_(os) {}
  template <typename... Args>
  void operator()(const Args&... args) {
    const std::string line = internal::StrCat(args...) + "\n";
    std::lock_guard<std::mutex> lock(mu_);
    os_ << line << std::flush;
  }

 private:
  std::mutex mu_;
  std::ostream& os_;
};

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

struct SimRequest {
  std::string id;
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  uint64_t prefix_cache_salt = 0;
  SeqId seq = -1;
  bool in_cache = false;
  int64_t prefix_hit_tokens = 0;
  // The prompt, then every generated token (first those it generated on
  // another group before it was routed here). Token `generated` comes once
  // the rows of all of them are computed.
  std::vector<int32_t> tokens;
  int64_t generated = 0;  // tokens.size() - prompt.size()
  int64_t computed = 0;   // rows of `tokens` in the cache
  // Its prefill is over (it emitted a token here): one decode row a step.
  bool decoding = false;
  int64_t step_rows = 0;        // rows the step in flight computes for it; 0: not in that step
  int64_t source_rows = 0;      // rows its MoveSource holds (another group's blocks); 0: none
  int64_t import_rows = 0;      // of those, the rows it fetches in its first step (not cached here)
  std::vector<int64_t> output;  // the tokens sent (with sampling.bad_words only)
  // Cache blocks this request may still take (its prompt + max_tokens - 1
  // rows were reserved at admission, so decoding never runs out of blocks).
  int64_t reserved_blocks = 0;
};

// The request's bad_words as a sampler applies them, for tests that they
// reach the group: a token that would end a bad word (its other tokens the
// last ones sent) becomes the next id that does not, modulo the vocabulary.
int64_t AvoidBadWords(SimRequest& r, int64_t token, int64_t vocab_size) {
  if (r.sampling.bad_words.empty()) return token;
  auto banned = [&](int64_t t) {
    for (const std::vector<int64_t>& w : r.sampling.bad_words) {
      const size_t before = w.size() - 1;
      if (w.back() == t && before <= r.output.size() &&
          std::equal(w.begin(), w.end() - 1, r.output.end() - static_cast<std::ptrdiff_t>(before)))
        return true;
    }
    return false;
  };
  for (int64_t tries = 0; tries < vocab_size && banned(token); ++tries) token = (token + 1) % vocab_size;
  r.output.push_back(token);
  return token;
}

class SimGroup {
 public:
  SimGroup(const SimWorkerOptions& o, int index, std::unique_ptr<LatentCache> cache, const std::atomic<bool>* stopping,
           Logger* log)
      : o_(o),
        index_(index),
        host_(HostName()),
        stopping_(stopping),
        log_(*log),
        cache_(std::move(cache)),
        link_({.coordinator = o.coordinator, .registration = Registration(), .secret = o.worker_secret, .tls = o.tls}) {
  }

  // The group's thread: serves what the link brings until `stopping`.
  void Run();

  // From another thread: wakes the group so it notices `stopping`. Thread-safe.
  void Interrupt() { link_.Wake(); }

 private:
  // One event of the link: a message from the coordinator or the end of a
  // connection attempt.
  void Handle(WorkerLinkEvent& e);
  // Moves waiting requests into the running set while there is room.
  void Admit();
  // Plans a step over the running requests (their rows), due at `base` +
  // its duration.
  void StartStep(Clock::time_point base);
  // Ends the step in flight: writes its rows, sends its tokens and the
  // RequestDone of the requests that finished.
  void FinishStep();
  // Writes rows computed + [0, n) of `r`'s tokens to the cache.
  void Compute(SimRequest& r, int64_t n);
  // Token `r.generated` of `r` into `batch`; `r` into `finished` (its
  // RequestDone into `dones`) when it was the last.
  void Emit(SimRequest& r, v1::TokenBatch& batch, std::vector<v1::WorkerMessage>& dones,
            std::vector<SimRequest*>& finished);
  void SendStats(Clock::time_point now);
  // Answers a MigrateOut of `r` (Exported) and drops it, keeping the blocks
  // of its computed rows with block moves.
  void Export(SimRequest& r);
  // Frees the blocks an Exported named for `request_id`, if still held.
  void ReleaseExport(const std::string& request_id);
  void Route(v1::RouteRequest& r);
  void Drop(SimRequest& r);
  void DropAll();
  v1::RankStats Rank() const;
  v1::Register Registration() const;

  // ---- Constant after construction.
  const SimWorkerOptions o_;
  const int index_;
  const std::string host_;
  const std::atomic<bool>* stopping_;
  Logger& log_;

  // ---- Owned by the group thread.
  std::unique_ptr<LatentCache> cache_;
  std::map<std::string, std::unique_ptr<SimRequest>> live_;  // by request id
  std::deque<SimRequest*> waiting_;
  std::vector<SimRequest*> running_;
  std::map<std::string, SeqId> exported_;  // blocks held for a moved request until ReleaseExported
  int64_t reserved_blocks_ = 0;            // sum of running requests' reserved_blocks
  int64_t transfer_fetches_ = 0, transfer_bytes_ = 0;
  SeqId next_seq_ = 1;
  int64_t peak_blocks_used_ = 0;
  int64_t tokens_since_stats_ = 0;
  double tokens_per_s_ = 0;
  bool connected_ = false;  // the link's stream is registered (its Registered drained)
  bool in_step_ = false;    // a step is in flight, due at step_end_
  Clock::time_point step_end_, next_stats_, last_stats_;
  std::string last_failure_;  // of the previous attempt, if it never registered

  // Last: it connects at once, registering the state above. Thread-safe.
  WorkerLinkClient link_;
};

v1::RankStats SimGroup::Rank() const {
  const LatentCacheStats s = cache_->stats();
  const int64_t block_bytes = kSimCacheBytesPerToken * o_.block_size;
  v1::RankStats r;
  r.set_worker_id(o_.worker_id);
  r.set_rank(index_);
  r.set_dp_group(index_);
  r.set_attn_tp_rank(0);
  r.set_host(host_);
  r.set_attention_weight_bytes(kSimAttentionWeightBytes);
  r.set_moe_weight_bytes(kSimMoeWeightBytes);
  r.set_dense_mlp_weight_bytes(kSimDenseMlpWeightBytes);
  r.set_embedding_head_weight_bytes(kSimEmbeddingHeadWeightBytes);
  r.set_cache_bytes_per_token(kSimCacheBytesPerToken);
  r.set_cache_block_bytes(block_bytes);
  r.set_cache_blocks_total(s.blocks_total);
  r.set_cache_blocks_used(s.blocks_used);
  r.set_cache_bytes_capacity(s.blocks_total * block_bytes);
  r.set_cache_bytes_used(s.blocks_used * block_bytes);
  r.set_cache_blocks_peak(peak_blocks_used_);
  r.set_cache_bytes_peak(peak_blocks_used_ * block_bytes);
  r.set_requests_running(static_cast<int64_t>(running_.size()));
  r.set_requests_waiting(static_cast<int64_t>(waiting_.size()));
  r.set_tokens_per_s(tokens_per_s_);
  if (o_.transfer_gbps > 0) {
    r.set_transfer_path("sim");
    r.set_transfer_fetches(transfer_fetches_);
    r.set_transfer_bytes(transfer_bytes_);
  }
  // The machine it runs on, as a worker's rank reports its own.
  const CpuFeatures& cpu = HostCpu();
  r.set_cpu_model_name(cpu.model_name);
  r.set_cpu_flags(cpu.FlagList());
  r.set_cpu_isa(std::string(CpuIsaName(ActiveCpuIsa())));
  return r;
}

v1::Register SimGroup::Registration() const {
  v1::Register reg;
  reg.set_worker_id(o_.worker_id);
  reg.set_dp_group(index_);
  reg.set_dp(o_.groups);
  reg.set_attn_tp(1);
  reg.set_vocab_size(o_.vocab_size);
  reg.set_max_position_embeddings(o_.max_position_embeddings);
  reg.set_block_size(o_.block_size);
  reg.set_cache_blocks_total(cache_->stats().blocks_total);
  *reg.add_ranks() = Rank();
  reg.set_role(o_.role);
  // Any bytes do: only another simulated group "reads" them.
  if (o_.transfer_gbps > 0) reg.add_transfer_descriptors(internal::StrCat("sim-transfer:", o_.worker_id, "/", index_));
  return reg;
}

void SimGroup::Run() {
  while (!stopping_->load()) {
    for (WorkerLinkEvent& e : link_.Drain()) Handle(e);
    if (!connected_) {
      link_.WaitUntil(Clock::now() + kStatsPeriod);
      continue;
    }
    auto now = Clock::now();
    bool chained = false;  // a step just ended: the next one follows it
    if (in_step_ && now >= step_end_) {
      FinishStep();
      chained = true;
    }
    Admit();
    if (!in_step_ && !running_.empty()) StartStep(chained ? std::max(step_end_, now - kCatchUp) : now);
    now = Clock::now();
    if (now >= next_stats_) SendStats(now);
    link_.WaitUntil(in_step_ ? std::min(next_stats_, step_end_) : next_stats_);
  }
}

void SimGroup::SendStats(Clock::time_point now) {
  const double dt = std::chrono::duration<double>(now - last_stats_).count();
  tokens_per_s_ = dt > 0 ? static_cast<double>(tokens_since_stats_) / dt : 0;
  tokens_since_stats_ = 0;
  last_stats_ = now;
  next_stats_ = std::max(next_stats_ + kStatsPeriod, now);
  const LatentCacheStats cs = cache_->stats();
  v1::WorkerMessage m;
  v1::WorkerStats* s = m.mutable_stats();
  s->set_free_blocks(std::max<int64_t>(0, cs.blocks_allocatable() - reserved_blocks_));
  *s->add_ranks() = Rank();
  link_.Send(m);
}

void SimGroup::Handle(WorkerLinkEvent& e) {
  if (e.ended) {
    connected_ = false;
    // The coordinator ends (or re-routes) every request of a broken stream, so
    // nothing in flight here may continue on the next connection.
    if (!live_.empty())
      log_("sim-worker ", o_.worker_id, " group ", index_, ": dropping ", live_.size(), " in-flight requests");
    DropAll();
    google::protobuf::RepeatedPtrField<v1::RankStats> ranks;
    *ranks.Add() = Rank();
    link_.UpdateRanks(ranks);  // the next registration shows the group as it is now
    // While the coordinator is down every attempt fails alike; one line per
    // distinct failure keeps the log readable at a retry every 2 s.
    std::string why =
        internal::StrCat(client_internal::GrpcCodeName(e.status.error_code()), ": ", e.status.error_message());
    if (!stopping_->load() && (e.registered || why != last_failure_))
      log_("sim-worker ", o_.worker_id, " group ", index_, ": connection to ", o_.coordinator, " ended (", why,
           "), reconnecting");
    last_failure_ = e.registered ? std::string() : std::move(why);
    return;
  }
  v1::CoordinatorMessage& m = e.message;
  if (m.has_registered()) {
    log_("sim-worker ", o_.worker_id, " group ", index_, ": registered with coordinator ",
         m.registered().coordinator_id(), " at ", o_.coordinator);
    connected_ = true;
    in_step_ = false;
    last_stats_ = Clock::now();
    next_stats_ = last_stats_ + kStatsPeriod;
    return;
  }
  if (m.has_cancel()) {
    auto it = live_.find(m.cancel().request_id());
    if (it != live_.end()) Drop(*it->second);  // unknown ids finished already: nothing to do
    ReleaseExport(m.cancel().request_id());
    return;
  }
  if (m.has_migrate_out()) {
    // Every token of this request sent (the step in flight emits none for it): it leaves.
    auto it = live_.find(m.migrate_out().request_id());
    if (it != live_.end()) Export(*it->second);  // else finished already; its RequestDone answered
    return;
  }
  if (m.has_release_exported()) {
    ReleaseExport(m.release_exported().request_id());
    return;
  }
  if (m.has_route()) Route(*m.mutable_route());
}

void SimGroup::Route(v1::RouteRequest& r) {
  if (live_.count(r.request_id())) {
    // The coordinator keeps ids unique; answering would end the live request
    // on its side, so the duplicate is only logged.
    log_("sim-worker ", o_.worker_id, " group ", index_, ": ignoring a second route of live request ", r.request_id());
    return;
  }
  GenerationRequest gen{.prompt = std::vector<int32_t>(r.prompt_ids().begin(), r.prompt_ids().end()),
                        .sampling = FromProto(r.sampling()),
                        .generated = std::vector<int32_t>(r.generated_ids().begin(), r.generated_ids().end())};
  if (o_.transfer_gbps > 0 && r.has_move_source() && r.move_source().cached_tokens() > 0) {
    // As the worker: the blocks are fetched instead of computed.
    const v1::MoveSource& from = r.move_source();
    gen.import = ImportSource{.descriptors = {from.descriptors().begin(), from.descriptors().end()},
                              .blocks = {from.block_ids().begin(), from.block_ids().end()},
                              .rows = from.cached_tokens()};
  }
  // The checks of Engine::Add, with its messages.
  Status st = ValidateGenerationRequest(gen, {.vocab_size = o_.vocab_size,
                                              .max_position_embeddings = o_.max_position_embeddings,
                                              .block_size = o_.block_size,
                                              .cache_blocks_total = cache_->stats().blocks_total});
  if (st.ok() && o_.check) st = o_.check(gen.sampling);
  if (!st.ok()) {
    v1::WorkerMessage d;
    v1::RequestDone* done = d.mutable_done();
    done->set_request_id(r.request_id());
    done->set_error_code(static_cast<int32_t>(st.code()));
    done->set_error_message(st.message());
    link_.Send(d);
    return;
  }
  auto req = std::make_unique<SimRequest>();
  req->id = r.request_id();
  req->prompt = std::move(gen.prompt);
  req->sampling = std::move(gen.sampling);
  req->prefix_cache_salt = r.prefix_cache_salt();
  req->generated = static_cast<int64_t>(gen.generated.size());
  if (!req->sampling.bad_words.empty()) req->output.assign(gen.generated.begin(), gen.generated.end());
  req->tokens = req->prompt;
  req->tokens.insert(req->tokens.end(), gen.generated.begin(), gen.generated.end());
  if (gen.import) req->source_rows = gen.import->rows;
  waiting_.push_back(req.get());
  live_[req->id] = std::move(req);
}

void SimGroup::Export(SimRequest& r) {
  v1::WorkerMessage x;
  v1::Exported* e = x.mutable_exported();
  e->set_request_id(r.id);
  e->set_tokens(r.generated);
  // As Engine::Export: the blocks of its computed rows stay held for the new
  // group; a request whose fetch has not happened yet exports none.
  if (o_.transfer_gbps > 0 && r.in_cache && r.computed > 0 && r.import_rows == 0) {
    const std::span<const int32_t> table = cache_->BlockTable(r.seq);
    const size_t n = static_cast<size_t>((r.computed + o_.block_size - 1) / o_.block_size);
    if (n == table.size()) {
      e->mutable_block_ids()->Assign(table.begin(), table.end());
      e->set_cached_tokens(r.computed);
      ReleaseExport(r.id);  // (a request exported here before is long released)
      exported_[r.id] = r.seq;
      r.in_cache = false;  // Drop leaves its blocks held
    } else {
      log_("sim-worker: internal: request ", r.id, " has ", r.computed, " rows in ", table.size(), " blocks");
    }
  }
  link_.Send(x);
  Drop(r);
}

void SimGroup::ReleaseExport(const std::string& request_id) {
  auto it = exported_.find(request_id);
  if (it == exported_.end()) return;
  (void)cache_->Release(it->second);  // its full blocks stay cached for prefix reuse
  exported_.erase(it);
}

void SimGroup::Admit() {
  while (!waiting_.empty() && running_.size() < kMaxRunning) {
    SimRequest& r = *waiting_.front();
    const int64_t len = static_cast<int64_t>(r.prompt.size());
    r.seq = next_seq_++;
    // The cache calls cannot fail here (fresh id, no tokens yet, blocks
    // checked first); a failure would be a bug in this file, so it drops the
    // request rather than continue with a wrong cache.
    Status st = cache_->AddSequence(r.seq, r.prefix_cache_salt);
    if (!st.ok()) {
      log_("sim-worker: internal: ", st);
      Drop(r);
      continue;
    }
    r.in_cache = true;
    // As Engine::Admit: reuse cached full blocks, keeping one token to compute.
    auto hit = cache_->AttachPrefix(r.seq, r.tokens, static_cast<int64_t>(r.tokens.size()) - 1);
    // Rows written over the request's life, from here: every token's but
    // the last generated one's (its row is never computed).
    auto need = hit.ok() ? cache_->BlocksNeeded(r.seq, len + r.sampling.max_tokens - 1 - *hit) : hit.status();
    if (!need.ok()) {
      log_("sim-worker: internal: ", need.status());
      Drop(r);
      continue;
    }
    if (*need > cache_->stats().blocks_allocatable() - reserved_blocks_) {
      // Wait for running requests to free blocks; the attached prefix goes
      // back to the LRU meanwhile.
      (void)cache_->Release(r.seq);
      r.in_cache = false;
      break;
    }
    r.computed = *hit;
    r.decoding = false;
    // As Engine::StartImport: only the rows its own prefix cache lacks are fetched.
    r.import_rows = std::max<int64_t>(0, r.source_rows - *hit);
    r.prefix_hit_tokens = std::min(*hit, len);  // prompt tokens, as the engine counts them
    r.reserved_blocks = *need;
    reserved_blocks_ += *need;
    waiting_.pop_front();
    running_.push_back(&r);
    peak_blocks_used_ = std::max(peak_blocks_used_, cache_->stats().blocks_used);
  }
}

void SimGroup::StartStep(Clock::time_point base) {
  const bool chunked = o_.prefill_tokens_per_s > 0;
  int64_t budget = o_.max_batched_tokens, decode = 0, prefill = 0, fetched = 0;
  for (SimRequest* r : running_) {
    const int64_t left = static_cast<int64_t>(r->tokens.size()) - r->computed;
    if (r->import_rows > 0) {  // its blocks, fetched before the step computes
      r->step_rows = r->import_rows;
      fetched += r->import_rows;
      continue;
    }
    if (r->decoding) {  // the row of its last token (left is 1)
      r->step_rows = left;
      decode += left;
      continue;
    }
    // The next chunk of its prefill, in admission order while the budget lasts.
    r->step_rows = chunked ? std::min(left, budget) : left;
    if (chunked) budget -= r->step_rows;
    prefill += r->step_rows;
  }
  const double step_s =
      1e-3 * o_.step_ms + (o_.tokens_per_s > 0 ? static_cast<double>(decode) / o_.tokens_per_s : 0.0) +
      (chunked ? static_cast<double>(prefill) / o_.prefill_tokens_per_s : 0.0) +
      (o_.transfer_gbps > 0 ? static_cast<double>(fetched * kSimCacheBytesPerToken) * 8 / (o_.transfer_gbps * 1e9)
                            : 0.0);
  step_end_ = base + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(step_s));
  in_step_ = true;
}

void SimGroup::Compute(SimRequest& r, int64_t n) {
  const size_t before = cache_->BlockTable(r.seq).size();
  const auto rows = std::span<const int32_t>(r.tokens).subspan(static_cast<size_t>(r.computed), static_cast<size_t>(n));
  Status st = cache_->Append(r.seq, rows);
  if (st.ok()) st = cache_->Commit(r.seq);
  // Cannot fail (the blocks were reserved at admission); the tokens do not
  // depend on the cache, so a bug here is only logged.
  if (!st.ok()) log_("sim-worker: internal: ", st);
  const int64_t taken = static_cast<int64_t>(cache_->BlockTable(r.seq).size() - before);
  r.reserved_blocks -= taken;
  reserved_blocks_ -= taken;
  r.computed += n;
}

void SimGroup::FinishStep() {
  in_step_ = false;
  v1::WorkerMessage batch_msg;
  v1::TokenBatch* batch = batch_msg.mutable_tokens();
  std::vector<v1::WorkerMessage> dones;
  std::vector<SimRequest*> finished;
  for (SimRequest* r : running_) {
    if (r->step_rows == 0) continue;  // admitted during the step, or no budget left for it
    const int64_t rows = std::exchange(r->step_rows, 0);
    Compute(*r, rows);
    if (r->import_rows > 0) {
      // Fetched: with the rows of every token but the last (the usual
      // export) it decodes from the next step, else it computes the rest.
      r->import_rows = 0;
      r->decoding = r->computed == static_cast<int64_t>(r->tokens.size()) - 1;
      ++transfer_fetches_;
      transfer_bytes_ += rows * kSimCacheBytesPerToken;
      continue;
    }
    if (r->computed < static_cast<int64_t>(r->tokens.size())) continue;  // more of its prefill to go
    r->decoding = true;
    Emit(*r, *batch, dones, finished);
  }
  peak_blocks_used_ = std::max(peak_blocks_used_, cache_->stats().blocks_used);
  tokens_since_stats_ += batch->events_size();
  for (SimRequest* r : finished) Drop(*r);
  // Tokens first: a request's RequestDone must follow its last token.
  if (batch->events_size() > 0) link_.Send(batch_msg);
  for (const auto& d : dones) link_.Send(d);
}

void SimGroup::Emit(SimRequest& r, v1::TokenBatch& batch, std::vector<v1::WorkerMessage>& dones,
                    std::vector<SimRequest*>& finished) {
  if (r.generated == 0 && r.sampling.prompt_logprobs >= 0 && r.prompt.size() > 1) {
    v1::PromptLogprobsEvent* pe = batch.add_prompt_logprobs();
    pe->set_request_id(r.id);
    pe->mutable_logprobs()->set_start(1);
    for (int64_t i = 1; i < static_cast<int64_t>(r.prompt.size()); ++i) {
      const SimToken pt = SimWorkerPromptToken(r.prompt, i);
      v1::PromptTokenLogprob* entry = pe->mutable_logprobs()->add_entries();
      entry->set_token_id(pt.token);
      entry->set_logprob(pt.logprob);
      AddTopLogprobs(SimWorkerTop(pt, r.sampling.prompt_logprobs, o_.vocab_size), entry);
    }
  }
  SimToken tok = SimWorkerToken(r.prompt, r.sampling.seed, r.generated, o_.vocab_size);
  const bool scripted = !o_.script.empty();
  if (scripted) tok.token = o_.script[static_cast<size_t>(r.generated)];
  tok.token = AvoidBadWords(r, tok.token, o_.vocab_size);
  v1::TokenEvent* e = batch.add_events();
  e->set_request_id(r.id);
  e->set_token_id(tok.token);
  e->set_logprob(tok.logprob);
  AddTopLogprobs(SimWorkerTop(tok, r.sampling.logprobs, o_.vocab_size), e);
  ++r.generated;
  r.tokens.push_back(static_cast<int32_t>(tok.token));
  const auto& stops = r.sampling.stop_token_ids;
  const bool stop = (o_.eos_token_id >= 0 && tok.token == o_.eos_token_id && !r.sampling.ignore_eos) ||
                    std::find(stops.begin(), stops.end(), tok.token) != stops.end() ||
                    (scripted && r.generated >= static_cast<int64_t>(o_.script.size()));
  if (stop || r.generated >= r.sampling.max_tokens) {
    v1::WorkerMessage d;
    v1::RequestDone* done = d.mutable_done();
    done->set_request_id(r.id);
    done->set_finish_reason(stop ? "stop" : "length");
    done->set_prefix_hit_tokens(r.prefix_hit_tokens);
    dones.push_back(std::move(d));
    finished.push_back(&r);
  }
}

void SimGroup::Drop(SimRequest& r) {
  if (r.in_cache) (void)cache_->Release(r.seq);
  reserved_blocks_ -= r.reserved_blocks;
  running_.erase(std::remove(running_.begin(), running_.end(), &r), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), &r), waiting_.end());
  live_.erase(r.id);  // destroys r
}

void SimGroup::DropAll() {
  while (!live_.empty()) Drop(*live_.begin()->second);
  while (!exported_.empty()) ReleaseExport(exported_.begin()->first);
  reserved_blocks_ = 0;
  in_step_ = false;
}

Status CheckOptions(const SimWorkerOptions& o) {
  MLARUN_RETURN_IF_ERROR(client_internal::CheckAddress(o.coordinator).WithContext("--coordinator"));
  if (o.worker_id.empty()) return InvalidArgumentError("--worker-id must not be empty");
  if (o.groups < 1 || o.groups > 1024) return InvalidArgumentError("--groups must be in [1, 1024], got ", o.groups);
  if (!(o.tokens_per_s >= 0)) return InvalidArgumentError("--tokens-per-s must be >= 0, got ", o.tokens_per_s);
  if (!(o.step_ms >= 0) || !std::isfinite(o.step_ms))
    return InvalidArgumentError("--step-ms must be a finite number >= 0, got ", o.step_ms);
  if (!(o.prefill_tokens_per_s >= 0) || !std::isfinite(o.prefill_tokens_per_s))
    return InvalidArgumentError("--prefill-tokens-per-s must be a finite number >= 0, got ", o.prefill_tokens_per_s);
  if (o.max_batched_tokens < 1 || o.max_batched_tokens > INT32_MAX)
    return InvalidArgumentError("--max-batched-tokens must be in [1, 2^31), got ", o.max_batched_tokens);
  if (o.role != "mixed" && o.role != "prefill" && o.role != "decode")
    return InvalidArgumentError("--role must be mixed, prefill or decode, got '", o.role, "'");
  if (!(o.transfer_gbps >= 0) || !std::isfinite(o.transfer_gbps))
    return InvalidArgumentError("--transfer-gbps must be a finite number >= 0, got ", o.transfer_gbps);
  if (o.vocab_size < 1 || o.vocab_size > INT32_MAX)
    return InvalidArgumentError("--vocab-size must be in [1, 2^31), got ", o.vocab_size);
  if (o.max_position_embeddings < 2 || o.max_position_embeddings > INT32_MAX)
    return InvalidArgumentError("--max-position-embeddings must be in [2, 2^31), got ", o.max_position_embeddings);
  if (o.block_size < 1) return InvalidArgumentError("--block-size must be positive, got ", o.block_size);
  if (o.cache_blocks < 1 || o.cache_blocks > INT32_MAX)
    return InvalidArgumentError("--cache-blocks must be in [1, 2^31), got ", o.cache_blocks);
  if (o.eos_token_id >= o.vocab_size)
    return InvalidArgumentError("--eos-token-id ", o.eos_token_id, " is outside the vocabulary [0, ", o.vocab_size,
                                ")");
  for (int64_t t : o.script) {
    if (t < 0 || t >= o.vocab_size)
      return InvalidArgumentError("script: token ", t, " is outside the vocabulary [0, ", o.vocab_size, ")");
  }
  return Status::Ok();
}

}  // namespace

int RunSimWorker(const SimWorkerOptions& o, const std::atomic<bool>* stop, std::ostream& log_stream) {
  Logger log(log_stream);
  if (Status st = CheckOptions(o); !st.ok()) {
    log("mlarun sim-worker: ", st.message());
    return 2;
  }
  // The simulated cache is a real LatentCache (so prefix hits, LRU eviction
  // and block accounting are the engine's own) with one f32 value per token:
  // cache_blocks * block_size * 4 bytes, allocated but never touched.
  std::atomic<bool> stopping{false};
  std::vector<std::unique_ptr<SimGroup>> groups;
  for (int i = 0; i < o.groups; ++i) {
    LatentCacheConfig cc{.num_layers = 1,
                         .kv_lora_rank = 1,
                         .rope_dim = 0,
                         .block_size = o.block_size,
                         .dtype = DType::kF32,
                         .budget_bytes = o.cache_blocks * o.block_size * 4,
                         .enable_prefix_caching = true};
    auto cache = LatentCache::Create(cc);
    if (!cache.ok()) {
      log("mlarun sim-worker: ", cache.status());
      return 2;
    }
    groups.push_back(std::make_unique<SimGroup>(o, i, std::move(*cache), &stopping, &log));
  }
  log("sim-worker ", o.worker_id, ": ", o.groups, " groups connecting to ", o.coordinator, " (vocab ", o.vocab_size,
      ", block size ", o.block_size, ", ", o.cache_blocks, " cache blocks, ", o.tokens_per_s, " tokens/s per group",
      o.step_ms > 0 ? internal::StrCat(" + ", o.step_ms, " ms per step") : std::string(),
      o.prefill_tokens_per_s > 0
          ? internal::StrCat(", prefill ", o.prefill_tokens_per_s, " tokens/s in chunks of ", o.max_batched_tokens)
          : std::string(),
      "; role ", o.role,
      o.transfer_gbps > 0 ? internal::StrCat(", block moves at ", o.transfer_gbps, " Gbit/s") : std::string(), ")");
  std::vector<std::thread> threads;
  for (auto& g : groups) threads.emplace_back([g = g.get()] { g->Run(); });
  // `stop` is a plain flag (a signal handler may set it); poll it here, and
  // hand the group threads an atomic they can wait on.
  while (!*stop) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  stopping.store(true);
  for (auto& g : groups) g->Interrupt();
  for (auto& t : threads) t.join();
  groups.clear();  // their links end their streams
  log("sim-worker ", o.worker_id, ": stopped");
  return 0;
}

}  // namespace mlarun
