#include "runtime/model/model.h"

#include "runtime/base/first_error.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <mutex>
#include <optional>

namespace mlarun {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Indices of the k largest values (ties: the lower index first), in
// descending order of value.
void TopK(const float* v, int64_t n, int64_t k, std::vector<int32_t>& idx) {
  idx.resize(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [v](int32_t a, int32_t b) {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
  });
  idx.resize(static_cast<size_t>(k));
}

// Route's buffers, reused token after token.
struct RouteScratch {
  std::vector<float> scores, choice, group_scores;
  std::vector<int32_t> idx;
  std::vector<char> keep;
};

// The routed experts of one token and their weights, as transformers'
// DeepseekV2TopkRouter / DeepseekV3TopkRouter compute them.
void Route(const ModelConfig& c, const float* logits, const std::vector<float>& bias, int32_t* experts,
           float* weights, RouteScratch& rs) {
  const int64_t E = c.n_routed_experts, K = c.num_experts_per_tok, G = c.n_group, per_group = E / G;
  std::vector<float>& scores = rs.scores;
  std::vector<float>& choice = rs.choice;
  std::vector<float>& group_scores = rs.group_scores;
  std::vector<int32_t>& idx = rs.idx;
  scores.assign(static_cast<size_t>(E), 0.f);
  group_scores.assign(static_cast<size_t>(G), 0.f);
  if (c.scoring_func == ScoringFunc::kSigmoid) {
    for (int64_t e = 0; e < E; ++e) scores[static_cast<size_t>(e)] = 1.f / (1.f + std::exp(-logits[e]));
  } else {
    const float mx = *std::max_element(logits, logits + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += scores[static_cast<size_t>(e)] = std::exp(logits[e] - mx);
    for (float& s : scores) s /= sum;
  }
  choice = scores;
  if (!bias.empty())
    for (int64_t e = 0; e < E; ++e) choice[static_cast<size_t>(e)] += bias[static_cast<size_t>(e)];
  const bool grouped = c.topk_method == TopkMethod::kNoauxTc || c.topk_method == TopkMethod::kGroupLimitedGreedy;
  if (grouped && G > 1) {
    for (int64_t g = 0; g < G; ++g) {
      const float* s = choice.data() + g * per_group;
      if (c.topk_method == TopkMethod::kNoauxTc) {  // sum of the group's two best (biased) scores
        TopK(s, per_group, std::min<int64_t>(2, per_group), idx);
        float sum = 0.f;
        for (int32_t i : idx) sum += s[i];
        group_scores[static_cast<size_t>(g)] = sum;
      } else {  // V2 group_limited_greedy: the group's best score
        group_scores[static_cast<size_t>(g)] = *std::max_element(s, s + per_group);
      }
    }
    TopK(group_scores.data(), G, c.topk_group, idx);
    std::vector<char>& keep = rs.keep;
    keep.assign(static_cast<size_t>(G), 0);
    for (int32_t g : idx) keep[static_cast<size_t>(g)] = 1;
    // V3 masks dropped groups to -inf, V2 to 0 (scores are positive there).
    const float masked = c.topk_method == TopkMethod::kNoauxTc ? -INFINITY : 0.f;
    for (int64_t e = 0; e < E; ++e)
      if (!keep[static_cast<size_t>(e / per_group)]) choice[static_cast<size_t>(e)] = masked;
  }
  TopK(choice.data(), E, K, idx);
  float sum = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    experts[k] = idx[static_cast<size_t>(k)];
    weights[k] = scores[static_cast<size_t>(idx[static_cast<size_t>(k)])];  // unbiased score
    sum += weights[k];
  }
  if (c.norm_topk_prob && K > 1)
    for (int64_t k = 0; k < K; ++k) weights[k] /= sum + 1e-20f;
  for (int64_t k = 0; k < K; ++k) weights[k] *= static_cast<float>(c.routed_scaling_factor);
}

// transformers (and DeepSeek's reference code) build q_a_layernorm and
// kv_a_layernorm with the RMSNorm default eps, not config.rms_norm_eps.
constexpr double kLatentNormEps = 1e-6;

}  // namespace

