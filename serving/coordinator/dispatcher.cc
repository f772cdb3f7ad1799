#include "serving/coordinator/dispatcher.h"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>

#include "base/status.h"
#include "kv/prefix_hash.h"
#include "runtime/request/request.h"
#include "serving/proto/proto_sampling.h"
#include "serving/security/security.h"

namespace mlarun::coord {
namespace {

// A client that set a deadline gets the "no DP group registered" UNAVAILABLE a
// little before it, or its own deadline timer would win and it would only ever
// see DEADLINE_EXCEEDED: 10% of its budget, at most 100 ms.
constexpr auto kUnavailableMarginMax = std::chrono::milliseconds(100);
constexpr double kUnavailableMarginFraction = 0.1;
// gRPC cancels a call at its deadline on its own (ClientGone); a cancellation
// this close to the deadline is counted as the deadline, not the client.
constexpr auto kDeadlineSlack = std::chrono::milliseconds(20);

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }
Clock::duration SecondsToDuration(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}
// Seconds with one decimal, for messages.
std::string Seconds(Clock::duration d) {
  const int64_t tenths = std::llround(std::chrono::duration<double>(d).count() * 10);
  return internal::StrCat(tenths / 10, ".", tenths % 10);
}

using internal::StrCat;

// What a registration may claim (anything beyond is refused, INVALID_ARGUMENT
// naming the field): far above any real deployment, low enough that nothing
// derived from them overflows or takes real memory.
constexpr size_t kMaxWorkerIdBytes = 256;
constexpr int32_t kMaxDp = 4096;
constexpr int32_t kMaxAttnTp = 1024;
constexpr int64_t kMaxRanksPerJob = 65536;       // dp * attn_tp
constexpr int64_t kMaxVocab = int64_t{1} << 31;  // token ids fit in int32
constexpr int64_t kMaxPositions = int64_t{1} << 31;
constexpr int64_t kMaxBlockSize = int64_t{1} << 20;
constexpr int64_t kMaxBlocks = int64_t{1} << 40;
constexpr size_t kMaxRankStatsBytes = 8 << 10;  // one RankStats (its strings, mostly)
// What GetStats answers must fit the 4 MiB a gRPC client takes by default:
// the rank stats of every group known (2 MiB: ~2000 ranks as workers report
// them), and the groups themselves with their disconnect reasons (1 KiB).
constexpr int64_t kMaxRankStatsTotalBytes = int64_t{2} << 20;
constexpr size_t kMaxReasonBytes = 1024;
// A group's transfer descriptors (Register.transfer_descriptors): a UCX
// worker address and remote key each, a few hundred bytes on TCP and
// shared memory, more with verbs.
constexpr size_t kMaxDescriptorBytes = 64 << 10;
constexpr int64_t kMaxGroupDescriptorsBytes = 1 << 20;

int64_t RanksBytes(const google::protobuf::RepeatedPtrField<v1::RankStats>& ranks) {
  int64_t n = 0;
  for (const v1::RankStats& r : ranks) n += static_cast<int64_t>(r.ByteSizeLong());
  return n;
}
// A logprob is a natural log of a probability, <= 0; this much above 0 is
// rounding.
constexpr double kLogprobSlack = 1e-3;
bool IsLogprob(double x) { return std::isfinite(x) && x <= kLogprobSlack; }

// What is wrong with a token's list of most likely tokens, for a request
// that asked for `asked` of them from a group of `vocab` ids: more than
// asked, an id outside the vocabulary, a logprob that is not finite and
// <= 0, or not best first; nullopt when it is right.
std::optional<std::string> CheckTopLogprobs(const google::protobuf::RepeatedPtrField<v1::TokenLogprob>& top,
                                            int64_t asked, int64_t vocab) {
  if (top.size() > asked) return StrCat(top.size(), " top_logprobs, more than the ", asked, " asked for");
  for (int i = 0; i < top.size(); ++i) {
    const v1::TokenLogprob& t = top[i];
    if (t.token_id() < 0 || t.token_id() >= vocab)
      return StrCat("top_logprobs[", i, "] token id ", t.token_id(), " is outside its vocabulary [0, ", vocab, ")");
    if (!IsLogprob(t.logprob()))
      return StrCat("top_logprobs[", i, "] logprob ", t.logprob(), " is not a finite log-probability (<= 0)");
    if (i > 0 && t.logprob() > top[i - 1].logprob())
      return StrCat("top_logprobs[", i, "] logprob ", t.logprob(), " is above the one before it (",
                    top[i - 1].logprob(), "): not best first");
  }
  return std::nullopt;
}

// What is wrong with prompt logprobs a group sent for `route` (a request
// whose tokens 1 .. `sent` had theirs passed on already): not asked for, not
// consecutive with what came before, past the prompt, a token that is not
// the prompt's, a logprob that cannot be one, or top_logprobs as
// CheckTopLogprobs; nullopt when they are right.
std::optional<std::string> CheckPromptLogprobs(const v1::PromptLogprobs& lp, const v1::RouteRequest& route,
                                               int64_t sent, int64_t vocab) {
  if (!route.sampling().has_prompt_logprobs()) return std::string("prompt_logprobs, which it did not ask for");
  const int64_t prompt = route.prompt_ids_size(), n = lp.entries_size();
  if (lp.start() < 1 || lp.start() > sent + 1)
    return StrCat("prompt_logprobs.start ", lp.start(), " where ", sent + 1, " was next");
  if (lp.start() + n > prompt)
    return StrCat("prompt_logprobs for tokens ", lp.start(), " .. ", lp.start() + n - 1, " of a prompt of ", prompt);
  for (int64_t i = 0; i < n; ++i) {
    const v1::PromptTokenLogprob& e = lp.entries(static_cast<int>(i));
    const int64_t at = lp.start() + i;
    if (e.token_id() != route.prompt_ids(static_cast<int>(at)))
      return StrCat("prompt_logprobs for token ", at, " name id ", e.token_id(), ", the prompt has ",
                    route.prompt_ids(static_cast<int>(at)));
    if (!IsLogprob(e.logprob()))
      return StrCat("prompt_logprobs for token ", at, ": logprob ", e.logprob(),
                    " is not a finite log-probability (<= 0)");
    if (auto bad = CheckTopLogprobs(e.top_logprobs(), route.sampling().prompt_logprobs(), vocab))
      return StrCat("prompt_logprobs for token ", at, ": ", *bad);
  }
  return std::nullopt;
}

// Register.role; nullopt for a name that is none.
std::optional<GroupRole> ParseRole(const std::string& name) {
  if (name.empty() || name == "mixed") return GroupRole::kMixed;
  if (name == "prefill") return GroupRole::kPrefill;
  if (name == "decode") return GroupRole::kDecode;
  return std::nullopt;
}

const char* RoleName(GroupRole role) {
  switch (role) {
    case GroupRole::kPrefill:
      return "prefill";
    case GroupRole::kDecode:
      return "decode";
    case GroupRole::kMixed:
      break;
  }
  return "mixed";
}

// The error of a Register that cannot be right, naming the field; nullopt
// when it is in range.
std::optional<std::string> CheckRegister(const v1::Register& reg) {
  if (reg.worker_id().empty()) return "register.worker_id: must not be empty";
  if (reg.worker_id().size() > kMaxWorkerIdBytes)
    return StrCat("register.worker_id: at most ", kMaxWorkerIdBytes, " bytes, got ", reg.worker_id().size());
  if (reg.dp() < 1 || reg.dp() > kMaxDp) return StrCat("register.dp: must be in [1, ", kMaxDp, "], got ", reg.dp());
  if (reg.attn_tp() < 1 || reg.attn_tp() > kMaxAttnTp)
    return StrCat("register.attn_tp: must be in [1, ", kMaxAttnTp, "], got ", reg.attn_tp());
  const int64_t world = int64_t{reg.dp()} * reg.attn_tp();
  if (world > kMaxRanksPerJob)
    return StrCat("register: dp * attn_tp must be at most ", kMaxRanksPerJob, ", got ", world);
  if (reg.dp_group() < 0 || reg.dp_group() >= reg.dp())
    return StrCat("register.dp_group: must be in [0, dp = ", reg.dp(), "), got ", reg.dp_group());
  if (reg.vocab_size() < 1 || reg.vocab_size() > kMaxVocab)
    return StrCat("register.vocab_size: must be in [1, ", kMaxVocab, "], got ", reg.vocab_size());
  if (reg.max_position_embeddings() < 0 || reg.max_position_embeddings() > kMaxPositions)
    return StrCat("register.max_position_embeddings: must be in [0, ", kMaxPositions, "], got ",
                  reg.max_position_embeddings());
  if (reg.block_size() < 0 || reg.block_size() > kMaxBlockSize)
    return StrCat("register.block_size: must be in [0, ", kMaxBlockSize, "], got ", reg.block_size());
  if (reg.cache_blocks_total() < 0 || reg.cache_blocks_total() > kMaxBlocks)
    return StrCat("register.cache_blocks_total: must be in [0, ", kMaxBlocks, "], got ", reg.cache_blocks_total());
  if (!ParseRole(reg.role()))
    return StrCat("register.role: '", reg.role().substr(0, 64), "' is none of prefill, decode, mixed");
  const int n = reg.transfer_descriptors_size();
  if (n != 0 && n != reg.attn_tp())
    return StrCat("register.transfer_descriptors: none or attn_tp = ", reg.attn_tp(), " of them, got ", n);
  int64_t bytes = 0;
  for (int i = 0; i < n; ++i) {
    const size_t b = reg.transfer_descriptors(i).size();
    if (b == 0 || b > kMaxDescriptorBytes)
      return StrCat("register.transfer_descriptors[", i, "]: 1 to ", kMaxDescriptorBytes, " bytes, got ", b);
    bytes += static_cast<int64_t>(b);
  }
  if (bytes > kMaxGroupDescriptorsBytes)
    return StrCat("register.transfer_descriptors: at most ", kMaxGroupDescriptorsBytes, " bytes in all, got ", bytes);
  return std::nullopt;
}

// The error of a group's rank list (at registration or in stats), naming the
// field; nullopt when it fits the group.
std::optional<std::string> CheckRanks(const google::protobuf::RepeatedPtrField<v1::RankStats>& ranks,
                                      const std::string& field, int32_t dp, int32_t attn_tp, int32_t dp_group) {
  if (ranks.size() > attn_tp)
    return StrCat(field, ": at most attn_tp = ", attn_tp, " entries (the group's ranks), got ", ranks.size());
  const int64_t world = int64_t{dp} * attn_tp;
  for (int i = 0; i < ranks.size(); ++i) {
    const v1::RankStats& r = ranks[i];
    const std::string at = StrCat(field, "[", i, "]");
    if (r.rank() < 0 || r.rank() >= world)
      return StrCat(at, ".rank: must be in [0, dp * attn_tp = ", world, "), got ", r.rank());
    if (r.dp_group() != dp_group)
      return StrCat(at, ".dp_group: must be the group's ", dp_group, ", got ", r.dp_group());
    if (r.attn_tp_rank() < 0 || r.attn_tp_rank() >= attn_tp)
      return StrCat(at, ".attn_tp_rank: must be in [0, attn_tp = ", attn_tp, "), got ", r.attn_tp_rank());
    if (r.ByteSizeLong() > kMaxRankStatsBytes)
      return StrCat(at, ": at most ", kMaxRankStatsBytes, " bytes, got ", r.ByteSizeLong());
  }
  return std::nullopt;
}

// What is wrong with blocks a group holds for another to fetch (`message`:
// "exported" for a moving request, "prefix_exported" for a prefix): rows
// (its cached_tokens) outside [0, most], rows that are not whole blocks of
// `block_size` tokens when `whole_blocks`, or a block table that does not
// hold them (CheckBlockTable); nullopt when they are right.
std::optional<std::string> CheckHeldBlocks(std::string_view message,
                                           const google::protobuf::RepeatedField<int32_t>& block_ids, int64_t rows,
                                           int64_t most, int64_t block_size, bool whole_blocks) {
  if (rows < 0 || rows > most) return StrCat(message, ".cached_tokens ", rows, " is outside [0, ", most, "]");
  if (whole_blocks && rows % block_size != 0)
    return StrCat(message, ".cached_tokens ", rows, " is not a multiple of the block size ", block_size);
  const Status st = CheckBlockTable(std::span<const int32_t>(block_ids.data(), block_ids.size()), rows, block_size,
                                    StrCat(message, ".block_ids"));
  if (st.ok()) return std::nullopt;
  return st.message();
}

}  // namespace

