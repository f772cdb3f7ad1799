#include "runtime/engine/engine.h"

#include <algorithm>
#include <chrono>
#include <iterator>

namespace mlarun {

std::string_view FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
  }
  return "none";
}

StatusOr<LatentCacheConfig> Engine::CacheConfig(const ModelConfig& model, const EngineConfig& config) {
  if (config.max_num_batched_tokens < 1)
    return InvalidArgumentError("engine: max_num_batched_tokens must be >= 1, got ", config.max_num_batched_tokens);
  if (config.max_num_seqs < 1)
    return InvalidArgumentError("engine: max_num_seqs must be >= 1, got ", config.max_num_seqs);
  if (config.max_scored_rows_per_step < 1)
    return InvalidArgumentError("engine: max_scored_rows_per_step must be >= 1, got ", config.max_scored_rows_per_step);
  LatentCacheConfig cc = CacheConfigFor(model, config.cache_budget_bytes, config.block_size);
  cc.enable_prefix_caching = config.enable_prefix_caching;
  cc.commit_memory = config.commit_cache_memory;
  MLARUN_RETURN_IF_ERROR(ValidateLatentCacheConfig(cc));
  return cc;
}

StatusOr<std::unique_ptr<Engine>> Engine::CreateScheduler(const ModelConfig& model, const EngineConfig& config) {
  MLARUN_ASSIGN_OR_RETURN(const LatentCacheConfig cc, CacheConfig(model, config));
  MLARUN_ASSIGN_OR_RETURN(auto cache, LatentCache::Create(cc));
  return std::unique_ptr<Engine>(new Engine(model, config, std::move(cache)));
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(Model& model, const EngineConfig& config) {
  MLARUN_ASSIGN_OR_RETURN(auto engine, CreateScheduler(model.config(), config));
  MLARUN_ASSIGN_OR_RETURN(engine->runner_, ModelRunner::Create(model, engine->cache_->config()));
  return engine;
}

Engine::Engine(const ModelConfig& model, const EngineConfig& config, std::unique_ptr<LatentCache> cache)
    : model_(model), config_(config), cache_(std::move(cache)) {}

StatusOr<int64_t> Engine::Add(GenerationRequest request) {
  const ModelConfig& c = model_;
  MLARUN_RETURN_IF_ERROR(ValidateGenerationRequest(request, {.vocab_size = c.vocab_size,
                                                             .max_position_embeddings = c.max_position_embeddings,
                                                             .block_size = config_.block_size,
                                                             .cache_blocks_total = cache_->stats().blocks_total}));
  const StructuredOutput& so = request.sampling.structured;
  if (so.active()) {
    if (config_.grammar == nullptr)
      return InvalidArgumentError(
          "structured output is off on this server: the model names no tokenizer, or the build has no xgrammar (the "
          "worker's start-up log says which)");
    MLARUN_RETURN_IF_ERROR(config_.grammar->Check(so));
  }
  // Without importers the rows are computed; so are those of a prompt
  // whose logprobs are wanted (each row scores a prompt token).
  if (!config_.imports || (request.generated.empty() && request.sampling.prompt_logprobs >= 0)) request.import.reset();
  auto r = std::make_unique<Req>();
  r->id = next_id_++;
  r->tokens = request.prompt;
  r->tokens.insert(r->tokens.end(), request.generated.begin(), request.generated.end());
  // The sampler keeps the request's history for its penalties: the prompt,
  // the tokens generated elsewhere (a resumed request's, whose draws its
  // random stream skips), then each token it draws. It lives as long as the
  // request, preemptions included, so it never counts a token twice (nor
  // feeds its grammar twice).
  r->sampler = std::make_unique<Sampler>(request.sampling, SamplerHistory{.prompt = request.prompt,
                                                                          .eos_token_ids = c.eos_token_ids,
                                                                          .output = request.generated,
                                                                          .draws = std::ssize(request.generated)});
  // Tens of milliseconds for a new JSON schema on a large vocabulary: not
  // on the step loop.
  if (so.active()) {
    r->grammar_abandoned = std::make_shared<std::atomic<bool>>(false);
    r->grammar = config_.grammar->CompileAsync(so, r->grammar_abandoned);
  }
  r->request = std::move(request);
  waiting_.push_back(r.get());
  const int64_t id = r->id;
  requests_[id] = std::move(r);
  return id;
}

const GenerationOutput* Engine::Output(int64_t id) const {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : &it->second->out;
}

StatusOr<GenerationOutput> Engine::TakeOutput(int64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return NotFoundError("engine: unknown request ", id);
  if (it->second->out.finish_reason == FinishReason::kNone)
    return FailedPreconditionError("engine: request ", id, " is still running");
  GenerationOutput out = std::move(it->second->out);
  requests_.erase(it);
  return out;
}

Status Engine::Cancel(int64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->out.finish_reason != FinishReason::kNone)
    return NotFoundError("engine: no live request ", id);
  Req& r = *it->second;
  if (r.in_cache) MLARUN_RETURN_IF_ERROR(cache_->Release(r.id));
  Leave(r);
  return Status::Ok();
}