// The MoE's work lists (MoeForward).
struct MoeJob {
  const Mlp* mlp;
  const std::vector<int32_t>* slots;  // nullptr: every token (the shared experts)
  int64_t n;
  size_t x, h, y;  // offsets into the buffers
};
struct MoeItem {
  uint32_t job;
  uint8_t matrix;  // 0 gate, 1 up, 2 down
  int64_t c0, c1;
};

struct Model::StepScratch {
  // ForwardImpl
  std::vector<int32_t> query_start, seq_lens, block_table, positions;
  std::vector<int64_t> hidden_counts;
  std::vector<float> h, x, q, qa, kv, kv_c, k_pe, attn, o_out, mlp_hidden, x_all, y_all, y_local, rows;
  std::vector<float> logits;  // ForwardInto's result
  // MoeForward
  std::vector<float> router_logits, route_weights;
  std::vector<int32_t> route_experts;
  std::vector<std::vector<int32_t>> by_expert;
  std::vector<MoeJob> jobs;
  std::vector<MoeItem> up_items, down_items;
  std::vector<const float*> slot_rows;
  std::vector<float> moe_x, moe_h, moe_y;  // the experts' rows, hidden and outputs
  RouteScratch route;
  MlaPlan attn_plan;  // re-planned every step into the same memory (MlaReplan)
};

Model::Model(const ModelConfig& c, const ModelOptions& o)
    : config_(c), options_(o), scratch_(std::make_unique<StepScratch>()) {}

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
  return MlaCheckConfig(options_.attention);
}

WeightBytes Model::weight_bytes() const {
  WeightBytes b;
  auto vec = [](const std::vector<float>& v) { return static_cast<int64_t>(v.size() * sizeof(float)); };
  auto mlp = [](const Mlp& m) { return m.bytes(); };
  b.embedding_and_head = embed_.bytes() + (lm_head_.data == embed_.data ? 0 : lm_head_.bytes()) + vec(final_norm_);
  for (const DecoderLayer& l : layers_) {
    const AttentionLayer& a = l.attn;
    const int64_t replicated = a.q_a.bytes() + vec(a.q_a_norm) + a.kv_a.bytes() + vec(a.kv_a_norm) +
                               vec(l.input_norm) + vec(l.post_attention_norm);
    b.attention_replicated += replicated;
    b.attention += replicated + a.q_b.bytes() + a.q.bytes() + static_cast<int64_t>(a.w_uk_t.size() + a.w_uv.size()) +
                   a.o.bytes();
    if (!l.moe) {
      b.dense_mlp += mlp(l.mlp);
      continue;
    }
    b.moe += l.moe_mlp.router.bytes() + vec(l.moe_mlp.score_bias) + (l.moe_mlp.has_shared ? mlp(l.moe_mlp.shared) : 0);
    for (const Mlp& e : l.moe_mlp.experts) b.moe += mlp(e);
  }
  return b;
}

int64_t Model::weight_bytes_in_place() const {
  int64_t n = 0;
  auto add = [&n](const Linear& l) { n += l.in_place() ? l.bytes() : 0; };
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
  return LatentCacheConfig{.num_layers = c.num_hidden_layers, .kv_lora_rank = c.kv_lora_rank,
                           .rope_dim = c.qk_rope_head_dim, .block_size = block_size, .dtype = c.kv_dtype,
                           .budget_bytes = budget_bytes};
}

LatentCacheConfig Model::CacheConfig(int64_t budget_bytes, int64_t block_size) const {
  return CacheConfigFor(config_, budget_bytes, block_size);
}

