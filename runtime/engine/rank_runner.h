// One rank's part of serving under mpirun, in lockstep with every other rank.
//
// Each step:
//  1. the DP group's leader (attn_tp_rank 0) schedules with its Engine (the
//     group's only scheduler) and broadcasts the step plan to its group: the
//     sequences' tokens, positions and block tables. Members run plans and
//     never schedule. When the plan imports blocks (StepPlan::imports:
//     requests moved from another group), every rank of the group fetches
//     them into its pool with its BlockImporter, the group agrees whether
//     all succeeded (a sum over the group), and the leader ends the imports
//     (Engine::FinishImports): imported requests run from the next step, a
//     failed import's requests are computed instead;
//  2. all ranks exchange [this group's tokens, work left] (one small
//     all-gather over the world): every rank learns every DP group's token
//     count, and when no rank has work they all stop together;
//  3. every rank's ModelRunner executes the plan: attention for its group's
//     tokens on its heads, the MLP / MoE on its shard for every group's
//     tokens. A group with nothing to do runs an empty batch, so no
//     collective misses a rank;
//  4. the leader's runner samples, and its Engine retires finished requests;
//     the next plan carries the sampled tokens to the members.
//
// A step whose computation failed on any rank (Model::Forward's contract:
// every rank learns of it and gets the same Status, naming the rank) fails
// only its requests: the leader ends them (Engine::FailStep, finish reason
// kError with that Status) and the ranks go on to the next step together. A
// collective that
// fails is returned as an error: the ranks cannot be relied upon to meet
// again, so the caller ends the job.
//
// Not thread-safe; every rank must call Step() the same number of times.
#pragma once

#include <memory>
#include <type_traits>
#include <vector>

#include "parallel/layout.h"
#include "runtime/engine/engine.h"

namespace mlarun {

struct RankCacheStats {
  LatentCacheStats now;
  int64_t peak_blocks_used = 0;  // highest now.blocks_used at an exchange or after a step
  int64_t bytes_written = 0;     // rows appended x bytes per token by steps that ran to their end, cumulative
  int64_t peak_bytes_used() const { return peak_blocks_used * now.block_bytes; }
};

// One rank's own cache, as every rank learns it at each lockstep exchange
// (the numbers ride on the step's all-gather, so they cost no extra message).
struct RankCacheSnapshot {
  int64_t blocks_used = 0;
  int64_t peak_blocks_used = 0;     // RankCacheStats::peak_blocks_used
  int64_t blocks_retired = 0;       // LatentCacheStats::blocks_retired
  BlockImporter::Counters imports;  // its importer's (zero without one)
};

// One rank's part of the lock-step exchange before every step: a world
// all-gather of these, in int64 words, tells every rank whether anyone has
// work or asks to stop, each DP group's token count (from its leader) for the
// hidden-state all-gather, and each rank's cache use for GetStats.
struct LockstepReport {
  static constexpr int64_t kWords = 9;
  int64_t tokens = 0;            // tokens this rank's group runs in the step
  int64_t has_work = 0;          // 1 when requests are left
  int64_t stop = 0;              // nonzero when this rank asks the job to stop: why
  int64_t blocks_used = 0;       // LatentCacheStats::blocks_used, this step's blocks taken
  int64_t peak_blocks_used = 0;  // the most blocks_used so far
  int64_t blocks_retired = 0;    // LatentCacheStats::blocks_retired
  int64_t import_fetches = 0;    // BlockImporter::Counters
  int64_t import_bytes = 0;
  int64_t import_failures = 0;
};
static_assert(sizeof(LockstepReport) == LockstepReport::kWords * sizeof(int64_t) &&
                  std::is_trivially_copyable_v<LockstepReport>,
              "LockstepReport travels as kWords int64 words");

class RankRunner {
 public:
  // `model` is this rank's shard (ModelShard::For(groups.layout, groups.rank)).
  // `rank_name` is how errors name this rank (ParallelStep::rank_name), e.g.
  // "rank 3 (node1)"; empty: "rank <groups.rank>". Leaders get the group's
  // scheduler and a runner; members a runner only, its pool configured as
  // the scheduler's (the same config on every rank). `importer` (not owned,
  // outliving the runner): how this rank fetches blocks from other groups'
  // pools; every rank of a group passes one, or none does. It decides
  // imports: the leader's scheduler gets EngineConfig::imports = (importer
  // != nullptr), whatever `config` says.
  static StatusOr<std::unique_ptr<RankRunner>> Create(Model& model, const EngineConfig& config, ProcessGroups& groups,
                                                      std::string rank_name = {}, BlockImporter* importer = nullptr);

