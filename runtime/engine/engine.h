// The scheduler of a DP group, and the serving loop of one process: requests
// in, step plans out (Schedule), sampled tokens back in (Finish); Step does
// the three with a ModelRunner of its own.
//
// Continuous batching: every step mixes the running requests' decode tokens
// with chunks of waiting prompts under a token budget (chunked prefill). New
// requests join between steps; finished ones leave and free their blocks
// (full prompt blocks stay cached for reuse by later requests with the same
// prefix). When blocks run out, the newest running request is preempted: its
// blocks are released and it is recomputed later from its prompt and the
// tokens it already produced; its sampler keeps its random stream, so the
// output does not depend on preemption.
//
// A request that already generated tokens elsewhere (GenerationRequest::
// generated: migrated from another DP group, or resumed after its group went
// away) is computed from its prompt and those tokens, and goes on exactly as
// it would have undisturbed: its sampler starts with their penalty history,
// grammar state and random draws behind it.
//
// Moving a request between DP groups without recomputing it: the old group
// exports it (Export), keeping its blocks pinned, and the new group admits
// it with those blocks as its import source (GenerationRequest::import): it
// takes blocks for the rows, every rank of the group fetches them through
// its runner's BlockImporter (StepPlan::imports), and the request decodes on
// from there (FinishImports). A failed fetch only costs the recompute.
//
// A step whose computation fails (Model::last_step_failure()) is a failed
// request, not a failed engine: the requests of that step end with
// FinishReason::kError and the step's Status, their blocks are released, and
// every other request carries on as if the step had not been tried.
//
// Not thread-safe: one owner drives Add/Step.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "base/block_size.h"
#include "base/status.h"
#include "kv/latent_cache.h"
#include "runtime/grammar/grammar.h"
#include "runtime/model/model.h"
#include "runtime/ops/sampler.h"
#include "runtime/request/request.h"
#include "runtime/runner/model_runner.h"
#include "runtime/runner/step_plan.h"