void Engine::Leave(Req& r) {
  r.in_cache = false;
  if (auto w = std::find(waiting_.begin(), waiting_.end(), &r); w != waiting_.end()) waiting_.erase(w);
  if (auto q = std::find(running_.begin(), running_.end(), &r); q != running_.end()) running_.erase(q);
  if (auto m = std::find(importing_.begin(), importing_.end(), &r); m != importing_.end()) importing_.erase(m);
  r.out.finish_reason = FinishReason::kCancelled;
  if (r.grammar_abandoned) r.grammar_abandoned->store(true);
}

StatusOr<ExportedRequest> Engine::Export(int64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->out.finish_reason != FinishReason::kNone)
    return NotFoundError("engine: no live request ", id);
  Req& r = *it->second;
  ExportedRequest out;
  const auto m = std::find(importing_.begin(), importing_.end(), &r);
  const bool importing = m != importing_.end();
  if (importing) importing_.erase(m);
  if (r.in_cache && !importing && r.computed > 0) {
    // Between steps every appended row is computed and committed: the table
    // is the computed rows' blocks.
    const std::span<const int32_t> table = cache_->BlockTable(r.id);
    const int64_t n = (r.computed + config_.block_size - 1) / config_.block_size;
    if (n > std::ssize(table))
      return InternalError("engine: request ", id, " has ", r.computed, " rows in ", table.size(), " blocks");
    out.blocks.assign(table.begin(), table.begin() + n);
    out.rows = r.computed;
    exported_.insert(r.id);
  } else if (r.in_cache) {
    MLARUN_RETURN_IF_ERROR(cache_->Release(r.id));
  }
  Leave(r);
  ++stats_.exported;
  return out;
}

StatusOr<Engine::ExportedPrefix> Engine::ExportPrefix(std::span<const int32_t> tokens, uint64_t salt) {
  ExportedPrefix out;
  if (!config_.enable_prefix_caching) return out;
  // A sequence of its own (an id no request gets) holds the blocks, so
  // eviction passes them over until ReleaseExport.
  const int64_t handle = next_id_++;
  MLARUN_RETURN_IF_ERROR(cache_->AddSequence(handle, salt));
  MLARUN_ASSIGN_OR_RETURN(const int64_t rows, cache_->AttachPrefix(handle, tokens, std::ssize(tokens)));
  if (rows == 0) {
    MLARUN_RETURN_IF_ERROR(cache_->Release(handle));
    return out;
  }
  const std::span<const int32_t> table = cache_->BlockTable(handle);  // whole blocks: AttachPrefix's
  out.handle = handle;
  out.held = ExportedRequest{.blocks = {table.begin(), table.end()}, .rows = rows};
  exported_.insert(handle);
  ++stats_.exported_prefixes;
  return out;
}

Status Engine::ReleaseExport(int64_t id) {
  if (exported_.erase(id) == 0) return NotFoundError("engine: request ", id, " has no exported blocks");
  return cache_->Release(id);
}

void Engine::Preempt(Req& r) {
  (void)cache_->Release(r.id);
  r.in_cache = false;
  r.computed = 0;
  running_.erase(std::find(running_.begin(), running_.end(), &r));
  waiting_.push_front(&r);  // first in line to come back
  ++r.out.preemptions;
  ++stats_.preemptions;
}

