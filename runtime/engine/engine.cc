#include "runtime/engine/engine.h"

#include <algorithm>
#include <chrono>

namespace mlarun {

std::string_view FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
  }
  return "none";
}


namespace {
enum CacheOp : int64_t { kOpAdd = 1, kOpAttach = 2, kOpAppend = 3, kOpCommit = 4, kOpRelease = 5, kOpRetire = 6 };
}  // namespace

int64_t StepPlan::num_tokens() const {
  int64_t n = 0;
  for (const Seq& s : seqs) n += static_cast<int64_t>(s.tokens.size());
  return n;
}

std::vector<ForwardSeq> StepPlan::ForwardSeqs() const {
  std::vector<ForwardSeq> out;
  for (const Seq& s : seqs)
    out.push_back(ForwardSeq{.id = s.id, .tokens = s.tokens, .start_pos = s.start_pos,
                             .logits = s.logits ? ForwardSeq::Logits::kLast : ForwardSeq::Logits::kNone});
  return out;
}

std::vector<int64_t> StepPlan::Encode() const {
  std::vector<int64_t> out = {has_work ? 1 : 0, static_cast<int64_t>(cache_ops.size())};
  out.insert(out.end(), cache_ops.begin(), cache_ops.end());
  out.push_back(static_cast<int64_t>(seqs.size()));
  for (const Seq& s : seqs) {
    out.insert(out.end(), {s.id, s.start_pos, s.logits ? 1 : 0, static_cast<int64_t>(s.tokens.size())});
    out.insert(out.end(), s.tokens.begin(), s.tokens.end());
  }
  return out;
}

StatusOr<StepPlan> StepPlan::Decode(std::span<const int64_t> d) {
  size_t i = 0;
  auto take = [&](int64_t* v) {
    if (i >= d.size()) return false;
    *v = d[i++];
    return true;
  };
  StepPlan p;
  int64_t has_work = 0, n_ops = 0, n_seqs = 0;
  if (!take(&has_work) || !take(&n_ops) || n_ops < 0 || static_cast<size_t>(n_ops) > d.size() - i)
    return InvalidArgumentError("step plan: truncated header");
  p.has_work = has_work != 0;
  p.cache_ops.assign(d.begin() + static_cast<int64_t>(i), d.begin() + static_cast<int64_t>(i) + n_ops);
  i += static_cast<size_t>(n_ops);
  if (!take(&n_seqs) || n_seqs < 0) return InvalidArgumentError("step plan: truncated sequence count");
  for (int64_t k = 0; k < n_seqs; ++k) {
    Seq s;
    int64_t logits = 0, n = 0;
    if (!take(&s.id) || !take(&s.start_pos) || !take(&logits) || !take(&n) || n < 0 ||
        static_cast<size_t>(n) > d.size() - i)
      return InvalidArgumentError("step plan: truncated sequence ", k);
    s.logits = logits != 0;
    for (int64_t t = 0; t < n; ++t) s.tokens.push_back(static_cast<int32_t>(d[i++]));
    p.seqs.push_back(std::move(s));
  }
  if (i != d.size()) return InvalidArgumentError("step plan: ", d.size() - i, " trailing values");
  return p;
}