namespace mlarun {

struct EngineConfig {
  int64_t max_num_batched_tokens = 512;  // tokens per step (decodes + prefill chunks)
  int64_t max_num_seqs = 64;             // running requests at once
  // Prompt tokens scored per step (SamplingParams::prompt_logprobs): each
  // takes a whole row of logits (vocab floats), so a long prompt's are
  // computed in chunks of at most this many, whatever the token budget.
  int64_t max_scored_rows_per_step = 64;
  int64_t cache_budget_bytes = int64_t{1} << 30;
  int64_t block_size = kDefaultBlockSize;
  bool enable_prefix_caching = true;
  bool commit_cache_memory = false;  // LatentCacheConfig::commit_memory
  // Structured output (SamplingParams::structured): the model's vocabulary
  // and compile cache, on the engine that samples (a group's leader).
  // nullptr: no tokenizer; a request asking for structured output is refused.
  std::shared_ptr<GrammarCompiler> grammar;
  // The group's runners can fetch blocks from other groups' pools (each has
  // a BlockImporter): a request with an import source is admitted by
  // importing its rows (StepPlan::imports, then FinishImports). When false,
  // Add drops a request's import source and its rows are computed.
  bool imports = false;
};

// kError: a step the request was part of failed (GenerationOutput::error).
enum class FinishReason : uint8_t { kNone = 0, kLength = 1, kStop = 2, kCancelled = 3, kError = 4 };
std::string_view FinishReasonName(FinishReason r);  // "length", "stop", "cancelled", "error"

struct GenerationOutput {
  // Generated ids only (those of the steps before a failure, if any); for a
  // resumed request only those generated here, after GenerationRequest::
  // generated.
  std::vector<int64_t> tokens;
  std::vector<double> logprobs;  // natural log, unmodified distribution
  // SamplingParams::logprobs > 0: per generated token, its step's most likely
  // tokens (SampledToken::top); empty otherwise.
  std::vector<std::vector<TokenLogprob>> top_logprobs;
  // SamplingParams::prompt_logprobs >= 0: entry i for prompt token i + 1 (the
  // first has none), its logprob given the tokens before it and that
  // position's most likely tokens. Complete once the first token is out.
  // Empty for a resumed request (GenerationRequest::generated not empty):
  // it reported them where it started.
  std::vector<LogprobEntry> prompt_logprobs;
  FinishReason finish_reason = FinishReason::kNone;
  Status error;                   // kError: why (the failed step's Status); OK otherwise
  int64_t prefix_hit_tokens = 0;  // prompt tokens reused from the prefix cache
  int64_t preemptions = 0;
};

struct EngineStats {
  int64_t steps = 0;
  int64_t prefill_tokens = 0;
  int64_t decode_tokens = 0;
  int64_t preemptions = 0;
  Model::StepTimes time;  // summed over steps (the runner's)
  double forward_seconds = 0;
  int64_t imported_tokens = 0;    // rows fetched from other groups' pools (FinishImports that succeeded)
  int64_t import_failures = 0;    // requests whose fetch failed (computed instead)
  int64_t exported = 0;           // requests that left by Export
  int64_t exported_prefixes = 0;  // ExportPrefix calls that pinned blocks
};

// What Export hands over of a request leaving the engine: the blocks that
// hold its first `rows` tokens' rows (prompt + generated, in token order),
// pinned until ReleaseExport. Empty and 0 when it held none.
struct ExportedRequest {
  std::vector<int32_t> blocks;
  int64_t rows = 0;
};

class Engine {
 public:
  // The serving loop of one process: a scheduler and a runner of its own
  // over the whole `model` (Step).
  static StatusOr<std::unique_ptr<Engine>> Create(Model& model, const EngineConfig& config);
  // A scheduler alone, for a DP group whose ranks' runners execute its plans
  // (RankRunner): Schedule / Finish / FailStep, no Step.
  static StatusOr<std::unique_ptr<Engine>> CreateScheduler(const ModelConfig& model, const EngineConfig& config);
  // The cache pool a scheduler of `config` hands out blocks of, for a model
  // of `model` (`config` checked as Create checks it): every runner of the
  // group creates its pool from it.
  static StatusOr<LatentCacheConfig> CacheConfig(const ModelConfig& model, const EngineConfig& config);

  // Validates and queues a request; returns its id. A bad request (empty
  // prompt, token id outside the vocabulary, prompt + max_tokens beyond the
  // model's positions or the whole cache, bad sampling values, a structured
  // output that does not parse or that no tokenizer backs) is
  // INVALID_ARGUMENT and changes nothing. A structured output is parsed
  // here and compiled against the vocabulary on a thread of its own
  // (EngineConfig::grammar's cache makes a repeated one cheap): the request
  // is not scheduled before its grammar is ready, and others pass it
  // meanwhile. A compile that fails all the same ends the request with
  // kError and that Status. The request ends with kStop once its grammar
  // is complete. A resumed request (GenerationRequest::generated) has its
  // earlier tokens count toward max_tokens and min_tokens; its output
  // lists only the tokens generated here. Its import source
  // (GenerationRequest::import, checked against config().block_size) is
  // dropped, and its rows computed, when EngineConfig::imports is off or
  // the request wants its prompt's logprobs.
  StatusOr<int64_t> Add(GenerationRequest request);

  // One step: schedule, run the model, sample. Returns the ids of the requests
  // that finished in this step (their outputs are in Output()), including
  // those of a step whose computation failed: they end with kError and the
  // runner's Status (FailStep). Errors returned are the engine's own
  // (scheduling, cache bookkeeping) and a Forward error that is not a
  // computation failure; after one, the engine should not be stepped again.
  StatusOr<std::vector<int64_t>> Step();