struct Dispatcher::Request {
  uint64_t serial = 0;
  std::string id;          // the client's name for it (its own, or a random one)
  std::string principal;   // who sent it ("" when the client API is open)
  std::string wire_id;     // the group's name for it: unique among live requests
  v1::RouteRequest route;  // what the group gets: id, prompt, sampling with every field set
  int64_t prompt_tokens = 0;
  int64_t max_tokens = 0;
  int64_t cost = 0;  // prompt + max_tokens: its weight in its group's queued_tokens
  std::shared_ptr<ClientOutlet> client;
  bool client_deadline = false;  // the call carried a gRPC deadline
  Clock::time_point arrival, routed_at, first_token_at, last_token_at;
  Clock::time_point unavailable_at;       // queued with no connected group: UNAVAILABLE from here
  Clock::time_point deadline;             // DEADLINE_EXCEEDED from here
  Clock::duration unavailable_margin{0};  // deadline - unavailable_at as submitted (0 without a deadline)
  int lost_group = -1;                    // the group that went away before answering it (re-routed), if any
  std::multimap<Clock::time_point, Request*>::iterator timer;  // valid while armed
  bool armed = false;
  bool queued = false;
  std::list<Request*>::iterator queue_pos;  // valid while queued
  int group = -1;                           // routed to groups_[group]; -1 while queued
  int64_t tokens_sent = 0;
  int64_t prompt_logprobs_sent = 0;  // prompt tokens 1 .. this have had their logprobs passed on
  // The ids its client got: a request that leaves its group resumes from
  // them (Resume), and prefix_affinity hashes them at the end.
  std::vector<int32_t> completion;
  // A Migrate in progress: from the MigrateOut to the first token (or the
  // end) on the new group.
  struct Move {
    int from = -1, to = -1;  // group indexes; `to` is where it should go
    int32_t from_group = 0;  // `from` as the caller names it (its slot may be reused)
    std::string from_worker;
    bool left = false;  // it left `from` (Exported, or `from` went away)
    int64_t tokens_before = 0;
    Clock::time_point paused_at;  // its last token before the move (or the call)
    // The group holding its blocks for the new group to fetch (Exported
    // with blocks) until ReleaseExported; -1: none.
    int export_group = -1;
    bool rebalancing = false;  // started by MaybeRebalance
    std::vector<MigrateDone> callers;
  };
  std::optional<Move> move;
  // Rows of its prompt's prefix that another group's cache holds
  // (AskForPrefix): groups_[source] was asked with `export_id`; until it
  // answers, the route to the request's group waits. `held`: it answered
  // with blocks, pinned for that group to fetch until the request's first
  // token there (or until it leaves the group).
  struct PrefixFetch {
    int source = -1;
    uint64_t export_id = 0;
    bool held = false;
  };
  std::optional<PrefixFetch> prefix;
  Clock::time_point moved_at;  // when its last move ended (rebalancing's cooldown)
  // Block-hash chains of the prompt, per block size seen (one in practice).
  std::vector<std::pair<int64_t, std::vector<uint64_t>>> chains;
};

struct Dispatcher::Group {
  Group(std::string w, int32_t dp, int64_t prefix_capacity)
      : worker_id(std::move(w)), dp_group(dp), prefix(prefix_capacity) {}
  const std::string worker_id;
  const int32_t dp_group;
  std::shared_ptr<WorkerOutlet> link;  // nullptr while disconnected
  int64_t vocab_size = 0, max_position_embeddings = 0, block_size = 0;
  int32_t dp = 1, attn_tp = 1;  // as registered (bounds its rank lists)
  int64_t free_blocks = 0;
  int64_t cache_blocks = 0;   // Register.cache_blocks_total
  int64_t queued_tokens = 0;  // cost of its requests routed and not done, counted when routed
  int64_t in_flight = 0;
  int64_t routed = 0, completed = 0, tokens_generated = 0;
  int64_t migrated_in = 0, migrated_out = 0;
  // Register.transfer_descriptors: empty when it does not move blocks.
  std::vector<std::string> descriptors;
  bool exports_prefixes = false;  // Register.exports_prefixes (with descriptors)
  GroupRole role = GroupRole::kMixed;
  std::vector<v1::RankStats> ranks;  // as last reported, worker_id filled in
  int64_t ranks_bytes = 0;           // their wire size as reported (counted in rank_stats_bytes_)
  PrefixIndex prefix;                // prefix_affinity only
  std::string disconnect_reason;     // how it last went away; empty if it never did
  Clock::time_point left_at;         // when (valid with disconnect_reason)
  // The last sign of progress: its latest message, or the routing that gave
  // it work after it had none. Stalled when this is stall_timeout_s old and
  // it has work in flight, or it has been sending stats on this stream (a
  // leader does every 0.5 s from its step loop, idle or not).
  Clock::time_point heard_at;
  bool heartbeats = false;  // this stream has carried stats
};

// Outlets that got messages while mu_ was held; flushed after it is released.
// Holding the shared_ptrs also keeps a finished call's reactor alive until its
// final status is handed to gRPC.
class Dispatcher::Pending {
 public:
  explicit Pending(bool log = false) : log_(log) {}
  void Add(std::shared_ptr<ClientOutlet> o) { clients_.push_back(std::move(o)); }
  void Add(std::shared_ptr<WorkerOutlet> o) { links_.push_back(std::move(o)); }
  // A line for the coordinator's log (CoordinatorOptions::log_groups),
  // written by Flush, outside the dispatcher's lock.
  void Note(std::string line) {
    if (log_) notes_.push_back(std::move(line));
  }
  // A caller to answer (Migrate's), by Flush.
  void Call(std::function<void()> call) { calls_.push_back(std::move(call)); }
  void Flush() {
    for (auto& o : links_) o->Flush();
    for (auto& o : clients_) o->Flush();
    for (const std::string& n : notes_) std::cerr << "mlarun coordinator: " << n << "\n";
    notes_.clear();
    for (auto& call : calls_) call();
    calls_.clear();
  }

 private:
  const bool log_;
  std::vector<std::shared_ptr<ClientOutlet>> clients_;
  std::vector<std::shared_ptr<WorkerOutlet>> links_;
  std::vector<std::string> notes_;
  std::vector<std::function<void()>> calls_;
};

namespace {

const std::vector<uint64_t>& ChainFor(std::vector<std::pair<int64_t, std::vector<uint64_t>>>& chains,
                                      const v1::RouteRequest& route, int64_t block_size) {
  for (auto& [bs, chain] : chains) {
    if (bs == block_size) return chain;
  }
  const auto& prompt = route.prompt_ids();
  chains.emplace_back(block_size,
                      PrefixBlockHashes(std::span<const int32_t>(prompt.data(), static_cast<size_t>(prompt.size())),
                                        block_size, route.prefix_cache_salt()));
  return chains.back().second;
}

}  // namespace

Dispatcher::Dispatcher(const CoordinatorOptions& options, std::string coordinator_id,
                       std::shared_ptr<DispatcherObserver> observer)
    : options_(options),
      coordinator_id_(std::move(coordinator_id)),
      observer_(std::move(observer)),
      router_(options.policy, options.balance_abs_tokens, options.balance_rel) {
  timer_thread_ = std::thread([this] { TimerLoop(); });
}

Dispatcher::~Dispatcher() { Shutdown(); }

// ---- Client API -------------------------------------------------------------

Dispatcher::ModelLimits Dispatcher::Limits() const {
  // Limits of the model the groups serve. A deployment serves one model; if
  // the groups disagree the most permissive limit is checked here (no false
  // rejection) and the group that gets the request re-checks its own. None is
  // known before a group registers.
  ModelLimits limits;
  const bool any_connected = ConnectedGroups() > 0;
  for (const auto& g : groups_) {
    if (any_connected && g->link == nullptr) continue;
    limits.vocab_size = std::max(limits.vocab_size, g->vocab_size);
    limits.max_position_embeddings = std::max(limits.max_position_embeddings, g->max_position_embeddings);
  }
  if (const int64_t cap = options_.max_model_len; cap > 0)
    limits.max_position_embeddings =
        limits.max_position_embeddings > 0 ? std::min(limits.max_position_embeddings, cap) : cap;
  return limits;
}

