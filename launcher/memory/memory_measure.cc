// `mlarun memory --measure`: the prediction beside what a live deployment's
// ranks report through the coordinator.
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "launcher/memory/format.h"
#include "launcher/memory/memory.h"
#include "launcher/memory/memory_internal.h"
#include "mlarun.grpc.pb.h"
#include "runtime/model/memory_plan.h"
#include "serving/client/grpc_util.h"
#include "serving/client/table.h"

namespace mlarun {
namespace {

namespace v1 = ::mlarun::v1;
using Json = nlohmann::json;
using memory_internal::Thousands;

StatusOr<v1::GetStatsResponse> FetchStats(v1::Mlarun::Stub& stub, double timeout_s, const ClientSecurity& security) {
  grpc::ClientContext ctx;
  client_internal::SetDeadline(ctx, timeout_s);
  client_internal::AddCredentials(ctx, security);
  v1::GetStatsResponse resp;
  const grpc::Status st = stub.GetStats(&ctx, v1::GetStatsRequest(), &resp);
  if (!st.ok())
    return UnavailableError("GetStats: ", client_internal::GrpcCodeName(st.error_code()), ": ", st.error_message());
  return resp;
}

// The ranks' reports settle once nothing runs or waits and two reads a stats
// period apart agree on every rank's cache counters.
std::string Fingerprint(const v1::GetStatsResponse& r) {
  std::ostringstream os;
  for (const v1::RankStats& k : r.ranks())
    os << k.worker_id() << "/" << k.rank() << ":" << k.cache_blocks_used() << "," << k.cache_blocks_retired() << ","
       << k.requests_running() << "," << k.requests_waiting() << ";";
  return os.str();
}
bool Idle(const v1::GetStatsResponse& r) {
  for (const v1::RankStats& k : r.ranks())
    if (k.requests_running() != 0 || k.requests_waiting() != 0) return false;
  return r.ranks_size() > 0;
}

// Blocks each DP group's requests held, from the request set alone: a request
// caches its prompt and every generated token but the last (which is sampled,
// never fed back), in whole blocks.
struct RequestSet {
  int64_t requests = 0, errors = 0;
  std::map<int64_t, int64_t> blocks_by_group;
  int64_t blocks_total = 0;
};

StatusOr<RequestSet> ReadRequestSet(const std::string& requests_path, const std::string& results_path,
                                    int64_t block_size) {
  std::ifstream rq(requests_path), rs(results_path);
  if (!rq) return NotFoundError("--requests ", requests_path, ": cannot open the file");
  if (!rs) return NotFoundError("--results ", results_path, ": cannot open the file");
  RequestSet set;
  std::string a, b;
  int64_t line = 0;
  while (std::getline(rq, a)) {
    ++line;
    if (a.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (!std::getline(rs, b))
      return InvalidArgumentError("--results ", results_path, " has fewer lines than --requests (", line, " and on)");
    Json req, res;
    try {
      req = Json::parse(a);
      res = Json::parse(b);
    } catch (const Json::exception& e) {
      return InvalidArgumentError("line ", line, " of --requests or --results is not JSON: ", e.what());
    }
    if (!req.contains("prompt_ids") || !req["prompt_ids"].is_array())
      return InvalidArgumentError("--requests ", requests_path, ":", line, ": no prompt_ids array");
    ++set.requests;
    if (res.contains("error") || !res.contains("tokens") || !res.contains("dp_group")) {
      ++set.errors;
      continue;
    }
    const int64_t cached = static_cast<int64_t>(req["prompt_ids"].size() + res["tokens"].size()) - 1;
    const int64_t blocks = (cached + block_size - 1) / block_size;
    set.blocks_by_group[res["dp_group"].get<int64_t>()] += blocks;
    set.blocks_total += blocks;
  }
  return set;
}

struct Side {
  WeightBytes weights;
  int64_t bytes_per_token = 0, block_bytes = 0, blocks_total = 0, request_blocks = -1;
};

Json SideJson(const Side& s) {
  Json j{{"attention_replicated", s.weights.attention_replicated},
         {"attention_split", s.weights.attention - s.weights.attention_replicated},
         {"moe", s.weights.moe},
         {"dense_mlp", s.weights.dense_mlp},
         {"embedding_and_head", s.weights.embedding_and_head},
         {"weights_total", s.weights.total()},
         {"cache_bytes_per_token", s.bytes_per_token},
         {"cache_block_bytes", s.block_bytes},
         {"cache_blocks_total", s.blocks_total},
         {"cache_bytes_capacity", s.blocks_total * s.block_bytes}};
  if (s.request_blocks >= 0) j["request_blocks"] = s.request_blocks;
  return j;
}

// GetStats until the ranks' reports settle (or the timeout passes): the last
// response, and whether it had settled.
struct SettledStats {
  v1::GetStatsResponse stats;
  bool settled = false;
};
StatusOr<SettledStats> WaitForSettledStats(const MemoryOptions& opt) {
  auto stub = v1::Mlarun::NewStub(client_internal::ConnectChannel(opt.coordinator, opt.security.tls, opt.timeout_s));
  // Wait for the reports to settle (or the timeout), then take the last one.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(opt.timeout_s);
  SettledStats out;
  MLARUN_ASSIGN_OR_RETURN(out.stats, FetchStats(*stub, opt.timeout_s, opt.security));
  while (std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    MLARUN_ASSIGN_OR_RETURN(v1::GetStatsResponse next, FetchStats(*stub, opt.timeout_s, opt.security));
    out.settled = Idle(next) && Fingerprint(next) == Fingerprint(out.stats);
    out.stats = std::move(next);
    if (out.settled) break;
  }
  return out;
}

// One worker job's comparison as it is built, rank by rank: its table rows,
// its JSON ranks, and whether everything agreed.
struct JobComparison {
  std::vector<std::vector<std::string>> rows, gpu_rows;
  Json ranks_json = Json::array();
  int64_t measured_request_blocks = 0;
  bool agree = true;
};

// A GPU rank: what its runner allocated on the device against the
// prediction (weights + cache pool). The allocation also holds the RoPE
// tables and cudaMalloc's 256-byte rounding, so it agrees when it is at
// least the prediction and within 16 MiB + 0.1% above it.
void CompareDeviceMemory(const v1::RankStats& k, const Side& p, JobComparison& job) {
  const int64_t want = p.weights.total() + p.blocks_total * p.block_bytes;
  const int64_t got = k.device_allocated_bytes(), extra = got - want;
  const bool device_agree = extra >= 0 && extra <= (int64_t{16} << 20) + want / 1000;
  job.agree &= device_agree;
  job.gpu_rows.push_back({std::to_string(k.rank()), k.device(), Thousands(want), Thousands(got), Thousands(extra),
                          memory_internal::Human(k.device_free_bytes()), memory_internal::Human(k.device_total_bytes()),
                          device_agree ? "yes" : "NO"});
  job.ranks_json.back()["device"] = Json{{"name", k.device()},
                                         {"predicted_bytes", want},
                                         {"allocated_bytes", got},
                                         {"free_bytes", k.device_free_bytes()},
                                         {"total_bytes", k.device_total_bytes()},
                                         {"agree", device_agree}};
}

// One rank of a job: its prediction from `c` and `layout` (the projections
// as checkpoint `model` stores them) beside what it reported, as a table row
// and a JSON object added to `job`.
void CompareRank(const MemoryOptions& opt, const std::string& model, const ModelConfig& c, const ParallelLayout& layout,
                 const std::optional<RequestSet>& set, const v1::RankStats& k, JobComparison& job) {
  Side p, m;
  const ModelShard shard = ModelShard::For(layout, k.rank());
  // The projections as the rank holds them (an fp8 checkpoint kept fp8; an
  // integer one int8 / int4 as its quantization_config says).
  WeightFormat format;
  if (k.projection_dtype() == DTypeName(DType::kF8E4M3)) {
    format.projection_dtype = DType::kF8E4M3;
  } else if (!k.projection_dtype().empty()) {
    auto f = CheckpointWeightFormat(model);  // --model, else the checkpoint the job loaded
    if (f.ok()) format = *f;
  }
  // An lm_head quantized at load (--lm-head; one stored so is in `format`).
  if (auto head = ParseLmHeadMode(k.lm_head_dtype()); head.ok()) format = WithLmHead(std::move(format), *head);
  p.weights = PredictWeightBytes(c, shard, format);
  // The prefill workspace is reserved from the shapes on both sides (it is
  // allocated only when a long prefill runs), so it is an input here, not
  // a measurement.
  const int64_t workspace = PredictPrefillWorkspace(c, layout.attn_tp, opt.chunk_rows).total();
  p.bytes_per_token = LatentBytesPerToken(c);
  p.block_bytes = p.bytes_per_token * k.block_size();
  const int64_t budget =
      k.memory_budget_bytes() > 0 ? k.memory_budget_bytes() - p.weights.total() - workspace : k.cache_budget_bytes();
  p.blocks_total = LatentCacheConfig::BlocksIn(budget, p.block_bytes);
  m.weights = WeightBytes{.attention = k.attention_weight_bytes(),
                          .attention_replicated = k.attention_replicated_weight_bytes(),
                          .dense_mlp = k.dense_mlp_weight_bytes(),
                          .moe = k.moe_weight_bytes(),
                          .embedding_and_head = k.embedding_head_weight_bytes()};
  m.bytes_per_token = k.cache_bytes_per_token();
  m.block_bytes = k.cache_block_bytes();
  m.blocks_total = k.cache_blocks_total();
  if (set) {
    auto it = set->blocks_by_group.find(k.dp_group());
    p.request_blocks = it == set->blocks_by_group.end() ? 0 : it->second;
    m.request_blocks = k.cache_blocks_retired();
    job.measured_request_blocks += m.request_blocks;
  }
  const bool weights_agree = p.weights.attention == m.weights.attention &&
                             p.weights.attention_replicated == m.weights.attention_replicated &&
                             p.weights.moe == m.weights.moe && p.weights.dense_mlp == m.weights.dense_mlp &&
                             p.weights.embedding_and_head == m.weights.embedding_and_head;
  const bool cache_agree = p.bytes_per_token == m.bytes_per_token && p.block_bytes == m.block_bytes &&
                           p.blocks_total == m.blocks_total && p.request_blocks == m.request_blocks;
  const bool agree = weights_agree && cache_agree && workspace == k.workspace_bytes();
  job.agree &= agree;
  auto pair = [](int64_t x, int64_t y) { return Thousands(x) + " | " + Thousands(y); };
  const int64_t not_accounted = k.resident_bytes() - m.weights.total() - m.blocks_total * m.block_bytes;
  job.rows.push_back(
      {std::to_string(k.rank()), std::to_string(k.dp_group()), std::to_string(k.attn_tp_rank()),
       pair(p.weights.total(), m.weights.total()), pair(p.bytes_per_token, m.bytes_per_token),
       pair(p.blocks_total * p.block_bytes, m.blocks_total * m.block_bytes), pair(p.blocks_total, m.blocks_total),
       set ? pair(p.request_blocks, m.request_blocks) : std::string("-"), Thousands(k.cache_blocks_peak()),
       agree            ? "yes"
       : !weights_agree ? "NO (weights)"
       : !cache_agree   ? "NO (cache)"
                        : "NO (workspace reserved)",
       memory_internal::Human(k.resident_bytes()), memory_internal::Human(not_accounted)});
  job.ranks_json.push_back(Json{{"rank", k.rank()},
                                {"dp_group", k.dp_group()},
                                {"attn_tp_rank", k.attn_tp_rank()},
                                {"predicted", SideJson(p)},
                                {"measured", SideJson(m)},
                                {"workspace_reserved_bytes", k.workspace_bytes()},
                                {"cache_blocks_peak", k.cache_blocks_peak()},
                                {"cache_bytes_peak", k.cache_bytes_peak()},
                                {"resident_bytes", k.resident_bytes()},
                                {"not_accounted_bytes", not_accounted},
                                {"agree", agree}});
  if (k.device().starts_with("cuda")) CompareDeviceMemory(k, p, job);
}

// One worker job (one mpirun): every rank predicted and compared, its tables
// onto `text`; its JSON object, with `all_agree` cleared when anything
// differs. `role` is its groups' (GetStats groups[].role): a prefill or
// decode job of a split is its own world, predicted from its own layout
// like any job (its MoE over its own ranks).
StatusOr<Json> MeasureJob(const MemoryOptions& opt, const std::string& worker_id, const std::string& role,
                          std::vector<const v1::RankStats*>& ranks, std::ostringstream& text, bool& all_agree) {
  std::sort(ranks.begin(), ranks.end(), [](auto* a, auto* b) { return a->rank() < b->rank(); });
  const v1::RankStats& first = *ranks.front();
  const std::string model = opt.model.empty() ? first.model() : opt.model;
  const std::string kv = opt.kv_dtype.empty() ? first.kv_dtype() : opt.kv_dtype;
  MLARUN_ASSIGN_OR_RETURN(ModelConfig c, memory_internal::LoadMemoryModel(model, kv, opt.num_layers));
  if (opt.num_layers == 0 && first.num_layers() > 0 && first.num_layers() != c.num_hidden_layers) {
    // The worker ran a reduced depth (--num-layers, YAML models).
    MLARUN_ASSIGN_OR_RETURN(c, memory_internal::LoadMemoryModel(model, kv, first.num_layers()));
  }
  MLARUN_ASSIGN_OR_RETURN(const ParallelLayout layout, ParseParallelLayout(first.parallel()));
  if (static_cast<int>(ranks.size()) != layout.world())
    return FailedPreconditionError("worker job ", worker_id, " (", first.parallel(), ") reported ", ranks.size(),
                                   " of its ", layout.world(), " ranks");
  std::optional<RequestSet> set;
  if (!opt.requests_path.empty()) {
    MLARUN_ASSIGN_OR_RETURN(RequestSet s, ReadRequestSet(opt.requests_path, opt.results_path, first.block_size()));
    set = std::move(s);
  }
  text << "mlarun memory --measure: " << opt.coordinator << ", job " << worker_id
       << (role.empty() ? std::string() : " (" + role + ")") << ", " << model << " (" << c.num_hidden_layers
       << " layers, cache " << DTypeName(c.kv_dtype) << "), " << memory_internal::LayoutName(layout) << " ("
       << first.parallel() << ")\n";
  if (first.memory_budget_bytes() > 0) {
    text << "  cache sized from " << Thousands(first.memory_budget_bytes())
         << " B per rank minus weights and prefill workspace\n";
  } else {
    text << "  cache sized by a budget of " << Thousands(first.cache_budget_bytes()) << " B per rank\n";
  }
  text << "  each cell: predicted | measured\n";
  JobComparison cmp;
  for (const v1::RankStats* k : ranks) CompareRank(opt, model, c, layout, set, *k, cmp);
  all_agree &= cmp.agree;
  PrintTable(text,
             {"rank", "group", "tp", "weights (B)", "cache B/token", "cache capacity (B)", "blocks", "request blocks",
              "peak", "agree", "resident (RSS)", "not accounted"},
             {true, true, true, false, false, false, false, false, false, true, false, false}, cmp.rows, "  ");
  if (!cmp.gpu_rows.empty()) {
    text << "  GPU memory at registration (predicted: weights + cache pool)\n";
    PrintTable(text, {"rank", "device", "predicted (B)", "allocated (B)", "other (B)", "free", "total", "agree"},
               {true, true, false, false, false, false, false, true}, cmp.gpu_rows, "  ");
  }
  Json job{{"worker_id", worker_id},
           {"role", role.empty() ? "mixed" : role},
           {"model", model},
           {"parallel", first.parallel()},
           {"layout", memory_internal::LayoutName(layout)},
           {"block_size", first.block_size()},
           {"memory_budget_bytes", first.memory_budget_bytes()},
           {"ranks", cmp.ranks_json}};
  if (set) {
    const int64_t predicted = set->blocks_total * layout.attn_tp;
    job["request_set"] = Json{{"requests", set->requests},
                              {"errors", set->errors},
                              {"blocks_once", set->blocks_total},
                              {"blocks_predicted_all_ranks", predicted},
                              {"blocks_measured_all_ranks", cmp.measured_request_blocks}};
    text << "  the request set (" << set->requests << " requests"
         << (set->errors ? ", " + std::to_string(set->errors) + " failed" : "") << "): " << Thousands(set->blocks_total)
         << " blocks of latent cache; held " << layout.attn_tp << (layout.attn_tp == 1 ? " time" : " times")
         << " over the ranks: " << Thousands(predicted) << " blocks predicted, "
         << Thousands(cmp.measured_request_blocks) << " measured\n";
    all_agree &= predicted == cmp.measured_request_blocks;
  }
  return job;
}

}  // namespace

Status RunMemoryMeasure(const MemoryOptions& opt, std::ostream& out) {
  MLARUN_RETURN_IF_ERROR(client_internal::CheckAddress(opt.coordinator));
  if (opt.requests_path.empty() != opt.results_path.empty())
    return InvalidArgumentError(
        "--requests and --results go together (the request set and its `mlarun "
        "submit --json` output)");
  MLARUN_ASSIGN_OR_RETURN(const SettledStats got, WaitForSettledStats(opt));
  const v1::GetStatsResponse& stats = got.stats;
  if (stats.ranks_size() == 0)
    return UnavailableError("the coordinator at ", opt.coordinator, " has no ranks registered");

  // One prediction per worker job (one mpirun).
  std::map<std::string, std::vector<const v1::RankStats*>> jobs;
  for (const v1::RankStats& k : stats.ranks()) jobs[k.worker_id()].push_back(&k);
  // Each job's role, from its groups (one role per job: mlarun worker --role).
  std::map<std::string, std::string> roles;
  for (const v1::GroupStats& g : stats.groups())
    if (!g.role().empty()) roles[g.worker_id()] = g.role();
  if (!opt.requests_path.empty() && jobs.size() > 1)
    return InvalidArgumentError("--requests/--results: the coordinator has ", jobs.size(),
                                " worker jobs, and submit's dp_group does not "
                                "say which; measure one job at a time");

  bool all_agree = true;
  Json jobs_json = Json::array();
  std::ostringstream text;
  for (auto& [worker_id, ranks] : jobs) {
    const auto role = roles.find(worker_id);
    MLARUN_ASSIGN_OR_RETURN(
        Json job, MeasureJob(opt, worker_id, role == roles.end() ? "" : role->second, ranks, text, all_agree));
    jobs_json.push_back(std::move(job));
  }
  text << (all_agree ? "predicted and measured agree: weights to the byte, latent "
                       "cache to the block, on every rank\n"
                     : "predicted and measured DISAGREE (see the rows marked NO)\n");
  if (!got.settled) text << "note: the ranks' reports had not settled within " << opt.timeout_s << " s\n";
  MLARUN_RETURN_IF_ERROR(memory_internal::Emit(
      opt,
      Json{{"coordinator", opt.coordinator}, {"settled", got.settled}, {"agree", all_agree}, {"jobs", jobs_json}}.dump(
          2) +
          "\n",
      text.str(), out));
  if (!all_agree) return FailedPreconditionError("predicted and measured memory differ");
  return Status::Ok();
}

}  // namespace mlarun