  bool is_leader() const { return groups_.is_leader(); }
  // Leaders only: queue a request for this DP group.
  StatusOr<int64_t> Add(GenerationRequest request);
  const GenerationOutput* Output(int64_t id) const;

  // One lockstep step on every rank. Returns false, on every rank at once,
  // when no rank had work (nothing ran).
  StatusOr<bool> Step() {
    MLARUN_ASSIGN_OR_RETURN(const StepResult r, StepOrStop(0));
    return r == StepResult::kWorked;
  }

  // The same, with a vote to stop: `stop` is 0, or a positive code saying why
  // this rank asks (the worker passes the signal it got). When any rank
  // votes, every rank returns kStop at the same step, before running it, so
  // none is left waiting in a collective, and stop_code() on every rank is
  // the largest code voted: a rank that got no signal itself can still say
  // why the job is stopping.
  //
  // A step whose computation failed returns kWorked on every rank, with
  // last_step_failure() set and the step's requests ended (kError). An error
  // returned (a collective's, or the engine's own bookkeeping) is fatal: the
  // ranks are no longer in lockstep.
  enum class StepResult : uint8_t { kWorked, kIdle, kStop };
  StatusOr<StepResult> StepOrStop(int stop);
  int stop_code() const { return stop_code_; }
  // OK, or the computation failure of the last StepOrStop (the same Status
  // on every rank, naming the rank that failed).
  const Status& last_step_failure() const { return last_failure_; }
  const std::string& rank_name() const { return runner_->rank_name(); }
  // Steps whose imports failed on some rank of the group (counted on every
  // rank of it; the requests were computed instead), and the last such
  // failure: this rank's importer's Status, or ABORTED when only another
  // rank's failed. OK until one fails. Not fatal: for the worker to report.
  int64_t import_failures() const { return import_failures_; }
  const Status& last_import_failure() const { return last_import_failure_; }

  // This rank's cache: its pool's size and the blocks in use, from the
  // group's scheduler: on the leader as they are now, on a member as of the
  // last plan.
  const RankCacheStats& cache_stats() const;
  // Every rank's snapshot, by world rank, as of the last exchange.
  const std::vector<RankCacheSnapshot>& world_cache() const { return world_cache_; }
  // Leaders: the group's scheduler (requests, blocks, sampling parameters);
  // members: nullptr.
  Engine* engine() { return engine_.get(); }
  ModelRunner& runner() { return *runner_; }

 private:
  RankRunner(ProcessGroups& groups, std::unique_ptr<Engine> engine, std::unique_ptr<ModelRunner> runner);
  // The cache's numbers and peak as of `plan` (a member's) or the scheduler's
  // block manager (the leader's); `written`: the plan's step ran to its end,
  // so its rows count in bytes_written.
  void UpdateCacheStats(const StepPlan* plan, bool written);
  // Step 1's imports on this rank, the group's agreement, FinishImports on
  // the leader. An error returned is a collective's or the engine's (fatal).
  Status RunImports(const StepPlan& plan);

  ProcessGroups& groups_;
  std::unique_ptr<Engine> engine_;  // leaders
  std::unique_ptr<ModelRunner> runner_;
  Status last_failure_;
  int64_t import_failures_ = 0;
  Status last_import_failure_;
  int stop_code_ = 0;
  std::vector<int64_t> dp_tokens_;
  mutable RankCacheStats cache_stats_;  // the leader's `now` is refreshed when read
  std::vector<RankCacheSnapshot> world_cache_;
};

}  // namespace mlarun