Dispatcher::ModelLimits Dispatcher::model_limits() const {
  MutexLock lock(mu_);
  return Limits();
}

int64_t Dispatcher::live_requests() const {
  MutexLock lock(mu_);
  return static_cast<int64_t>(requests_.size());
}

void Dispatcher::Observe(const Request& r, grpc::StatusCode code, std::string_view finish_reason,
                         int64_t prefix_hit_tokens, Clock::time_point now) {
  if (observer_ == nullptr) return;
  const bool routed = r.routed_at != Clock::time_point{};
  observer_->OnEnd(RequestEnd{
      .request_id = r.id,
      .status_code = static_cast<int>(code),
      .finish_reason = finish_reason,
      .prompt_tokens = r.prompt_tokens,
      .completion_tokens = r.tokens_sent,
      .prefix_hit_tokens = prefix_hit_tokens,
      .queued_s = routed ? std::chrono::duration<double>(r.routed_at - r.arrival).count() : -1.0,
      .first_token_s = r.tokens_sent > 0 ? std::chrono::duration<double>(r.first_token_at - r.arrival).count() : -1.0,
      .total_s = std::chrono::duration<double>(now - r.arrival).count(),
  });
}

std::optional<std::string> Dispatcher::Validate(const v1::GenerateRequest& request,
                                                const SamplingParams& sampling) const {
  if (request.cache_salt().size() > kMaxCacheSaltBytes)
    return StrCat("cache_salt: at most ", kMaxCacheSaltBytes, " bytes, got ", request.cache_salt().size());
  const ModelLimits limits = Limits();
  const int64_t vocab = limits.vocab_size, max_pos = limits.max_position_embeddings;
  const auto& prompt = request.prompt_ids();
  const Status st =
      ValidateRequest(std::span<const int32_t>(prompt.data(), static_cast<size_t>(prompt.size())), sampling,
                      {.vocab_size = vocab > 0 ? vocab : kLimitUnknown,
                       .max_position_embeddings = max_pos > 0 ? max_pos : kLimitUnknown,
                       .whose = "the registered DP groups'"});
  if (st.ok()) return std::nullopt;
  return st.message();
}

std::optional<Dispatcher::Accepted> Dispatcher::Submit(std::shared_ptr<ClientOutlet> client,
                                                       const v1::GenerateRequest& request, const std::string& principal,
                                                       std::chrono::system_clock::time_point grpc_deadline) {
  const Clock::time_point now = Clock::now();
  // The gRPC deadline is wall-clock; the dispatcher works in steady time.
  const bool has_deadline = grpc_deadline != std::chrono::system_clock::time_point::max();
  const Clock::duration budget =
      has_deadline
          ? std::max(Clock::duration::zero(),
                     std::chrono::duration_cast<Clock::duration>(grpc_deadline - std::chrono::system_clock::now()))
          : Clock::duration::zero();
  const Clock::duration queue_timeout = SecondsToDuration(options_.queue_timeout_s);

  const SamplingParams sampling = FromProto(request.sampling());  // absent fields filled in
  Pending pending(options_.log_groups);
  std::optional<Accepted> accepted;
  {
    MutexLock lock(mu_);
    ++counters_.received;
    auto reject = [&](grpc::StatusCode code, std::string message) MLARUN_REQUIRES(mu_) {
      Count(code);
      if (observer_ != nullptr)
        observer_->OnEnd(RequestEnd{.request_id = request.request_id(),
                                    .status_code = static_cast<int>(code),
                                    .prompt_tokens = request.prompt_ids_size()});
      client->Close(code, std::move(message));
      pending.Add(client);
    };
    if (shutting_down_) {
      reject(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down");
    } else if (auto error = Validate(request, sampling)) {
      reject(grpc::StatusCode::INVALID_ARGUMENT, std::move(*error));
    } else if (!request.request_id().empty() && client_ids_.contains({principal, request.request_id()})) {
      // Ids are the principal's own: nobody learns which ids others use.
      reject(grpc::StatusCode::ALREADY_EXISTS,
             StrCat("request_id: '", request.request_id(), "' is in use by a live request of yours"));
    } else {
      auto owned = std::make_unique<Request>();
      Request* r = owned.get();
      r->serial = ++next_serial_;
      r->principal = principal;
      r->id = request.request_id();
      // Random, so that no client can guess another's id (Cancel takes only
      // one's own anyway).
      while (r->id.empty() || client_ids_.contains({principal, r->id})) r->id = NewRandomRequestId();
      // Two principals may use the same id; the group sees distinct ones.
      r->wire_id = r->id;
      for (int k = 0; requests_.contains(r->wire_id); ++k) r->wire_id = StrCat(r->id, "#", r->serial, ".", k);
      r->route.set_request_id(r->wire_id);
      *r->route.mutable_prompt_ids() = request.prompt_ids();
      ToProto(sampling, r->route.mutable_sampling());
      // Workers and the router's prefix index hash the prompt under it.
      r->route.set_prefix_cache_salt(PrefixCacheSalt(
          options_.prefix_cache_shared_across_principals ? std::string_view() : principal, request.cache_salt()));
      r->max_tokens = sampling.max_tokens;
      r->prompt_tokens = request.prompt_ids_size();
      r->cost = r->prompt_tokens + r->max_tokens;
      r->client = client;
      r->client_deadline = has_deadline;
      r->arrival = now;
      // Without a client deadline the request runs as long as it takes; the
      // queue timeout only bounds the wait for a DP group to register.
      r->deadline = has_deadline ? now + budget : Clock::time_point::max();
      if (has_deadline) {
        r->unavailable_margin = std::min<Clock::duration>(
            kUnavailableMarginMax, std::chrono::duration_cast<Clock::duration>(budget * kUnavailableMarginFraction));
      }
      r->unavailable_at = std::min(now + queue_timeout, r->deadline - r->unavailable_margin);
      requests_.emplace(r->wire_id, std::move(owned));
      client_ids_.emplace(std::make_pair(r->principal, r->id), r);
      if (!TryRoute(r, pending)) {
        if (static_cast<int64_t>(queue_.size()) >= options_.max_queued) {
          client_ids_.erase(std::make_pair(r->principal, r->id));
          requests_.erase(requests_.find(r->wire_id));  // by iterator: r->wire_id dies with the node
          reject(grpc::StatusCode::RESOURCE_EXHAUSTED,
                 StrCat("queue full: ", queue_.size(), " requests wait for a DP group (max_queued ",
                        options_.max_queued, ")"));
          r = nullptr;
        } else {
          r->queued = true;
          r->queue_pos = queue_.insert(queue_.end(), r);
        }
      }
      if (r != nullptr) {
        ArmNext(r, now);
        accepted = Accepted{r->wire_id, r->serial};
      }
    }
  }
  pending.Flush();
  return accepted;
}

void Dispatcher::ClientGone(const std::string& wire_id, uint64_t serial) {
  Pending pending(options_.log_groups);
  {
    MutexLock lock(mu_);
    auto it = requests_.find(wire_id);
    if (it == requests_.end() || it->second->serial != serial) return;
    Request* r = it->second.get();
    if (r->client_deadline && Clock::now() + kDeadlineSlack >= r->deadline) {
      Fail(r, grpc::StatusCode::DEADLINE_EXCEEDED, "deadline exceeded", true, pending);
    } else {
      Fail(r, grpc::StatusCode::CANCELLED, "cancelled by the client", true, pending);
    }
    DrainQueue(pending);
  }
  pending.Flush();
}

void Dispatcher::EndEarly(const std::string& wire_id, uint64_t serial, const std::string& finish_reason) {
  Pending pending(options_.log_groups);
  {
    MutexLock lock(mu_);
    auto it = requests_.find(wire_id);
    if (it == requests_.end() || it->second->serial != serial) return;
    Request* r = it->second.get();
    if (r->group < 0 && r->tokens_sent == 0) {
      // Not routed (re-queued after a loss) and nothing generated that a
      // client could have stopped on: end it as the client's cancel.
      Fail(r, grpc::StatusCode::CANCELLED, "cancelled by the client", false, pending);
    } else {
      if (r->group >= 0) CancelRoute(*r, pending);
      v1::RequestDone done;
      done.set_request_id(r->wire_id);
      done.set_finish_reason(finish_reason);
      Complete(r, done, pending);
    }
    DrainQueue(pending);
  }
  pending.Flush();
}

bool Dispatcher::Cancel(const std::string& principal, const std::string& id) {
  Pending pending(options_.log_groups);
  {
    MutexLock lock(mu_);
    auto it = client_ids_.find({principal, id});
    if (it == client_ids_.end()) return false;
    Fail(it->second, grpc::StatusCode::CANCELLED, "cancelled by a Cancel call", true, pending);
    DrainQueue(pending);
  }
  pending.Flush();
  return true;
}

void Dispatcher::Migrate(const std::string& principal, const v1::MigrateRequest& request, MigrateDone done) {
  Pending pending(options_.log_groups);
  grpc::Status error;
  {
    MutexLock lock(mu_);
    auto it = client_ids_.find({principal, request.request_id()});
    if (shutting_down_) {
      error = grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down");
    } else if (it == client_ids_.end()) {
      error = grpc::Status(grpc::StatusCode::NOT_FOUND,
                           StrCat("request_id: no live request of yours is named '", request.request_id(), "'"));
    } else if (Request* r = it->second; r->move) {
      error = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, StrCat("request '", r->id, "' is moving already"));
    } else if (r->group < 0 || (r->prefix && !r->prefix->held)) {
      error = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                           StrCat("request '", r->id, "' waits for a DP group; it runs on none yet"));
    } else if (const int to = MoveTarget(*r, request, &error); to >= 0) {
      StartMove(r, to, pending);
      r->move->callers.push_back(std::move(done));
    }
  }
  pending.Flush();
  if (!error.ok()) done(error, v1::MigrateResponse());
}

