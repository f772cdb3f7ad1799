#include "runtime/model/model.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>

#include "kv/latent_write.h"
#include "runtime/ops/elementwise.h"
#include "runtime/ops/embedding.h"
#include "runtime/ops/moe_experts.h"
#include "runtime/ops/moe_gate.h"
#include "runtime/ops/norm.h"
#include "runtime/ops/rope.h"

namespace mlarun {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// transformers (and DeepSeek's reference code) build q_a_layernorm and
// kv_a_layernorm with the RMSNorm default eps, not config.rms_norm_eps.
constexpr double kLatentNormEps = 1e-6;

}  // namespace

// In the model's memory: the activations and the ops' batch arrays (staged
// from the host). On the host: the batch description the attention plans
// from (query_start, seq_lens, block_table), the collectives' counts, and
// the routed expert ids the MoE plans from (copied out of the device when
// it is not the host).
struct Model::StepScratch {
  explicit StepScratch(DeviceMemory* m)
      : h(m),
        x(m),
        q(m),
        qa(m),
        kv(m),
        kv_c(m),
        k_pe(m),
        attn(m),
        o_out(m),
        mlp_hidden(m),
        x_all(m),
        y_all(m),
        y_local(m),
        rows(m),
        logits(m),
        router_logits(m),
        route_weights(m),
        route_experts(m),
        moe_ws(m) {}
  // ForwardImpl
  std::vector<int32_t> query_start, seq_lens, block_table;
  StagedArray<int32_t> positions, tokens, logit_ids;
  StagedArray<int64_t> slots;
  std::vector<int64_t> hidden_counts;
  DeviceArray<float> h, x, q, qa, kv, kv_c, k_pe, attn, o_out, mlp_hidden, x_all, y_all, y_local, rows;
  DeviceArray<float> logits;  // ForwardInto's result
  // MoeForward
  DeviceArray<float> router_logits, route_weights;
  DeviceArray<int32_t> route_experts;
  std::vector<int32_t> route_experts_host;  // when the memory is not the host's
  MoePlan moe_plan;                         // re-planned every MoE layer into the same memory (MoeReplan)
  Workspace moe_ws;
  MlaPlan attn_plan;  // re-planned every step into the same memory (MlaReplan)
};

Model::Model(const ModelConfig& c, const ModelOptions& o) : config_(c), options_(o) {}

Model::~Model() = default;

Status Model::Init() {
  MLARUN_RETURN_IF_ERROR(ValidateModelConfig(config_));
  // A V3.2 config parses (so memory planning can size it), but decoding it
  // with dense MLA would silently compute a different function than the
  // checkpoint was trained for: refuse it here rather than in each caller.
  if (config_.has_indexer())
    return UnimplementedError("model: DeepSeek Sparse Attention (the DeepSeek-V3.2 indexer, index_n_heads=",
                              config_.index_n_heads, ") is not implemented; `mlarun memory` can still size this model");
  MLARUN_ASSIGN_OR_RETURN(Rope rope, Rope::Create(config_.rope));
  rope_ = std::make_unique<Rope>(std::move(rope));
  rope_inv_freq_.host = rope_->inv_freq();
  if (options_.memory != nullptr) {
    if (options_.memory->backend() != backend())
      return InvalidArgumentError("model: its memory is ", BackendName(options_.memory->backend()),
                                  "'s but its ops run on ", BackendName(backend()));
    memory_ = options_.memory;
  } else {
    MLARUN_ASSIGN_OR_RETURN(memory_, MemoryFor(backend()));
  }
  scratch_ = std::make_unique<StepScratch>(memory_);
  attn_ws_ = Workspace(memory_);
  return MlaCheckConfig(options_.attention);
}

Status Model::PlaceWeights() {
  DeviceMemory& m = *memory_;
  if (m.host_accessible()) return Status::Ok();
  const bool tied = lm_head_.data == embed_.data;
  MLARUN_RETURN_IF_ERROR(embed_.Place(m, "the embedding"));
  if (tied) {
    lm_head_ = embed_;
  } else {
    MLARUN_RETURN_IF_ERROR(lm_head_.Place(m, "lm_head"));
  }
  MLARUN_RETURN_IF_ERROR(final_norm_.Place(m, "the final norm"));
  MLARUN_RETURN_IF_ERROR(rope_inv_freq_.Place(m, "the RoPE frequencies"));
  auto mlp = [&m](Mlp& p, const std::string& what) -> Status {
    MLARUN_RETURN_IF_ERROR(p.gate.Place(m, what + " gate"));
    MLARUN_RETURN_IF_ERROR(p.up.Place(m, what + " up"));
    return p.down.Place(m, what + " down");
  };
  for (size_t i = 0; i < layers_.size(); ++i) {
    DecoderLayer& l = layers_[i];
    const std::string at = "layer " + std::to_string(i) + " ";
    AttentionLayer& a = l.attn;
    for (Linear* w : {&a.q_a, &a.q_b, &a.q, &a.kv_a, &a.o}) MLARUN_RETURN_IF_ERROR(w->Place(m, at + "attention"));
    MLARUN_RETURN_IF_ERROR(a.q_a_norm.Place(m, at + "q_a norm"));
    MLARUN_RETURN_IF_ERROR(a.kv_a_norm.Place(m, at + "kv_a norm"));
    MLARUN_RETURN_IF_ERROR(a.w_uk_t.Place(m, at + "W_UK"));
    MLARUN_RETURN_IF_ERROR(a.w_uv.Place(m, at + "W_UV"));
    MLARUN_RETURN_IF_ERROR(l.input_norm.Place(m, at + "input norm"));
    MLARUN_RETURN_IF_ERROR(l.post_attention_norm.Place(m, at + "post-attention norm"));
    if (!l.moe) {
      MLARUN_RETURN_IF_ERROR(mlp(l.mlp, at + "MLP"));
      continue;
    }
    MoeLayer& moe = l.moe_mlp;
    MLARUN_RETURN_IF_ERROR(moe.router.Place(m, at + "router"));
    MLARUN_RETURN_IF_ERROR(moe.score_bias.Place(m, at + "router bias"));
    if (moe.has_shared) MLARUN_RETURN_IF_ERROR(mlp(moe.shared, at + "shared experts"));
    for (size_t e = 0; e < moe.experts.size(); ++e)
      MLARUN_RETURN_IF_ERROR(mlp(moe.experts[e], at + "expert " + std::to_string(moe.expert_begin + e)));
  }
  return Status::Ok();
}

