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
// Not thread-safe: one owner drives Add/Step.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kv/latent_cache.h"
#include "runtime/base/status.h"
#include "runtime/engine/sampler.h"
#include "runtime/model/model.h"

namespace mlarun {

struct EngineConfig {
  int64_t max_num_batched_tokens = 512;  // tokens per step (decodes + prefill chunks)
  int64_t max_num_seqs = 64;             // running requests at once
  int64_t cache_budget_bytes = int64_t{1} << 30;
  int64_t block_size = 64;
  bool enable_prefix_caching = true;
};

enum class FinishReason : uint8_t { kNone = 0, kLength = 1, kStop = 2 };
std::string_view FinishReasonName(FinishReason r);  // "length", "stop"

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
};

struct GenerationOutput {
  std::vector<int64_t> tokens;    // generated ids only
  std::vector<double> logprobs;   // natural log, unmodified distribution
  FinishReason finish_reason = FinishReason::kNone;
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

class Engine {
 public:
  static StatusOr<std::unique_ptr<Engine>> Create(Model& model, const EngineConfig& config);

  // Validates and queues a request; returns its id. A bad request (empty
  // prompt, token id outside the vocabulary, prompt + max_tokens beyond the
  // model's positions or the whole cache, bad sampling values) is
  // INVALID_ARGUMENT and changes nothing.
  StatusOr<int64_t> Add(GenerationRequest request);

  // One step: schedule, run the model, sample. Returns the ids of the requests
  // that finished in this step (their outputs are in Output()).
  StatusOr<std::vector<int64_t>> Step();

  bool HasWork() const { return !running_.empty() || !waiting_.empty(); }
  // Output so far of request `id` (complete once it finished). nullptr if unknown.
  const GenerationOutput* Output(int64_t id) const;
  const EngineStats& stats() const { return stats_; }
  const LatentCache& cache() const { return *cache_; }

  // Runs Add for each request and steps until all finish. Outputs in input
  // order; a rejected request gets its error Status in its slot.
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

  Model& model_;
  EngineConfig config_;
  std::unique_ptr<LatentCache> cache_;
  int64_t next_id_ = 0;
  std::map<int64_t, std::unique_ptr<Req>> requests_;
  std::deque<Req*> waiting_;
  std::vector<Req*> running_;  // in admission order: the back is the newest
  EngineStats stats_;
};

}  // namespace mlarun