void Dispatcher::FillStats(v1::GetStatsResponse* out, bool details) const {
  MutexLock lock(mu_);
  // Without details, each worker job is "worker-<k>" (k by first
  // registration) and the ranks' hosts and model paths are left out: the
  // worker id is the leader's host:pid.
  std::map<std::string, std::string> alias;
  auto job = [&](const std::string& worker_id) -> const std::string& {
    if (details) return worker_id;
    auto [it, fresh] = alias.try_emplace(worker_id);
    if (fresh) it->second = StrCat("worker-", alias.size() - 1);
    return it->second;
  };
  for (const auto& g : groups_) {
    for (const auto& rank : g->ranks) {
      v1::RankStats* r = out->add_ranks();
      *r = rank;
      if (!details) {
        r->set_worker_id(job(rank.worker_id()));
        r->clear_host();
        r->clear_model();
      }
    }
    v1::GroupStats* s = out->add_groups();
    s->set_worker_id(job(g->worker_id));
    s->set_dp_group(g->dp_group);
    s->set_connected(g->link != nullptr);
    s->set_requests_routed(g->routed);
    s->set_requests_completed(g->completed);
    s->set_requests_in_flight(g->in_flight);
    s->set_tokens_generated(g->tokens_generated);
    s->set_free_blocks(g->free_blocks);
    s->set_queued_tokens(g->queued_tokens);
    s->set_migrated_in(g->migrated_in);
    s->set_migrated_out(g->migrated_out);
    s->set_role(RoleName(g->role));
    std::string reason = g->disconnect_reason;
    if (!details) {
      for (size_t at; !g->worker_id.empty() && (at = reason.find(g->worker_id)) != std::string::npos;)
        reason.replace(at, g->worker_id.size(), job(g->worker_id));
    }
    s->set_disconnect_reason(reason);
  }
  v1::CoordinatorStats* c = out->mutable_coordinator();
  c->set_policy(std::string(RoutingPolicyName(options_.policy)));
  c->set_requests_received(counters_.received);
  c->set_requests_completed(counters_.completed);
  c->set_requests_rejected(counters_.rejected);
  c->set_requests_failed(counters_.failed);
  c->set_requests_cancelled(counters_.cancelled);
  c->set_requests_queued(static_cast<int64_t>(queue_.size()));
  c->set_requests_rerouted(counters_.rerouted);
  c->set_requests_migrated(counters_.migrated);
  c->set_migrations_failed(counters_.migrations_failed);
  c->set_rebalance_moves(counters_.rebalance_moves);
  c->set_prefix_fetches(counters_.prefix_fetches);
  c->set_prefix_fetch_tokens(counters_.prefix_fetch_tokens);
}

void Dispatcher::FillHealth(v1::HealthResponse* out) const {
  MutexLock lock(mu_);
  out->set_serving(!shutting_down_);
  out->set_groups_connected(static_cast<int32_t>(ConnectedGroups()));
}

// ---- Worker link --------------------------------------------------------------

int Dispatcher::OldestGone() const {
  int oldest = -1;
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = *groups_[i];
    if (g.link != nullptr || g.in_flight > 0) continue;
    if (oldest < 0 || g.left_at < groups_[static_cast<size_t>(oldest)]->left_at) oldest = static_cast<int>(i);
  }
  return oldest;
}

void Dispatcher::Replace(int index, std::unique_ptr<Group> fresh) {
  const Group& old = *groups_[static_cast<size_t>(index)];
  group_index_.erase(std::make_pair(old.worker_id, old.dp_group));
  rank_stats_bytes_ -= old.ranks_bytes;
  // Requests still waiting after it went away forget it too (their message
  // then says that no group took them, not which one left).
  for (auto& [id, r] : requests_)
    if (r->lost_group == index) r->lost_group = -1;
  groups_[static_cast<size_t>(index)] = std::move(fresh);
}

bool Dispatcher::Watched(const Group& g) { return g.link != nullptr && (g.in_flight > 0 || g.heartbeats); }

bool Dispatcher::Attach(std::shared_ptr<WorkerOutlet> link, const v1::Register& reg) {
  Pending pending(options_.log_groups);
  bool attached = false;
  {
    MutexLock lock(mu_);
    int reuse = -1;  // the slot of a gone group to forget, when the registry is full
    std::string error;
    grpc::StatusCode code = grpc::StatusCode::INVALID_ARGUMENT;
    if (shutting_down_) {
      code = grpc::StatusCode::UNAVAILABLE;
      error = "coordinator shutting down";
    } else if (std::optional<std::string> bad = CheckRegister(reg)) {
      error = std::move(*bad);
    } else if (std::optional<std::string> bad_ranks =
                   CheckRanks(reg.ranks(), "register.ranks", reg.dp(), reg.attn_tp(), reg.dp_group())) {
      error = std::move(*bad_ranks);
    } else if (auto held = group_index_.find(std::make_pair(reg.worker_id(), reg.dp_group()));
               held != group_index_.end() && groups_[static_cast<size_t>(held->second)]->link != nullptr) {
      // Its owner is connected: a second registration would take its
      // requests. A restarted worker whose old stream is not seen broken yet
      // retries with its back-off until it is.
      code = grpc::StatusCode::ALREADY_EXISTS;
      error = StrCat("register: DP group ", reg.dp_group(), " of worker '", reg.worker_id(),
                     "' is registered and connected on another stream");
    } else if (held == group_index_.end() && static_cast<int64_t>(groups_.size()) >= options_.max_known_groups &&
               (reuse = OldestGone()) < 0) {
      code = grpc::StatusCode::RESOURCE_EXHAUSTED;
      error = StrCat("register: the coordinator knows ", groups_.size(),
                     " DP groups, its limit, and every one of them is connected");
    } else if (const int64_t before = held != group_index_.end()
                                          ? groups_[static_cast<size_t>(held->second)]->ranks_bytes
                                      : reuse >= 0 ? groups_[static_cast<size_t>(reuse)]->ranks_bytes
                                                   : 0;
               rank_stats_bytes_ - before + RanksBytes(reg.ranks()) > kMaxRankStatsTotalBytes) {
      code = grpc::StatusCode::RESOURCE_EXHAUSTED;
      error =
          StrCat("register.ranks: the rank stats of all groups may take at most ", kMaxRankStatsTotalBytes, " bytes");
    }
    if (!error.empty()) {
      link->Close(code, std::move(error));
      pending.Add(link);
    } else {
      const auto key = std::make_pair(reg.worker_id(), reg.dp_group());
      auto fresh = [&] {
        return std::make_unique<Group>(reg.worker_id(), reg.dp_group(), options_.prefix_hashes_per_group);
      };
      if (reuse >= 0) {
        Replace(reuse, fresh());  // forgets the gone group only now that the registration holds
        group_index_.emplace(key, reuse);
      } else if (group_index_.try_emplace(key, static_cast<int>(groups_.size())).second) {
        groups_.push_back(fresh());
      }
      const auto it = group_index_.find(key);
      const int index = it->second;
      Group& g = *groups_[static_cast<size_t>(index)];
      g.link = link;
      g.heard_at = Clock::now();
      g.heartbeats = false;
      link_group_[link.get()] = index;
      g.vocab_size = reg.vocab_size();
      g.max_position_embeddings = reg.max_position_embeddings();
      g.block_size = reg.block_size();
      g.dp = reg.dp();
      g.attn_tp = reg.attn_tp();
      g.free_blocks = reg.cache_blocks_total();
      g.cache_blocks = reg.cache_blocks_total();
      g.descriptors.assign(reg.transfer_descriptors().begin(), reg.transfer_descriptors().end());
      g.exports_prefixes = reg.exports_prefixes() && !g.descriptors.empty();
      g.role = *ParseRole(reg.role());
      g.ranks.assign(reg.ranks().begin(), reg.ranks().end());
      for (auto& rank : g.ranks) {
        if (rank.worker_id().empty()) rank.set_worker_id(reg.worker_id());
      }
      rank_stats_bytes_ += RanksBytes(reg.ranks()) - g.ranks_bytes;
      g.ranks_bytes = RanksBytes(reg.ranks());
      // A (re)registering group starts with whatever its cache holds now; the
      // coordinator cannot know, and an empty guess costs at most one miss.
      g.prefix.Clear();
      v1::CoordinatorMessage registered;
      registered.mutable_registered()->set_coordinator_id(coordinator_id_);
      link->Queue(std::move(registered));
      pending.Add(link);
      pending.Note(StrCat("DP group ", reg.dp_group(), " of worker ", reg.worker_id(), " registered (dp=", reg.dp(),
                          ",attn_tp=", reg.attn_tp(), ", ", reg.cache_blocks_total(), " cache blocks); ",
                          ConnectedGroups(), " group(s) connected"));
      attached = true;
      DrainQueue(pending);
    }
  }
  pending.Flush();
  return attached;
}

bool Dispatcher::OnWorkerMessage(const WorkerOutlet* link, const v1::WorkerMessage& msg) {
  Pending pending(options_.log_groups);
  bool attached = true;
  {
    MutexLock lock(mu_);
    auto it = link_group_.find(link);
    if (it == link_group_.end()) return false;
    const int index = it->second;
    Group& g = *groups_[static_cast<size_t>(index)];
    g.heard_at = Clock::now();
    std::optional<Violation> violation;
    switch (msg.msg_case()) {
      case v1::WorkerMessage::kTokens:
        violation = OnTokens(g, index, msg.tokens(), pending);
        break;
      case v1::WorkerMessage::kDone:
        violation = OnDone(index, msg.done(), pending);
        break;
      case v1::WorkerMessage::kExported:
        violation = OnExported(index, msg.exported(), pending);
        break;
      case v1::WorkerMessage::kPrefixExported:
        violation = OnPrefixExported(index, msg.prefix_exported(), pending);
        break;
      case v1::WorkerMessage::kStats:
        if (msg.stats().free_blocks() < 0 || msg.stats().free_blocks() > kMaxBlocks) {
          violation = Violation{
              .what = StrCat("stats.free_blocks: must be in [0, ", kMaxBlocks, "], got ", msg.stats().free_blocks())};
          break;
        }
        if (std::optional<std::string> bad =
                CheckRanks(msg.stats().ranks(), "stats.ranks", g.dp, g.attn_tp, g.dp_group)) {
          violation = Violation{.what = std::move(*bad)};
          break;
        }
        if (msg.stats().ranks_size() > 0 &&
            rank_stats_bytes_ - g.ranks_bytes + RanksBytes(msg.stats().ranks()) > kMaxRankStatsTotalBytes) {
          violation = Violation{.what = StrCat("stats.ranks: the rank stats of all groups may take at most ",
                                               kMaxRankStatsTotalBytes, " bytes")};
          break;
        }
        g.free_blocks = msg.stats().free_blocks();
        if (!g.heartbeats) {
          g.heartbeats = true;
          timer_cv_.notify_all();  // the stall watch now covers it while idle
        }
        if (msg.stats().ranks_size() > 0) {
          rank_stats_bytes_ += RanksBytes(msg.stats().ranks()) - g.ranks_bytes;
          g.ranks_bytes = RanksBytes(msg.stats().ranks());
          g.ranks.assign(msg.stats().ranks().begin(), msg.stats().ranks().end());
          for (auto& rank : g.ranks) {
            if (rank.worker_id().empty()) rank.set_worker_id(g.worker_id);
          }
        }
        break;
      case v1::WorkerMessage::kRegister: {
        std::shared_ptr<WorkerOutlet> owned = g.link;
        Disconnect(index, "its leader sent register twice on one stream", pending);
        owned->Close(grpc::StatusCode::FAILED_PRECONDITION, "register: sent twice on one stream");
        pending.Add(owned);
        attached = false;
        break;
      }
      case v1::WorkerMessage::kLeaving: {
        // The group cannot continue and said why: end its stream (OK: the
        // worker asked for it) and its requests, with the reason.
        std::shared_ptr<WorkerOutlet> owned = g.link;
        const std::string why = msg.leaving().reason().substr(0, kMaxReasonBytes);
        Disconnect(index, why.empty() ? "its leader left without a reason" : "its leader left: " + why, pending);
        owned->Close(grpc::StatusCode::OK, "");
        pending.Add(owned);
        attached = false;
        break;
      }
      case v1::WorkerMessage::MSG_NOT_SET:
        break;
    }
    if (violation) {
      ProtocolViolation(index, std::move(*violation), pending);
      attached = false;
    }
    DrainQueue(pending);
    MaybeRebalance(Clock::now(), pending);
  }
  pending.Flush();
  return attached;
}