WeightBytes Model::weight_bytes() const {
  WeightBytes b;
  auto vec = [](const PlacedVector<float>& v) { return static_cast<int64_t>(v.size() * sizeof(float)); };
  auto mlp = [](const Mlp& m) { return m.bytes(); };
  b.embedding_and_head = embed_.bytes() + (lm_head_.data == embed_.data ? 0 : lm_head_.bytes()) + vec(final_norm_);
  for (const DecoderLayer& l : layers_) {
    const AttentionLayer& a = l.attn;
    const int64_t replicated = a.q_a.bytes() + vec(a.q_a_norm) + a.kv_a.bytes() + vec(a.kv_a_norm) + vec(l.input_norm) +
                               vec(l.post_attention_norm);
    b.attention_replicated += replicated;
    b.attention +=
        replicated + a.q_b.bytes() + a.q.bytes() + static_cast<int64_t>(a.w_uk_t.size() + a.w_uv.size()) + a.o.bytes();
    if (!l.moe) {
      b.dense_mlp += mlp(l.mlp);
      continue;
    }
    b.moe += l.moe_mlp.router.bytes() + vec(l.moe_mlp.score_bias) + (l.moe_mlp.has_shared ? mlp(l.moe_mlp.shared) : 0);
    for (const Mlp& e : l.moe_mlp.experts) b.moe += mlp(e);
  }
  return b;
}

bool Model::holds_fp8_projections() const {
  return !layers_.empty() && layers_.front().attn.kv_a.dtype == DType::kF8E4M3;
}

int64_t Model::weight_bytes_in_place() const {
  int64_t n = 0;
  auto add = [&n](const Linear& l) { n += l.in_place() ? l.data_bytes() : 0; };  // fp8 scales are copies
  auto mlp = [&add](const Mlp& m) { add(m.gate), add(m.up), add(m.down); };
  add(embed_);
  if (lm_head_.data != embed_.data) add(lm_head_);
  for (const DecoderLayer& l : layers_) {
    for (const Linear* w : {&l.attn.q_a, &l.attn.q_b, &l.attn.q, &l.attn.kv_a, &l.attn.o}) add(*w);
    if (!l.moe) {
      mlp(l.mlp);
      continue;
    }
    add(l.moe_mlp.router);
    if (l.moe_mlp.has_shared) mlp(l.moe_mlp.shared);
    for (const Mlp& e : l.moe_mlp.experts) mlp(e);
  }
  return n;
}

LatentCacheConfig CacheConfigFor(const ModelConfig& c, int64_t budget_bytes, int64_t block_size) {
  return LatentCacheConfig{.num_layers = c.num_hidden_layers,
                           .kv_lora_rank = c.kv_lora_rank,
                           .rope_dim = c.qk_rope_head_dim,
                           .block_size = block_size,
                           .dtype = c.kv_dtype,
                           .budget_bytes = budget_bytes};
}

LatentCacheConfig Model::CacheConfig(int64_t budget_bytes, int64_t block_size) const {
  return CacheConfigFor(config_, budget_bytes, block_size);
}