// Y = this rank's part of the MoE for rows X [T, H]: the routed experts it
// holds (all experts, narrowed, when sharded by intermediate size) and its
// slice of the shared experts. Tokens are grouped by expert so each expert runs
// one product over its tokens. The work of a step is spread over the threads
// as (expert, column range) items of about 1 MiB of weights, so a few experts
// with one token each (a decode step) keep every thread streaming weights to
// the end of each phase: the gate and up products first, then SiLU, then the
// down products. Each (token, k) result
// goes to its own slot (no two threads add into one row), and the slots are
// summed in k order, so the result does not depend on the thread count.
Status Model::MoeForward(const MoeLayer& moe, const float* X, int64_t T, float* Y) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  StepScratch& sc = *scratch_;
  std::vector<float>& router_logits = sc.router_logits;
  router_logits.assign(static_cast<size_t>(T * E), 0.f);
  MLARUN_RETURN_IF_ERROR(ApplyLinear(moe.router, X, T, H, router_logits.data(), E));
  std::vector<int32_t>& route_experts = sc.route_experts;
  std::vector<float>& route_weights = sc.route_weights;
  route_experts.assign(static_cast<size_t>(T * K), 0);
  route_weights.assign(static_cast<size_t>(T * K), 0.f);
  for (int64_t t = 0; t < T; ++t)
    Route(c, router_logits.data() + t * E, moe.score_bias, route_experts.data() + t * K, route_weights.data() + t * K,
          sc.route);
  if (routing_.size() <= routing_layers_) routing_.emplace_back();
  std::vector<int32_t>& routed = routing_[routing_layers_++];
  routed.assign(route_experts.begin(), route_experts.end());
  for (int64_t t = 0; t < T; ++t) std::sort(routed.begin() + t * K, routed.begin() + (t + 1) * K);

  const int64_t e0 = moe.expert_begin, e1 = e0 + static_cast<int64_t>(moe.experts.size());
  std::vector<std::vector<int32_t>>& by_expert = sc.by_expert;  // slot ids (t * K + k)
  by_expert.resize(static_cast<size_t>(E));
  for (auto& v : by_expert) v.clear();
  for (int64_t sl = 0; sl < T * K; ++sl) by_expert[static_cast<size_t>(route_experts[static_cast<size_t>(sl)])].push_back(static_cast<int32_t>(sl));

  // The MLPs to run: the routed experts some token chose, then the shared
  // experts over every token. Each gets its rows of X, a hidden [n, 2I] and
  // an output [n, H] in three flat buffers.
  using Job = MoeJob;
  std::vector<Job>& jobs = sc.jobs;
  jobs.clear();
  size_t x_size = 0, h_size = 0, y_size = 0;
  auto add = [&](const Mlp& m, const std::vector<int32_t>* slots, int64_t n) {
    jobs.push_back(Job{&m, slots, n, x_size, h_size, y_size});
    x_size += static_cast<size_t>(slots ? n * H : 0);
    h_size += static_cast<size_t>(n * 2 * m.intermediate());
    y_size += static_cast<size_t>(n * H);
  };
  for (int64_t e = e0; e < e1; ++e) {
    const std::vector<int32_t>& slots = by_expert[static_cast<size_t>(e)];
    if (!slots.empty()) add(moe.experts[static_cast<size_t>(e - e0)], &slots, static_cast<int64_t>(slots.size()));
  }
  const size_t routed_jobs = jobs.size();
  if (moe.has_shared && T > 0) add(moe.shared, nullptr, T);
  if (sc.moe_x.size() < x_size) sc.moe_x.resize(x_size);
  if (sc.moe_h.size() < h_size) sc.moe_h.resize(h_size);
  if (sc.moe_y.size() < y_size) sc.moe_y.resize(y_size);
  auto rows_of = [&](const Job& j) { return j.slots ? sc.moe_x.data() + j.x : X; };

  // The products as items of at most ~1 MiB of weights each (a column range
  // of one matrix), in matrix order, each thread taking one contiguous run
  // of them: the threads' shares of bytes are equal to about one item, and
  // each reads its weights as a few long sequential runs (a run that starts
  // anew costs the prefetchers' warm-up: handing out items one by one was
  // slower).
  using Item = MoeItem;
  std::vector<Item>& up_items = sc.up_items;
  std::vector<Item>& down_items = sc.down_items;
  up_items.clear();
  down_items.clear();
  constexpr int64_t kItemBytes = int64_t{1} << 20;
  const int64_t threads = std::max(1, omp_get_max_threads());
  auto split = [&](std::vector<Item>& out, uint32_t job, uint8_t matrix, const Linear& w) {
    const int64_t parts = std::clamp<int64_t>((w.bytes() + kItemBytes - 1) / kItemBytes, 1, std::max<int64_t>(w.out / 16, 1));
    for (int64_t p = 0; p < parts; ++p) out.push_back(Item{job, matrix, w.out * p / parts, w.out * (p + 1) / parts});
  };
  for (uint32_t ji = 0; ji < jobs.size(); ++ji) {
    split(up_items, ji, 0, jobs[ji].mlp->gate);
    split(up_items, ji, 1, jobs[ji].mlp->up);
    split(down_items, ji, 2, jobs[ji].mlp->down);
  }
  FirstError err;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