std::optional<Dispatcher::Violation> Dispatcher::OnTokens(Group& g, int group, const v1::TokenBatch& batch,
                                                          Pending& pending) {
  const Clock::time_point now = Clock::now();
  for (const v1::PromptLogprobsEvent& ev : batch.prompt_logprobs()) {
    auto it = requests_.find(ev.request_id());
    if (it == requests_.end() || it->second->group != group) continue;  // as tokens below
    Request* r = it->second.get();
    const v1::PromptLogprobs& lp = ev.logprobs();
    if (std::optional<std::string> bad = CheckPromptLogprobs(lp, r->route, r->prompt_logprobs_sent, g.vocab_size))
      return Violation{.request_id = r->wire_id, .what = StrCat("request '", r->id, "': ", *bad)};
    // A re-routed request's new group sends them all again: only what the
    // client has not had goes on, and none after its first token.
    const int64_t skip = r->prompt_logprobs_sent + 1 - lp.start();
    if (skip >= lp.entries_size()) continue;
    if (r->tokens_sent > 0)
      return Violation{.request_id = r->wire_id,
                       .what = StrCat("request '", r->id, "': prompt_logprobs after its first token")};
    v1::GenerateResponse out;
    out.set_request_id(r->id);
    v1::PromptLogprobs* fwd = out.mutable_prompt_logprobs();
    fwd->set_start(lp.start() + skip);
    fwd->mutable_entries()->CopyFrom(lp.entries());
    if (skip > 0) fwd->mutable_entries()->DeleteSubrange(0, static_cast<int>(skip));
    r->prompt_logprobs_sent = lp.start() + lp.entries_size() - 1;
    r->client->Queue(std::move(out));
    pending.Add(r->client);
  }
  for (const v1::TokenEvent& ev : batch.events()) {
    auto it = requests_.find(ev.request_id());
    // Tokens of a request this group no longer serves (cancelled, timed out)
    // are expected in flight: CancelRoute and the tokens crossed.
    if (it == requests_.end() || it->second->group != group) continue;
    Request* r = it->second.get();
    // Nothing a group sends reaches a client unchecked; the tokens before
    // the bad one were fine and are already queued.
    if (ev.token_id() < 0 || ev.token_id() >= g.vocab_size)
      return Violation{.request_id = r->wire_id,
                       .what = StrCat("token id ", ev.token_id(), " for request '", r->id,
                                      "' is outside its vocabulary [0, ", g.vocab_size, ")")};
    if (!IsLogprob(ev.logprob()))
      return Violation{.request_id = r->wire_id,
                       .what = StrCat("logprob ", ev.logprob(), " for request '", r->id,
                                      "' is not a finite log-probability (<= 0)")};
    if (std::optional<std::string> bad =
            CheckTopLogprobs(ev.top_logprobs(), r->route.sampling().logprobs(), g.vocab_size))
      return Violation{.request_id = r->wire_id, .what = StrCat("request '", r->id, "': ", *bad)};
    if (r->tokens_sent >= r->max_tokens)
      return Violation{
          .request_id = r->wire_id,
          .what = StrCat("request '", r->id, "' got more than its max_tokens = ", r->max_tokens, " tokens")};
    if (observer_ != nullptr)
      observer_->OnToken(
          r->tokens_sent == 0,
          std::chrono::duration<double>(now - (r->tokens_sent == 0 ? r->arrival : r->last_token_at)).count());
    if (r->tokens_sent == 0) r->first_token_at = now;
    r->last_token_at = now;
    v1::GenerateResponse out;
    out.set_request_id(r->id);
    v1::Token* t = out.mutable_token();
    t->set_token_id(ev.token_id());
    t->set_logprob(ev.logprob());
    t->set_index(r->tokens_sent++);
    *t->mutable_top_logprobs() = ev.top_logprobs();
    r->client->Queue(std::move(out));
    pending.Add(r->client);
    ++g.tokens_generated;
    r->completion.push_back(static_cast<int32_t>(ev.token_id()));
    if (r->move && r->move->left) EndMove(r, grpc::Status::OK, pending);
    if (r->prefix && r->prefix->held) DropPrefix(r, pending);  // its group has the rows it fetched
    if (g.role == GroupRole::kPrefill && !r->move && r->tokens_sent < r->max_tokens) HandOff(r, pending);
  }
  return std::nullopt;
}

std::optional<Dispatcher::Violation> Dispatcher::OnDone(int group, const v1::RequestDone& done, Pending& pending) {
  auto it = requests_.find(done.request_id());
  if (it == requests_.end() || it->second->group != group) return std::nullopt;
  Request* r = it->second.get();
  if (done.error_code() != 0) {
    if (done.error_code() < 0 || done.error_code() > static_cast<int32_t>(grpc::StatusCode::UNAUTHENTICATED))
      return Violation{.request_id = r->wire_id,
                       .what = StrCat("done.error_code ", done.error_code(), " for request '", r->id,
                                      "' is not a gRPC status code")};
    // The group's own checks rejected it, or a step of the group failed
    // (the message names the rank and why): forward its status unchanged.
    Fail(r, static_cast<grpc::StatusCode>(done.error_code()), done.error_message(), false, pending);
    return std::nullopt;
  }
  if (done.finish_reason() != "length" && done.finish_reason() != "stop")
    return Violation{.request_id = r->wire_id,
                     .what = StrCat("done.finish_reason '", done.finish_reason().substr(0, 64), "' for request '",
                                    r->id, "' is neither 'length' nor 'stop'")};
  if (done.prefix_hit_tokens() < 0 || done.prefix_hit_tokens() > r->prompt_tokens)
    return Violation{.request_id = r->wire_id,
                     .what = StrCat("done.prefix_hit_tokens ", done.prefix_hit_tokens(), " for request '", r->id,
                                    "' is outside [0, prompt tokens = ", r->prompt_tokens, "]")};
  Complete(r, done, pending);
  return std::nullopt;
}

std::optional<Dispatcher::Violation> Dispatcher::OnExported(int group, const v1::Exported& exported, Pending& pending) {
  auto it = requests_.find(exported.request_id());
  // A request that ended or moved on meanwhile.
  if (it == requests_.end() || it->second->group != group || !it->second->move || it->second->move->left)
    return std::nullopt;
  Request* r = it->second.get();
  if (exported.tokens() != r->tokens_sent)
    return Violation{.request_id = r->wire_id,
                     .what = StrCat("exported.tokens ", exported.tokens(), " for request '", r->id, "', which had ",
                                    r->tokens_sent, " tokens")};
  Group& g = *groups_[static_cast<size_t>(group)];
  if (std::optional<std::string> bad =
          CheckHeldBlocks("exported", exported.block_ids(), exported.cached_tokens(),
                          r->prompt_tokens + r->tokens_sent - 1, g.block_size, /*whole_blocks=*/false))
    return Violation{.request_id = r->wire_id, .what = StrCat("request '", r->id, "': ", *bad)};
  ++g.migrated_out;
  r->move->left = true;
  if (exported.block_ids_size() > 0) {
    r->move->export_group = group;
    if (!g.descriptors.empty()) {
      v1::MoveSource* source = r->route.mutable_move_source();
      source->mutable_descriptors()->Assign(g.descriptors.begin(), g.descriptors.end());
      *source->mutable_block_ids() = exported.block_ids();
      source->set_cached_tokens(exported.cached_tokens());
    }
  }
  Resume(r, pending);
  return std::nullopt;
}

void Dispatcher::ProtocolViolation(int group, Violation v, Pending& pending) {
  Group& g = *groups_[static_cast<size_t>(group)];
  const std::string reason = "it violated the worker protocol: " + v.what;
  // The request it was answering fails (whatever the client saw may be
  // wrong); the group's others are handled as on any loss: re-routed
  // without a token, UNAVAILABLE with.
  if (auto it = requests_.find(v.request_id);
      !v.request_id.empty() && it != requests_.end() && it->second->group == group) {
    Fail(
        it->second.get(), grpc::StatusCode::INTERNAL,
        StrCat("DP group ", g.dp_group, " of worker '", g.worker_id, "' ", reason, "; the coordinator disconnected it"),
        false, pending);
  }
  std::shared_ptr<WorkerOutlet> owned = g.link;
  Disconnect(group, reason, pending);
  owned->Close(grpc::StatusCode::FAILED_PRECONDITION, "the coordinator disconnected this DP group: " + reason);
  pending.Add(owned);
}

void Dispatcher::Detach(const WorkerOutlet* link) {
  Pending pending(options_.log_groups);
  {
    MutexLock lock(mu_);
    auto it = link_group_.find(link);
    if (it == link_group_.end()) return;
    Disconnect(it->second,
               "its stream to the coordinator ended without a reason (the worker stopped or died, or the "
               "network failed)",
               pending);
    DrainQueue(pending);
  }
  pending.Flush();
}

