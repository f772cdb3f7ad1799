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

Status Model::ForwardImpl(std::span<const ForwardSeq> seqs, LatentPool& pool, const ParallelStep* parallel,
                          Communicator* tp, Communicator* peers, int64_t call, Status* collective) {
  const ModelConfig& c = config_;
  const ModelShard& shard = options_.shard;
  // N: this rank's heads.
  const int64_t H = c.hidden_size, N = c.num_attention_heads / shard.attn_tp_size, L = c.kv_lora_rank;
  const int64_t R = c.qk_rope_head_dim;
  const int64_t P = c.qk_nope_head_dim, V = c.v_head_dim, Dq = c.q_head_dim(), vocab = c.vocab_size;
  const Backend be = backend();
  times_ = {};
  traffic_ = {};
  routing_layers_ = 0;
  StepScratch& sc = *scratch_;
  const auto t_start = Clock::now();
  // This rank's computation; after a failure the step only joins the collectives.
  Status st;
  auto fail = [&st](Status s) {
    if (st.ok() && !s.ok()) st = std::move(s);
  };
  if ((shard.attn_tp_size > 1 || shard.mlp_size > 1) && parallel == nullptr)
    return FailedPreconditionError("model forward: a sharded model needs the step's communicators");
  const LatentCacheConfig& cc = pool.config();
  if (cc.num_layers != c.num_hidden_layers || cc.kv_lora_rank != L || cc.rope_dim != R || cc.dtype != c.kv_dtype)
    fail(InvalidArgumentError("model forward: the latent cache does not match the model (layers, widths, dtype)"));

  // The batch: flat tokens and positions, the attention's batch description.
  const int32_t S = static_cast<int32_t>(seqs.size());
  std::vector<int32_t>& query_start = sc.query_start;
  std::vector<int32_t>& seq_lens = sc.seq_lens;
  query_start.assign(static_cast<size_t>(S) + 1, 0);
  seq_lens.assign(static_cast<size_t>(S), 0);
  int64_t max_blocks = 1, logit_rows = 0;
  for (int32_t i = 0; i < S; ++i) {
    const ForwardSeq& s = seqs[static_cast<size_t>(i)];
    const int64_t n = static_cast<int64_t>(s.tokens.size()), end = s.start_pos + n;
    query_start[static_cast<size_t>(i) + 1] = query_start[static_cast<size_t>(i)] + static_cast<int32_t>(n);
    seq_lens[static_cast<size_t>(i)] = static_cast<int32_t>(end);
    logit_rows += s.logits == ForwardSeq::Logits::kAll ? n : (s.logits == ForwardSeq::Logits::kLast && n > 0 ? 1 : 0);
    if (!st.ok()) continue;
    if (s.start_pos < 0 || static_cast<int64_t>(s.block_table.size()) * cc.block_size < end)
      fail(InvalidArgumentError("model forward: sequence ", s.id, " covers positions [", s.start_pos, ", ", end,
                                ") but its block table holds ", s.block_table.size(), " blocks of ", cc.block_size));
    // The blocks the new tokens' rows go to must be the pool's: the cache
    // write addresses them through slots, unchecked on a device.
    for (int64_t b = s.start_pos / cc.block_size; st.ok() && b * cc.block_size < end; ++b)
      if (const int32_t id = s.block_table[static_cast<size_t>(b)]; id < 0 || id >= pool.num_blocks())
        fail(OutOfRangeError("model forward: sequence ", s.id, ": block_table[", b, "] = ", id,
                             " outside the pool's [0, ", pool.num_blocks(), ")"));
    if (end > c.max_position_embeddings)
      fail(InvalidArgumentError("model forward: sequence ", s.id, " reaches position ", end,
                                ", beyond max_position_embeddings ", c.max_position_embeddings));
    for (int32_t t : s.tokens)
      if (t < 0 || t >= vocab) {
        fail(InvalidArgumentError("model forward: token id ", t, " outside [0, ", vocab, ")"));
        break;
      }
    if (st.ok()) max_blocks = std::max<int64_t>(max_blocks, static_cast<int64_t>(s.block_table.size()));
  }
  const int64_t T = query_start.back();
  // Every rank must agree on the collectives' sizes; a plan that disagrees
  // cannot be run by anyone.
  int64_t T_all = T;
  std::vector<int64_t>& hidden_counts = sc.hidden_counts;
  hidden_counts.clear();
  if (peers) {
    if (static_cast<int>(parallel->dp_tokens.size()) != peers->size() ||
        parallel->dp_tokens[static_cast<size_t>(parallel->dp_rank)] != T) {
      *collective = InternalError("model forward: DP token counts disagree with this group's batch (", T, " tokens)");
      return st;
    }
    T_all = 0;
    for (int64_t n : parallel->dp_tokens) {
      hidden_counts.push_back(n * H);
      T_all += n;
    }
  }
  // Per token: its id, its position and the cache slot its row goes to
  // (block * block_size + offset in the block).
  std::vector<int32_t>& block_table = sc.block_table;
  std::vector<int32_t>& positions = sc.positions.host;
  std::vector<int32_t>& tokens = sc.tokens.host;
  std::vector<int64_t>& slots = sc.slots.host;
  block_table.assign(static_cast<size_t>(S * max_blocks), 0);
  positions.assign(static_cast<size_t>(T), 0);
  tokens.assign(static_cast<size_t>(T), 0);
  slots.assign(static_cast<size_t>(T), -1);
  for (int32_t i = 0; i < S && st.ok(); ++i) {
    const ForwardSeq& s = seqs[static_cast<size_t>(i)];
    std::copy(s.block_table.begin(), s.block_table.end(), block_table.begin() + i * max_blocks);
    for (int64_t j = 0; j < static_cast<int64_t>(s.tokens.size()); ++j) {
      const size_t t = static_cast<size_t>(query_start[static_cast<size_t>(i)] + j);
      const int64_t p = s.start_pos + j;
      positions[t] = static_cast<int32_t>(p);
      tokens[t] = s.tokens[static_cast<size_t>(j)];
      slots[t] = s.block_table[static_cast<size_t>(p / cc.block_size)] * cc.block_size + p % cc.block_size;
    }
  }

  // The step's buffers, in the model's memory. One that cannot be had ends
  // the step on every rank: nobody can run a collective on it.
  auto zeroed = [&](DeviceArray<float>& v, int64_t n, const char* what) -> DeviceArray<float>& {
    if (Status z = v.Zeroed(static_cast<size_t>(n), what); !z.ok() && collective->ok())
      *collective = z.WithContext("model forward");
    return v;
  };
  DeviceArray<float>& h = zeroed(sc.h, T * H, "the hidden states");
  DeviceArray<float>& x = zeroed(sc.x, T * H, "the normed hidden states");
  DeviceArray<float>& q = zeroed(sc.q, T * N * Dq, "the queries");
  DeviceArray<float>& qa = zeroed(sc.qa, T * std::max<int64_t>(c.q_lora_rank, 1), "the query latents");
  DeviceArray<float>& kv = zeroed(sc.kv, T * (L + R), "the key latents");
  DeviceArray<float>& kv_c = zeroed(sc.kv_c, T * L, "the normed key latents");
  DeviceArray<float>& k_pe = zeroed(sc.k_pe, T * R, "the rope keys");
  DeviceArray<float>& attn = zeroed(sc.attn, T * N * V, "the attention outputs");
  DeviceArray<float>& o_out = zeroed(sc.o_out, T * H, "the o_proj outputs");
  DeviceArray<float>& mlp_hidden = sc.mlp_hidden;  // sized by the largest dense MLP step
  DeviceArray<float>& x_all = sc.x_all;
  DeviceArray<float>& y_all = zeroed(sc.y_all, T_all * H, "the MLP outputs");
  // This group's rows of the MLP outputs: reduce-scattered over the peers, or
  // (alone) y_all itself.
  float* const y_local = peers ? zeroed(sc.y_local, T * H, "this group's MLP outputs").data() : y_all.data();
  // The batch arrays the ops read, on the device.
  auto publish = [&](auto& staged, const char* what) {
    auto p = staged.Publish(*memory_, what);
    if (!p.ok() && collective->ok()) *collective = p.status().WithContext("model forward");
    return p.ok() ? *p : nullptr;
  };
  const int32_t* const d_tokens = publish(sc.tokens, "the token ids");
  const int32_t* const d_positions = publish(sc.positions, "the positions");
  const int64_t* const d_slots = publish(sc.slots, "the cache slots");
  if (!collective->ok()) return st;

  // Embeddings.
  const size_t wes = DTypeSize(c.weight_dtype);
  if (st.ok())
    fail(EmbeddingRun({.table = embed_.data,
                       .dtype = embed_.dtype,
                       .num_rows = embed_.out,
                       .width = H,
                       .ld = embed_.ld,
                       .ids = d_tokens,
                       .n = T,
                       .out = h.data(),
                       .ld_out = H,
                       .backend = be}));

  MlaParams ap;
  ap.shape = c.mla_shape();
  ap.shape.h_q = N;
  ap.q = q.data();
  ap.num_tokens = T;
  ap.q_stride_token = N * Dq;
  ap.q_stride_head = Dq;
  ap.w_dtype = c.kv_dtype;
  ap.num_seqs = S;
  ap.query_start = query_start.data();
  ap.seq_lens = seq_lens.data();
  ap.block_table = block_table.data();
  ap.block_table_stride = max_blocks;
  ap.softmax_scale = static_cast<float>(c.softmax_scale());
  ap.out = attn.data();
  ap.out_stride_token = N * V;
  ap.out_stride_head = V;
  bool planned = false;  // sc.attn_plan is for this step's batch
  // A collective's failure ends the step here: nobody can be waited for.
  auto join = [collective](const Status& s) {
    if (!s.ok()) *collective = s.WithContext("collective");
    return s.ok();
  };

  // Layer li's attention for this group's tokens, into o_out (this rank's
  // heads' part of o_proj).
  auto attention = [&](const DecoderLayer& layer, int64_t li) -> Status {
    const AttentionLayer& a = layer.attn;
    const int64_t QL = c.q_lora_rank;
    MLARUN_RETURN_IF_ERROR(RmsNormRun({.x = h.data(),
                                       .ldx = H,
                                       .y = x.data(),
                                       .ldy = H,
                                       .rows = T,
                                       .n = H,
                                       .weight = layer.input_norm.data(),
                                       .eps = c.rms_norm_eps,
                                       .backend = be}));
    if (QL > 0) {
      MLARUN_RETURN_IF_ERROR(
          LinearRun({.w = &a.q_a, .x = x.data(), .rows = T, .ldx = H, .y = qa.data(), .ldy = QL, .backend = be}));
      MLARUN_RETURN_IF_ERROR(RmsNormRun({.x = qa.data(),
                                         .ldx = QL,
                                         .y = qa.data(),
                                         .ldy = QL,
                                         .rows = T,
                                         .n = QL,
                                         .weight = a.q_a_norm.data(),
                                         .eps = kLatentNormEps,
                                         .backend = be}));
      MLARUN_RETURN_IF_ERROR(
          LinearRun({.w = &a.q_b, .x = qa.data(), .rows = T, .ldx = QL, .y = q.data(), .ldy = N * Dq, .backend = be}));
    } else {
      MLARUN_RETURN_IF_ERROR(
          LinearRun({.w = &a.q, .x = x.data(), .rows = T, .ldx = H, .y = q.data(), .ldy = N * Dq, .backend = be}));
    }
    MLARUN_RETURN_IF_ERROR(
        LinearRun({.w = &a.kv_a, .x = x.data(), .rows = T, .ldx = H, .y = kv.data(), .ldy = L + R, .backend = be}));
    MLARUN_RETURN_IF_ERROR(RmsNormRun({.x = kv.data(),
                                       .ldx = L + R,
                                       .y = kv_c.data(),
                                       .ldy = L,
                                       .rows = T,
                                       .n = L,
                                       .weight = a.kv_a_norm.data(),
                                       .eps = kLatentNormEps,
                                       .backend = be}));
    MLARUN_RETURN_IF_ERROR(CopyRowsRun(
        {.x = kv.data() + L, .ldx = L + R, .y = k_pe.data(), .ldy = R, .rows = T, .cols = R, .backend = be}));
    MLARUN_RETURN_IF_ERROR(RopeRun(WithRopeTables({.x = q.data() + P,
                                                   .n_tokens = T,
                                                   .n_heads = N,
                                                   .stride_token = N * Dq,
                                                   .stride_head = Dq,
                                                   .positions = d_positions,
                                                   .backend = be},
                                                  *rope_, rope_inv_freq_.data())));
    MLARUN_RETURN_IF_ERROR(RopeRun(WithRopeTables(
        {.x = k_pe.data(), .n_tokens = T, .n_heads = 1, .stride_token = R, .positions = d_positions, .backend = be},
        *rope_, rope_inv_freq_.data())));
    const PagedRowsView cache = pool.Layer(li);
    MLARUN_RETURN_IF_ERROR(LatentWriteRun({.cache = pool.LayerData(li),
                                           .dtype = cache.dtype,
                                           .block_size = cache.block_size,
                                           .num_blocks = cache.num_blocks,
                                           .stride_block = cache.stride_block,
                                           .stride_token = cache.stride_token,
                                           .d_latent = L,
                                           .d_rope = R,
                                           .n = T,
                                           .slots = d_slots,
                                           .kv_c = kv_c.data(),
                                           .kv_c_stride = L,
                                           .k_pe = k_pe.data(),
                                           .k_pe_stride = R,
                                           .backend = be}));
    ap.w_uk_t = a.w_uk_t.data();
    ap.w_uv = a.w_uv.data();
    ap.cache = cache;
    if (!planned) {
      MLARUN_RETURN_IF_ERROR(MlaReplan(ap, options_.attention, sc.attn_plan));
      planned = true;
    }
    const MlaPlan& plan = sc.attn_plan;
    WorkspaceView ws = attn_ws_.Reserve(plan.workspace_bytes);
    if (plan.workspace_bytes > 0 && ws.data == nullptr)
      return ResourceExhaustedError("model forward: cannot allocate ", plan.workspace_bytes,
                                    " bytes of attention workspace");
    if (Status run = MlaRun(ap, plan, ws); !run.ok()) return run.WithContext("layer " + std::to_string(li));
    MLARUN_RETURN_IF_ERROR(
        LinearRun({.w = &a.o, .x = attn.data(), .rows = T, .ldx = N * V, .y = o_out.data(), .ldy = H, .backend = be}));
    const int64_t proj_bytes = a.q_a.bytes() + a.q_b.bytes() + a.q.bytes() + a.kv_a.bytes() + a.o.bytes();
    traffic_.weight_bytes += proj_bytes + static_cast<int64_t>(a.w_uk_t.size() + a.w_uv.size());
    const int64_t proj_elements =
        a.q_a.elements() + a.q_b.elements() + a.q.elements() + a.kv_a.elements() + a.o.elements();
    traffic_.flops += 2.0 * static_cast<double>(T) * static_cast<double>(proj_elements);
    for (int32_t i = 0; i < S; ++i) {
      const int64_t q_len = query_start[static_cast<size_t>(i) + 1] - query_start[static_cast<size_t>(i)];
      const int64_t len = seq_lens[static_cast<size_t>(i)];
      traffic_.cache_bytes += len * (cc.bytes_per_token() / c.num_hidden_layers);
      if (q_len == 0) continue;
      traffic_.flops += MlaPathFor(options_.attention, q_len, len - q_len) == MlaPath::kAbsorbed
                            ? MlaAbsorbedFlops(ap.shape, q_len, len)
                            : MlaExpandedFlops(ap.shape, q_len, len);
    }
    return Status::Ok();
  };

  for (int64_t li = 0; li < c.num_hidden_layers; ++li) {
    const DecoderLayer& layer = layers_[static_cast<size_t>(li)];
    auto t0 = Clock::now();
    if (T > 0 && st.ok()) fail(attention(layer, li));
    if (call == options_.fail_forward_call && li == 0)
      fail(InternalError("injected failure (fail_forward_call ", call, ") in layer 0"));
    // o_proj is row-parallel over heads: its partial sums meet in the group.
    if (tp && !join(tp->AllReduceSum(o_out.data(), T * H, CommType::kF32))) return st;
    if (st.ok()) fail(AddRun({.y = h.data(), .x = o_out.data(), .n = T * H, .backend = be}));
    times_.attention += Since(t0);

    t0 = Clock::now();
    if (st.ok())
      fail(RmsNormRun({.x = h.data(),
                       .ldx = H,
                       .y = x.data(),
                       .ldy = H,
                       .rows = T,
                       .n = H,
                       .weight = layer.post_attention_norm.data(),
                       .eps = c.rms_norm_eps,
                       .backend = be}));
    // Every DP group's tokens, in dp_rank order.
    const float* X = x.data();
    if (peers) {
      // All of it written by the all-gather.
      if (!join(x_all.Resize(static_cast<size_t>(T_all * H), "the gathered hidden states"))) return st;
      if (!join(peers->AllGatherV(x.data(), hidden_counts, x_all.data(), CommType::kF32))) return st;
      X = x_all.data();
    }
    if (st.ok()) {
      if (!layer.moe) {
        const size_t hidden = static_cast<size_t>(T_all * 2 * layer.mlp.intermediate());
        if (mlp_hidden.size() < hidden) fail(mlp_hidden.Resize(hidden, "the MLP's hidden rows"));
        if (st.ok())
          fail(MlpRun({.mlp = &layer.mlp,
                       .x = X,
                       .rows = T_all,
                       .ldx = H,
                       .y = y_all.data(),
                       .ldy = H,
                       .hidden = mlp_hidden.data(),
                       .backend = be}));
        if (T_all > 0) {
          traffic_.weight_bytes += layer.mlp.bytes();
          traffic_.flops += 2.0 * static_cast<double>(T_all) * static_cast<double>(layer.mlp.elements());
        }
      } else {
        fail(MoeForward(layer.moe_mlp, X, T_all, y_all.data()));
      }
    }
    // This rank's partial outputs for this group's tokens, summed over the world.
    if (peers && !join(peers->ReduceScatterSumV(y_all.data(), hidden_counts, y_local, CommType::kF32))) return st;
    if (tp && !join(tp->AllReduceSum(y_local, T * H, CommType::kF32))) return st;
    if (st.ok()) fail(AddRun({.y = h.data(), .x = y_local, .n = T * H, .backend = be}));
    (layer.moe ? times_.moe : times_.dense_mlp) += Since(t0);
  }
  if (!st.ok()) return st;

  // Logits for the rows asked for.
  const auto t_head = Clock::now();
  DeviceArray<float>& rows = sc.rows;
  MLARUN_RETURN_IF_ERROR(rows.Zeroed(static_cast<size_t>(logit_rows * H), "the logit rows"));
  DeviceArray<float>& logits_out = sc.logits;
  MLARUN_RETURN_IF_ERROR(logits_out.Zeroed(static_cast<size_t>(logit_rows * vocab), "the logits"));
  std::vector<int32_t>& logit_ids = sc.logit_ids.host;  // the rows of h asked for
  logit_ids.clear();
  for (int32_t i = 0; i < S; ++i) {
    const ForwardSeq& s = seqs[static_cast<size_t>(i)];
    const int32_t n = static_cast<int32_t>(s.tokens.size()), t0 = query_start[static_cast<size_t>(i)];
    if (s.logits == ForwardSeq::Logits::kNone || n == 0) continue;
    for (int32_t j = s.logits == ForwardSeq::Logits::kAll ? 0 : n - 1; j < n; ++j) logit_ids.push_back(t0 + j);
  }
  MLARUN_ASSIGN_OR_RETURN(const int32_t* d_logit_ids, sc.logit_ids.Publish(*memory_, "the logit row ids"));
  MLARUN_RETURN_IF_ERROR(EmbeddingRun({.table = h.data(),
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
  traffic_.weight_bytes += T * H * static_cast<int64_t>(wes);  // embedding rows
  times_.lm_head = Since(t_head);
  times_.other = Since(t_start) - times_.attention - times_.moe - times_.dense_mlp - times_.lm_head;
  return Status::Ok();
}

}  // namespace mlarun