// Y = this rank's part of the MoE for rows X [T, H]: the routed experts it
// holds (all experts, narrowed, when sharded by intermediate size) and its
// slice of the shared experts (runtime/ops/moe_experts.h).
Status Model::MoeForward(const MoeLayer& moe, const float* X, int64_t T, float* Y) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  const Backend be = backend();
  StepScratch& sc = *scratch_;
  DeviceArray<float>& router_logits = sc.router_logits;
  MLARUN_RETURN_IF_ERROR(router_logits.Zeroed(static_cast<size_t>(T * E), "the router's logits"));
  MLARUN_RETURN_IF_ERROR(LinearRun({.w = &moe.router,
                                    .x = X,
                                    .rows = T,
                                    .ldx = H,
                                    .y = router_logits.data(),
                                    .ldy = E,
                                    .router = true,
                                    .backend = be}));
  DeviceArray<int32_t>& route_experts = sc.route_experts;
  DeviceArray<float>& route_weights = sc.route_weights;
  MLARUN_RETURN_IF_ERROR(route_experts.Zeroed(static_cast<size_t>(T * K), "the routed expert ids"));
  MLARUN_RETURN_IF_ERROR(route_weights.Zeroed(static_cast<size_t>(T * K), "the routing weights"));
  MLARUN_RETURN_IF_ERROR(MoeGateRun({.logits = router_logits.data(),
                                     .tokens = T,
                                     .num_experts = E,
                                     .bias = moe.score_bias.empty() ? nullptr : moe.score_bias.data(),
                                     .scoring = c.scoring_func,
                                     .method = c.topk_method,
                                     .top_k = K,
                                     .n_group = c.n_group,
                                     .topk_group = c.topk_group,
                                     .norm_topk_prob = c.norm_topk_prob,
                                     .routed_scaling_factor = c.routed_scaling_factor,
                                     .experts = route_experts.data(),
                                     .weights = route_weights.data(),
                                     .backend = be}));
  // The expert ids on the host: the MoE plan (tokens grouped by expert) is
  // made there.
  const int32_t* ids = route_experts.data();
  if (!memory_->host_accessible()) {
    sc.route_experts_host.resize(static_cast<size_t>(T * K));
    MLARUN_RETURN_IF_ERROR(
        memory_->CopyOut(sc.route_experts_host.data(), ids, static_cast<size_t>(T * K) * sizeof(int32_t)));
    ids = sc.route_experts_host.data();
  }
  if (routing_.size() <= routing_layers_) routing_.emplace_back();
  std::vector<int32_t>& routed = routing_[routing_layers_++];
  routed.assign(ids, ids + T * K);
  for (int64_t t = 0; t < T; ++t) std::sort(routed.begin() + t * K, routed.begin() + (t + 1) * K);

  const MoeExpertsParams p{.experts = moe.experts.data(),
                           .num_local = static_cast<int64_t>(moe.experts.size()),
                           .expert_begin = moe.expert_begin,
                           .num_experts = E,
                           .shared = moe.has_shared ? &moe.shared : nullptr,
                           .x = X,
                           .tokens = T,
                           .hidden = H,
                           .route_experts = route_experts.data(),
                           .route_weights = route_weights.data(),
                           .top_k = K,
                           .y = Y,
                           .backend = be};
  MoePlan& plan = sc.moe_plan;
  MoeExpertsParams host_ids = p;  // what the plan reads: the ids on the host
  host_ids.route_experts = ids;
  MLARUN_RETURN_IF_ERROR(MoeReplan(host_ids, plan));
  const WorkspaceView ws = sc.moe_ws.Reserve(plan.workspace_bytes);
  if (plan.workspace_bytes > 0 && ws.data == nullptr)
    return ResourceExhaustedError("model forward: cannot allocate ", plan.workspace_bytes, " bytes of MoE workspace");
  MLARUN_RETURN_IF_ERROR(MoeExpertsRun(p, plan, ws));
  if (T > 0) {
    traffic_.weight_bytes += moe.router.bytes();
    traffic_.flops += 2.0 * static_cast<double>(T * moe.router.out * moe.router.in);
  }
  for (const MoePlan::Job& j : plan.jobs) {  // weights are read once per step; every row multiplies them
    traffic_.weight_bytes += j.mlp->bytes();
    traffic_.flops += 2.0 * static_cast<double>(j.n) * static_cast<double>(j.mlp->elements());
  }
  return Status::Ok();
}

// Every rank's part of a failed computation, agreed on by all ranks: a flag
// summed over the attn-TP group and then over the DP peers (which together
// span the world), and only when it is set, the failing ranks' messages, the
// first in rank order winning, by the same two hops. Errors of the
// collectives themselves come back as they are.
namespace {
struct Agreement {
  Status collective;  // not OK: a collective failed (fatal)
  Status failure;     // the step's computation failure, the same on every rank
};
Agreement AgreeOnFailure(Communicator* tp, Communicator* peers, const Status& local, const std::string& rank_name) {
  Agreement out;
  float flag = local.ok() ? 0.f : 1.f;
  for (Communicator* c : {tp, peers}) {
    if (c == nullptr) continue;
    if (Status st = c->AllReduceSum(&flag, 1, CommType::kF32); !st.ok()) {
      out.collective = st;
      return out;
    }
  }
  if (flag == 0.f) return out;
  std::string mine;
  if (!local.ok())
    mine = std::to_string(static_cast<int>(local.code())) + "|" + (rank_name.empty() ? "a rank" : rank_name) + ": " +
           local.message();
  for (Communicator* c : {tp, peers}) {
    if (c == nullptr) continue;
    auto all = AllGatherStrings(*c, mine);
    if (!all.ok()) {
      out.collective = all.status();
      return out;
    }
    for (const std::string& m : *all)
      if (!m.empty()) {
        mine = m;
        break;
      }
  }
  const size_t bar = mine.find('|');
  const int code = bar == std::string::npos ? static_cast<int>(StatusCode::kInternal) : std::atoi(mine.c_str());
  out.failure =
      Status(static_cast<StatusCode>(code), "step failed on " + mine.substr(bar == std::string::npos ? 0 : bar + 1));
  return out;
}
}  // namespace

StatusOr<std::vector<float>> Model::Forward(std::span<const ForwardSeq> seqs, LatentPool& pool,
                                            const ParallelStep* parallel) {
  MLARUN_ASSIGN_OR_RETURN(const std::span<const float> logits, ForwardInto(seqs, pool, parallel));
  std::vector<float> out(logits.size());
  MLARUN_RETURN_IF_ERROR(memory_->CopyOut(out.data(), logits.data(), logits.size() * sizeof(float)));
  return out;
}