void Dispatcher::Shutdown() {
  {
    Pending pending(options_.log_groups);
    {
      MutexLock lock(mu_);
      if (!shutting_down_) {
        shutting_down_ = true;
        std::vector<Request*> live;
        for (auto& [id, r] : requests_) live.push_back(r.get());
        for (Request* r : live) {
          Fail(r, grpc::StatusCode::UNAVAILABLE, "coordinator shutting down", false, pending);
        }
        for (auto& g : groups_) {
          if (g->link == nullptr) continue;
          g->link->Close(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down");
          pending.Add(g->link);
          g->link = nullptr;
          g->in_flight = 0;
          g->queued_tokens = 0;
        }
        link_group_.clear();
      }
      stop_timer_ = true;
    }
    timer_cv_.notify_all();
    pending.Flush();
  }
  if (timer_thread_.joinable() && timer_thread_.get_id() != std::this_thread::get_id()) timer_thread_.join();
}

// ---- Internals (REQUIRE mu_) ---------------------------------------------------

int64_t Dispatcher::ConnectedGroups() const {
  int64_t n = 0;
  for (const auto& g : groups_) n += g->link != nullptr;
  return n;
}

bool Dispatcher::Eligible(const Group& g) const {
  return g.link != nullptr && g.in_flight < options_.max_in_flight_per_group;
}

Candidate Dispatcher::CandidateOf(int index) const {
  const Group& g = *groups_[static_cast<size_t>(index)];
  return Candidate{.index = index, .queued_tokens = g.queued_tokens, .free_blocks = g.free_blocks};
}

bool Dispatcher::IndexesPrefixes(const Group& g) const {
  return router_.policy() == RoutingPolicy::kPrefixAffinity ||
         (options_.prefix_fetch_min_tokens > 0 && g.exports_prefixes);
}

bool Dispatcher::Suits(const Group& g, const Request& r) {
  return g.role == GroupRole::kMixed || (g.role == GroupRole::kPrefill) == (r.tokens_sent == 0);
}

bool Dispatcher::TryRoute(Request* r, Pending& pending) {
  // A new request goes to a prefill or mixed group, a resumed one to a
  // decode or mixed group; to any group only while none of those is connected.
  bool suited = false;
  for (const auto& g : groups_) suited |= g->link != nullptr && Suits(*g, *r);
  std::vector<Candidate> candidates;
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = *groups_[i];
    if (!Eligible(g) || (suited && !Suits(g, *r))) continue;
    Candidate c = CandidateOf(static_cast<int>(i));
    if (router_.policy() == RoutingPolicy::kPrefixAffinity)
      c.prefix_blocks = g.prefix.LeadingMatch(ChainFor(r->chains, r->route, g.block_size));
    candidates.push_back(c);
  }
  if (candidates.empty()) return false;
  RouteTo(r, candidates[router_.Pick(candidates)].index, pending);
  return true;
}

void Dispatcher::RouteTo(Request* r, int index, Pending& pending) {
  Group& g = *groups_[static_cast<size_t>(index)];
  if (r->queued) {
    queue_.erase(r->queue_pos);
    r->queued = false;
  }
  r->group = index;
  r->routed_at = Clock::now();
  g.queued_tokens += r->cost;  // now, not when the group next reports (sglang #21699)
  if (g.in_flight++ == 0) {
    // Idle until now: its silence so far was no stall. The stall watch may
    // now be due before whatever the timer thread sleeps for.
    g.heard_at = r->routed_at;
    timer_cv_.notify_one();
  }
  ++g.routed;
  if (observer_ != nullptr) observer_->OnRouted(g.worker_id, g.dp_group);
  // Asked before the target's index learns the chain, which would hide
  // what the target lacks.
  const bool asked = AskForPrefix(r, index, pending);
  if (IndexesPrefixes(g)) g.prefix.Insert(ChainFor(r->chains, r->route, g.block_size));
  if (!asked) SendRoute(r, nullptr, pending);
}

void Dispatcher::SendRoute(Request* r, const v1::MoveSource* prefix, Pending& pending) {
  Group& g = *groups_[static_cast<size_t>(r->group)];
  v1::CoordinatorMessage msg;
  *msg.mutable_route() = r->route;
  // The tokens its client has: a request that ran elsewhere resumes from them.
  msg.mutable_route()->mutable_generated_ids()->Assign(r->completion.begin(), r->completion.end());
  if (prefix != nullptr) *msg.mutable_route()->mutable_move_source() = *prefix;
  if (g.descriptors.empty()) msg.mutable_route()->clear_move_source();  // it computes them
  g.link->Queue(std::move(msg));
  pending.Add(g.link);
}

bool Dispatcher::AskForPrefix(Request* r, int target, Pending& pending) {
  const Group& t = *groups_[static_cast<size_t>(target)];
  const int64_t bs = t.block_size;
  // A move brings its rows; prompt logprobs need every row computed.
  if (options_.prefix_fetch_min_tokens <= 0 || t.descriptors.empty() || bs <= 0 || r->route.has_move_source() ||
      (r->completion.empty() && r->route.sampling().has_prompt_logprobs()))
    return false;
  // Whole blocks, leaving at least one prompt token to compute (the
  // engine's own rule for a cached prefix).
  const std::vector<uint64_t>& chain = ChainFor(r->chains, r->route, bs);
  const auto usable =
      std::span<const uint64_t>(chain).first(std::min(chain.size(), static_cast<size_t>((r->prompt_tokens - 1) / bs)));
  const int64_t own = IndexesPrefixes(t) ? t.prefix.LeadingMatch(usable) : 0;
  int source = -1;
  int64_t best = own;
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = *groups_[i];
    if (static_cast<int>(i) == target || g.link == nullptr || !g.exports_prefixes || g.block_size != bs) continue;
    if (const int64_t m = g.prefix.LeadingMatch(usable); m > best) {
      best = m;
      source = static_cast<int>(i);
    }
  }
  if (source < 0 || (best - own) * bs < options_.prefix_fetch_min_tokens) return false;
  const uint64_t export_id = next_export_id_++;
  r->prefix = Request::PrefixFetch{.source = source, .export_id = export_id};
  prefix_asks_[export_id] = r;
  Group& s = *groups_[static_cast<size_t>(source)];
  v1::CoordinatorMessage msg;
  v1::ExportPrefix* ask = msg.mutable_export_prefix();
  ask->set_export_id(export_id);
  ask->mutable_token_ids()->Assign(r->route.prompt_ids().begin(), r->route.prompt_ids().begin() + best * bs);
  ask->set_prefix_cache_salt(r->route.prefix_cache_salt());
  s.link->Queue(std::move(msg));
  pending.Add(s.link);
  return true;
}

void Dispatcher::DropPrefix(Request* r, Pending& pending) {
  if (!r->prefix) return;
  const Request::PrefixFetch f = *r->prefix;
  r->prefix.reset();
  if (!f.held) {
    prefix_asks_.erase(f.export_id);  // its answer, when it comes, is released
    return;
  }
  ReleasePrefix(*groups_[static_cast<size_t>(f.source)], f.export_id, pending);
}

void Dispatcher::ReleasePrefix(Group& source, uint64_t export_id, Pending& pending) {
  if (source.link == nullptr) return;
  v1::CoordinatorMessage msg;
  msg.mutable_release_prefix()->set_export_id(export_id);
  source.link->Queue(std::move(msg));
  pending.Add(source.link);
}

std::optional<Dispatcher::Violation> Dispatcher::OnPrefixExported(int group, const v1::PrefixExported& x,
                                                                  Pending& pending) {
  Group& s = *groups_[static_cast<size_t>(group)];
  auto it = prefix_asks_.find(x.export_id());
  if (it == prefix_asks_.end() || it->second->prefix->source != group) {
    // Its request ended, or left the group it was for, meanwhile.
    if (x.block_ids_size() > 0) ReleasePrefix(s, x.export_id(), pending);
    return std::nullopt;
  }
  Request* r = it->second;
  prefix_asks_.erase(it);
  const std::optional<std::string> bad =
      CheckHeldBlocks("prefix_exported", x.block_ids(), x.cached_tokens(),
                      (r->prompt_tokens - 1) / s.block_size * s.block_size, s.block_size, /*whole_blocks=*/true);
  if (bad || x.cached_tokens() == 0) {  // forged (the group is disconnected for it), or evicted meanwhile: computed
    r->prefix.reset();
    SendRoute(r, nullptr, pending);
    if (bad) return Violation{.what = *bad};
    return std::nullopt;
  }
  r->prefix->held = true;
  ++counters_.prefix_fetches;
  counters_.prefix_fetch_tokens += x.cached_tokens();
  v1::MoveSource source;
  source.mutable_descriptors()->Assign(s.descriptors.begin(), s.descriptors.end());
  *source.mutable_block_ids() = x.block_ids();
  source.set_cached_tokens(x.cached_tokens());
  SendRoute(r, &source, pending);
  return std::nullopt;
}

void Dispatcher::Resume(Request* r, Pending& pending) {
  DropPrefix(r, pending);
  ReleaseFromGroup(r);
  const int to = r->move ? r->move->to : -1;
  if (to >= 0 && groups_[static_cast<size_t>(to)]->link != nullptr) {
    RouteTo(r, to, pending);
  } else if (!TryRoute(r, pending)) {
    r->queued = true;
    r->queue_pos = queue_.insert(queue_.begin(), r);
  }
}

int Dispatcher::MoveTarget(const Request& r, const v1::MigrateRequest& m, grpc::Status* error) {
  if (!m.has_to_group()) {
    std::vector<Candidate> candidates;
    for (size_t i = 0; i < groups_.size(); ++i) {
      const Group& g = *groups_[i];
      if (g.link == nullptr || static_cast<int>(i) == r.group) continue;
      candidates.push_back(CandidateOf(static_cast<int>(i)));
    }
    if (!candidates.empty()) return candidates[router_.Pick(candidates)].index;
    *error = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          StrCat("no DP group but its own is connected to move request '", r.id, "' to"));
    return -1;
  }
  std::vector<int> named;
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = *groups_[i];
    if (g.link != nullptr && g.dp_group == m.to_group() &&
        (m.to_worker_id().empty() || g.worker_id == m.to_worker_id()))
      named.push_back(static_cast<int>(i));
  }
  const std::string which =
      StrCat("DP group ", m.to_group(), m.to_worker_id().empty() ? "" : StrCat(" of worker '", m.to_worker_id(), "'"));
  if (named.size() == 1 && named[0] != r.group) return named[0];
  *error = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        named.empty()      ? StrCat("to_group: no connected ", which)
                        : named.size() > 1 ? StrCat("to_group: ", which,
                                                    " is connected in several worker jobs; name one with to_worker_id")
                                           : StrCat("to_group: request '", r.id, "' runs on ", which, " already"));
  return -1;
}