Status ApplyCacheOps(LatentCache& cache, std::span<const int64_t> ops) {
  size_t i = 0;
  auto need = [&](size_t n) { return i + n <= ops.size(); };
  while (i < ops.size()) {
    if (!need(2)) return InvalidArgumentError("cache ops: truncated");
    const int64_t op = ops[i], id = ops[i + 1];
    i += 2;
    switch (op) {
      case kOpAdd: MLARUN_RETURN_IF_ERROR(cache.AddSequence(id)); break;
      case kOpCommit: MLARUN_RETURN_IF_ERROR(cache.Commit(id)); break;
      case kOpRelease: MLARUN_RETURN_IF_ERROR(cache.Release(id)); break;
      case kOpRetire: MLARUN_RETURN_IF_ERROR(cache.Retire(id)); break;
      case kOpAttach:
      case kOpAppend: {
        const int64_t extra = op == kOpAttach ? 1 : 0;
        if (!need(static_cast<size_t>(1 + extra))) return InvalidArgumentError("cache ops: truncated");
        const int64_t max_tokens = op == kOpAttach ? ops[i++] : 0;
        const int64_t n = ops[i++];
        if (n < 0 || !need(static_cast<size_t>(n))) return InvalidArgumentError("cache ops: truncated tokens");
        std::vector<int32_t> tokens(ops.begin() + static_cast<int64_t>(i), ops.begin() + static_cast<int64_t>(i) + n);
        i += static_cast<size_t>(n);
        if (op == kOpAppend) {
          MLARUN_RETURN_IF_ERROR(cache.Append(id, tokens));
        } else {
          MLARUN_RETURN_IF_ERROR(cache.AttachPrefix(id, tokens, max_tokens).status());
        }
        break;
      }
      default: return InvalidArgumentError("cache ops: unknown operation ", op);
    }
  }
  return Status::Ok();
}

Status Engine::CacheAdd(SeqId id) {
  MLARUN_RETURN_IF_ERROR(cache_->AddSequence(id));
  cache_ops_.insert(cache_ops_.end(), {kOpAdd, id});
  return Status::Ok();
}

StatusOr<int64_t> Engine::CacheAttach(SeqId id, std::span<const int32_t> tokens, int64_t max_tokens) {
  MLARUN_ASSIGN_OR_RETURN(const int64_t n, cache_->AttachPrefix(id, tokens, max_tokens));
  cache_ops_.insert(cache_ops_.end(), {kOpAttach, id, max_tokens, static_cast<int64_t>(tokens.size())});
  cache_ops_.insert(cache_ops_.end(), tokens.begin(), tokens.end());
  return n;
}

Status Engine::CacheAppend(SeqId id, std::span<const int32_t> tokens) {
  MLARUN_RETURN_IF_ERROR(cache_->Append(id, tokens));
  cache_ops_.insert(cache_ops_.end(), {kOpAppend, id, static_cast<int64_t>(tokens.size())});
  cache_ops_.insert(cache_ops_.end(), tokens.begin(), tokens.end());
  return Status::Ok();
}

Status Engine::CacheCommit(SeqId id) {
  MLARUN_RETURN_IF_ERROR(cache_->Commit(id));
  cache_ops_.insert(cache_ops_.end(), {kOpCommit, id});
  return Status::Ok();
}

Status Engine::CacheRelease(SeqId id, bool retire) {
  MLARUN_RETURN_IF_ERROR(retire ? cache_->Retire(id) : cache_->Release(id));
  cache_ops_.insert(cache_ops_.end(), {retire ? kOpRetire : kOpRelease, id});
  return Status::Ok();
}

StatusOr<std::unique_ptr<LatentCache>> Engine::CreateCache(const Model& model, const EngineConfig& config) {
  if (config.max_num_batched_tokens < 1)
    return InvalidArgumentError("engine: max_num_batched_tokens must be >= 1, got ", config.max_num_batched_tokens);
  if (config.max_num_seqs < 1) return InvalidArgumentError("engine: max_num_seqs must be >= 1, got ", config.max_num_seqs);
  LatentCacheConfig cc = model.CacheConfig(config.cache_budget_bytes, config.block_size);
  cc.enable_prefix_caching = config.enable_prefix_caching;
  cc.commit_memory = config.commit_cache_memory;
  return LatentCache::Create(cc);
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(Model& model, const EngineConfig& config) {
  MLARUN_ASSIGN_OR_RETURN(auto cache, CreateCache(model, config));
  return std::unique_ptr<Engine>(new Engine(model, config, std::move(cache)));
}

Engine::Engine(Model& model, const EngineConfig& config, std::unique_ptr<LatentCache> cache)
    : model_(model), config_(config), cache_(std::move(cache)) {}

StatusOr<int64_t> Engine::Add(GenerationRequest request) {
  const ModelConfig& c = model_.config();
  MLARUN_RETURN_IF_ERROR(ValidateGenerationRequest(request, {.vocab_size = c.vocab_size,
                                                             .max_position_embeddings = c.max_position_embeddings,
                                                             .block_size = config_.block_size,
                                                             .cache_blocks_total = cache_->stats().blocks_total}));
  auto r = std::make_unique<Req>();
  r->id = next_id_++;
  r->tokens = request.prompt;
  r->sampler = std::make_unique<Sampler>(request.sampling);
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
  if (r.in_cache) MLARUN_RETURN_IF_ERROR(CacheRelease(r.id));
  r.in_cache = false;
  if (auto w = std::find(waiting_.begin(), waiting_.end(), &r); w != waiting_.end()) waiting_.erase(w);
  if (auto q = std::find(running_.begin(), running_.end(), &r); q != running_.end()) running_.erase(q);
  r.out.finish_reason = FinishReason::kCancelled;
  return Status::Ok();
}

void Engine::Preempt(Req& r) {
  (void)CacheRelease(r.id);
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
      MLARUN_RETURN_IF_ERROR(CacheAppend(
          r.id, std::span<const int32_t>(r.tokens).subspan(static_cast<size_t>(r.computed), static_cast<size_t>(n))));
      return true;
    }
    Req* victim = running_.back();
    Preempt(*victim);
    if (victim == &r) return false;
  }
}