StatusOr<std::span<const float>> Model::ForwardInto(std::span<const ForwardSeq> seqs, LatentPool& pool,
                                                    const ParallelStep* parallel) {
  last_failure_ = Status::Ok();
  const int64_t call = forward_calls_++;
  // Across ranks: the attn-TP group sums o_proj's partial products; the MLP /
  // MoE runs on every DP group's tokens (gathered over the DP peers), and its
  // partial outputs come back summed over the world (reduce-scatter over the
  // peers, then all-reduce in the group).
  Communicator* tp = parallel && parallel->attn_tp && parallel->attn_tp->size() > 1 ? parallel->attn_tp : nullptr;
  Communicator* peers = parallel && parallel->dp_peers && parallel->dp_peers->size() > 1 ? parallel->dp_peers : nullptr;
  // Device buffers travel over the device's communicators (NCCL) when the
  // runner has them; the failure agreement below stays on the host's.
  Communicator* data_tp = tp != nullptr && parallel->device_attn_tp != nullptr ? parallel->device_attn_tp : tp;
  Communicator* data_peers =
      peers != nullptr && parallel->device_dp_peers != nullptr ? parallel->device_dp_peers : peers;
  if (!memory_->host_accessible() && ((tp != nullptr && data_tp == tp) || (peers != nullptr && data_peers == peers)))
    return FailedPreconditionError("model: a ", BackendName(backend()),
                                   " runner over several ranks needs device communicators (NCCL) for its collectives");
  Status collective;
  const Status local = ForwardImpl(seqs, pool, parallel, data_tp, data_peers, call, &collective);
  routing_.resize(routing_layers_);         // the MoE layers this step ran (shrinks only when a step stopped early)
  if (!collective.ok()) return collective;  // nobody can be waited for
  if (parallel == nullptr) {
    last_failure_ = local;
    if (!local.ok()) return local;
    return std::span<const float>(scratch_->logits.data(), scratch_->logits.size());
  }
  const Agreement agreed = AgreeOnFailure(tp, peers, local, parallel->rank_name);
  if (!agreed.collective.ok()) return agreed.collective;
  last_failure_ = agreed.failure;
  if (!agreed.failure.ok()) return agreed.failure;
  return std::span<const float>(scratch_->logits.data(), scratch_->logits.size());
}

// One step on this rank, as ForwardImpl's phases share it: the batch, the
// collectives, the batch's shape, the batch arrays on the device and this
// rank's failure so far. The buffers are the StepScratch's, sized for the
// step by CarveBuffers. Lives on ForwardImpl's stack for one step.
struct Model::Step {
  std::span<const ForwardSeq> seqs;
  LatentPool& pool;
  const ParallelStep* parallel;
  Communicator* tp;     // o_proj's and the MLP's all-reduce; null: alone in the group
  Communicator* peers;  // the MLP's gather / reduce-scatter; null: one DP group
  int64_t call;         // this Forward call's index (ModelOptions::fail_forward_call)
  Status* collective;   // a failed collective: it ends the step at once
  int64_t heads;        // N: this rank's heads
  // This rank's computation; after a failure the step only joins the collectives.
  Status st;
  int32_t S = 0;      // sequences
  int64_t T = 0;      // this group's tokens
  int64_t T_all = 0;  // every DP group's tokens
  int64_t max_blocks = 1, logit_rows = 0;
  // This group's rows of the MLP outputs: reduce-scattered over the peers, or
  // (alone) y_all itself.
  float* y_local = nullptr;
  // The batch arrays the ops read, on the device.
  const int32_t* d_tokens = nullptr;
  const int32_t* d_positions = nullptr;
  const int64_t* d_slots = nullptr;
  MlaParams ap;          // the attention's batch; each layer sets its weights and cache
  bool planned = false;  // sc.attn_plan is for this step's batch

  void Fail(Status s) {
    if (st.ok() && !s.ok()) st = std::move(s);
  }
  // A collective's failure ends the step here: nobody can be waited for.
  bool Join(const Status& s) {
    if (!s.ok()) *collective = s.WithContext("collective");
    return s.ok();
  }
};

Status Model::ForwardImpl(std::span<const ForwardSeq> seqs, LatentPool& pool, const ParallelStep* parallel,
                          Communicator* tp, Communicator* peers, int64_t call, Status* collective) {
  const ModelConfig& c = config_;
  const ModelShard& shard = options_.shard;
  const int64_t H = c.hidden_size;
  times_ = {};
  traffic_ = {};
  routing_layers_ = 0;
  const auto t_start = Clock::now();
  Step step{.seqs = seqs,
            .pool = pool,
            .parallel = parallel,
            .tp = tp,
            .peers = peers,
            .call = call,
            .collective = collective,
            .heads = c.num_attention_heads / shard.attn_tp_size};
  if ((shard.attn_tp_size > 1 || shard.mlp_size > 1) && parallel == nullptr)
    return FailedPreconditionError("model forward: a sharded model needs the step's communicators");
  if (!PrepareStep(step)) return step.st;

  // Embeddings.
  if (step.st.ok())
    step.Fail(EmbeddingRun({.table = embed_.data,
                            .dtype = embed_.dtype,
                            .num_rows = embed_.out,
                            .width = H,
                            .ld = embed_.ld,
                            .ids = step.d_tokens,
                            .n = step.T,
                            .out = scratch_->h.data(),
                            .ld_out = H,
                            .backend = backend()}));

  for (int64_t li = 0; li < c.num_hidden_layers; ++li) {
    const DecoderLayer& layer = layers_[static_cast<size_t>(li)];
    if (!AttentionBlock(layer, li, step)) return step.st;
    if (!MlpBlock(layer, step)) return step.st;
  }
  if (!step.st.ok()) return step.st;

  MLARUN_RETURN_IF_ERROR(ComputeLogits(step));
  traffic_.weight_bytes += step.T * H * static_cast<int64_t>(DTypeSize(c.weight_dtype));  // embedding rows
  times_.other = Since(t_start) - times_.attention - times_.moe - times_.dense_mlp - times_.lm_head;
  return Status::Ok();
}