void Dispatcher::StartMove(Request* r, int to, Pending& pending) {
  Group& from = *groups_[static_cast<size_t>(r->group)];
  r->move = Request::Move{.from = r->group,
                          .to = to,
                          .from_group = from.dp_group,
                          .from_worker = from.worker_id,
                          .tokens_before = r->tokens_sent,
                          .paused_at = r->tokens_sent > 0 ? r->last_token_at : Clock::now()};
  v1::CoordinatorMessage msg;
  msg.mutable_migrate_out()->set_request_id(r->wire_id);
  from.link->Queue(std::move(msg));
  pending.Add(from.link);
  pending.Note(StrCat("request '", r->id, "' moves from DP group ", from.dp_group, " of worker ", from.worker_id,
                      " to DP group ", groups_[static_cast<size_t>(to)]->dp_group, " of worker ",
                      groups_[static_cast<size_t>(to)]->worker_id, " after ", r->tokens_sent, " tokens"));
}

void Dispatcher::HandOff(Request* r, Pending& pending) {
  std::vector<Candidate> candidates;
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = *groups_[i];
    if (g.link == nullptr || g.role != GroupRole::kDecode) continue;
    candidates.push_back(CandidateOf(static_cast<int>(i)));
  }
  if (candidates.empty()) return;  // no decode group: it decodes where it is
  StartMove(r, candidates[router_.Pick(candidates)].index, pending);
}

double Dispatcher::CacheUse(const Group& g) {
  if (g.cache_blocks <= 0) return 0;
  return 1.0 - static_cast<double>(std::min(g.free_blocks, g.cache_blocks)) / static_cast<double>(g.cache_blocks);
}

std::pair<int, int> Dispatcher::Extremes(double (*load)(const Group&)) const {
  int most = -1, least = -1;
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = *groups_[i];
    if (g.link == nullptr || g.role == GroupRole::kPrefill) continue;
    if (most < 0 || load(g) > load(*groups_[static_cast<size_t>(most)])) most = static_cast<int>(i);
    if (least < 0 || load(g) < load(*groups_[static_cast<size_t>(least)])) least = static_cast<int>(i);
  }
  return {most, least};
}

void Dispatcher::MaybeRebalance(Clock::time_point now, Pending& pending) {
  if ((options_.rebalance_threshold <= 0 && options_.rebalance_cache_fraction <= 0) || rebalancing_ ||
      now < last_rebalance_ + SecondsToDuration(options_.rebalance_period_s))
    return;
  last_rebalance_ = now;
  if (options_.rebalance_threshold > 0) {
    const auto [busiest, idlest] = Extremes([](const Group& g) { return static_cast<double>(g.in_flight); });
    if (busiest >= 0 &&
        groups_[static_cast<size_t>(busiest)]->in_flight - groups_[static_cast<size_t>(idlest)]->in_flight >=
            options_.rebalance_threshold)
      if (MoveOne(busiest, idlest, /*by_cache=*/false, now, pending)) return;
  }
  if (options_.rebalance_cache_fraction > 0) {
    const auto [fullest, emptiest] = Extremes(CacheUse);
    if (fullest >= 0 &&
        CacheUse(*groups_[static_cast<size_t>(fullest)]) - CacheUse(*groups_[static_cast<size_t>(emptiest)]) >=
            options_.rebalance_cache_fraction)
      MoveOne(fullest, emptiest, /*by_cache=*/true, now, pending);
  }
}

bool Dispatcher::MoveOne(int source, int target, bool by_cache, Clock::time_point now, Pending& pending) {
  Group& from = *groups_[static_cast<size_t>(source)];
  Group& to = *groups_[static_cast<size_t>(target)];
  // With a policy that routes by queued tokens, not one whose move would
  // leave the target with more of them than the source: the router would
  // then send the next requests to the source, undoing the move (and
  // moving again would chase it, leaving the groups further apart than
  // without rebalancing). By cache use, likewise not one that would leave
  // the target's cache fuller than the source's.
  const bool load_aware = router_.policy() != RoutingPolicy::kRoundRobin;
  const Clock::duration cooldown = SecondsToDuration(options_.rebalance_cooldown_s);
  auto rows = [](const Request& r) { return r.prompt_tokens + r.tokens_sent; };
  auto blocks = [&](const Request& r) { return (rows(r) + from.block_size - 1) / from.block_size; };
  Request* pick = nullptr;
  for (auto& [id, owned] : requests_) {
    Request* r = owned.get();
    if (r->group != source || r->move || r->tokens_sent == 0 || (r->prefix && !r->prefix->held) ||
        (r->moved_at != Clock::time_point{} && now < r->moved_at + cooldown))
      continue;
    if (!by_cache && load_aware && to.queued_tokens + r->cost > from.queued_tokens - r->cost) continue;
    if (by_cache && from.block_size > 0 && to.cache_blocks > 0 && from.cache_blocks > 0) {
      const double b = static_cast<double>(blocks(*r));
      const double to_use = CacheUse(to) + b / static_cast<double>(to.cache_blocks);
      const double from_use = CacheUse(from) - b / static_cast<double>(from.cache_blocks);
      if (to_use > from_use) continue;
    }
    // By requests: the one with the most tokens left; by cache: the one
    // holding the most rows.
    if (pick == nullptr ||
        (by_cache ? rows(*r) > rows(*pick) : r->max_tokens - r->tokens_sent > pick->max_tokens - pick->tokens_sent))
      pick = r;
  }
  if (pick == nullptr) return false;
  StartMove(pick, target, pending);
  if (by_cache && from.block_size > 0) {
    // Until the groups next report, the view counts the move done, so that
    // the next period does not move more for the same gap.
    from.free_blocks = std::min(from.cache_blocks, from.free_blocks + blocks(*pick));
    to.free_blocks = std::max<int64_t>(0, to.free_blocks - blocks(*pick));
  }
  pick->move->rebalancing = true;
  rebalancing_ = true;
  ++counters_.rebalance_moves;
  return true;
}

void Dispatcher::EndMove(Request* r, const grpc::Status& status, Pending& pending) {
  Request::Move m = std::move(*r->move);
  r->move.reset();
  r->moved_at = Clock::now();
  if (m.rebalancing) rebalancing_ = false;
  // Its old group's blocks are no longer needed: its new group has them (or
  // computed them), or the request ended.
  r->route.clear_move_source();
  if (m.export_group >= 0) {
    Group& held = *groups_[static_cast<size_t>(m.export_group)];
    if (held.link != nullptr) {
      v1::CoordinatorMessage msg;
      msg.mutable_release_exported()->set_request_id(r->wire_id);
      held.link->Queue(std::move(msg));
      pending.Add(held.link);
    }
  }
  v1::MigrateResponse response;
  response.set_from_group(m.from_group);
  response.set_from_worker_id(m.from_worker);
  response.set_tokens_before(m.tokens_before);
  if (status.ok()) {
    Group& to = *groups_[static_cast<size_t>(r->group)];
    ++to.migrated_in;
    ++counters_.migrated;
    response.set_to_group(to.dp_group);
    response.set_to_worker_id(to.worker_id);
    if (r->tokens_sent > m.tokens_before) {
      response.set_pause_ms(Ms(r->last_token_at - m.paused_at));
      if (observer_ != nullptr) observer_->OnMigrated(response.pause_ms() / 1e3);
    }
  } else {
    ++counters_.migrations_failed;
  }
  for (MigrateDone& caller : m.callers)
    pending.Call([caller = std::move(caller), status, response] { caller(status, response); });
}

void Dispatcher::DrainQueue(Pending& pending) {
  // FIFO: eligibility does not depend on the request, so if the head cannot
  // be routed, nothing behind it can.
  while (!queue_.empty() && TryRoute(queue_.front(), pending)) {
  }
}

void Dispatcher::ArmTimer(Request* r, Clock::time_point at) {
  if (r->armed) timers_.erase(r->timer);
  r->timer = timers_.emplace(at, r);
  r->armed = true;
  if (r->timer == timers_.begin()) timer_cv_.notify_one();
}

void Dispatcher::OnTimer(Request* r, Clock::time_point now, Pending& pending) {
  if (now >= r->deadline) {
    Fail(r, grpc::StatusCode::DEADLINE_EXCEEDED,
         r->group >= 0 ? "deadline exceeded" : "deadline exceeded while waiting for a free DP group", true, pending);
  } else if (r->queued && ConnectedGroups() == 0 && now >= r->unavailable_at) {
    Fail(r, grpc::StatusCode::UNAVAILABLE, NoGroupMessage(*r, now), false, pending);
  } else {
    ArmNext(r, now);
  }
}

void Dispatcher::ArmNext(Request* r, Clock::time_point now) {
  // The request's next timed fate: its own deadline, and, while it waits
  // with no group connected, the end of that wait. A request routed to a
  // connected group (or queued for room in one) without a deadline needs no
  // timer: its group's progress, or the stall watch, decides its fate.
  Clock::time_point at = r->client_deadline ? r->deadline : Clock::time_point::max();
  if (r->queued && ConnectedGroups() == 0) at = std::min(at, std::max(now, r->unavailable_at));
  if (at != Clock::time_point::max()) {
    ArmTimer(r, at);
  } else if (r->armed) {
    timers_.erase(r->timer);
    r->armed = false;
  }
}

std::optional<Clock::time_point> Dispatcher::NextStall() const {
  std::optional<Clock::time_point> next;
  const Clock::duration timeout = SecondsToDuration(options_.stall_timeout_s);
  for (const auto& g : groups_) {
    if (!Watched(*g)) continue;
    const Clock::time_point at = g->heard_at + timeout;
    if (!next || at < *next) next = at;
  }
  return next;
}

