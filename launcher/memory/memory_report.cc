// `mlarun memory`: the prediction, as tables, JSON and an SVG chart.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "launcher/memory/format.h"
#include "launcher/memory/memory.h"
#include "launcher/memory/memory_internal.h"
#include "runtime/model/memory_plan.h"
#include "runtime/model/safetensors.h"

namespace mlarun {
namespace memory_internal {

StatusOr<ParallelLayout> ParseLayoutName(const std::string& name, int world) {
  auto l = ParseParallelLayout(name);
  if (!l.ok()) return InvalidArgumentError("layout '", name, "': ", l.status().message());
  if (world > 0 && l->world() != world)
    return InvalidArgumentError("layout '", name, "' has ", l->world(), " ranks (dp ", l->dp, " x attn_tp ", l->attn_tp,
                                ") but --world is ", world);
  return *l;
}

std::string LayoutName(const ParallelLayout& l) {
  std::string s = l.dp == 1        ? "tp" + std::to_string(l.attn_tp)
                  : l.attn_tp == 1 ? "dp" + std::to_string(l.dp)
                                   : "dp" + std::to_string(l.dp) + "xtp" + std::to_string(l.attn_tp);
  return l.moe == MoeSharding::kByIntermediate ? s + "(moe=intermediate)" : s;
}

StatusOr<ModelConfig> LoadMemoryModel(const std::string& path, const std::string& kv_dtype, int64_t num_layers) {
  if (path.empty())
    return InvalidArgumentError("--model is required (a checkpoint directory, config.json or YAML file)");
  if (!std::filesystem::exists(path)) return NotFoundError("--model ", path, ": no such file or directory");
  MLARUN_ASSIGN_OR_RETURN(const ModelOverrides ov, ParseModelOverrides(kv_dtype, num_layers));
  return Model::LoadConfig(path, ov);  // parsed configs are validated
}

Status Emit(const MemoryOptions& opt, const std::string& doc, const std::string& text, std::ostream& out) {
  out << (opt.json ? doc : text);
  if (opt.json_path.empty()) return Status::Ok();
  std::ofstream f(opt.json_path);
  if (!(f << doc)) return InvalidArgumentError("--json-out ", opt.json_path, ": cannot write the file");
  return Status::Ok();
}

StatusOr<std::optional<DType>> ParseWeightDType(const std::string& name) {
  if (name.empty()) return std::optional<DType>();
  if (name == "fp8" || name == "f8_e4m3" || name == "e4m3") return std::optional<DType>(DType::kF8E4M3);
  if (name == "int8") return std::optional<DType>(DType::kInt8);
  if (name == "int4") return std::optional<DType>(DType::kInt4);
  auto dt = ParseDType(name);
  if (!dt.ok() || (*dt != DType::kBF16 && *dt != DType::kF32))
    return InvalidArgumentError("--weight-dtype must be bf16, fp32, fp8, int8 or int4, got '", name, "'");
  return std::optional<DType>(*dt);
}

StatusOr<WeightFormat> MemoryWeightFormat(const MemoryOptions& o) {
  MLARUN_ASSIGN_OR_RETURN(const LmHeadMode head, ParseLmHeadMode(o.lm_head));
  if (o.weight_dtype.empty()) {
    MLARUN_ASSIGN_OR_RETURN(WeightFormat f, CheckpointWeightFormat(o.model));
    return WithLmHead(std::move(f), head);
  }
  MLARUN_ASSIGN_OR_RETURN(const std::optional<DType> proj, ParseWeightDType(o.weight_dtype));
  WeightFormat f{.projection_dtype = proj};
  if (proj && IsIntWeight(*proj)) {
    if (o.group_size > 0 && o.group_size % 2 != 0)
      return InvalidArgumentError("--group-size must be even (or 0: per channel), got ", o.group_size);
    f.group = o.group_size;
  }
  return WithLmHead(std::move(f), head);
}

namespace {
std::string ProjectionsName(const WeightFormat& f, DType weight_dtype) {
  const std::string rest = std::string(DTypeName(weight_dtype)) + " embeddings";
  if (f.projection_dtype == DType::kF8E4M3) return "fp8 e4m3 projections (128x128 fp32 block scales), " + rest;
  if (f.projection_dtype && IsIntWeight(*f.projection_dtype))
    return std::string(*f.projection_dtype == DType::kInt4 ? "int4" : "int8") + " projections (fp32 scales " +
           (f.group > 0 ? "per " + std::to_string(f.group) + " elements" : std::string("per output channel")) +
           (f.offsets ? ", offsets" : "") + "), " + rest;
  return std::string(DTypeName(f.projection_dtype.value_or(weight_dtype)));
}
}  // namespace

std::string WeightFormatName(const WeightFormat& f, DType weight_dtype) {
  std::string name = ProjectionsName(f, weight_dtype);
  if (f.lm_head != nullptr && f.lm_head->projection_dtype && f.quantized && f.quantized("lm_head"))
    name += std::string(", lm_head ") + (*f.lm_head->projection_dtype == DType::kInt4 ? "int4" : "int8");
  return name;
}

}  // namespace memory_internal

namespace {

using Json = nlohmann::json;
using memory_internal::BytesAndUnit;
using memory_internal::Decimal;
using memory_internal::ExactUnit;
using memory_internal::Human;
using memory_internal::LayoutName;
using memory_internal::Thousands;

std::string ModelName(const std::string& path) {
  std::filesystem::path p(path);
  if (p.filename() == "config.json") p = p.parent_path();
  std::string name = p.filename().string();
  if (name.empty()) name = p.parent_path().filename().string();
  for (const char* ext : {".yaml", ".yml", ".json"}) {
    if (name.ends_with(ext)) name.resize(name.size() - std::strlen(ext));
  }
  return name;
}

// Everything the report shows, computed once.
struct Report {
  std::string model_name, model_path;
  ModelConfig config;
  std::string weight_dtype_name;  // as held
  MemoryOptions opt;
  int64_t memory_bytes = 0;
  // The single-job (mixed) layouts, in order.
  std::vector<std::string> names;
  std::vector<RankMemory> plans;
  // Prefill/decode splits: each job planned over its own ranks.
  struct Split {
    std::string name;
    RankMemory prefill, decode;
  };
  std::vector<Split> splits;
  int64_t prompt_tokens = 0, context_tokens = 0;  // what a group's cache is counted in
  // Cache per token.
  int64_t latent_layer = 0, latent_token = 0, expanded_token = 0, cache_token = 0;
  int64_t indexer_layer = 0, indexer_token = 0;  // V3.2's key, over this model's layers
  PrefillWorkspace workspace_tp1;
  GqaModel gqa;
  int64_t gqa_token = 0;
  double tp_break_even = 0;
  // Every pair of layouts where `more_dp` has more DP groups than `less_dp`.
  struct BreakEven {
    size_t less_dp = 0, more_dp = 0;
    int64_t extra_bytes = 0;  // weights + workspace more per rank under more_dp
    double memory_bytes = 0;  // BreakEvenMemoryBytes
    double tokens_ratio = 0;  // distinct tokens, more_dp / less_dp, at the given memory (0: either holds none)
  };
  std::vector<BreakEven> break_even;
};

constexpr double kKiB = 1024.0, kMiB = 1024.0 * 1024.0, kGiB = 1024.0 * 1024.0 * 1024.0;

// --layouts as the CLI split it on commas, rejoined: a key=value part
// continues the layout before it unless that has the key already
// ("dp=2,attn_tp=4,moe=..."; "dp2xtp4,moe=intermediate" too: dp2xtp4 holds
// dp and attn_tp). In a split only its last job counts ("p:dp=2,attn_tp=1+
// d:dp=2,attn_tp=1" arrives as "p:dp=2", "attn_tp=1+d:dp=2", "attn_tp=1").
std::vector<std::string> JoinLayoutParts(const std::vector<std::string>& parts) {
  std::vector<std::string> names;
  for (const std::string& part : parts) {
    const size_t eq = part.find('=');
    const std::string last = names.empty() ? std::string() : names.back().substr(names.back().rfind('+') + 1);
    const bool joins = eq != std::string::npos && !names.empty() &&
                       (last.find('=') != std::string::npos || part.starts_with("moe=")) &&
                       last.find(part.substr(0, eq + 1)) == std::string::npos;
    if (joins) {
      names.back() += "," + part;
    } else {
      names.push_back(part);
    }
  }
  return names;
}

// The plan of one job of a split (`role` names it in errors).
StatusOr<RankMemory> PlanJob(const ModelConfig& c, const std::string& split, const char* role, const ParallelLayout& l,
                             const MemoryPlanOptions& mo) {
  auto plan = PlanRankMemory(c, l, mo);
  if (!plan.ok()) return InvalidArgumentError("layout ", split, ", ", role, " job: ", plan.status().message());
  return *plan;
}

// Plans every layout of --layouts into r.names / r.plans and r.splits. When
// only splits are named, the default mixed layouts of the world (and the
// mixed layout of the split's own groups) go beside them for comparison.
Status PlanLayouts(Report& r, const MemoryPlanOptions& mo) {
  const int world = r.opt.world;
  std::vector<std::string> names = JoinLayoutParts(r.opt.layouts), mixed;
  std::vector<memory_internal::SplitLayout> splits;
  for (const std::string& n : names) {
    if (memory_internal::IsSplitName(n)) {
      MLARUN_ASSIGN_OR_RETURN(const memory_internal::SplitLayout s, memory_internal::ParseSplitName(n, world));
      splits.push_back(s);
    } else {
      mixed.push_back(n);
    }
  }
  if (mixed.empty()) {
    mixed = {"tp" + std::to_string(world), "dp" + std::to_string(world)};
    if (world >= 4 && world % 2 == 0) mixed.push_back("dp2xtp" + std::to_string(world / 2));
    for (const memory_internal::SplitLayout& s : splits) {
      if (s.prefill.attn_tp != s.decode.attn_tp || s.prefill.moe != s.decode.moe) continue;
      const ParallelLayout same{.dp = s.prefill.dp + s.decode.dp, .attn_tp = s.prefill.attn_tp, .moe = s.prefill.moe};
      const std::string name = "dp=" + std::to_string(same.dp) + ",attn_tp=" + std::to_string(same.attn_tp) +
                               (same.moe == MoeSharding::kByIntermediate ? ",moe=intermediate" : "");
      const bool listed = std::any_of(mixed.begin(), mixed.end(), [&](const std::string& m) {
        auto l = memory_internal::ParseLayoutName(m, 0);
        return l.ok() && *l == same;
      });
      if (!listed) mixed.push_back(name);
    }
  }
  for (const std::string& n : mixed) {
    MLARUN_ASSIGN_OR_RETURN(const ParallelLayout l, memory_internal::ParseLayoutName(n, world));
    auto plan = PlanRankMemory(r.config, l, mo);
    if (!plan.ok()) return InvalidArgumentError("layout ", n, ": ", plan.status().message());
    r.names.push_back(LayoutName(l));
    r.plans.push_back(*plan);
  }
  for (const memory_internal::SplitLayout& s : splits) {
    Report::Split split{.name = memory_internal::SplitName(s)};
    MLARUN_ASSIGN_OR_RETURN(split.prefill, PlanJob(r.config, split.name, "prefill", s.prefill, mo));
    MLARUN_ASSIGN_OR_RETURN(split.decode, PlanJob(r.config, split.name, "decode", s.decode, mo));
    r.splits.push_back(std::move(split));
  }
  return Status::Ok();
}

StatusOr<Report> Build(const MemoryOptions& o) {
  Report r;
  r.opt = o;
  r.model_path = o.model;
  r.model_name = ModelName(o.model);
  MLARUN_ASSIGN_OR_RETURN(r.config, memory_internal::LoadMemoryModel(o.model, o.kv_dtype, o.num_layers));
  // By default what loading holds: an fp8 checkpoint's projections stay fp8,
  // an integer one's int8 / int4.
  MLARUN_ASSIGN_OR_RETURN(const WeightFormat format, memory_internal::MemoryWeightFormat(o));
  r.weight_dtype_name = memory_internal::WeightFormatName(format, r.config.weight_dtype);
  if (o.world < 1) return InvalidArgumentError("--world must be at least 1, got ", o.world);
  if (!(o.memory_gib > 0) || o.memory_gib > 1e6)
    return InvalidArgumentError("--hbm-gib must be in (0, 1e6], got ", o.memory_gib);
  r.memory_bytes = static_cast<int64_t>(o.memory_gib * kGiB);
  if (o.prompt_tokens < 1) return InvalidArgumentError("--prompt-tokens must be at least 1, got ", o.prompt_tokens);
  if (o.context_tokens < 0)
    return InvalidArgumentError("--context-tokens must be positive (or 0: --prompt-tokens + 1024), got ",
                                o.context_tokens);
  r.prompt_tokens = o.prompt_tokens;
  r.context_tokens = o.context_tokens > 0 ? o.context_tokens : o.prompt_tokens + 1024;
  const MemoryPlanOptions mo{.memory_bytes = r.memory_bytes,
                             .block_size = o.block_size,
                             .chunk_rows = o.chunk_rows,
                             .projection_dtype = std::nullopt,
                             .weight_format = format};
  MLARUN_RETURN_IF_ERROR(PlanLayouts(r, mo));
  const ModelConfig& c = r.config;
  r.latent_layer = LatentBytesPerTokenLayer(c);
  r.latent_token = LatentBytesPerToken(c);
  r.expanded_token = ExpandedKvBytesPerToken(c);
  r.cache_token = CacheBytesPerToken(c);
  r.indexer_layer = IndexerKeyBytesPerTokenLayer(c.has_indexer() ? c.index_head_dim : kV32IndexHeadDim);
  r.indexer_token = r.indexer_layer * c.num_hidden_layers;
  r.workspace_tp1 = PredictPrefillWorkspace(c, 1, o.chunk_rows);
  r.gqa = Llama3_70B();
  r.gqa_token = GqaKvBytesPerToken(r.gqa);
  r.tp_break_even = MlaTpBreakEven(r.gqa_token, r.latent_token);
  for (size_t a = 0; a < r.plans.size(); ++a) {
    for (size_t b = 0; b < r.plans.size(); ++b) {
      const RankMemory &A = r.plans[a], &B = r.plans[b];
      auto m = BreakEvenMemoryBytes(A, B);
      if (!m.ok()) continue;  // not a pair with more DP groups on the right
      const bool both = A.cluster_cached_tokens() > 0 && B.cluster_cached_tokens() > 0;
      r.break_even.push_back(
          {.less_dp = a,
           .more_dp = b,
           .extra_bytes = (B.weights.total() + B.workspace.total()) - (A.weights.total() + A.workspace.total()),
           .memory_bytes = *m,
           .tokens_ratio = both ? static_cast<double>(B.cluster_cached_tokens()) / A.cluster_cached_tokens() : 0});
    }
  }
  return r;
}

// ---- JSON ----------------------------------------------------------------------

Json WeightsJson(const WeightBytes& w) {
  return Json{{"attention_replicated", w.attention_replicated},
              {"attention_split", w.attention - w.attention_replicated},
              {"moe", w.moe},
              {"dense_mlp", w.dense_mlp},
              {"embedding_and_head", w.embedding_and_head},
              {"total", w.total()}};
}

// What a group's cache holds at once (memory_internal::HeldBy), as JSON.
Json HeldJson(const RankMemory& p, const char* unit, int64_t tokens_each) {
  const memory_internal::Held h = memory_internal::HeldBy(p, tokens_each);
  return Json{{"unit", unit},
              {"tokens_each", h.tokens_each},
              {"blocks_each", h.blocks_each},
              {"per_group", h.per_group},
              {"cluster", h.cluster}};
}

// One job's layout: its per-rank breakdown, the cluster (or job) view, and
// what its groups hold in the units of `role`.
Json LayoutJson(const Report& r, const std::string& name, const RankMemory& p, const std::string& role) {
  const bool prompts = role == "prefill";
  return Json{{"name", name},
              {"role", role},
              {"dp", p.layout.dp},
              {"attn_tp", p.layout.attn_tp},
              {"ranks", p.layout.world()},
              {"moe", p.layout.moe == MoeSharding::kByExpert ? "expert" : "intermediate"},
              {"per_rank",
               {{"weights", WeightsJson(p.weights)},
                {"prefill_workspace_bytes", p.workspace.total()},
                {"prefill_workspace",
                 {{"rows", p.workspace.rows},
                  {"heads", p.workspace.heads},
                  {"latent_bytes", p.workspace.latent_bytes},
                  {"key_bytes", p.workspace.key_bytes},
                  {"value_bytes", p.workspace.value_bytes}}},
                {"cache_bytes_per_token", p.cache_bytes_per_token},
                {"cache_budget_bytes", p.cache_budget_bytes},
                {"cache_blocks", p.cache_blocks},
                {"max_cached_tokens", p.max_cached_tokens},
                {"fits", p.fits()}}},
              {"cluster",
               {{"distinct_cached_tokens", p.cluster_cached_tokens()},
                {"copies_per_token", p.layout.attn_tp},
                {"cache_bytes_per_distinct_token", p.cache_bytes_per_token * p.layout.attn_tp}}},
              {"groups", p.layout.dp},
              {"held", HeldJson(p, prompts ? "prompt" : "sequence", prompts ? r.prompt_tokens : r.context_tokens)}};
}

// A split: both jobs, and each job against every mixed layout of the report.
Json SplitJson(const Report& r, const Report::Split& s) {
  Json vs = Json::array();
  const memory_internal::Held decode = memory_internal::HeldBy(s.decode, r.context_tokens);
  for (size_t i = 0; i < r.plans.size(); ++i) {
    const RankMemory& m = r.plans[i];
    vs.push_back(Json{{"mixed", r.names[i]},
                      {"prefill_extra_weight_bytes_per_rank", s.prefill.weights.total() - m.weights.total()},
                      {"decode_extra_weight_bytes_per_rank", s.decode.weights.total() - m.weights.total()},
                      {"decode_sequences", decode.cluster},
                      {"mixed_sequences", memory_internal::HeldBy(m, r.context_tokens).cluster}});
  }
  return Json{{"name", s.name},
              {"world", s.prefill.layout.world() + s.decode.layout.world()},
              {"jobs",
               {LayoutJson(r, LayoutName(s.prefill.layout), s.prefill, "prefill"),
                LayoutJson(r, LayoutName(s.decode.layout), s.decode, "decode")}},
              // The transfer plane reads blocks straight into the decode
              // pool's own blocks: no staging buffer on either side.
              {"transfer_staging_bytes_per_rank", 0},
              {"vs_mixed", vs}};
}

Json ToJson(const Report& r) {
  const ModelConfig& c = r.config;
  Json layouts = Json::array();
  for (size_t i = 0; i < r.plans.size(); ++i) layouts.push_back(LayoutJson(r, r.names[i], r.plans[i], "mixed"));
  Json splits = Json::array();
  for (const Report::Split& s : r.splits) splits.push_back(SplitJson(r, s));
  Json break_even = Json::array();
  for (const Report::BreakEven& e : r.break_even) {
    break_even.push_back(Json{{"less_dp", r.names[e.less_dp]},
                              {"more_dp", r.names[e.more_dp]},
                              {"extra_replicated_bytes_per_rank", e.extra_bytes},
                              {"break_even_memory_bytes", e.memory_bytes},
                              {"distinct_tokens_ratio", e.tokens_ratio > 0 ? Json(e.tokens_ratio) : Json(nullptr)}});
  }
  Json gqa_rows = Json::array();
  for (int tp : {1, 2, 4, 8}) {
    gqa_rows.push_back(Json{{"tp", tp},
                            {"mla_bytes_per_rank", r.latent_token},
                            {"mla_bytes_per_group", r.latent_token * tp},
                            {"gqa_bytes_per_rank", GqaKvBytesPerTokenPerRank(r.gqa, tp)},
                            {"gqa_bytes_per_group", GqaKvBytesPerTokenPerRank(r.gqa, tp) * tp}});
  }
  return Json{{"model",
               {{"name", r.model_name},
                {"path", r.model_path},
                {"layers", c.num_hidden_layers},
                {"heads", c.num_attention_heads},
                {"kv_lora_rank", c.kv_lora_rank},
                {"qk_rope_head_dim", c.qk_rope_head_dim},
                {"weights", r.weight_dtype_name},
                {"kv_dtype", DTypeName(c.kv_dtype)},
                {"indexer", c.has_indexer()}}},
              {"world", r.opt.world},
              {"memory_bytes_per_rank", r.memory_bytes},
              {"block_size", r.opt.block_size},
              {"cache_per_token",
               {{"latent_bytes_per_layer", r.latent_layer},
                {"latent_bytes", r.latent_token},
                {"latent_kib", r.latent_token / kKiB},
                {"bytes", r.cache_token},
                {"expanded_bytes", r.expanded_token},
                {"expanded_mib", r.expanded_token / kMiB},
                {"expanded_ratio", std::round(100.0 * r.expanded_token / r.latent_token) / 100.0},
                {"v32_indexer_key",
                 {{"in_model", c.has_indexer()},
                  {"bytes_per_layer", r.indexer_layer},
                  {"layers", c.num_hidden_layers},
                  {"bytes", r.indexer_token},
                  {"kib", std::round(100.0 * r.indexer_token / kKiB) / 100.0}}}}},
              {"prefill_workspace_all_heads",
               {{"rows", r.workspace_tp1.rows},
                {"latent_bytes", r.workspace_tp1.latent_bytes},
                {"key_bytes", r.workspace_tp1.key_bytes},
                {"value_bytes", r.workspace_tp1.value_bytes}}},
              {"prompt_tokens", r.prompt_tokens},
              {"context_tokens", r.context_tokens},
              {"layouts", layouts},
              {"disaggregated", splits},
              {"break_even", break_even},
              {"gqa_comparison",
               {{"model", r.gqa.name},
                {"layers", r.gqa.layers},
                {"kv_heads", r.gqa.kv_heads},
                {"head_dim", r.gqa.head_dim},
                {"bytes_per_token", r.gqa_token},
                {"kib_per_token", r.gqa_token / kKiB},
                {"mla_tp_break_even", std::round(100.0 * r.tp_break_even) / 100.0},
                {"rows", gqa_rows}}}};
}

// ---- Text ----------------------------------------------------------------------

// One column of the per-rank table: a mixed layout, or one job of a split
// (the split's name above its prefill job).
struct Column {
  std::string top, label, role;
  const RankMemory* plan = nullptr;
};

std::vector<Column> Columns(const Report& r) {
  std::vector<Column> cols;
  for (size_t i = 0; i < r.plans.size(); ++i) cols.push_back({"", r.names[i], "mixed", &r.plans[i]});
  for (const Report::Split& s : r.splits) {
    cols.push_back({s.name, "prefill " + LayoutName(s.prefill.layout), "prefill", &s.prefill});
    cols.push_back({"", "decode " + LayoutName(s.decode.layout), "decode", &s.decode});
  }
  return cols;
}

// What one group of `col` holds at once: prompts on a prefill group, running
// sequences on the others.
memory_internal::Held HeldOf(const Report& r, const Column& col) {
  return memory_internal::HeldBy(*col.plan, col.role == "prefill" ? r.prompt_tokens : r.context_tokens);
}

// Per rank, one column per mixed layout and per job of a split.
void PrintPerRankTable(const Report& r, std::ostream& out) {
  const std::vector<Column> cols = Columns(r);
  std::vector<std::vector<std::string>> rows;
  auto row = [&](const std::string& label, auto&& cell) {
    std::vector<std::string> v{label};
    for (const Column& col : cols) v.push_back(cell(col));
    rows.push_back(v);
  };
  auto plan_row = [&](const std::string& label, auto&& cell) {
    row(label, [&](const Column& col) { return cell(*col.plan); });
  };
  std::vector<std::string> head{"Per rank (" + Decimal(r.opt.memory_gib) + " GiB)"};
  for (const Column& col : cols) head.push_back(col.label);
  rows.push_back(head);
  plan_row("  attention, replicated", [](const RankMemory& p) { return Human(p.weights.attention_replicated); });
  plan_row("  attention, split by head",
           [](const RankMemory& p) { return Human(p.weights.attention - p.weights.attention_replicated); });
  plan_row("  MoE experts and routers", [](const RankMemory& p) { return Human(p.weights.moe); });
  plan_row("  dense MLP", [](const RankMemory& p) { return Human(p.weights.dense_mlp); });
  plan_row("  embeddings and head", [](const RankMemory& p) { return Human(p.weights.embedding_and_head); });
  plan_row("  weights", [](const RankMemory& p) { return Human(p.weights.total()); });
  plan_row("  prefill workspace", [](const RankMemory& p) { return Human(p.workspace.total()); });
  plan_row("  left for the cache", [](const RankMemory& p) {
    return p.cache_budget_bytes < 0 ? Human(p.cache_budget_bytes) + " (does not fit)" : Human(p.cache_budget_bytes);
  });
  plan_row("  cache per token", [](const RankMemory& p) { return Thousands(p.cache_bytes_per_token) + " B"; });
  plan_row("  cache blocks", [](const RankMemory& p) { return Thousands(p.cache_blocks); });
  plan_row("  max cached tokens", [](const RankMemory& p) { return Thousands(p.max_cached_tokens); });
  rows.push_back({r.splits.empty() ? "Cluster" : "Cluster (a split: each job)"});
  plan_row("  copies of each token", [](const RankMemory& p) { return std::to_string(p.layout.attn_tp); });
  plan_row("  distinct cached tokens", [](const RankMemory& p) { return Thousands(p.cluster_cached_tokens()); });
  rows.push_back({"Groups"});
  row("  role", [](const Column& col) { return col.role; });
  plan_row("  groups", [](const RankMemory& p) { return std::to_string(p.layout.dp); });
  // Prompts on prefill groups, running sequences on the others ("-" where
  // the group does not hold that kind).
  auto held = [&](bool prompts, bool all) {
    return [&r, prompts, all](const Column& col) {
      if ((col.role == "prefill") != prompts) return std::string("-");
      const memory_internal::Held h = HeldOf(r, col);
      return Thousands(all ? h.cluster : h.per_group);
    };
  };
  row("  prompts per group", held(true, false));
  row("  prompts, all groups", held(true, true));
  row("  sequences per group", held(false, false));
  row("  sequences, all groups", held(false, true));
  std::vector<size_t> width(cols.size() + 1, 0);
  for (const auto& v : rows)
    for (size_t i = 0; i < v.size(); ++i) width[i] = std::max(width[i], v[i].size());
  // A split's name spans its two columns.
  for (size_t i = 0; i + 1 < cols.size(); ++i) {
    const size_t span = width[i + 1] + 2 + width[i + 2];
    if (span < cols[i].top.size()) width[i + 2] += cols[i].top.size() - span;
  }
  out << "\n";
  if (!r.splits.empty()) {
    std::string line;
    size_t pos = width[0];
    for (size_t i = 0; i < cols.size(); ++i) {
      pos += 2;
      if (!cols[i].top.empty()) {
        line.resize(pos, ' ');
        line += cols[i].top;
      }
      pos += width[i + 1];
    }
    out << line << "\n";
  }
  for (const auto& v : rows) {
    for (size_t i = 0; i < v.size(); ++i) {
      if (v.size() == 1) {
        out << v[0];  // a section's title: no padding after it
      } else if (i == 0) {
        out << std::left << std::setw(static_cast<int>(width[0])) << v[0];
      } else {
        out << "  " << std::right << std::setw(static_cast<int>(width[i])) << v[i];
      }
    }
    out << std::left << "\n";
  }
  out << "  (held at once: prompts of " << Thousands(r.prompt_tokens) << " tokens on a prefill group, --prompt-tokens; "
      << "running sequences of " << Thousands(r.context_tokens)
      << " tokens on a decode or mixed group, --context-tokens; whole blocks each)\n";
}

// Each split: what its two jobs' groups hold, the transfer plane's share
// (nothing), and each job against the mixed layouts of the same world.
void PrintSplits(const Report& r, std::ostream& out) {
  if (r.splits.empty()) return;
  out << "\nDisaggregated: a prefill job and a decode job, each its own world, each sharding the MoE and dense MLP "
         "over its own ranks only\n";
  auto job = [&](const char* role, const RankMemory& p, int64_t tokens, const char* unit, const char* all) {
    const memory_internal::Held h = memory_internal::HeldBy(p, tokens);
    out << "    " << role << LayoutName(p.layout) << ": ";
    if (!p.fits()) {
      out << "does not fit (weights and workspace exceed " << Decimal(r.opt.memory_gib) << " GiB per rank)\n";
      return;
    }
    out << p.layout.dp << (p.layout.dp == 1 ? " group x " : " groups x ") << Thousands(h.per_group) << " " << unit
        << " of " << Thousands(tokens) << " tokens = " << Thousands(h.cluster) << " " << all << "\n";
  };
  for (const Report::Split& s : r.splits) {
    out << "  " << s.name << " (" << s.prefill.layout.world() << " + " << s.decode.layout.world() << " ranks)\n";
    job("prefill ", s.prefill, r.prompt_tokens, "prompts", "prompts in flight");
    job("decode  ", s.decode, r.context_tokens, "sequences", "running sequences");
    out << "    transfer staging: 0 B per rank (blocks are fetched straight into the decode pool's own blocks)\n";
    const int64_t decode = memory_internal::HeldBy(s.decode, r.context_tokens).cluster;
    auto more = [](int64_t d) {
      std::string s = d >= 0 ? "+" : "";
      return s += Human(d);
    };
    for (size_t i = 0; i < r.plans.size(); ++i) {
      const RankMemory& m = r.plans[i];
      out << "    vs " << r.names[i] << ": weights per rank " << more(s.prefill.weights.total() - m.weights.total())
          << " (prefill), " << more(s.decode.weights.total() - m.weights.total()) << " (decode); running sequences "
          << Thousands(decode) << " against " << Thousands(memory_internal::HeldBy(m, r.context_tokens).cluster)
          << " on " << m.layout.dp << " mixed " << (m.layout.dp == 1 ? "group" : "groups") << " (which also prefill)\n";
    }
  }
}

void PrintText(const Report& r, std::ostream& out) {
  const ModelConfig& c = r.config;
  const int64_t e = static_cast<int64_t>(DTypeSize(c.kv_dtype));
  const int64_t L = c.kv_lora_rank, R = c.qk_rope_head_dim, n = c.num_hidden_layers;
  out << "mlarun memory: " << r.model_name << " (" << r.model_path << ")\n"
      << "  " << n << " layers, " << c.num_attention_heads << " heads, hidden " << c.hidden_size << ", "
      << c.n_routed_experts << " routed experts; weights " << r.weight_dtype_name << ", cache " << DTypeName(c.kv_dtype)
      << "; " << r.opt.world << " ranks x " << Decimal(r.opt.memory_gib) << " GiB; blocks of " << r.opt.block_size
      << " tokens\n\n";

  out << "Cache per token\n";
  out << "  latent row, one layer      (" << L << " + " << R << ") x " << e << " B = " << Thousands(r.latent_layer)
      << " B\n";
  out << "  all " << n << " layers" << std::string(n < 10 ? 15 : 14, ' ') << n << " x " << Thousands(r.latent_layer)
      << " B = " << BytesAndUnit(r.latent_token) << "\n";
  out << "  expanded per-head K/V      " << n << " x " << c.num_attention_heads << " x (" << c.q_head_dim() << " + "
      << c.v_head_dim << ") x " << e << " B = " << BytesAndUnit(r.expanded_token) << " ("
      << Decimal(std::round(100.0 * r.expanded_token / r.latent_token) / 100.0) << "x the latent)\n";
  out << "  DeepSeek-V3.2 indexer key  " << (c.has_indexer() ? c.index_head_dim : kV32IndexHeadDim)
      << " fp8 + 4 B scale = " << r.indexer_layer << " B per layer; " << n
      << " layers: " << BytesAndUnit(r.indexer_token)
      << (c.has_indexer() ? " (this model has it: cached per token " : " (not in this model; V3.2 adds it to its ")
      << Thousands(r.latent_token) << " B latent)\n";
  if (c.has_indexer()) out << "  cached per token           " << Thousands(r.cache_token) << " B\n";

  const PrefillWorkspace& w = r.workspace_tp1;
  out << "\nPrefill workspace (expanded path, context up-projected in chunks of " << Thousands(w.rows) << " rows)\n";
  out << "  latent chunk               " << Thousands(w.rows) << " x " << L + R << " x " << e
      << " B = " << Thousands(w.latent_bytes) << " B\n";
  out << "  up-projected keys          " << Thousands(w.rows) << " x " << c.num_attention_heads << " x "
      << c.q_head_dim() << " x " << e << " B = " << Thousands(w.key_bytes) << " B ("
      << Decimal(std::round(100.0 * w.key_bytes / w.latent_bytes) / 100.0)
      << "x the latent; a rank keeps heads / attn_tp)\n";
  out << "  up-projected values        " << Thousands(w.rows) << " x " << c.num_attention_heads << " x " << c.v_head_dim
      << " x " << e << " B = " << Thousands(w.value_bytes) << " B\n";

  PrintPerRankTable(r, out);
  PrintSplits(r, out);

  if (std::none_of(r.plans.begin(), r.plans.end(), [](const RankMemory& p) { return p.fits(); })) {
    out << "\nNo layout leaves room for the cache: the weights need more than " << Decimal(r.opt.memory_gib)
        << " GiB per rank. More ranks (--world) split the experts further";
    if (!r.weight_dtype_name.starts_with("fp8"))
      out << "; --weight-dtype fp8 sizes the projections as the DeepSeek-V3 release stores them (e4m3 with 128x128 "
             "block scales), which is how mlarun holds a checkpoint stored that way (an fp8 checkpoint directory "
             "given as --model is sized so by default)";
    out << ".\n";
  }

  // DP vs TP: what each replicates.
  if (!r.break_even.empty())
    out << "\nBreak-even: DP replicates attention weights and workspace; TP replicates every cached token\n";
  for (const Report::BreakEven& e : r.break_even) {
    out << "  " << r.names[e.more_dp] << " vs " << r.names[e.less_dp] << ": " << Human(e.extra_bytes)
        << " more per rank (" << Thousands(e.extra_bytes / r.plans[e.less_dp].cache_bytes_per_token)
        << " tokens of cache); it caches more distinct tokens "
        << (e.memory_bytes <= 0 ? std::string("at any memory size")
                                : "once a rank has more than " + Human(static_cast<int64_t>(e.memory_bytes)));
    if (e.tokens_ratio > 0)
      out << "; at " << Decimal(r.opt.memory_gib) << " GiB: " << Decimal(std::round(100.0 * e.tokens_ratio) / 100.0)
          << "x the tokens";
    out << "\n";
  }

  out << "\nMLA vs GQA under tensor parallelism (" << r.gqa.name << ": " << r.gqa.layers << " layers, "
      << r.gqa.kv_heads << " KV heads of " << r.gqa.head_dim << ", bf16: " << r.gqa.layers << " x " << r.gqa.kv_heads
      << " x " << r.gqa.head_dim << " x 2 x 2 B = " << BytesAndUnit(r.gqa_token) << " per token)\n";
  out << "  KiB per token:  TP   MLA per rank   MLA per TP group   GQA per rank   GQA per TP group\n";
  for (int tp : {1, 2, 4, 8}) {
    const int64_t g = GqaKvBytesPerTokenPerRank(r.gqa, tp);
    out << "                 " << std::setw(3) << std::right << tp << "   " << std::setw(12)
        << Decimal(r.latent_token / kKiB) << "   " << std::setw(16) << Decimal(r.latent_token * tp / kKiB) << "   "
        << std::setw(12) << Decimal(g / kKiB) << "   " << std::setw(16) << Decimal(g * tp / kKiB) << std::left << "\n";
  }
  out << "  The latent is replicated on every TP rank, GQA heads are split: MLA + TP stops winning at TP = "
      << Decimal(r.gqa_token / kKiB) << " / " << Decimal(r.latent_token / kKiB) << " = "
      << Decimal(std::round(100.0 * r.tp_break_even) / 100.0) << ". DP attention keeps each token's latent once.\n";
}

// ---- SVG -----------------------------------------------------------------------

Status WriteSvg(const Report& r, const std::string& path) {
  std::ofstream f(path);
  if (!f) return InvalidArgumentError("--svg ", path, ": cannot write the file");
  struct Part {
    const char* name;
    const char* color;
  };
  const Part parts[] = {{"attention, replicated", "#c0392b"},
                        {"attention, split by head", "#e67e22"},
                        {"MoE", "#2980b9"},
                        {"dense MLP", "#8e44ad"},
                        {"embeddings and head", "#7f8c8d"},
                        {"prefill workspace", "#f1c40f"},
                        {"latent cache", "#27ae60"}};
  const int bar_w = 90, gap = 70, left = 80, top = 70, plot_h = 300;
  const int k = static_cast<int>(r.plans.size());
  // Right of the bars: the per-rank memory line's label, then the legend
  // beside it (never under it: the line sits anywhere from the top of the
  // plot, when the weights alone exceed the memory, to its bottom).
  const int label_w = 120, legend_w = 180;
  // A split is two jobs of their own worlds: not drawn, a line says so.
  const int width = left + k * (bar_w + gap) + label_w + legend_w,
            height = top + plot_h + 110 + (r.splits.empty() ? 0 : 18);
  double max_bytes = static_cast<double>(r.memory_bytes);
  for (const RankMemory& p : r.plans)
    max_bytes = std::max(max_bytes, static_cast<double>(p.weights.total() + p.workspace.total()));
  auto y_of = [&](double bytes) { return top + plot_h - bytes / max_bytes * plot_h; };
  f << "<svg xmlns='http://www.w3.org/2000/svg' width='" << width << "' height='" << height
    << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n";
  f << "<text x='" << left << "' y='22' font-size='15'>" << r.model_name << ": memory per rank, " << r.opt.world
    << " ranks x " << Decimal(r.opt.memory_gib) << " GiB (weights "
    << (r.weight_dtype_name.starts_with("fp8") ? std::string("fp8 projections")
                                               : std::string(DTypeName(r.config.weight_dtype)))
    << ", cache " << DTypeName(r.config.kv_dtype) << ")</text>\n";
  f << "<text x='" << left
    << "' y='42'>bars: what one rank holds; under each: max cached tokens per rank and distinct tokens in the "
       "cluster</text>\n";
  // Axis in GiB.
  const double step_gib = std::max(1.0, std::pow(10.0, std::floor(std::log10(max_bytes / kGiB / 2))));
  for (double g = 0; g * kGiB <= max_bytes * 1.0001; g += step_gib) {
    const double y = y_of(g * kGiB);
    f << "<line x1='" << left - 5 << "' x2='" << left + k * (bar_w + gap) << "' y1='" << y << "' y2='" << y
      << "' stroke='#eee'/>\n<text x='" << left - 8 << "' y='" << y + 4 << "' text-anchor='end'>" << Decimal(g)
      << " GiB</text>\n";
  }
  const double hbm_y = y_of(static_cast<double>(r.memory_bytes));
  for (int i = 0; i < k; ++i) {
    const RankMemory& p = r.plans[static_cast<size_t>(i)];
    const double vals[] = {double(p.weights.attention_replicated),
                           double(p.weights.attention - p.weights.attention_replicated),
                           double(p.weights.moe),
                           double(p.weights.dense_mlp),
                           double(p.weights.embedding_and_head),
                           double(p.workspace.total()),
                           double(std::max<int64_t>(0, p.cache_blocks * p.block_bytes))};
    const int x = left + gap / 2 + i * (bar_w + gap);
    double acc = 0;
    for (int j = 0; j < 7; ++j) {
      if (vals[j] <= 0) continue;
      const double y1 = y_of(acc + vals[j]), y0 = y_of(acc);
      f << "<rect x='" << x << "' y='" << y1 << "' width='" << bar_w << "' height='" << std::max(0.0, y0 - y1)
        << "' fill='" << parts[j].color << "'><title>" << parts[j].name << ": " << Human(static_cast<int64_t>(vals[j]))
        << "</title></rect>\n";
      acc += vals[j];
    }
    f << "<text x='" << x + bar_w / 2 << "' y='" << top + plot_h + 18 << "' text-anchor='middle' font-size='13'>"
      << r.names[static_cast<size_t>(i)] << "</text>\n";
    f << "<text x='" << x + bar_w / 2 << "' y='" << top + plot_h + 36 << "' text-anchor='middle'>"
      << (p.fits() ? Thousands(p.max_cached_tokens) + " / rank" : std::string("does not fit")) << "</text>\n";
    f << "<text x='" << x + bar_w / 2 << "' y='" << top + plot_h + 52 << "' text-anchor='middle'>"
      << (p.fits() ? Thousands(p.cluster_cached_tokens()) + " cluster" : std::string()) << "</text>\n";
  }
  f << "<line x1='" << left - 5 << "' x2='" << left + k * (bar_w + gap) << "' y1='" << hbm_y << "' y2='" << hbm_y
    << "' stroke='black' stroke-dasharray='6,4'/>\n<text x='" << left + k * (bar_w + gap) + 4 << "' y='" << hbm_y + 4
    << "'>" << Decimal(r.opt.memory_gib) << " GiB per rank</text>\n";
  for (int j = 0; j < 7; ++j) {
    const int y = top + 30 + j * 20;
    const int x = left + k * (bar_w + gap) + label_w;
    f << "<rect x='" << x << "' y='" << y << "' width='12' height='12' fill='" << parts[j].color << "'/>\n<text x='"
      << x + 18 << "' y='" << y + 11 << "'>" << parts[j].name << "</text>\n";
  }
  if (!r.splits.empty()) {
    std::string names;
    for (const Report::Split& s : r.splits) names += (names.empty() ? "" : ", ") + s.name;
    f << "<text x='" << left << "' y='" << height - 48 << "'>not drawn: " << names
      << " (a prefill job and a decode job, each its own world; see the tables)</text>\n";
  }
  f << "<text x='" << left << "' y='" << height - 30 << "'>latent cache: " << Thousands(r.cache_token)
    << " B per token on every rank that holds it</text>\n";
  f << "<text x='" << left << "' y='" << height - 12
    << "'>the attn-TP ranks of a group hold the same tokens; DP groups hold different ones</text>\n";
  f << "</svg>\n";
  return f.good() ? Status::Ok() : InternalError("--svg ", path, ": write failed");
}

}  // namespace

Status RunMemory(const MemoryOptions& opt, std::ostream& out) {
  MLARUN_ASSIGN_OR_RETURN(const Report r, Build(opt));
  if (!opt.svg_path.empty()) MLARUN_RETURN_IF_ERROR(WriteSvg(r, opt.svg_path));
  std::ostringstream text;
  PrintText(r, text);
  if (!opt.svg_path.empty())
    text << "\nchart written to " << opt.svg_path
         << (r.splits.empty() ? "" : " (the mixed layouts; a split is two jobs, in the tables only)") << "\n";
  return memory_internal::Emit(opt, ToJson(r).dump(2) + "\n", text.str(), out);
}

}  // namespace mlarun
