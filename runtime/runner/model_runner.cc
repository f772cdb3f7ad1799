#include "runtime/runner/model_runner.h"

#include <algorithm>
#include <chrono>

#include "runtime/ops/sampling.h"

namespace mlarun {

StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(Model& model, const LatentCacheConfig& pool,
                                                           ProcessGroups* groups, std::string rank_name) {
  if (groups != nullptr) {
    if (!(model.shard() == ModelShard::For(groups->layout, groups->rank)))
      return InvalidArgumentError("model runner: the model was not loaded as this rank's shard of ", groups->layout);
    if (!groups->world || !groups->attn_tp || !groups->dp_peers)
      return InvalidArgumentError("model runner: process groups are missing communicators");
  } else if (!(model.shard() == ModelShard{})) {
    return InvalidArgumentError("model runner: a model shard needs the rank's process groups");
  }
  const LatentCacheConfig want = model.CacheConfig(pool.budget_bytes, pool.block_size);
  if (pool.num_layers != want.num_layers || pool.kv_lora_rank != want.kv_lora_rank || pool.rope_dim != want.rope_dim ||
      pool.dtype != want.dtype)
    return InvalidArgumentError("model runner: the cache pool's layers, widths or dtype do not match the model's");
  MLARUN_ASSIGN_OR_RETURN(auto p, LatentPool::Create(pool, model.memory()));
  if (rank_name.empty()) rank_name = "rank " + std::to_string(groups ? groups->rank : 0);
  return std::unique_ptr<ModelRunner>(new ModelRunner(model, std::move(p), groups, std::move(rank_name)));
}

ModelRunner::ModelRunner(Model& model, std::unique_ptr<LatentPool> pool, ProcessGroups* groups, std::string rank_name)
    : model_(model), pool_(std::move(pool)), groups_(groups) {
  step_.rank_name = std::move(rank_name);
  if (groups_) {
    step_.attn_tp = groups_->attn_tp.get();
    step_.dp_peers = groups_->dp_peers.get();
    step_.device_attn_tp = groups_->device_attn_tp.get();
    step_.device_dp_peers = groups_->device_dp_peers.get();
    step_.dp_rank = groups_->dp_rank();
  }
}

Status ModelRunner::Import(const StepPlan& plan, int rank_in_group) {
  if (plan.imports.empty()) return Status::Ok();
  if (importer_ == nullptr)
    return FailedPreconditionError("model runner: the plan imports blocks of ", plan.imports.size(), " requests and ",
                                   step_.rank_name, " has no block importer");
  for (const StepPlan::Import& m : plan.imports) {
    if (m.src.size() != m.dst.size() || m.descriptors.empty())
      return InvalidArgumentError("model runner: the import of request ", m.id, " has ", m.src.size(),
                                  " source blocks, ", m.dst.size(), " destination blocks and ", m.descriptors.size(),
                                  " descriptors");
    for (const int32_t b : m.dst)
      if (b < 0 || b >= pool_->num_blocks())
        return InvalidArgumentError("model runner: the import of request ", m.id, " writes block ", b, " outside [0, ",
                                    pool_->num_blocks(), ")");
    if (Status st = importer_->Import(m, rank_in_group, *pool_); !st.ok())
      return st.WithContext("import of request " + std::to_string(m.id) + " on " + step_.rank_name);
  }
  return Status::Ok();
}

StatusOr<std::span<const SampledToken>> ModelRunner::Execute(const StepPlan& plan, std::span<const int64_t> dp_tokens) {
  seqs_.clear();
  bool any_all = false;
  for (const StepPlan::Seq& s : plan.seqs) {
    const bool all = !s.score_tokens.empty() && !s.tokens.empty();
    any_all |= all;
    seqs_.push_back(ForwardSeq{.id = s.id,
                               .tokens = s.tokens,
                               .start_pos = s.start_pos,
                               .block_table = s.block_table,
                               .logits = all         ? ForwardSeq::Logits::kAll
                                         : s.sampler ? ForwardSeq::Logits::kLast
                                                     : ForwardSeq::Logits::kNone});
  }
  if (groups_) step_.dp_tokens.assign(dp_tokens.begin(), dp_tokens.end());
  const auto t0 = std::chrono::steady_clock::now();
  auto logits = model_.ForwardInto(seqs_, *pool_, groups_ ? &step_ : nullptr);
  last_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!logits.ok()) return logits.status();
  const int64_t vocab = model_.config().vocab_size;
  samplers_.clear();
  for (const StepPlan::Seq& s : plan.seqs)
    if (s.sampler != nullptr && !s.tokens.empty()) samplers_.push_back(s.sampler);
  sampled_.assign(samplers_.size(), SampledToken{});
  scores_.assign(plan.seqs.size(), {});
  if (!any_all) {
    // The logit rows are the sampled sequences', in plan order: one call for
    // all of them (a device sampler reads its rows where they are).
    MLARUN_RETURN_IF_ERROR(SampleRun({.logits = logits->data(),
                                      .rows = static_cast<int64_t>(samplers_.size()),
                                      .vocab = vocab,
                                      .ld = vocab,
                                      .samplers = samplers_.data(),
                                      .out = sampled_.data(),
                                      .backend = model_.backend()}));
    return std::span<const SampledToken>(sampled_);
  }
  // Some sequences have a row per token: walk the rows sequence by sequence.
  size_t scored = 0;
  for (const StepPlan::Seq& s : plan.seqs) scored += s.tokens.empty() ? 0 : s.score_tokens.size();
  scored_.assign(scored, SampledToken{});
  const float* row = logits->data();
  size_t sampled = 0, at = 0;
  for (size_t q = 0; q < plan.seqs.size(); ++q) {
    const StepPlan::Seq& s = plan.seqs[q];
    const ForwardSeq& f = seqs_[q];
    if (f.logits == ForwardSeq::Logits::kNone || s.tokens.empty()) continue;  // no rows (as samplers_ above)
    const int64_t rows = f.logits == ForwardSeq::Logits::kAll ? static_cast<int64_t>(s.tokens.size()) : 1;
    if (f.logits == ForwardSeq::Logits::kAll) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(s.score_tokens.size()), rows);
      MLARUN_RETURN_IF_ERROR(ScoreRun({.logits = row,
                                       .rows = n,
                                       .vocab = vocab,
                                       .ld = vocab,
                                       .tokens = s.score_tokens.data(),
                                       .top = s.score_top,
                                       .out = &scored_[at],
                                       .backend = model_.backend()}));
      scores_[q] = std::span<const SampledToken>(&scored_[at], static_cast<size_t>(n));
      at += static_cast<size_t>(n);
    }
    if (s.sampler != nullptr) {
      MLARUN_RETURN_IF_ERROR(SampleRun({.logits = row + (rows - 1) * vocab,
                                        .rows = 1,
                                        .vocab = vocab,
                                        .ld = vocab,
                                        .samplers = &samplers_[sampled],
                                        .out = &sampled_[sampled],
                                        .backend = model_.backend()}));
      ++sampled;
    }
    row += rows * vocab;
  }
  return std::span<const SampledToken>(sampled_);
}

}  // namespace mlarun