StatusOr<bool> Engine::Reserve(Req& r, int64_t n) {
  for (;;) {
    MLARUN_ASSIGN_OR_RETURN(const int64_t need, cache_->BlocksNeeded(r.id, n));
    if (need <= cache_->stats().blocks_allocatable()) {
      MLARUN_RETURN_IF_ERROR(Append(r, n));
      return true;
    }
    Req* victim = running_.back();
    Preempt(*victim);
    if (victim == &r) return false;
  }
}

Status Engine::Append(Req& r, int64_t n) {
  return cache_->Append(
      r.id, std::span<const int32_t>(r.tokens).subspan(static_cast<size_t>(r.computed), static_cast<size_t>(n)));
}

Status Engine::Admit(Req& r) {
  MLARUN_RETURN_IF_ERROR(cache_->AddSequence(r.id, r.request.prefix_cache_salt));
  r.in_cache = true;
  // Reuse cached full blocks of the prompt, keeping at least one token to
  // compute so the step produces logits; none while the prompt's logprobs
  // are wanted and not all recorded (their rows must be computed).
  const int64_t reusable = ScoresPending(r) ? 0 : static_cast<int64_t>(r.tokens.size()) - 1;
  MLARUN_ASSIGN_OR_RETURN(r.computed, cache_->AttachPrefix(r.id, r.tokens, reusable));
  r.out.prefix_hit_tokens += PromptTokens(r, r.computed);
  return Status::Ok();
}

Status Engine::Unadmit(Req& r) {
  MLARUN_RETURN_IF_ERROR(cache_->Release(r.id));
  r.in_cache = false;
  r.out.prefix_hit_tokens -= PromptTokens(r, r.computed);
  r.computed = 0;
  return Status::Ok();
}

StatusOr<Engine::ImportStart> Engine::StartImport(Req& r, StepPlan& plan) {
  const ImportSource& source = *r.request.import;
  if (r.computed >= source.rows) {  // the local prefix cache has them all
    r.request.import.reset();
    return ImportStart::kLocal;
  }
  // The cached prefix is whole blocks: the import starts at a block's start.
  const int64_t n = source.rows - r.computed, first = r.computed / config_.block_size;
  MLARUN_ASSIGN_OR_RETURN(const int64_t need, cache_->BlocksNeeded(r.id, n));
  if (need > cache_->stats().blocks_allocatable()) {
    MLARUN_RETURN_IF_ERROR(Unadmit(r));
    return ImportStart::kNoRoom;
  }
  MLARUN_RETURN_IF_ERROR(Append(r, n));
  MLARUN_RETURN_IF_ERROR(cache_->CheckWritable(r.id, r.computed, n));
  const std::span<const int32_t> table = cache_->BlockTable(r.id);
  if (r.computed % config_.block_size != 0 || table.size() != source.blocks.size())
    return InternalError("engine: request ", r.id, " imports ", source.blocks.size(), " blocks into ", table.size(),
                         " from row ", r.computed);
  plan.imports.push_back(
      StepPlan::Import{.id = r.id,
                       .descriptors = source.descriptors,
                       .src = std::vector<int32_t>(source.blocks.begin() + first, source.blocks.end()),
                       .dst = std::vector<int32_t>(table.begin() + first, table.end())});
  importing_.push_back(&r);
  return ImportStart::kStarted;
}

Status Engine::FinishImports(const StepPlan& plan, bool ok) {
  size_t requeued = 0;  // failed ones go to the front of the queue, in plan order
  for (const StepPlan::Import& m : plan.imports) {
    const auto it = std::find_if(importing_.begin(), importing_.end(), [&](const Req* r) { return r->id == m.id; });
    if (it == importing_.end()) continue;  // exported or cancelled since
    Req& r = **it;
    importing_.erase(it);
    const int64_t rows = r.request.import->rows;
    r.request.import.reset();  // once: a later preemption computes the rows
    if (ok) {
      MLARUN_RETURN_IF_ERROR(cache_->Commit(r.id));
      stats_.imported_tokens += rows - r.computed;
      r.computed = rows;
      running_.push_back(&r);
      continue;
    }
    MLARUN_RETURN_IF_ERROR(Unadmit(r));
    waiting_.insert(waiting_.begin() + static_cast<std::ptrdiff_t>(requeued++), &r);
    ++stats_.import_failures;
  }
  return Status::Ok();
}