Status Engine::Admit(Req& r) {
  MLARUN_RETURN_IF_ERROR(CacheAdd(r.id));
  r.in_cache = true;
  // Reuse cached full blocks of the prompt, keeping at least one token to
  // compute so the step produces logits.
  MLARUN_ASSIGN_OR_RETURN(r.computed, CacheAttach(r.id, r.tokens, static_cast<int64_t>(r.tokens.size()) - 1));
  r.out.prefix_hit_tokens += r.computed;
  return Status::Ok();
}

StatusOr<StepPlan> Engine::Schedule() {
  struct Scheduled {
    Req* r;
    int64_t n;
  };
  std::vector<Scheduled> scheduled;
  int64_t budget = config_.max_num_batched_tokens;
  // 1. Running requests, oldest first: a decode token or the next prompt chunk.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Req& r = *running_[i];
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(r.tokens.size()) - r.computed, budget);
    MLARUN_ASSIGN_OR_RETURN(const bool kept, Reserve(r, n));
    if (!kept) continue;  // r was the newest and got preempted; running_ shrank
    scheduled.push_back({&r, n});
    budget -= n;
    ++i;
  }
  // 2. Waiting requests, in order, while the budget and the cache allow.
  while (budget > 0 && !waiting_.empty() && static_cast<int64_t>(running_.size()) < config_.max_num_seqs) {
    Req& r = *waiting_.front();
    MLARUN_RETURN_IF_ERROR(Admit(r));
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(r.tokens.size()) - r.computed, budget);
    MLARUN_ASSIGN_OR_RETURN(const int64_t need, cache_->BlocksNeeded(r.id, n));
    if (need > cache_->stats().blocks_allocatable()) {  // wait for running requests to free blocks
      MLARUN_RETURN_IF_ERROR(CacheRelease(r.id));
      r.in_cache = false;
      r.out.prefix_hit_tokens -= r.computed;
      r.computed = 0;
      break;
    }
    MLARUN_RETURN_IF_ERROR(CacheAppend(
        r.id, std::span<const int32_t>(r.tokens).subspan(static_cast<size_t>(r.computed), static_cast<size_t>(n))));
    waiting_.pop_front();
    running_.push_back(&r);
    scheduled.push_back({&r, n});
    budget -= n;
  }
  if (scheduled.empty() && HasWork())
    return InternalError("engine: no request could be scheduled although work is pending");

  StepPlan plan;
  for (const Scheduled& s : scheduled) {
    const bool last = s.r->computed + s.n == static_cast<int64_t>(s.r->tokens.size());
    plan.seqs.push_back(StepPlan::Seq{.id = s.r->id, .start_pos = s.r->computed,
                                      .tokens = std::vector<int32_t>(s.r->tokens.begin() + s.r->computed,
                                                                     s.r->tokens.begin() + s.r->computed + s.n),
                                      .logits = last});
    (s.n == 1 && s.r->computed >= static_cast<int64_t>(s.r->request.prompt.size()) ? stats_.decode_tokens
                                                                                     : stats_.prefill_tokens) += s.n;
  }
  plan.cache_ops = std::move(cache_ops_);
  cache_ops_.clear();
  plan.has_work = HasWork();
  return plan;
}