bool Model::PrepareStep(Step& step) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size;
  const ParallelStep* parallel = step.parallel;
  StepScratch& sc = *scratch_;
  DescribeBatch(step);
  const int64_t T = sc.query_start.back();
  step.T = T;
  // Every rank must agree on the collectives' sizes; a plan that disagrees
  // cannot be run by anyone.
  step.T_all = T;
  std::vector<int64_t>& hidden_counts = sc.hidden_counts;
  hidden_counts.clear();
  if (step.peers) {
    if (static_cast<int>(parallel->dp_tokens.size()) != step.peers->size() ||
        parallel->dp_tokens[static_cast<size_t>(parallel->dp_rank)] != T) {
      *step.collective =
          InternalError("model forward: DP token counts disagree with this group's batch (", T, " tokens)");
      return false;
    }
    step.T_all = 0;
    for (int64_t n : parallel->dp_tokens) {
      hidden_counts.push_back(n * H);
      step.T_all += n;
    }
  }
  // Per token: its id, its position and the cache slot its row goes to
  // (block * block_size + offset in the block).
  const int64_t block_size = step.pool.config().block_size, max_blocks = step.max_blocks;
  std::vector<int32_t>& block_table = sc.block_table;
  std::vector<int32_t>& positions = sc.positions.host;
  std::vector<int32_t>& tokens = sc.tokens.host;
  std::vector<int64_t>& slots = sc.slots.host;
  block_table.assign(static_cast<size_t>(step.S * max_blocks), 0);
  positions.assign(static_cast<size_t>(T), 0);
  tokens.assign(static_cast<size_t>(T), 0);
  slots.assign(static_cast<size_t>(T), -1);
  for (int32_t i = 0; i < step.S && step.st.ok(); ++i) {
    const ForwardSeq& s = step.seqs[static_cast<size_t>(i)];
    std::copy(s.block_table.begin(), s.block_table.end(), block_table.begin() + i * max_blocks);
    for (int64_t j = 0; j < static_cast<int64_t>(s.tokens.size()); ++j) {
      const size_t t = static_cast<size_t>(sc.query_start[static_cast<size_t>(i)] + j);
      const int64_t p = s.start_pos + j;
      positions[t] = static_cast<int32_t>(p);
      tokens[t] = s.tokens[static_cast<size_t>(j)];
      slots[t] = s.block_table[static_cast<size_t>(p / block_size)] * block_size + p % block_size;
    }
  }
  return CarveBuffers(step);
}

void Model::DescribeBatch(Step& step) {
  const ModelConfig& c = config_;
  const int64_t vocab = c.vocab_size;
  const LatentPool& pool = step.pool;
  const LatentCacheConfig& cc = pool.config();
  if (cc.num_layers != c.num_hidden_layers || cc.kv_lora_rank != c.kv_lora_rank || cc.rope_dim != c.qk_rope_head_dim ||
      cc.dtype != c.kv_dtype)
    step.Fail(InvalidArgumentError("model forward: the latent cache does not match the model (layers, widths, dtype)"));

  // The batch: flat tokens and positions, the attention's batch description.
  const int32_t S = static_cast<int32_t>(step.seqs.size());
  step.S = S;
  std::vector<int32_t>& query_start = scratch_->query_start;
  std::vector<int32_t>& seq_lens = scratch_->seq_lens;
  query_start.assign(static_cast<size_t>(S) + 1, 0);
  seq_lens.assign(static_cast<size_t>(S), 0);
  for (int32_t i = 0; i < S; ++i) {
    const ForwardSeq& s = step.seqs[static_cast<size_t>(i)];
    const int64_t n = static_cast<int64_t>(s.tokens.size()), end = s.start_pos + n;
    query_start[static_cast<size_t>(i) + 1] = query_start[static_cast<size_t>(i)] + static_cast<int32_t>(n);
    seq_lens[static_cast<size_t>(i)] = static_cast<int32_t>(end);
    step.logit_rows +=
        s.logits == ForwardSeq::Logits::kAll ? n : (s.logits == ForwardSeq::Logits::kLast && n > 0 ? 1 : 0);
    if (!step.st.ok()) continue;
    if (s.start_pos < 0 || static_cast<int64_t>(s.block_table.size()) * cc.block_size < end)
      step.Fail(InvalidArgumentError("model forward: sequence ", s.id, " covers positions [", s.start_pos, ", ", end,
                                     ") but its block table holds ", s.block_table.size(), " blocks of ",
                                     cc.block_size));
    // The blocks the new tokens' rows go to must be the pool's: the cache
    // write addresses them through slots, unchecked on a device.
    for (int64_t b = s.start_pos / cc.block_size; step.st.ok() && b * cc.block_size < end; ++b)
      if (const int32_t id = s.block_table[static_cast<size_t>(b)]; id < 0 || id >= pool.num_blocks())
        step.Fail(OutOfRangeError("model forward: sequence ", s.id, ": block_table[", b, "] = ", id,
                                  " outside the pool's [0, ", pool.num_blocks(), ")"));
    if (end > c.max_position_embeddings)
      step.Fail(InvalidArgumentError("model forward: sequence ", s.id, " reaches position ", end,
                                     ", beyond max_position_embeddings ", c.max_position_embeddings));
    for (int32_t t : s.tokens)
      if (t < 0 || t >= vocab) {
        step.Fail(InvalidArgumentError("model forward: token id ", t, " outside [0, ", vocab, ")"));
        break;
      }
    if (step.st.ok()) step.max_blocks = std::max<int64_t>(step.max_blocks, static_cast<int64_t>(s.block_table.size()));
  }
}

