// The serving loop of one process: requests in, tokens out.
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
// A step whose computation fails (Model::last_step_failure()) is a failed
// request, not a failed engine: the requests of that step end with
// FinishReason::kError and the step's Status, their blocks are released, and
// every other request carries on as if the step had not been tried.
//
// Not thread-safe: one owner drives Add/Step.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kv/latent_cache.h"
#include "runtime/base/block_size.h"
#include "runtime/base/status.h"
#include "runtime/engine/sampler.h"
#include "runtime/model/model.h"
#include "runtime/request/request.h"

namespace mlarun {

struct EngineConfig {
  int64_t max_num_batched_tokens = 512;  // tokens per step (decodes + prefill chunks)
  int64_t max_num_seqs = 64;             // running requests at once
  int64_t cache_budget_bytes = int64_t{1} << 30;
  int64_t block_size = kDefaultBlockSize;
  bool enable_prefix_caching = true;
  bool commit_cache_memory = false;  // LatentCacheConfig::commit_memory
};

// kError: a step the request was part of failed (GenerationOutput::error).
enum class FinishReason : uint8_t { kNone = 0, kLength = 1, kStop = 2, kCancelled = 3, kError = 4 };
std::string_view FinishReasonName(FinishReason r);  // "length", "stop", "cancelled", "error"

struct GenerationOutput {
  std::vector<int64_t> tokens;    // generated ids only (those of the steps before a failure, if any)
  std::vector<double> logprobs;   // natural log, unmodified distribution
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
  Model::StepTimes time;  // summed over steps
  double forward_seconds = 0;
};

// One step as the DP group's leader decided it: the latent-cache mutations it
// made since the previous plan (which the group's other members replay on
// their identical caches) and the batch to run.
struct StepPlan {
  struct Seq {
    SeqId id = 0;
    int64_t start_pos = 0;
    std::vector<int32_t> tokens;
    bool logits = false;  // the step samples this sequence's next token
  };
  std::vector<int64_t> cache_ops;  // encoded, see ApplyCacheOps
  std::vector<Seq> seqs;
  bool has_work = false;  // requests remain after this step

  int64_t num_tokens() const;
  std::vector<ForwardSeq> ForwardSeqs() const;
  // A flat int64 encoding, for broadcasting within the group.
  std::vector<int64_t> Encode() const;
  static StatusOr<StepPlan> Decode(std::span<const int64_t> data);
};

// Replays a plan's cache mutations on `cache` (a member's copy of the leader's
// cache): AddSequence, AttachPrefix, Append, Commit, Release, in order.
Status ApplyCacheOps(LatentCache& cache, std::span<const int64_t> ops);

class Engine {
 public:
  static StatusOr<std::unique_ptr<Engine>> Create(Model& model, const EngineConfig& config);
  // The latent cache an engine of `config` would own (the config checked as
  // Create checks it): for an attn-TP member, which mirrors its leader's
  // cache through the plans' cache operations and never schedules.
  static StatusOr<std::unique_ptr<LatentCache>> CreateCache(const Model& model, const EngineConfig& config);

  // Validates and queues a request; returns its id. A bad request (empty
  // prompt, token id outside the vocabulary, prompt + max_tokens beyond the
  // model's positions or the whole cache, bad sampling values) is
  // INVALID_ARGUMENT and changes nothing.
  StatusOr<int64_t> Add(GenerationRequest request);

  // One step: schedule, run the model, sample. Returns the ids of the requests
  // that finished in this step (their outputs are in Output()), including
  // those of a step whose computation failed: they end with kError and the
  // model's Status (FailStep). Errors returned are the engine's own
  // (scheduling, cache bookkeeping) and a Forward error that is not a
  // computation failure; after one, the engine should not be stepped again.
  StatusOr<std::vector<int64_t>> Step();

  // The two halves of Step, for ranks that run the model together: decide the
  // step (plan.seqs may be empty), then sample from the logits of the plan's
  // sequences that asked for them (in order) and retire finished requests.
  StatusOr<StepPlan> Schedule();
  StatusOr<std::vector<int64_t>> Finish(const StepPlan& plan, std::span<const float> logits);
  // Instead of Finish, for a plan whose step failed: ends every request of
  // the plan with kError and `error` (not OK), releases their blocks (as
  // cache operations, so the next plan carries the releases to the group's
  // other members) and leaves every other request as it was. The rows the
  // failed step wrote are never committed, so no later request reuses them.
  // Returns the ids of the requests it ended, in plan order.
  StatusOr<std::vector<int64_t>> FailStep(const StepPlan& plan, const Status& error);
  // Adds the model's last step times to stats().
  void RecordStepTimes(double forward_seconds);
  LatentCache& mutable_cache() { return *cache_; }
  const EngineConfig& config() const { return config_; }

  bool HasWork() const { return !running_.empty() || !waiting_.empty(); }
  // Ends a queued or running request now: its blocks are released and it will
  // produce no more tokens (finish_reason kCancelled). NOT_FOUND if it is
  // unknown or already finished.
  Status Cancel(int64_t id);
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  // Output so far of request `id` (complete once it finished). nullptr if unknown.
  const GenerationOutput* Output(int64_t id) const;
  // Hands over the output of a finished or cancelled request and forgets the
  // request, so a long-running server does not keep every request it served.
  // NOT_FOUND if unknown; FAILED_PRECONDITION while it is still live.
  StatusOr<GenerationOutput> TakeOutput(int64_t id);
  const EngineStats& stats() const { return stats_; }
  const LatentCache& cache() const { return *cache_; }

  // Runs Add for each request and steps until all finish. Outputs in input
  // order; a rejected request, or one whose step failed (kError), gets its
  // error Status in its slot.
  std::vector<StatusOr<GenerationOutput>> Generate(std::vector<GenerationRequest> requests);

 private:
  struct Req {
    int64_t id;
    GenerationRequest request;
    std::vector<int32_t> tokens;  // prompt, then generated tokens
    int64_t computed = 0;         // tokens whose rows are in the cache
    bool in_cache = false;
    std::unique_ptr<Sampler> sampler;
    GenerationOutput out;
  };

  Engine(Model& model, const EngineConfig& config, std::unique_ptr<LatentCache> cache);
  // Reserves cache slots for `n` more tokens of `r`, preempting the newest
  // running requests (never `r` itself unless it is the newest) as needed.
  // Returns false if `r` itself had to be preempted.
  StatusOr<bool> Reserve(Req& r, int64_t n);
  void Preempt(Req& r);
  Status Admit(Req& r);
  // Cache mutations, recorded for the plan.
  Status CacheAdd(SeqId id);
  StatusOr<int64_t> CacheAttach(SeqId id, std::span<const int32_t> tokens, int64_t max_tokens);
  Status CacheAppend(SeqId id, std::span<const int32_t> tokens);
  Status CacheCommit(SeqId id);
  Status CacheRelease(SeqId id, bool retire = false);  // retire: the request is done

  Model& model_;
  EngineConfig config_;
  std::unique_ptr<LatentCache> cache_;
  int64_t next_id_ = 0;
  std::map<int64_t, std::unique_ptr<Req>> requests_;
  std::deque<Req*> waiting_;
  std::vector<Req*> running_;  // in admission order: the back is the newest
  std::vector<int64_t> cache_ops_;  // mutations since the last plan
  EngineStats stats_;
};

}  // namespace mlarun
