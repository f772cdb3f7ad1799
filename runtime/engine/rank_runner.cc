#include "runtime/engine/rank_runner.h"

#include <chrono>

namespace mlarun {

StatusOr<std::unique_ptr<RankRunner>> RankRunner::Create(Model& model, const EngineConfig& config,
                                                         ProcessGroups& groups, std::string rank_name) {
  if (!(model.shard() == ModelShard::For(groups.layout, groups.rank)))
    return InvalidArgumentError("rank runner: the model was not loaded as this rank's shard of ", groups.layout);
  if (!groups.world || !groups.attn_tp || !groups.dp_peers)
    return InvalidArgumentError("rank runner: process groups are missing communicators");
  std::unique_ptr<Engine> engine;
  std::unique_ptr<LatentCache> member_cache;
  if (groups.is_leader()) {
    MLARUN_ASSIGN_OR_RETURN(engine, Engine::Create(model, config));
  } else {
    MLARUN_ASSIGN_OR_RETURN(member_cache, Engine::CreateCache(model, config));
  }
  if (rank_name.empty()) rank_name = "rank " + std::to_string(groups.rank);
  return std::unique_ptr<RankRunner>(
      new RankRunner(model, groups, std::move(engine), std::move(member_cache), std::move(rank_name)));
}

StatusOr<int64_t> RankRunner::Add(GenerationRequest request) {
  if (!is_leader()) return FailedPreconditionError("rank runner: only a DP group's leader takes requests");
  return engine_->Add(std::move(request));
}

const GenerationOutput* RankRunner::Output(int64_t id) const { return engine_ ? engine_->Output(id) : nullptr; }

void RankRunner::UpdateCacheStats(const StepPlan& plan, bool written) {
  cache_stats_.now = cache().stats();
  cache_stats_.peak_blocks_used = std::max(cache_stats_.peak_blocks_used, cache_stats_.now.blocks_used);
  if (written) cache_stats_.bytes_written += plan.num_tokens() * cache_stats_.now.bytes_per_token;
}

StatusOr<RankRunner::StepResult> RankRunner::StepOrStop(bool stop) {
  last_failure_ = Status::Ok();
  // 1. The plan: made by the leader, replayed by the group.
  StepPlan plan;
  if (is_leader()) {
    MLARUN_ASSIGN_OR_RETURN(plan, engine_->Schedule());
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
      MLARUN_RETURN_IF_ERROR(ApplyCacheOps(mutable_cache(), plan.cache_ops));
      for (StepPlan::Seq& s : plan.seqs) s.logits = false;  // only the leader samples
    }
  }
  // 2. Lockstep: every rank's report, with this step's blocks already taken.
  Communicator& world = *groups_.world;
  const LatentCacheStats cs = cache().stats();
  int64_t& peak = cache_stats_.peak_blocks_used;
  peak = std::max(peak, cs.blocks_used);
  const LockstepReport mine{.tokens = plan.num_tokens(),
                            .has_work = plan.has_work || !plan.seqs.empty() ? 1 : 0,
                            .stop = stop ? 1 : 0,
                            .blocks_used = cs.blocks_used,
                            .peak_blocks_used = peak,
                            .blocks_retired = cs.blocks_retired};
  std::vector<LockstepReport> all(static_cast<size_t>(world.size()));
  MLARUN_RETURN_IF_ERROR(world.AllGather(&mine, LockstepReport::kWords, all.data(), CommType::kI64));
  bool any_work = false, any_stop = false;
  world_cache_.resize(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    any_work |= all[r].has_work != 0;
    any_stop |= all[r].stop != 0;
    world_cache_[r] = {.blocks_used = all[r].blocks_used, .peak_blocks_used = all[r].peak_blocks_used,
                       .blocks_retired = all[r].blocks_retired};
  }
  if (any_stop) return StepResult::kStop;
  if (!any_work) return StepResult::kIdle;
  const ParallelLayout& layout = groups_.layout;
  dp_tokens_.assign(static_cast<size_t>(layout.dp), 0);
  for (int g = 0; g < layout.dp; ++g)
    dp_tokens_[static_cast<size_t>(g)] = all[static_cast<size_t>(layout.leader_of(g))].tokens;
  // 3. The model step, on every rank, idle or not.
  const ParallelStep step{.attn_tp = groups_.attn_tp.get(), .dp_peers = groups_.dp_peers.get(),
                          .dp_tokens = dp_tokens_, .dp_rank = groups_.dp_rank(), .rank_name = rank_name_};
  const std::vector<ForwardSeq> seqs = plan.ForwardSeqs();
  const auto t0 = std::chrono::steady_clock::now();
  auto logits = model_.ForwardInto(seqs, mutable_cache(), &step);
  if (engine_) engine_->RecordStepTimes(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (!logits.ok()) {
    // A collective's own error: the ranks cannot meet again.
    if (model_.last_step_failure().ok()) return logits.status();
    // A computation failure, the same on every rank: the step's requests
    // fail, the ranks stay in lockstep. Members never sample; the leader's
    // releases reach them with the next plan.
    last_failure_ = logits.status();
    if (is_leader()) {
      MLARUN_RETURN_IF_ERROR(engine_->FailStep(plan, last_failure_).status());
    }
    UpdateCacheStats(plan, /*written=*/false);
    return StepResult::kWorked;
  }
  // 4. Sampling, on the leader. Members mirror the cache commits through the
  //    next plan's cache operations.
  if (is_leader()) {
    MLARUN_RETURN_IF_ERROR(engine_->Finish(plan, *logits).status());
  }
  UpdateCacheStats(plan, /*written=*/true);
  return StepResult::kWorked;
}

}  // namespace mlarun