bool Model::CarveBuffers(Step& step) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, N = step.heads, L = c.kv_lora_rank, R = c.qk_rope_head_dim;
  const int64_t V = c.v_head_dim, Dq = c.q_head_dim(), T = step.T;
  StepScratch& sc = *scratch_;
  Status* const collective = step.collective;
  // The step's buffers, in the model's memory. One that cannot be had ends
  // the step on every rank: nobody can run a collective on it.
  auto zeroed = [&](DeviceArray<float>& v, int64_t n, const char* what) -> DeviceArray<float>& {
    if (Status z = v.Zeroed(static_cast<size_t>(n), what); !z.ok() && collective->ok())
      *collective = z.WithContext("model forward");
    return v;
  };
  zeroed(sc.h, T * H, "the hidden states");
  zeroed(sc.x, T * H, "the normed hidden states");
  zeroed(sc.q, T * N * Dq, "the queries");
  zeroed(sc.qa, T * std::max<int64_t>(c.q_lora_rank, 1), "the query latents");
  zeroed(sc.kv, T * (L + R), "the key latents");
  zeroed(sc.kv_c, T * L, "the normed key latents");
  zeroed(sc.k_pe, T * R, "the rope keys");
  zeroed(sc.attn, T * N * V, "the attention outputs");
  zeroed(sc.o_out, T * H, "the o_proj outputs");
  // sc.mlp_hidden: sized by the largest dense MLP step; sc.x_all: by the
  // all-gather (MlpBlock).
  DeviceArray<float>& y_all = zeroed(sc.y_all, step.T_all * H, "the MLP outputs");
  step.y_local = step.peers ? zeroed(sc.y_local, T * H, "this group's MLP outputs").data() : y_all.data();
  // The batch arrays the ops read, on the device.
  auto publish = [&](auto& staged, const char* what) {
    auto p = staged.Publish(*memory_, what);
    if (!p.ok() && collective->ok()) *collective = p.status().WithContext("model forward");
    return p.ok() ? *p : nullptr;
  };
  step.d_tokens = publish(sc.tokens, "the token ids");
  step.d_positions = publish(sc.positions, "the positions");
  step.d_slots = publish(sc.slots, "the cache slots");
  if (!collective->ok()) return false;

  MlaParams& ap = step.ap;
  ap.shape = c.mla_shape();
  ap.shape.h_q = N;
  ap.q = sc.q.data();
  ap.num_tokens = T;
  ap.q_stride_token = N * Dq;
  ap.q_stride_head = Dq;
  ap.w_dtype = c.kv_dtype;
  ap.num_seqs = step.S;
  ap.query_start = sc.query_start.data();
  ap.seq_lens = sc.seq_lens.data();
  ap.block_table = sc.block_table.data();
  ap.block_table_stride = step.max_blocks;
  ap.softmax_scale = static_cast<float>(c.softmax_scale());
  ap.out = sc.attn.data();
  ap.out_stride_token = N * V;
  ap.out_stride_head = V;
  return true;
}

bool Model::AttentionBlock(const DecoderLayer& layer, int64_t li, Step& step) {
  const int64_t H = config_.hidden_size, T = step.T;
  DeviceArray<float>& o_out = scratch_->o_out;
  const auto t0 = Clock::now();
  if (T > 0 && step.st.ok()) step.Fail(Attention(layer, li, step));
  if (step.call == options_.fail_forward_call && li == 0)
    step.Fail(InternalError("injected failure (fail_forward_call ", step.call, ") in layer 0"));
  // o_proj is row-parallel over heads: its partial sums meet in the group.
  if (step.tp && !step.Join(step.tp->AllReduceSum(o_out.data(), T * H, CommType::kF32))) return false;
  if (step.st.ok()) step.Fail(AddRun({.y = scratch_->h.data(), .x = o_out.data(), .n = T * H, .backend = backend()}));
  times_.attention += Since(t0);
  return true;
}