#pragma omp for schedule(static)
    for (size_t ji = 0; ji < routed_jobs; ++ji) {  // gather each expert's rows
      const Job& j = jobs[ji];
      for (int64_t r = 0; r < j.n; ++r)
        std::memcpy(sc.moe_x.data() + j.x + static_cast<size_t>(r * H), X + (*j.slots)[static_cast<size_t>(r)] / K * H,
                    static_cast<size_t>(H) * sizeof(float));
    }
#pragma omp for schedule(static)
    for (size_t it = 0; it < up_items.size(); ++it) {  // gate and up
      const Item& item = up_items[it];
      const Job& j = jobs[item.job];
      const int64_t I = j.mlp->intermediate();
      const bool up = item.matrix == 1;
      err.Set(ApplyLinearCols(up ? j.mlp->up : j.mlp->gate, item.c0, item.c1, rows_of(j), j.n, H,
                              sc.moe_h.data() + j.h + static_cast<size_t>((up ? I : 0) + item.c0), 2 * I));
    }
#pragma omp for schedule(static)
    for (size_t ji = 0; ji < jobs.size(); ++ji) SiluMul(sc.moe_h.data() + jobs[ji].h, jobs[ji].n, jobs[ji].mlp->intermediate());
#pragma omp for schedule(static)
    for (size_t it = 0; it < down_items.size(); ++it) {  // down
      const Item& item = down_items[it];
      const Job& j = jobs[item.job];
      err.Set(ApplyLinearCols(j.mlp->down, item.c0, item.c1, sc.moe_h.data() + j.h, j.n, 2 * j.mlp->intermediate(),
                              sc.moe_y.data() + j.y + static_cast<size_t>(item.c0), H));
    }
  }
  MLARUN_RETURN_IF_ERROR(err.Get());

  // Weighted slots, summed in k order; routes to other ranks' experts add 0.
  std::vector<const float*>& slot_rows = sc.slot_rows;
  slot_rows.assign(static_cast<size_t>(T * K), nullptr);
  for (size_t ji = 0; ji < routed_jobs; ++ji)
    for (int64_t r = 0; r < jobs[ji].n; ++r)
      slot_rows[static_cast<size_t>((*jobs[ji].slots)[static_cast<size_t>(r)])] = sc.moe_y.data() + jobs[ji].y + static_cast<size_t>(r * H);
  const float* shared = moe.has_shared && T > 0 ? sc.moe_y.data() + jobs.back().y : nullptr;