void Engine::CollectGrammars() {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Req& r = **it;
    if (!r.grammar.valid() || r.grammar.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      ++it;
      continue;
    }
    StatusOr<std::unique_ptr<TokenConstraint>> constraint = r.grammar.get();
    if (constraint.ok()) {
      r.sampler->SetConstraint(std::move(*constraint), r.request.generated);
      ++it;
      continue;
    }
    r.out.finish_reason = FinishReason::kError;
    r.out.error = constraint.status();
    it = waiting_.erase(it);
  }
}

bool Engine::GrammarsPending() const {
  return std::any_of(waiting_.begin(), waiting_.end(), [](const Req* r) { return r->grammar.valid(); });
}

void Engine::WaitForGrammar(std::chrono::milliseconds most) const {
  for (const Req* r : waiting_)
    if (r->grammar.valid()) {
      r->grammar.wait_for(most);
      return;
    }
}

StatusOr<StepPlan> Engine::Schedule() {
  if (!importing_.empty())
    return FailedPreconditionError("engine: the last plan's imports were not finished (FinishImports)");
  CollectGrammars();
  StepPlan plan;
  struct Scheduled {
    Req* r;
    int64_t n;
  };
  std::vector<Scheduled> scheduled;
  int64_t budget = config_.max_num_batched_tokens;
  // Rows that score prompt tokens (each a whole row of logits) are bounded
  // per step apart from the token budget.
  int64_t score_budget = config_.max_scored_rows_per_step;
  auto chunk = [&](const Req& r, bool scores) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(r.tokens.size()) - r.computed, budget);
    return scores ? std::min(n, score_budget) : n;
  };
  // 1. Running requests, oldest first: a decode token or the next prompt chunk.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Req& r = *running_[i];
    const bool scores = ScoresPending(r);
    const int64_t n = chunk(r, scores);
    if (n == 0) {  // no scoring rows left this step
      ++i;
      continue;
    }
    MLARUN_ASSIGN_OR_RETURN(const bool kept, Reserve(r, n));
    if (!kept) continue;  // r was the newest and got preempted; running_ shrank
    scheduled.push_back({&r, n});
    budget -= n;
    if (scores) score_budget -= n;
    ++i;
  }
  // 2. Waiting requests, in order, while the budget and the cache allow;
  // those whose grammar is still compiling are passed over.
  // One with an import source takes blocks for the rows to import and
  // waits for them instead (no tokens this step).
  for (size_t w = 0; budget > 0 && w < waiting_.size() && num_seqs() < config_.max_num_seqs;) {
    Req& r = *waiting_[w];
    if (r.grammar.valid()) {
      ++w;
      continue;
    }
    const bool scores = ScoresPending(r);
    if (scores && score_budget == 0) break;
    MLARUN_RETURN_IF_ERROR(Admit(r));
    if (r.request.import) {
      MLARUN_ASSIGN_OR_RETURN(const ImportStart start, StartImport(r, plan));
      if (start == ImportStart::kNoRoom) break;  // wait for running requests to free blocks
      if (start == ImportStart::kStarted) {
        waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(w));
        continue;
      }
    }
    const int64_t n = chunk(r, scores);
    MLARUN_ASSIGN_OR_RETURN(const int64_t need, cache_->BlocksNeeded(r.id, n));
    if (need > cache_->stats().blocks_allocatable()) {  // wait for running requests to free blocks
      MLARUN_RETURN_IF_ERROR(Unadmit(r));
      break;
    }
    MLARUN_RETURN_IF_ERROR(Append(r, n));
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(w));
    running_.push_back(&r);
    scheduled.push_back({&r, n});
    budget -= n;
    if (scores) score_budget -= n;
  }
  if (scheduled.empty() && plan.imports.empty() && HasWork() && !GrammarsPending())
    return InternalError("engine: no request could be scheduled although work is pending");

  for (const Scheduled& s : scheduled) {
    Req& r = *s.r;
    // What the runners will write must be this sequence's alone.
    MLARUN_RETURN_IF_ERROR(cache_->CheckWritable(r.id, r.computed, s.n));
    const std::span<const int32_t> table = cache_->BlockTable(r.id);
    const bool last = r.computed + s.n == static_cast<int64_t>(r.tokens.size());
    plan.seqs.push_back(StepPlan::Seq{
        .id = r.id,
        .start_pos = r.computed,
        .tokens = std::vector<int32_t>(r.tokens.begin() + r.computed, r.tokens.begin() + r.computed + s.n),
        .block_table = std::vector<int32_t>(table.begin(), table.end()),
        .sampler = last ? r.sampler.get() : nullptr});
    if (ScoresPending(r)) {
      // Row i scores the prompt token after its position, while there is one.
      const int64_t prompt = static_cast<int64_t>(r.request.prompt.size());
      StepPlan::Seq& q = plan.seqs.back();
      for (int64_t p = r.computed; p < r.computed + s.n && p + 1 < prompt; ++p)
        q.score_tokens.push_back(r.request.prompt[static_cast<size_t>(p + 1)]);
      q.score_top = r.request.sampling.prompt_logprobs;
    }
    // A resumed request's tokens generated elsewhere are part of its prefill.
    const int64_t prefill = std::ssize(r.request.prompt) + std::ssize(r.request.generated);
    (s.n == 1 && r.computed >= prefill ? stats_.decode_tokens : stats_.prefill_tokens) += s.n;
  }
  const LatentCacheStats cs = cache_->stats();
  plan.cache = {.blocks_used = cs.blocks_used,
                .blocks_cached = cs.blocks_cached,
                .blocks_retired = cs.blocks_retired,
                .prefix_hit_tokens = cs.prefix_hit_tokens,
                .evictions = cs.evictions};
  plan.has_work = HasWork();
  return plan;
}