Status Model::Attention(const DecoderLayer& layer, int64_t li, Step& step) {
  const ModelConfig& c = config_;
  const AttentionLayer& a = layer.attn;
  const int64_t H = c.hidden_size, N = step.heads, L = c.kv_lora_rank, R = c.qk_rope_head_dim;
  const int64_t V = c.v_head_dim, T = step.T;
  const Backend be = backend();
  StepScratch& sc = *scratch_;
  MLARUN_RETURN_IF_ERROR(AttentionProjections(layer, step));
  const PagedRowsView cache = step.pool.Layer(li);
  MLARUN_RETURN_IF_ERROR(LatentWriteRun({.cache = step.pool.LayerData(li),
                                         .dtype = cache.dtype,
                                         .block_size = cache.block_size,
                                         .num_blocks = cache.num_blocks,
                                         .stride_block = cache.stride_block,
                                         .stride_token = cache.stride_token,
                                         .d_latent = L,
                                         .d_rope = R,
                                         .n = T,
                                         .slots = step.d_slots,
                                         .kv_c = sc.kv_c.data(),
                                         .kv_c_stride = L,
                                         .k_pe = sc.k_pe.data(),
                                         .k_pe_stride = R,
                                         .backend = be}));
  MlaParams& ap = step.ap;
  ap.w_uk_t = a.w_uk_t.data();
  ap.w_uv = a.w_uv.data();
  ap.cache = cache;
  if (!step.planned) {
    MLARUN_RETURN_IF_ERROR(MlaReplan(ap, options_.attention, sc.attn_plan));
    step.planned = true;
  }
  const MlaPlan& plan = sc.attn_plan;
  WorkspaceView ws = attn_ws_.Reserve(plan.workspace_bytes);
  if (plan.workspace_bytes > 0 && ws.data == nullptr)
    return ResourceExhaustedError("model forward: cannot allocate ", plan.workspace_bytes,
                                  " bytes of attention workspace");
  if (Status run = MlaRun(ap, plan, ws); !run.ok()) return run.WithContext("layer " + std::to_string(li));
  MLARUN_RETURN_IF_ERROR(LinearRun(
      {.w = &a.o, .x = sc.attn.data(), .rows = T, .ldx = N * V, .y = sc.o_out.data(), .ldy = H, .backend = be}));
  const int64_t proj_bytes = a.q_a.bytes() + a.q_b.bytes() + a.q.bytes() + a.kv_a.bytes() + a.o.bytes();
  traffic_.weight_bytes += proj_bytes + static_cast<int64_t>(a.w_uk_t.size() + a.w_uv.size());
  const int64_t proj_elements =
      a.q_a.elements() + a.q_b.elements() + a.q.elements() + a.kv_a.elements() + a.o.elements();
  traffic_.flops += 2.0 * static_cast<double>(T) * static_cast<double>(proj_elements);
  const int64_t row_bytes = step.pool.config().bytes_per_token() / c.num_hidden_layers;
  for (int32_t i = 0; i < step.S; ++i) {
    const int64_t q_len = sc.query_start[static_cast<size_t>(i) + 1] - sc.query_start[static_cast<size_t>(i)];
    const int64_t len = sc.seq_lens[static_cast<size_t>(i)];
    traffic_.cache_bytes += len * row_bytes;
    if (q_len == 0) continue;
    traffic_.flops += MlaPathFor(options_.attention, q_len, len - q_len) == MlaPath::kAbsorbed
                          ? MlaAbsorbedFlops(ap.shape, q_len, len)
                          : MlaExpandedFlops(ap.shape, q_len, len);
  }
  return Status::Ok();
}

Status Model::AttentionProjections(const DecoderLayer& layer, const Step& step) {
  const ModelConfig& c = config_;
  const AttentionLayer& a = layer.attn;
  const int64_t H = c.hidden_size, N = step.heads, L = c.kv_lora_rank, R = c.qk_rope_head_dim;
  const int64_t P = c.qk_nope_head_dim, Dq = c.q_head_dim(), QL = c.q_lora_rank, T = step.T;
  const Backend be = backend();
  StepScratch& sc = *scratch_;
  float *const x = sc.x.data(), *const q = sc.q.data(), *const qa = sc.qa.data(), *const kv = sc.kv.data();
  MLARUN_RETURN_IF_ERROR(RmsNormRun({.x = sc.h.data(),
                                     .ldx = H,
                                     .y = x,
                                     .ldy = H,
                                     .rows = T,
                                     .n = H,
                                     .weight = layer.input_norm.data(),
                                     .eps = c.rms_norm_eps,
                                     .backend = be}));
  if (QL > 0) {
    MLARUN_RETURN_IF_ERROR(LinearRun({.w = &a.q_a, .x = x, .rows = T, .ldx = H, .y = qa, .ldy = QL, .backend = be}));
    MLARUN_RETURN_IF_ERROR(RmsNormRun({.x = qa,
                                       .ldx = QL,
                                       .y = qa,
                                       .ldy = QL,
                                       .rows = T,
                                       .n = QL,
                                       .weight = a.q_a_norm.data(),
                                       .eps = kLatentNormEps,
                                       .backend = be}));
    MLARUN_RETURN_IF_ERROR(
        LinearRun({.w = &a.q_b, .x = qa, .rows = T, .ldx = QL, .y = q, .ldy = N * Dq, .backend = be}));
  } else {
    MLARUN_RETURN_IF_ERROR(LinearRun({.w = &a.q, .x = x, .rows = T, .ldx = H, .y = q, .ldy = N * Dq, .backend = be}));
  }
  MLARUN_RETURN_IF_ERROR(LinearRun({.w = &a.kv_a, .x = x, .rows = T, .ldx = H, .y = kv, .ldy = L + R, .backend = be}));
  MLARUN_RETURN_IF_ERROR(RmsNormRun({.x = kv,
                                     .ldx = L + R,
                                     .y = sc.kv_c.data(),
                                     .ldy = L,
                                     .rows = T,
                                     .n = L,
                                     .weight = a.kv_a_norm.data(),
                                     .eps = kLatentNormEps,
                                     .backend = be}));
  MLARUN_RETURN_IF_ERROR(
      CopyRowsRun({.x = kv + L, .ldx = L + R, .y = sc.k_pe.data(), .ldy = R, .rows = T, .cols = R, .backend = be}));
  MLARUN_RETURN_IF_ERROR(RopeRun(WithRopeTables({.x = q + P,
                                                 .n_tokens = T,
                                                 .n_heads = N,
                                                 .stride_token = N * Dq,
                                                 .stride_head = Dq,
                                                 .positions = step.d_positions,
                                                 .backend = be},
                                                *rope_, rope_inv_freq_.data())));
  return RopeRun(WithRopeTables({.x = sc.k_pe.data(),
                                 .n_tokens = T,
                                 .n_heads = 1,
                                 .stride_token = R,
                                 .positions = step.d_positions,
                                 .backend = be},
                                *rope_, rope_inv_freq_.data()));
}