void Dispatcher::CheckStalls(Clock::time_point now, Pending& pending) {
  const Clock::duration timeout = SecondsToDuration(options_.stall_timeout_s);
  for (size_t i = 0; i < groups_.size(); ++i) {
    Group& g = *groups_[i];
    if (!Watched(g) || now < g.heard_at + timeout) continue;
    // Nothing from the group for that long although it has work, or although
    // its step loop reported stats before: that loop is stuck (a rank died or
    // stopped inside a collective, a step that never ends). An idle group is
    // dropped too, so that Health stops counting it and no request is routed
    // to it. Closing the stream makes a worker that was only slow drop what
    // it held and register again.
    const std::string reason =
        g.in_flight > 0
            ? StrCat("it stalled: its leader sent nothing for ", Seconds(now - g.heard_at), " s with ", g.in_flight,
                     g.in_flight == 1 ? " request" : " requests", " in flight (stall timeout ", Seconds(timeout), " s)")
            : StrCat("it stalled: its leader, which reports stats while it runs, sent nothing for ",
                     Seconds(now - g.heard_at), " s while idle (stall timeout ", Seconds(timeout), " s)");
    std::shared_ptr<WorkerOutlet> owned = g.link;
    Disconnect(static_cast<int>(i), reason, pending);
    owned->Close(grpc::StatusCode::UNAVAILABLE, "the coordinator gave up on this DP group: " + reason);
    pending.Add(owned);
  }
}

void Dispatcher::ReleaseFromGroup(Request* r) {
  if (r->group < 0) return;
  Group& g = *groups_[static_cast<size_t>(r->group)];
  g.queued_tokens -= r->cost;
  --g.in_flight;
  r->group = -1;
}

void Dispatcher::Count(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      ++counters_.completed;
      break;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      ++counters_.rejected;
      break;
    case grpc::StatusCode::CANCELLED:
      ++counters_.cancelled;
      break;
    default:
      ++counters_.failed;
      break;
  }
}

void Dispatcher::CancelRoute(const Request& r, Pending& pending) {
  Group& g = *groups_[static_cast<size_t>(r.group)];
  if (g.link == nullptr) return;
  v1::CoordinatorMessage msg;
  msg.mutable_cancel()->set_request_id(r.wire_id);
  g.link->Queue(std::move(msg));
  pending.Add(g.link);
}

void Dispatcher::Fail(Request* r, grpc::StatusCode code, std::string message, bool cancel_route, Pending& pending) {
  if (cancel_route && r->group >= 0) CancelRoute(*r, pending);
  if (r->move)
    EndMove(r, grpc::Status(code, StrCat("request '", r->id, "' ended before it ran on its new group: ", message)),
            pending);
  Count(code);
  Observe(*r, code, "", 0, Clock::now());
  r->client->Close(code, std::move(message));
  pending.Add(r->client);
  Forget(r, pending);
}

void Dispatcher::Complete(Request* r, const v1::RequestDone& done, Pending& pending) {
  const Clock::time_point now = Clock::now();
  if (r->move) {
    if (r->move->left && r->group >= 0) {
      EndMove(r, grpc::Status::OK, pending);  // it ended on its new group
    } else {
      EndMove(r,
              grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                           StrCat("request '", r->id, "' finished (", done.finish_reason(), ") before it could move")),
              pending);
    }
  }
  Count(grpc::StatusCode::OK);
  Observe(*r, grpc::StatusCode::OK, done.finish_reason(), done.prefix_hit_tokens(), now);
  // The group that served it: its own, or the one it lost while it waits to
  // resume (ended early by its client meanwhile).
  const int served = r->group >= 0 ? r->group : r->lost_group;
  if (r->group >= 0) {
    Group& g = *groups_[static_cast<size_t>(r->group)];
    ++g.completed;
    if (IndexesPrefixes(g) && !r->completion.empty() && g.block_size > 0) {
      // The group's cache now also holds the generated tokens' blocks (all
      // but the last token, whose row is never written): a follow-up turn
      // that resends prompt + answer should find them.
      std::vector<int32_t> seq(r->route.prompt_ids().begin(), r->route.prompt_ids().end());
      seq.insert(seq.end(), r->completion.begin(), r->completion.end() - 1);
      g.prefix.Insert(PrefixBlockHashes(seq, g.block_size, r->route.prefix_cache_salt()));
    }
  }
  v1::GenerateResponse out;
  out.set_request_id(r->id);
  v1::Finished* f = out.mutable_finished();
  f->set_finish_reason(done.finish_reason());
  f->set_dp_group(served >= 0 ? groups_[static_cast<size_t>(served)]->dp_group : -1);
  f->set_prompt_tokens(r->prompt_tokens);
  f->set_completion_tokens(r->tokens_sent);
  f->set_prefix_hit_tokens(done.prefix_hit_tokens());
  v1::Timings* t = f->mutable_timings();
  t->set_queued_ms(Ms(r->routed_at - r->arrival));
  t->set_first_token_ms(Ms((r->tokens_sent > 0 ? r->first_token_at : now) - r->arrival));
  t->set_total_ms(Ms(now - r->arrival));
  r->client->Queue(std::move(out));
  r->client->Close(grpc::StatusCode::OK, "");
  pending.Add(r->client);
  Forget(r, pending);
}

void Dispatcher::Forget(Request* r, Pending& pending) {
  DropPrefix(r, pending);
  ReleaseFromGroup(r);
  if (r->queued) queue_.erase(r->queue_pos);
  if (r->armed) timers_.erase(r->timer);
  client_ids_.erase(std::make_pair(r->principal, r->id));
  requests_.erase(requests_.find(r->wire_id));  // destroys r (by iterator: the key dies with it)
}

std::string Dispatcher::NoGroupMessage(const Request& r, Clock::time_point now) const {
  if (r.lost_group >= 0) {
    const Group& g = *groups_[static_cast<size_t>(r.lost_group)];
    const std::string before = r.tokens_sent == 0
                                   ? std::string("before answering")
                                   : StrCat("after sending ", r.tokens_sent, r.tokens_sent == 1 ? " token" : " tokens");
    return StrCat("DP group ", g.dp_group, " of worker '", g.worker_id, "' went away ", Seconds(now - g.left_at),
                  " s ago ", before, " (", g.disconnect_reason,
                  "), and no DP group connected to take the request over");
  }
  // The group that went away last, if any ever registered.
  const Group* last = nullptr;
  for (const auto& g : groups_) {
    if (!g->disconnect_reason.empty() && (last == nullptr || g->left_at > last->left_at)) last = g.get();
  }
  const std::string waited = StrCat(r.client_deadline && r.unavailable_at + r.unavailable_margin >= r.deadline
                                        ? "before the deadline"
                                        : StrCat("within the coordinator's queue timeout of ",
                                                 Seconds(SecondsToDuration(options_.queue_timeout_s)), " s"),
                                    " (waited ", Ms(now - r.arrival), " ms)");
  if (last == nullptr) return StrCat("no DP group registered ", waited);
  return StrCat("no DP group connected ", waited, ": ",
                groups_.size() == 1
                    ? std::string("the one DP group registered before, ")
                    : StrCat("all ", groups_.size(), " DP groups registered before went away; the last, "),
                "DP group ", last->dp_group, " of worker '", last->worker_id, "', went away ",
                Seconds(now - last->left_at), " s ago: ", last->disconnect_reason);
}

void Dispatcher::Disconnect(int group, std::string reason, Pending& pending) {
  Group& g = *groups_[static_cast<size_t>(group)];
  link_group_.erase(g.link.get());
  g.link = nullptr;
  if (reason.size() > kMaxReasonBytes) reason = reason.substr(0, kMaxReasonBytes - 3) + "...";
  g.disconnect_reason = std::move(reason);
  g.left_at = Clock::now();
  pending.Note(StrCat("DP group ", g.dp_group, " of worker ", g.worker_id, " went away: ", g.disconnect_reason, "; ",
                      ConnectedGroups(), " group(s) connected"));
  std::vector<Request*> affected;
  for (auto& [id, r] : requests_) {
    if (r->group == group) affected.push_back(r.get());
  }
  // Oldest first, so the re-routed keep their arrival order at the queue's head.
  std::sort(affected.begin(), affected.end(), [](Request* a, Request* b) { return a->serial < b->serial; });
  auto head = queue_.begin();
  for (Request* r : affected) {
    DropPrefix(r, pending);
    ReleaseFromGroup(r);
    ++counters_.rerouted;
    r->lost_group = group;
    if (r->move && !r->move->left && r->move->from == group) {
      r->move->left = true;  // it moves on as asked, from the tokens its client has
      ++g.migrated_out;
    }
    // Tokens the group made that never arrived are made again: the new
    // group resumes from the ones the client has (RouteTo sends them).
    r->queued = true;
    r->queue_pos = queue_.insert(head, r);
  }
  // Requests whose prefix it held or was asked for: one still waiting for
  // its answer goes to its group now, which computes the rows; one whose
  // group fetches them meanwhile finds the source gone and computes them.
  for (auto& [id, r] : requests_) {
    if (!r->prefix || r->prefix->source != group) continue;
    const bool waited = !r->prefix->held;
    DropPrefix(r.get(), pending);
    if (waited) SendRoute(r.get(), nullptr, pending);
  }
  // Nothing of the group is in flight any more (ReleaseFromGroup / Fail).
  if (ConnectedGroups() > 0) return;
  // No group left to take what waits: a restarting worker gets
  // lost_group_wait_s to register again, and the clients learn soon if it
  // does not (bounded by their own deadlines, early as at submission).
  const Clock::time_point now = Clock::now();
  const Clock::time_point soon = now + SecondsToDuration(options_.lost_group_wait_s);
  for (Request* r : queue_) {
    r->unavailable_at = std::min(soon, r->deadline - r->unavailable_margin);
    ArmNext(r, now);
  }
}

void Dispatcher::TimerLoop() {
  MutexLock lock(mu_);
  while (!stop_timer_) {
    std::optional<Clock::time_point> next = NextStall();
    if (!timers_.empty() && (!next || timers_.begin()->first < *next)) next = timers_.begin()->first;
    if (!next) {
      lock.Wait(timer_cv_);
      continue;
    }
    if (Clock::now() < *next) {
      lock.WaitUntil(timer_cv_, *next);
      continue;
    }
    Pending pending(options_.log_groups);
    const Clock::time_point now = Clock::now();
    CheckStalls(now, pending);
    while (!timers_.empty() && timers_.begin()->first <= now) {
      Request* r = timers_.begin()->second;
      timers_.erase(timers_.begin());
      r->armed = false;
      OnTimer(r, now, pending);
    }
    DrainQueue(pending);
    lock.Unlock();
    pending.Flush();
    lock.Lock();
  }
}

}  // namespace mlarun::coord