int64_t Engine::PromptTokens(const Req& r, int64_t n) {
  return std::min<int64_t>(n, static_cast<int64_t>(r.request.prompt.size()));
}

bool Engine::ScoresPending(const Req& r) {
  return r.request.generated.empty() && r.request.sampling.prompt_logprobs >= 0 &&
         static_cast<int64_t>(r.out.prompt_logprobs.size()) + 1 < static_cast<int64_t>(r.request.prompt.size());
}

StatusOr<std::vector<int64_t>> Engine::Finish(const StepPlan& plan, std::span<const SampledToken> sampled,
                                              std::span<const std::span<const SampledToken>> scores) {
  const ModelConfig& c = model_;
  std::vector<int64_t> finished;
  size_t row = 0;
  for (size_t q = 0; q < plan.seqs.size(); ++q) {
    const StepPlan::Seq& s = plan.seqs[q];
    Req& r = *requests_.at(s.id);
    if (!s.score_tokens.empty()) {
      if (q >= scores.size() || scores[q].size() != s.score_tokens.size())
        return InternalError("engine: sequence ", s.id, " asked for ", s.score_tokens.size(),
                             " scored prompt tokens and got ", q < scores.size() ? scores[q].size() : 0);
      // Positions recorded before a preemption are computed again, not recorded again.
      for (size_t i = 0; i < s.score_tokens.size(); ++i) {
        if (s.start_pos + static_cast<int64_t>(i) != static_cast<int64_t>(r.out.prompt_logprobs.size())) continue;
        const SampledToken& t = scores[q][i];
        r.out.prompt_logprobs.push_back(
            LogprobEntry{.token = {t.token, t.logprob}, .top = {t.top_logprobs().begin(), t.top_logprobs().end()}});
      }
    }
    r.computed += static_cast<int64_t>(s.tokens.size());
    MLARUN_RETURN_IF_ERROR(cache_->Commit(r.id));
    if (s.sampler == nullptr) continue;
    if (row >= sampled.size())
      return InternalError("engine: ", sampled.size(), " sampled tokens for more sampled sequences");
    const SampledToken& tok = sampled[row++];
    r.out.tokens.push_back(tok.token);
    r.out.logprobs.push_back(tok.logprob);
    if (r.request.sampling.logprobs > 0)
      r.out.top_logprobs.emplace_back(tok.top_logprobs().begin(), tok.top_logprobs().end());
    r.tokens.push_back(static_cast<int32_t>(tok.token));
    const SamplingParams& sp = r.request.sampling;
    const bool stop_id =
        std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), tok.token) != sp.stop_token_ids.end();
    const bool eos =
        !sp.ignore_eos && std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), tok.token) != c.eos_token_ids.end();
    const TokenConstraint* grammar = r.sampler->constraint();
    if (stop_id || eos || (grammar != nullptr && grammar->terminated())) {
      r.out.finish_reason = FinishReason::kStop;
    } else if (std::ssize(r.request.generated) + std::ssize(r.out.tokens) >= sp.max_tokens) {
      r.out.finish_reason = FinishReason::kLength;
    } else {
      continue;
    }
    MLARUN_RETURN_IF_ERROR(cache_->Retire(r.id));
    r.in_cache = false;
    running_.erase(std::find(running_.begin(), running_.end(), &r));
    finished.push_back(r.id);
  }
  return finished;
}

