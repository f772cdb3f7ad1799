// One rank's executor: everything a step runs on, and nothing that decides
// what a step is. It owns the latent cache pool and the step's buffers, holds
// the rank's model shard and process groups, and runs the plans a scheduler
// made (StepPlan): the forward pass over the plan's sequences, reading and
// writing the pool through their block tables, then the sampling of the
// sequences the plan asks to sample.
//
// A scheduler (runtime/engine/engine.h) on a DP group's leader makes the
// plans; every rank of the group runs each one with its own runner. A member
// has a runner and no scheduler. A GPU runner is the same contract with the
// pool, the buffers and the ops on the device.
//
// Not thread-safe; one step at a time.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kv/latent_pool.h"
#include "parallel/layout.h"
#include "runtime/model/model.h"
#include "runtime/ops/sampler.h"
#include "runtime/runner/step_plan.h"

namespace mlarun {

// Fills blocks of this rank's pool from another group's pools (the worker's
// UCX transfer plane; tests copy between pools). Called on every rank of a
// group for each StepPlan::Import before the step runs.
class BlockImporter {
 public:
  virtual ~BlockImporter() = default;
  // `rank_in_group`: this rank's attn_tp rank (pick descriptors[rank_in_group % size] to spread the load).
  // Copies the rows of block import.src[i] of the old group's pool, every
  // layer, into block import.dst[i] of `pool` (ids ModelRunner::Import has
  // checked against `pool`). A failure is the import's, not the step's: the
  // scheduler then computes the request's rows instead.
  virtual Status Import(const StepPlan::Import& import, int rank_in_group, LatentPool& pool) = 0;

  // What it moved so far, for the ranks' stats: imports that landed, their
  // bytes, imports that failed.
  struct Counters {
    int64_t fetches = 0, bytes = 0, failures = 0;
  };
  virtual Counters counters() const { return {}; }
};

class ModelRunner {
 public:
  // `model`: this rank's shard (ModelShard::For(groups->layout,
  // groups->rank)), which outlives the runner. `groups`: the rank's process
  // groups, which outlive it too; nullptr for one process holding the whole
  // model. `pool`: the cache pool, configured as the group's scheduler's
  // block manager (the same on every rank of the group). `rank_name`: how
  // errors name this rank, e.g. "rank 3 (node1)"; empty: "rank <rank>".
  static StatusOr<std::unique_ptr<ModelRunner>> Create(Model& model, const LatentCacheConfig& pool,
                                                       ProcessGroups* groups = nullptr, std::string rank_name = {});

  // Runs `plan` on this rank. With groups, this is the rank's part of a step
  // of all ranks (Model::ForwardInto's contract: every rank joins every
  // collective, a computation failure anywhere is every rank's Status, a
  // collective's failure only its own); `dp_tokens` is each DP group's token
  // count for the step, by dp_rank, as the ranks' lock-step exchange gave it.
  // Returns one token per plan sequence with a sampler, in plan order
  // (valid until the next Execute). After the first steps of a shape it
  // allocates nothing.
  StatusOr<std::span<const SampledToken>> Execute(const StepPlan& plan, std::span<const int64_t> dp_tokens = {});
  // The last Execute's scored prompt tokens: per plan sequence, one entry per
  // score_tokens entry (empty for a sequence without). Valid as Execute's.
  std::span<const std::span<const SampledToken>> last_scores() const { return scores_; }

  // The importer Import hands the plan's imports to (not owned; it outlives
  // the runner or is unset first). nullptr: none.
  void SetImporter(BlockImporter* importer) { importer_ = importer; }
  const BlockImporter* importer() const { return importer_; }
  // Fills this rank's pool with every import of `plan` (StepPlan::imports),
  // in order, through the importer, before the plan is executed; stops at
  // the first failure and returns it, naming the request. OK when the plan
  // has none; FAILED_PRECONDITION when it has some and no importer is set;
  // INVALID_ARGUMENT for an import whose blocks do not pair up or whose
  // destination is outside the pool (the importer is not called). No
  // collective: every rank of the group calls it, and the group agrees on
  // the outcome (RankRunner).
  Status Import(const StepPlan& plan, int rank_in_group);

  // OK, or the computation failure of the last Execute (see Execute).
  const Status& last_step_failure() const { return model_.last_step_failure(); }
  // Wall time of the last Execute's forward pass.
  double last_step_seconds() const { return last_seconds_; }
  Model& model() { return model_; }
  const LatentPool& pool() const { return *pool_; }
  const std::string& rank_name() const { return step_.rank_name; }

 private:
  ModelRunner(Model& model, std::unique_ptr<LatentPool> pool, ProcessGroups* groups, std::string rank_name);

  Model& model_;
  std::unique_ptr<LatentPool> pool_;
  ProcessGroups* const groups_;
  BlockImporter* importer_ = nullptr;
  ParallelStep step_;  // reused: the groups' communicators, this step's dp_tokens
  std::vector<ForwardSeq> seqs_;
  std::vector<SampledToken> sampled_;
  std::vector<Sampler*> samplers_;                     // the sampled rows' samplers, in plan order
  std::vector<SampledToken> scored_;                   // every sequence's scored rows, in plan order
  std::vector<std::span<const SampledToken>> scores_;  // per plan sequence, into scored_
  double last_seconds_ = 0;
};

}  // namespace mlarun
