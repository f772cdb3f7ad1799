// One step as a DP group's scheduler decided it: the one thing that crosses
// from the scheduler (runtime/engine/, the group's leader) to the runners of
// the group's ranks (runtime/runner/model_runner.h).
//
// Per sequence: its new tokens, where they sit, and the whole block table
// that holds its latent rows, so a runner writes and reads its cache pool by
// block id and needs no block manager of its own; and, on the leader only,
// the sampler of a sequence whose next token this step draws. Per request
// moved from another DP group whose rows that group's pools still hold: the
// blocks every rank fetches before the step (Import).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"

namespace mlarun {

class Sampler;

struct StepPlan {
  struct Seq {
    int64_t id = 0;
    int64_t start_pos = 0;  // tokens sit at [start_pos, start_pos + tokens.size())
    std::vector<int32_t> tokens;
    std::vector<int32_t> block_table;  // the pool blocks of positions [0, start_pos + tokens.size()), in order
    // The request's sampler (its parameters and its random stream) when this
    // step samples the sequence's next token; nullptr: no token is drawn.
    // Scheduler-local: not broadcast (only the leader samples).
    Sampler* sampler = nullptr;
    // Prompt tokens this step's rows score (SamplingParams::prompt_logprobs):
    // row i, at position start_pos + i, scores score_tokens[i], the prompt
    // token after it, with score_top most likely tokens; empty: none. The
    // runner then computes every row's logits. Scheduler-local, as sampler.
    std::vector<int32_t> score_tokens;
    int64_t score_top = 0;
  };
  // The group's cache use as the scheduler's block manager has it once the
  // step is scheduled, so that members, which have none, report the same.
  struct CacheUse {
    int64_t blocks_used = 0, blocks_cached = 0, blocks_retired = 0, prefix_hit_tokens = 0, evictions = 0;
    friend bool operator==(const CacheUse&, const CacheUse&) = default;
  };

  // Blocks every rank of the group fetches into its pool before this step:
  // src[i] of the old group's pools into dst[i] of its own (the same count),
  // through a BlockImporter (runtime/runner/model_runner.h). The request is
  // in no Seq of this plan; it joins the next plans once the group's import
  // succeeded (Engine::FinishImports).
  struct Import {
    int64_t id = 0;                        // the request
    std::vector<std::string> descriptors;  // ImportSource::descriptors: the old group's ranks
    std::vector<int32_t> src, dst;
  };

  std::vector<Seq> seqs;
  std::vector<Import> imports;
  CacheUse cache;
  bool has_work = false;  // requests remain after this step

  int64_t num_tokens() const;
  int64_t num_sampled() const;
  // A flat int64 encoding, for broadcasting within the group (samplers stay
  // behind), and its inverse; Decode names what is truncated or out of range.
  std::vector<int64_t> Encode() const;
  static StatusOr<StepPlan> Decode(std::span<const int64_t> data);
};

}  // namespace mlarun