  // The two halves of Step, for ranks that run the model together: decide the
  // step (plan.seqs may be empty; each sequence carries its block table, and
  // its sampler when the step draws its next token), then take the tokens a
  // runner drew for the plan's sampled sequences (ModelRunner::Execute, in
  // plan order) and retire finished requests.
  StatusOr<StepPlan> Schedule();
  // `scores`: the runner's scored prompt tokens per plan sequence
  // (ModelRunner::last_scores); empty when the plan scores none.
  StatusOr<std::vector<int64_t>> Finish(const StepPlan& plan, std::span<const SampledToken> sampled,
                                        std::span<const std::span<const SampledToken>> scores = {});
  // Instead of Finish, for a plan whose step failed: ends every request of
  // the plan with kError and `error` (not OK), releases their blocks (as
  // and leaves every other request as it was. The rows the
  // failed step wrote are never committed, so no later request reuses them.
  // Returns the ids of the requests it ended, in plan order.
  StatusOr<std::vector<int64_t>> FailStep(const StepPlan& plan, const Status& error);
  // For a plan with imports (StepPlan::imports), once every rank of the
  // group ran them (ModelRunner::Import) and the group agreed on `ok` (all
  // succeeded): the leader calls it before the next Schedule (which refuses
  // to run before). ok: each imported request's rows count as computed and
  // committed (its full blocks are published for prefix reuse), and it runs
  // from the next step. Not ok: its blocks are released and it goes back to
  // the front of the queue without its import source, to be computed as a
  // preempted request is (the same output). A request exported or cancelled
  // meanwhile is skipped.
  Status FinishImports(const StepPlan& plan, bool ok);
  // Adds a step's times (the runner's forward pass and its parts) to stats().
  void RecordStepTimes(double forward_seconds, const Model::StepTimes& parts);
  const EngineConfig& config() const { return config_; }

  bool HasWork() const { return !running_.empty() || !waiting_.empty() || !importing_.empty(); }
  // Ends a queued or running request now: its blocks are released and it will
  // produce no more tokens (finish_reason kCancelled). NOT_FOUND if it is
  // unknown or already finished.
  Status Cancel(int64_t id);
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  // Requests whose import the last plan started and FinishImports has not
  // ended; they count against max_num_seqs.
  int64_t num_importing() const { return static_cast<int64_t>(importing_.size()); }

  // A live request leaves the engine between steps, to go on in another DP
  // group: its output so far stays here (finish_reason kCancelled, for
  // TakeOutput), and, when it holds blocks, the rows of its computed tokens
  // (prompt + generated, the last generated token excepted) stay in them,
  // pinned until ReleaseExport, for the new group to import. A waiting
  // request, or one whose import has not finished, exports no blocks (rows
  // 0; the latter's are released). NOT_FOUND if unknown or finished.
  StatusOr<ExportedRequest> Export(int64_t id);
  // Pins the cached full blocks of the longest prefix of `tokens` under
  // `salt` (the blocks a new request with that prompt and salt would attach,
  // all of `tokens` at most) for another group to import. Returns a handle
  // for ReleaseExport (never a request's id) and the blocks with the rows
  // they hold, a multiple of the block size; rows 0, no blocks and handle -1
  // when none is cached or prefix caching is off.
  struct ExportedPrefix {
    int64_t handle = -1;
    ExportedRequest held;
  };
  StatusOr<ExportedPrefix> ExportPrefix(std::span<const int32_t> tokens, uint64_t salt);
  // Unpins an exported request's blocks, or an exported prefix's (as
  // Release: full published blocks stay cached for prefix reuse). NOT_FOUND
  // if `id` holds none.
  Status ReleaseExport(int64_t id);
  // Exported requests whose blocks are still pinned.
  int64_t num_exported() const { return static_cast<int64_t>(exported_.size()); }
  // Output so far of request `id` (complete once it finished). nullptr if unknown.
  const GenerationOutput* Output(int64_t id) const;
  // Hands over the output of a finished or cancelled request and forgets the
  // request, so a long-running server does not keep every request it served.
  // NOT_FOUND if unknown; FAILED_PRECONDITION while it is still live.
  StatusOr<GenerationOutput> TakeOutput(int64_t id);
  const EngineStats& stats() const { return stats_; }
  // Waits up to `most` for a waiting request's grammar to compile (at once
  // when none compiles): what a step loop with nothing else to schedule does
  // instead of spinning.
  void WaitForGrammar(std::chrono::milliseconds most) const;
  const LatentCache& cache() const { return *cache_; }
  // Create's runner (its pool; SetImporter for imports); nullptr for a
  // scheduler alone.
  ModelRunner* runner() { return runner_.get(); }