StatusOr<std::vector<int64_t>> Engine::Finish(const StepPlan& plan, std::span<const float> logits) {
  const ModelConfig& c = model_.config();
  const int64_t vocab = c.vocab_size;
  std::vector<int64_t> finished;
  int64_t row = 0;
  for (const StepPlan::Seq& s : plan.seqs) {
    Req& r = *requests_.at(s.id);
    r.computed += static_cast<int64_t>(s.tokens.size());
    MLARUN_RETURN_IF_ERROR(CacheCommit(r.id));
    if (!s.logits) continue;
    if (static_cast<int64_t>(logits.size()) < (row + 1) * vocab)
      return InternalError("engine: ", logits.size() / static_cast<size_t>(vocab), " logit rows for more sampled sequences");
    const SampledToken tok = r.sampler->Sample(logits.subspan(static_cast<size_t>(row * vocab), static_cast<size_t>(vocab)));
    ++row;
    r.out.tokens.push_back(tok.token);
    r.out.logprobs.push_back(tok.logprob);
    r.tokens.push_back(static_cast<int32_t>(tok.token));
    const SamplingParams& sp = r.request.sampling;
    const bool stop_id = std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), tok.token) != sp.stop_token_ids.end();
    const bool eos = !sp.ignore_eos && std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), tok.token) != c.eos_token_ids.end();
    if (stop_id || eos) {
      r.out.finish_reason = FinishReason::kStop;
    } else if (static_cast<int64_t>(r.out.tokens.size()) >= sp.max_tokens) {
      r.out.finish_reason = FinishReason::kLength;
    } else {
      continue;
    }
    MLARUN_RETURN_IF_ERROR(CacheRelease(r.id, /*retire=*/true));
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
    if (r.in_cache) MLARUN_RETURN_IF_ERROR(CacheRelease(r.id));
    r.in_cache = false;
    if (auto q = std::find(running_.begin(), running_.end(), &r); q != running_.end()) running_.erase(q);
    r.out.finish_reason = FinishReason::kError;
    r.out.error = error;
    failed.push_back(r.id);
  }
  return failed;
}

void Engine::RecordStepTimes(double forward_seconds) {
  stats_.forward_seconds += forward_seconds;
  const Model::StepTimes& st = model_.last_step_times();
  stats_.time.attention += st.attention;
  stats_.time.moe += st.moe;
  stats_.time.dense_mlp += st.dense_mlp;
  stats_.time.other += st.other;
  ++stats_.steps;
}

StatusOr<std::vector<int64_t>> Engine::Step() {
  MLARUN_ASSIGN_OR_RETURN(const StepPlan plan, Schedule());
  if (plan.seqs.empty()) return std::vector<int64_t>{};
  const std::vector<ForwardSeq> seqs = plan.ForwardSeqs();
  const auto t0 = std::chrono::steady_clock::now();
  auto logits = model_.ForwardInto(seqs, *cache_);
  RecordStepTimes(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (!logits.ok()) {
    // A computation failure ends this step's requests; anything else is not
    // the requests' fault and goes to the caller.
    if (model_.last_step_failure().ok()) return logits.status();
    return FailStep(plan, logits.status());
  }
  return Finish(plan, *logits);
}

std::vector<StatusOr<GenerationOutput>> Engine::Generate(std::vector<GenerationRequest> requests) {
  std::vector<StatusOr<GenerationOutput>> out;
  std::vector<int64_t> ids;
  for (GenerationRequest& r : requests) {
    auto id = Add(std::move(r));
    ids.push_back(id.ok() ? *id : -1);
    out.emplace_back(id.ok() ? StatusOr<GenerationOutput>(GenerationOutput{}) : StatusOr<GenerationOutput>(id.status()));
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