bool Model::MlpBlock(const DecoderLayer& layer, Step& step) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, T = step.T, T_all = step.T_all;
  const Backend be = backend();
  StepScratch& sc = *scratch_;
  const auto t0 = Clock::now();
  if (step.st.ok())
    step.Fail(RmsNormRun({.x = sc.h.data(),
                          .ldx = H,
                          .y = sc.x.data(),
                          .ldy = H,
                          .rows = T,
                          .n = H,
                          .weight = layer.post_attention_norm.data(),
                          .eps = c.rms_norm_eps,
                          .backend = be}));
  // Every DP group's tokens, in dp_rank order.
  const float* X = sc.x.data();
  if (step.peers) {
    // All of it written by the all-gather.
    if (!step.Join(sc.x_all.Resize(static_cast<size_t>(T_all * H), "the gathered hidden states"))) return false;
    if (!step.Join(step.peers->AllGatherV(sc.x.data(), sc.hidden_counts, sc.x_all.data(), CommType::kF32)))
      return false;
    X = sc.x_all.data();
  }
  if (step.st.ok()) {
    if (!layer.moe) {
      const size_t hidden = static_cast<size_t>(T_all * 2 * layer.mlp.intermediate());
      if (sc.mlp_hidden.size() < hidden) step.Fail(sc.mlp_hidden.Resize(hidden, "the MLP's hidden rows"));
      if (step.st.ok())
        step.Fail(MlpRun({.mlp = &layer.mlp,
                          .x = X,
                          .rows = T_all,
                          .ldx = H,
                          .y = sc.y_all.data(),
                          .ldy = H,
                          .hidden = sc.mlp_hidden.data(),
                          .backend = be}));
      if (T_all > 0) {
        traffic_.weight_bytes += layer.mlp.bytes();
        traffic_.flops += 2.0 * static_cast<double>(T_all) * static_cast<double>(layer.mlp.elements());
      }
    } else {
      step.Fail(MoeForward(layer.moe_mlp, X, T_all, sc.y_all.data()));
    }
  }
  // This rank's partial outputs for this group's tokens, summed over the world.
  if (step.peers &&
      !step.Join(step.peers->ReduceScatterSumV(sc.y_all.data(), sc.hidden_counts, step.y_local, CommType::kF32)))
    return false;
  if (step.tp && !step.Join(step.tp->AllReduceSum(step.y_local, T * H, CommType::kF32))) return false;
  if (step.st.ok()) step.Fail(AddRun({.y = sc.h.data(), .x = step.y_local, .n = T * H, .backend = be}));
  (layer.moe ? times_.moe : times_.dense_mlp) += Since(t0);
  return true;
}

Status Model::ComputeLogits(const Step& step) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, vocab = c.vocab_size, T = step.T, logit_rows = step.logit_rows;
  const Backend be = backend();
  StepScratch& sc = *scratch_;
  const auto t_head = Clock::now();
  DeviceArray<float>& rows = sc.rows;
  MLARUN_RETURN_IF_ERROR(rows.Zeroed(static_cast<size_t>(logit_rows * H), "the logit rows"));
  DeviceArray<float>& logits_out = sc.logits;
  MLARUN_RETURN_IF_ERROR(logits_out.Zeroed(static_cast<size_t>(logit_rows * vocab), "the logits"));
  std::vector<int32_t>& logit_ids = sc.logit_ids.host;  // the rows of h asked for
  logit_ids.clear();
  for (int32_t i = 0; i < step.S; ++i) {
    const ForwardSeq& s = step.seqs[static_cast<size_t>(i)];
    const int32_t n = static_cast<int32_t>(s.tokens.size()), t0 = sc.query_start[static_cast<size_t>(i)];
    if (s.logits == ForwardSeq::Logits::kNone || n == 0) continue;
    for (int32_t j = s.logits == ForwardSeq::Logits::kAll ? 0 : n - 1; j < n; ++j) logit_ids.push_back(t0 + j);
  }
  MLARUN_ASSIGN_OR_RETURN(const int32_t* d_logit_ids, sc.logit_ids.Publish(*memory_, "the logit row ids"));
  MLARUN_RETURN_IF_ERROR(EmbeddingRun({.table = sc.h.data(),
                                       .dtype = DType::kF32,
                                       .num_rows = T,
                                       .width = H,
                                       .ld = H,
                                       .ids = d_logit_ids,
                                       .n = logit_rows,
                                       .out = rows.data(),
                                       .ld_out = H,
                                       .backend = be}));
  MLARUN_RETURN_IF_ERROR(RmsNormRun({.x = rows.data(),
                                     .ldx = H,
                                     .y = rows.data(),
                                     .ldy = H,
                                     .rows = logit_rows,
                                     .n = H,
                                     .weight = final_norm_.data(),
                                     .eps = c.rms_norm_eps,
                                     .backend = be}));
  MLARUN_RETURN_IF_ERROR(LinearRun({.w = &lm_head_,
                                    .x = rows.data(),
                                    .rows = logit_rows,
                                    .ldx = H,
                                    .y = logits_out.data(),
                                    .ldy = vocab,
                                    .backend = be}));
  if (logit_rows > 0) {
    traffic_.weight_bytes += lm_head_.bytes();
    traffic_.flops += 2.0 * static_cast<double>(logit_rows * vocab * H);
  }
  times_.lm_head = Since(t_head);
  return Status::Ok();
}

}  // namespace mlarun