  // Runs Add for each request and steps until all finish. Outputs in input
  // order; a rejected request, or one whose step failed (kError), gets its
  // error Status in its slot.
  std::vector<StatusOr<GenerationOutput>> Generate(std::vector<GenerationRequest> requests);

 private:
  struct Req {
    int64_t id;
    GenerationRequest request;
    std::vector<int32_t> tokens;  // prompt, then generated tokens (elsewhere, then here)
    int64_t computed = 0;         // tokens whose rows are in the cache
    bool in_cache = false;
    std::unique_ptr<Sampler> sampler;
    // Its structured output, compiling (valid() until CollectGrammars gives
    // it to the sampler).
    std::future<StatusOr<std::unique_ptr<TokenConstraint>>> grammar;
    // Set when the request ends or is forgotten: a compile still queued for
    // it is then skipped.
    std::shared_ptr<std::atomic<bool>> grammar_abandoned;
    GenerationOutput out;

    Req() = default;
    Req(const Req&) = delete;
    Req& operator=(const Req&) = delete;
    ~Req() {
      if (grammar_abandoned) grammar_abandoned->store(true);
    }
  };

  Engine(const ModelConfig& model, const EngineConfig& config, std::unique_ptr<LatentCache> cache);
  // Reserves cache slots for `n` more tokens of `r`, preempting the newest
  // running requests (never `r` itself unless it is the newest) as needed.
  // Returns false if `r` itself had to be preempted.
  StatusOr<bool> Reserve(Req& r, int64_t n);
  void Preempt(Req& r);
  Status Admit(Req& r);
  // Gives each compiled grammar of a waiting request to its sampler; a
  // compile that failed ends its request (kError).
  void CollectGrammars();
  bool GrammarsPending() const;
  // Of the first `n` tokens of r.tokens, those of its prompt (what
  // prefix_hit_tokens counts: a preempted or resumed request may find its
  // generated tokens' blocks cached too).
  static int64_t PromptTokens(const Req& r, int64_t n);
  // Whether `r` wants its prompt's logprobs and some are not recorded yet;
  // never for a resumed request, which reported them before.
  static bool ScoresPending(const Req& r);
  // Reserves slots for r.tokens[r.computed, + n).
  Status Append(Req& r, int64_t n);
  // `r` leaves every queue, its blocks already dealt with (released, or
  // pinned by Export): kCancelled, its grammar compile abandoned.
  void Leave(Req& r);
  // Undoes Admit of a request that stays waiting.
  Status Unadmit(Req& r);
  // For an admitted request with an import source: kLocal when its cached
  // prefix already holds the rows (the source is dropped), kNoRoom when the
  // blocks for the rest do not fit (unadmitted), else kStarted: blocks
  // reserved, the import added to `plan`, the request moved to importing_.
  enum class ImportStart : uint8_t { kLocal, kNoRoom, kStarted };
  StatusOr<ImportStart> StartImport(Req& r, StepPlan& plan);
  // Requests that hold a sequence slot: running and importing.
  int64_t num_seqs() const { return static_cast<int64_t>(running_.size() + importing_.size()); }

  ModelConfig model_;
  EngineConfig config_;
  std::unique_ptr<LatentCache> cache_;   // the block manager
  std::unique_ptr<ModelRunner> runner_;  // Create's; nullptr for CreateScheduler's
  int64_t next_id_ = 0;
  std::map<int64_t, std::unique_ptr<Req>> requests_;
  std::deque<Req*> waiting_;
  std::vector<Req*> running_;    // in admission order: the back is the newest
  std::vector<Req*> importing_;  // the last plan's imports, until FinishImports
  std::set<int64_t> exported_;   // exported requests' and prefixes' sequences that still pin their blocks
  EngineStats stats_;
};

}  // namespace mlarun
