#include "runtime/engine/rank_runner.h"

#include <algorithm>
#include <chrono>

namespace mlarun {

StatusOr<std::unique_ptr<RankRunner>> RankRunner::Create(Model& model, const EngineConfig& config,
                                                         ProcessGroups& groups, std::string rank_name,
                                                         BlockImporter* importer) {
  MLARUN_ASSIGN_OR_RETURN(const LatentCacheConfig pool, Engine::CacheConfig(model.config(), config));
  if (rank_name.empty()) rank_name = "rank " + std::to_string(groups.rank);
  MLARUN_ASSIGN_OR_RETURN(auto runner, ModelRunner::Create(model, pool, &groups, std::move(rank_name)));
  runner->SetImporter(importer);
  std::unique_ptr<Engine> engine;
  if (groups.is_leader()) {
    EngineConfig leader = config;
    leader.imports = importer != nullptr;
    MLARUN_ASSIGN_OR_RETURN(engine, Engine::CreateScheduler(model.config(), leader));
  }
  std::unique_ptr<RankRunner> r(new RankRunner(groups, std::move(engine), std::move(runner)));
  r->UpdateCacheStats(nullptr, /*written=*/false);
  return r;
}

RankRunner::RankRunner(ProcessGroups& groups, std::unique_ptr<Engine> engine, std::unique_ptr<ModelRunner> runner)
    : groups_(groups), engine_(std::move(engine)), runner_(std::move(runner)) {}

StatusOr<int64_t> RankRunner::Add(GenerationRequest request) {
  if (!is_leader()) return FailedPreconditionError("rank runner: only a DP group's leader takes requests");
  return engine_->Add(std::move(request));
}

const GenerationOutput* RankRunner::Output(int64_t id) const { return engine_ ? engine_->Output(id) : nullptr; }

const RankCacheStats& RankRunner::cache_stats() const {
  if (engine_) cache_stats_.now = engine_->cache().stats();
  return cache_stats_;
}

void RankRunner::UpdateCacheStats(const StepPlan* plan, bool written) {
  LatentCacheStats& now = cache_stats_.now;
  if (engine_) {
    now = engine_->cache().stats();
  } else {
    const LatentCacheConfig& c = runner_->pool().config();
    now.bytes_per_token = c.bytes_per_token();
    now.block_bytes = c.block_bytes();
    now.blocks_total = runner_->pool().num_blocks();
    now.bytes_capacity = runner_->pool().bytes();
    if (plan) {
      now.blocks_used = plan->cache.blocks_used;
      now.blocks_cached = plan->cache.blocks_cached;
      now.blocks_retired = plan->cache.blocks_retired;
      now.prefix_hit_tokens = plan->cache.prefix_hit_tokens;
      now.evictions = plan->cache.evictions;
    }
    now.blocks_free = now.blocks_total - now.blocks_used - now.blocks_cached;
    now.bytes_used = now.blocks_used * now.block_bytes;
  }
  cache_stats_.peak_blocks_used = std::max(cache_stats_.peak_blocks_used, now.blocks_used);
  if (written && plan) cache_stats_.bytes_written += plan->num_tokens() * now.bytes_per_token;
}

Status RankRunner::RunImports(const StepPlan& plan) {
  const Status mine = runner_->Import(plan, groups_.attn_tp_rank());
  int64_t failed = mine.ok() ? 0 : 1;
  Communicator& group = *groups_.attn_tp;
  if (group.size() > 1) MLARUN_RETURN_IF_ERROR(group.AllReduceSum(&failed, 1, CommType::kI64));
  if (failed > 0) {
    ++import_failures_;
    last_import_failure_ = mine.ok()
                               ? Status(StatusCode::kAborted, "import: " + std::to_string(failed) +
                                                                  " other rank(s) of the DP group failed to fetch "
                                                                  "the blocks")
                               : mine;
  }
  if (is_leader()) MLARUN_RETURN_IF_ERROR(engine_->FinishImports(plan, failed == 0));
  return Status::Ok();
}

StatusOr<RankRunner::StepResult> RankRunner::StepOrStop(int stop) {
  last_failure_ = Status::Ok();
  // 1. The plan: made by the leader, run by the whole group.
  StepPlan plan;
  if (is_leader()) {
    MLARUN_ASSIGN_OR_RETURN(plan, engine_->Schedule());
    // Only grammars compiling here: a short wait, so the group's empty steps
    // do not spin while they compile.
    if (plan.seqs.empty()) engine_->WaitForGrammar(std::chrono::milliseconds(2));
  }
  Communicator& group = *groups_.attn_tp;
  if (group.size() > 1) {
    std::vector<int64_t> encoded;
    if (is_leader()) encoded = plan.Encode();
    int64_t n = static_cast<int64_t>(encoded.size());
    MLARUN_RETURN_IF_ERROR(group.Broadcast(&n, 1, CommType::kI64, 0));
    encoded.resize(static_cast<size_t>(n));
    MLARUN_RETURN_IF_ERROR(group.Broadcast(encoded.data(), n, CommType::kI64, 0));
    if (!is_leader()) {
      MLARUN_ASSIGN_OR_RETURN(plan, StepPlan::Decode(encoded));
    }
  }
  if (!plan.imports.empty()) MLARUN_RETURN_IF_ERROR(RunImports(plan));
  // 2. Lockstep: every rank's report, with this step's blocks already taken.
  UpdateCacheStats(&plan, /*written=*/false);
  Communicator& world = *groups_.world;
  const LatentCacheStats& cs = cache_stats_.now;
  const BlockImporter::Counters imports =
      runner_->importer() != nullptr ? runner_->importer()->counters() : BlockImporter::Counters{};
  const LockstepReport mine{.tokens = plan.num_tokens(),
                            .has_work = plan.has_work || !plan.seqs.empty() ? 1 : 0,
                            .stop = stop,
                            .blocks_used = cs.blocks_used,
                            .peak_blocks_used = cache_stats_.peak_blocks_used,
                            .blocks_retired = cs.blocks_retired,
                            .import_fetches = imports.fetches,
                            .import_bytes = imports.bytes,
                            .import_failures = imports.failures};
  std::vector<LockstepReport> all(static_cast<size_t>(world.size()));
  MLARUN_RETURN_IF_ERROR(world.AllGather(&mine, LockstepReport::kWords, all.data(), CommType::kI64));
  bool any_work = false;
  int64_t stop_code = 0;
  world_cache_.resize(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    any_work |= all[r].has_work != 0;
    stop_code = std::max(stop_code, all[r].stop);
    world_cache_[r] = {
        .blocks_used = all[r].blocks_used,
        .peak_blocks_used = all[r].peak_blocks_used,
        .blocks_retired = all[r].blocks_retired,
        .imports = {
            .fetches = all[r].import_fetches, .bytes = all[r].import_bytes, .failures = all[r].import_failures}};
  }
  if (stop_code > 0) {
    stop_code_ = static_cast<int>(stop_code);
    return StepResult::kStop;
  }
  if (!any_work) return StepResult::kIdle;
  const ParallelLayout& layout = groups_.layout;
  dp_tokens_.assign(static_cast<size_t>(layout.dp), 0);
  for (int g = 0; g < layout.dp; ++g)
    dp_tokens_[static_cast<size_t>(g)] = all[static_cast<size_t>(layout.leader_of(g))].tokens;
  // 3. The step, on every rank, idle or not; the leader's runner samples.
  auto sampled = runner_->Execute(plan, dp_tokens_);
  if (engine_) engine_->RecordStepTimes(runner_->last_step_seconds(), runner_->model().last_step_times());
  if (!sampled.ok()) {
    // A collective's own error: the ranks cannot meet again.
    if (runner_->last_step_failure().ok()) return sampled.status();
    // A computation failure, the same on every rank: the step's requests
    // fail, the ranks stay in lockstep.
    last_failure_ = sampled.status();
    if (is_leader()) {
      MLARUN_RETURN_IF_ERROR(engine_->FailStep(plan, last_failure_).status());
    }
    UpdateCacheStats(is_leader() ? nullptr : &plan, /*written=*/false);
    return StepResult::kWorked;
  }
  // 4. The leader's scheduler takes the tokens and retires finished requests.
  if (is_leader()) {
    MLARUN_RETURN_IF_ERROR(engine_->Finish(plan, *sampled, runner_->last_scores()).status());
  }
  UpdateCacheStats(&plan, /*written=*/true);
  return StepResult::kWorked;
}

}  // namespace mlarun