#pragma omp parallel for schedule(static) if (T > 4)
  for (int64_t t = 0; t < T; ++t) {
    float* dst = Y + t * H;
    std::fill(dst, dst + H, 0.f);
    for (int64_t k = 0; k < K; ++k) {
      const float* src = slot_rows[static_cast<size_t>(t * K + k)];
      if (src == nullptr) continue;
      const float w = route_weights[static_cast<size_t>(t * K + k)];
      for (int64_t j = 0; j < H; ++j) dst[j] += src[j] * w;
    }
    if (shared)
      for (int64_t j = 0; j < H; ++j) dst[j] += shared[t * H + j];
  }
  if (T > 0) {
    traffic_.weight_bytes += moe.router.bytes();
    traffic_.flops += 2.0 * static_cast<double>(T * moe.router.out * moe.router.in);
  }
  for (const Job& j : jobs) {  // weights are read once per step; every row multiplies them
    traffic_.weight_bytes += j.mlp->bytes();
    traffic_.flops += 2.0 * static_cast<double>(j.n) * static_cast<double>(j.mlp->bytes() / static_cast<int64_t>(DTypeSize(j.mlp->gate.dtype)));
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
    mine = std::to_string(static_cast<int>(local.code())) + "|" + (rank_name.empty() ? "a rank" : rank_name) +
           ": " + local.message();
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
  out.failure = Status(static_cast<StatusCode>(code), "step failed on " + mine.substr(bar == std::string::npos ? 0 : bar + 1));
  return out;
}
}  // namespace

StatusOr<std::vector<float>> Model::Forward(std::span<const ForwardSeq> seqs, LatentPool& pool,
                                            const ParallelStep* parallel) {
  MLARUN_ASSIGN_OR_RETURN(const std::span<const float> logits, ForwardInto(seqs, pool, parallel));
  return std::vector<float>(logits.begin(), logits.end());
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
  Status collective;
  const Status local = ForwardImpl(seqs, pool, parallel, tp, peers, call, &scratch_->logits, &collective);
  routing_.resize(routing_layers_);  // the MoE layers this step ran (shrinks only when a step stopped early)
  if (!collective.ok()) return collective;  // nobody can be waited for
  if (parallel == nullptr) {
    last_failure_ = local;
    if (!local.ok()) return local;
    return std::span<const float>(scratch_->logits);
  }
  const Agreement agreed = AgreeOnFailure(tp, peers, local, parallel->rank_name);
  if (!agreed.collective.ok()) return agreed.collective;
  last_failure_ = agreed.failure;
  if (!agreed.failure.ok()) return agreed.failure;
  return std::span<const float>(scratch_->logits);
}