StatusOr<std::vector<int64_t>> Engine::FailStep(const StepPlan& plan, const Status& error) {
  if (error.ok()) return InvalidArgumentError("engine: FailStep needs the step's error, got OK");
  std::vector<int64_t> failed;
  for (const StepPlan::Seq& s : plan.seqs) {
    auto it = requests_.find(s.id);
    // Every sequence of a plan is live until its step ends; this engine made
    // the plan, so anything else is a caller's mix-up.
    if (it == requests_.end() || it->second->out.finish_reason != FinishReason::kNone)
      return InternalError("engine: the failed plan's sequence ", s.id, " is not a live request");
    Req& r = *it->second;
    // Released, not retired: the request did not run to its end. Its rows of
    // this step were never committed, so its partly written blocks are not
    // published for reuse.
    if (r.in_cache) MLARUN_RETURN_IF_ERROR(cache_->Release(r.id));
    r.in_cache = false;
    if (auto q = std::find(running_.begin(), running_.end(), &r); q != running_.end()) running_.erase(q);
    r.out.finish_reason = FinishReason::kError;
    r.out.error = error;
    failed.push_back(r.id);
  }
  return failed;
}

void Engine::RecordStepTimes(double forward_seconds, const Model::StepTimes& parts) {
  stats_.forward_seconds += forward_seconds;
  stats_.time.attention += parts.attention;
  stats_.time.moe += parts.moe;
  stats_.time.dense_mlp += parts.dense_mlp;
  stats_.time.other += parts.other;
  ++stats_.steps;
}

StatusOr<std::vector<int64_t>> Engine::Step() {
  if (runner_ == nullptr)
    return FailedPreconditionError("engine: a scheduler alone does not step; its ranks' runners do");
  MLARUN_ASSIGN_OR_RETURN(const StepPlan plan, Schedule());
  if (!plan.imports.empty()) MLARUN_RETURN_IF_ERROR(FinishImports(plan, runner_->Import(plan, 0).ok()));
  if (plan.seqs.empty()) {
    WaitForGrammar(std::chrono::milliseconds(2));
    return std::vector<int64_t>{};
  }
  auto sampled = runner_->Execute(plan);
  RecordStepTimes(runner_->last_step_seconds(), runner_->model().last_step_times());
  if (!sampled.ok()) {
    // A computation failure ends this step's requests; anything else is not
    // the requests' fault and goes to the caller.
    if (runner_->last_step_failure().ok()) return sampled.status();
    return FailStep(plan, sampled.status());
  }
  return Finish(plan, *sampled, runner_->last_scores());
}

std::vector<StatusOr<GenerationOutput>> Engine::Generate(std::vector<GenerationRequest> requests) {
  std::vector<StatusOr<GenerationOutput>> out;
  std::vector<int64_t> ids;
  for (GenerationRequest& r : requests) {
    auto id = Add(std::move(r));
    ids.push_back(id.ok() ? *id : -1);
    out.emplace_back(id.ok() ? StatusOr<GenerationOutput>(GenerationOutput{})
                             : StatusOr<GenerationOutput>(id.status()));
  }
  Status failure;
  while (HasWork()) {
    auto step = Step();
    if (!step.ok()) {
      failure = step.status();
      break;
    }
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0) continue;
    if (!failure.ok() && Output(ids[i])->finish_reason == FinishReason::kNone) {
      out[i] = failure;
    } else {
      out[i] = TakeOutput(ids[i]);
      if (out[i].ok() && out[i]->finish_reason == FinishReason::kError) {
        const Status error = out[i]->error;  // a copy: out[i] is overwritten
        out[i] = error;
      }
    }
  }
  return out;
}

}  // namespace mlarun