Status Model::ForwardImpl(std::span<const ForwardSeq> seqs, LatentPool& pool, const ParallelStep* parallel,
                          Communicator* tp, Communicator* peers, int64_t call, std::vector<float>* logits_out,
                          Status* collective) {
  const ModelConfig& c = config_;
  const ModelShard& shard = options_.shard;
  // N: this rank's heads.
  const int64_t H = c.hidden_size, N = c.num_attention_heads / shard.attn_tp_size, L = c.kv_lora_rank;
  const int64_t R = c.qk_rope_head_dim;
  const int64_t P = c.qk_nope_head_dim, V = c.v_head_dim, Dq = c.q_head_dim(), vocab = c.vocab_size;
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
  std::vector<int32_t>& block_table = sc.block_table;
  std::vector<int32_t>& positions = sc.positions;
  block_table.assign(static_cast<size_t>(S * max_blocks), 0);
  positions.assign(static_cast<size_t>(T), 0);
  for (int32_t i = 0; i < S && st.ok(); ++i) {
    const std::span<const int32_t> table = seqs[static_cast<size_t>(i)].block_table;
    std::copy(table.begin(), table.end(), block_table.begin() + i * max_blocks);
    for (int64_t j = 0; j < static_cast<int64_t>(seqs[static_cast<size_t>(i)].tokens.size()); ++j)
      positions[static_cast<size_t>(query_start[static_cast<size_t>(i)] + j)] =
          static_cast<int32_t>(seqs[static_cast<size_t>(i)].start_pos + j);
  }

  // Embeddings.
  auto zeroed = [](std::vector<float>& v, int64_t n) -> std::vector<float>& {
    v.assign(static_cast<size_t>(n), 0.f);
    return v;
  };
  std::vector<float>& h = zeroed(sc.h, T * H);
  std::vector<float>& x = zeroed(sc.x, T * H);
  const size_t wes = DTypeSize(c.weight_dtype);
  for (int32_t i = 0; i < S && st.ok(); ++i)
    for (size_t j = 0; j < seqs[static_cast<size_t>(i)].tokens.size(); ++j) {
      const int64_t t = query_start[static_cast<size_t>(i)] + static_cast<int64_t>(j);
      LoadToF32(embed_.row(seqs[static_cast<size_t>(i)].tokens[j]), c.weight_dtype, h.data() + t * H, H);
    }

  std::vector<float>& q = zeroed(sc.q, T * N * Dq);
  std::vector<float>& qa = zeroed(sc.qa, T * std::max<int64_t>(c.q_lora_rank, 1));
  std::vector<float>& kv = zeroed(sc.kv, T * (L + R));
  std::vector<float>& kv_c = zeroed(sc.kv_c, T * L);
  std::vector<float>& k_pe = zeroed(sc.k_pe, T * R);
  std::vector<float>& attn = zeroed(sc.attn, T * N * V);
  std::vector<float>& o_out = zeroed(sc.o_out, T * H);
  std::vector<float>& mlp_hidden = sc.mlp_hidden;  // ApplyMlp sizes it
  std::vector<float>& x_all = sc.x_all;
  std::vector<float>& y_all = zeroed(sc.y_all, T_all * H);
  std::vector<float>& y_local = zeroed(sc.y_local, T * H);

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
    RmsNormTo(h.data(), T, H, layer.input_norm.data(), H, c.rms_norm_eps, x.data(), H);
    if (c.q_lora_rank > 0) {
      MLARUN_RETURN_IF_ERROR(ApplyLinear(a.q_a, x.data(), T, H, qa.data(), c.q_lora_rank));
      RmsNorm(qa.data(), T, c.q_lora_rank, a.q_a_norm.data(), c.q_lora_rank, kLatentNormEps);
      MLARUN_RETURN_IF_ERROR(ApplyLinear(a.q_b, qa.data(), T, c.q_lora_rank, q.data(), N * Dq));
    } else {
      MLARUN_RETURN_IF_ERROR(ApplyLinear(a.q, x.data(), T, H, q.data(), N * Dq));
    }
    MLARUN_RETURN_IF_ERROR(ApplyLinear(a.kv_a, x.data(), T, H, kv.data(), L + R));
    RmsNormTo(kv.data(), T, L + R, a.kv_a_norm.data(), L, kLatentNormEps, kv_c.data(), L);
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(&k_pe[static_cast<size_t>(t * R)], &kv[static_cast<size_t>(t * (L + R) + L)], static_cast<size_t>(R) * sizeof(float));
    rope_->Apply(q.data() + P, T, N, N * Dq, Dq, positions.data());
    rope_->Apply(k_pe.data(), T, 1, R, 0, positions.data());
    for (int32_t i = 0; i < S; ++i) {
      const ForwardSeq& s = seqs[static_cast<size_t>(i)];
      const int64_t t = query_start[static_cast<size_t>(i)];
      MLARUN_RETURN_IF_ERROR(pool.WriteRows(li, s.block_table, s.start_pos, static_cast<int64_t>(s.tokens.size()),
                                            kv_c.data() + t * L, L, k_pe.data() + t * R, R));
    }
    ap.w_uk_t = a.w_uk_t.data();
    ap.w_uv = a.w_uv.data();
    ap.cache = pool.Layer(li);
    if (!planned) {
      MLARUN_RETURN_IF_ERROR(MlaReplan(ap, options_.attention, sc.attn_plan));
      planned = true;
    }
    const MlaPlan& plan = sc.attn_plan;
    WorkspaceView ws = attn_ws_.Reserve(plan.workspace_bytes);
    if (plan.workspace_bytes > 0 && ws.data == nullptr)
      return ResourceExhaustedError("model forward: cannot allocate ", plan.workspace_bytes, " bytes of attention workspace");
    if (Status run = MlaRun(ap, plan, ws); !run.ok()) return run.WithContext("layer " + std::to_string(li));
    MLARUN_RETURN_IF_ERROR(ApplyLinear(a.o, attn.data(), T, N * V, o_out.data(), H));
    const int64_t proj_bytes = a.q_a.bytes() + a.q_b.bytes() + a.q.bytes() + a.kv_a.bytes() + a.o.bytes();
    traffic_.weight_bytes += proj_bytes + static_cast<int64_t>(a.w_uk_t.size() + a.w_uv.size());
    traffic_.flops += 2.0 * static_cast<double>(T) * static_cast<double>(proj_bytes / static_cast<int64_t>(wes));
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
    if (st.ok())
      for (int64_t k = 0; k < T * H; ++k) h[static_cast<size_t>(k)] += o_out[static_cast<size_t>(k)];
    times_.attention += Since(t0);

    t0 = Clock::now();
    if (st.ok()) RmsNormTo(h.data(), T, H, layer.post_attention_norm.data(), H, c.rms_norm_eps, x.data(), H);
    // Every DP group's tokens, in dp_rank order.
    const float* X = x.data();
    if (peers) {
      x_all.resize(static_cast<size_t>(T_all * H));  // all of it written by the all-gather
      if (!join(peers->AllGatherV(x.data(), hidden_counts, x_all.data(), CommType::kF32))) return st;
      X = x_all.data();
    }
    if (st.ok()) {
      if (!layer.moe) {
        fail(ApplyMlp(layer.mlp, X, T_all, H, y_all.data(), H, /*accumulate=*/false, mlp_hidden));
        if (T_all > 0) {
          traffic_.weight_bytes += layer.mlp.bytes();
          traffic_.flops += 2.0 * static_cast<double>(T_all) * static_cast<double>(layer.mlp.bytes() / static_cast<int64_t>(wes));
        }
      } else {
        fail(MoeForward(layer.moe_mlp, X, T_all, y_all.data()));
      }
    }
    // This rank's partial outputs for this group's tokens, summed over the world.
    if (peers) {
      if (!join(peers->ReduceScatterSumV(y_all.data(), hidden_counts, y_local.data(), CommType::kF32))) return st;
    } else {
      std::copy(y_all.begin(), y_all.begin() + T * H, y_local.begin());
    }
    if (tp && !join(tp->AllReduceSum(y_local.data(), T * H, CommType::kF32))) return st;
    if (st.ok())
      for (int64_t k = 0; k < T * H; ++k) h[static_cast<size_t>(k)] += y_local[static_cast<size_t>(k)];
    (layer.moe ? times_.moe : times_.dense_mlp) += Since(t0);
  }
  if (!st.ok()) return st;

  // Logits for the rows asked for.
  const auto t_head = Clock::now();
  std::vector<float>& rows = zeroed(sc.rows, logit_rows * H);
  logits_out->assign(static_cast<size_t>(logit_rows * vocab), 0.f);
  int64_t r = 0;
  for (int32_t i = 0; i < S; ++i) {
    const ForwardSeq& s = seqs[static_cast<size_t>(i)];
    const int64_t n = static_cast<int64_t>(s.tokens.size()), t0 = query_start[static_cast<size_t>(i)];
    const int64_t first = s.logits == ForwardSeq::Logits::kAll ? 0 : n - 1;
    if (s.logits == ForwardSeq::Logits::kNone || n == 0) continue;
    for (int64_t j = first; j < n; ++j, ++r)
      std::memcpy(&rows[static_cast<size_t>(r * H)], &h[static_cast<size_t>((t0 + j) * H)], static_cast<size_t>(H) * sizeof(float));
  }
  RmsNorm(rows.data(), logit_rows, H, final_norm_.data(), H, c.rms_norm_eps);
  MLARUN_RETURN_IF_ERROR(ApplyLinear(lm_head_, rows.data(), logit_rows, H, logits_out->data(), vocab));
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
