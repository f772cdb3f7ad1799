#include "runtime/rank/bootstrap.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <ostream>

#include "base/cpu_isa.h"
#include "base/cuda_device.h"
#include "parallel/communicator.h"
#include "parallel/mpi/mpi_world.h"
#include "parallel/nccl/nccl_communicator.h"
#include "runtime/model/model_config.h"
#include "runtime/rank/thresholds.h"

namespace mlarun {
namespace {

// A loading rank's progress lines: one per this many seconds at most.
constexpr double kLoadProgressPeriodS = 5;

}  // namespace

DeploymentSpec::Fields DeploymentSpec::ToFields() const {
  return {{"--model", model},
          {"--parallel", parallel},
          {"--kv-dtype", kv_dtype},
          {"--num-layers", std::to_string(num_layers)},
          {"--experts", std::to_string(experts)},
          {"--weights", weights},
          {"--attention-thresholds", attention_thresholds},
          {"--device", device},
          {"--fp8-weights", fp8_weights},
          {"--lm-head", lm_head},
          {"weight limit (bytes)", std::to_string(max_weight_bytes)},
          {"--fail-forward-call", std::to_string(fail_forward_call) + "@" + std::to_string(fail_forward_rank)}};
}

Status ParseFailForwardCall(std::string_view text, DeploymentSpec* spec) {
  auto number = [](std::string_view t, int64_t* v) {
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), *v);
    return ec == std::errc() && end == t.data() + t.size() && *v >= 0;
  };
  const size_t at = text.find('@');
  int64_t call = 0, rank = -1;
  if (!number(text.substr(0, at), &call) ||
      (at != std::string_view::npos && (!number(text.substr(at + 1), &rank) || rank > INT32_MAX)))
    return InvalidArgumentError("--fail-forward-call: expected N or N@RANK (N, RANK >= 0), got '", text, "'");
  spec->fail_forward_call = call;
  spec->fail_forward_rank = static_cast<int>(rank);
  return Status::Ok();
}

std::string DescribeSpecDifference(const DeploymentSpec::Fields& first, const DeploymentSpec::Fields& other,
                                   int other_rank) {
  auto shown = [](const std::string& v) { return v.empty() ? std::string("none") : "'" + v + "'"; };
  for (size_t i = 0; i < first.size() && i < other.size(); ++i) {
    if (first[i] != other[i])
      return first[i].first + ": rank " + std::to_string(other_rank) + " has " + shown(other[i].second) +
             ", rank 0 has " + shown(first[i].second);
  }
  return first.size() == other.size() ? std::string() : "the ranks' specs have different fields";
}

std::string EncodeSpecFields(const DeploymentSpec::Fields& fields) { return nlohmann::json(fields).dump(); }

StatusOr<DeploymentSpec::Fields> DecodeSpecFields(std::string_view text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_array()) return InvalidArgumentError("deployment spec: not a JSON array");
  try {
    return j.get<DeploymentSpec::Fields>();
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError("deployment spec: ", e.what());
  }
}

StatusOr<Backend> ParseDeviceFlag(std::string_view device) {
  if (device == "cpu") return Backend::kCpu;
  if (device == "cuda") return Backend::kCuda;
  return InvalidArgumentError("--device: expected cpu or cuda, got '", device, "'");
}

StatusOr<int> SelectDeviceForSpec(const DeploymentSpec& spec, int rank) {
  MLARUN_ASSIGN_OR_RETURN(const Backend backend, ParseDeviceFlag(spec.device));
  if (backend == Backend::kCpu) return -1;
  auto devices = CudaDevices();
  if (!devices.ok()) return devices.status().WithContext("--device cuda");
  const int index = NodeLocalRank(rank) % static_cast<int>(devices->size());
  if (Status st = SelectCudaDevice(index); !st.ok()) return st.WithContext("--device cuda");
  SetCudaErrorLabel("rank " + std::to_string(rank));
  return index;
}

StatusOr<LoadedModel> LoadModelForSpec(const DeploymentSpec& spec, const ModelShard& shard, int rank,
                                       std::function<void(const std::string&)> progress,
                                       std::function<void(int64_t, int64_t, int64_t)> on_layer) {
  const bool yaml = spec.model.ends_with(".yaml") || spec.model.ends_with(".yml");
  if (!yaml && spec.experts > 0) return InvalidArgumentError("--experts applies to YAML models only");
  MLARUN_ASSIGN_OR_RETURN(const ModelOverrides ov, ParseModelOverrides(spec.kv_dtype, spec.num_layers));
  LoadedModel lm;
  uint64_t seed = 0;
  MLARUN_ASSIGN_OR_RETURN(lm.config, Model::LoadConfig(spec.model, ov, &seed));
  if (spec.experts > 0) {
    ModelConfig& c = lm.config;
    if (spec.experts % c.n_group != 0 || spec.experts < c.num_experts_per_tok)
      return InvalidArgumentError("--experts ", spec.experts, " must be a multiple of n_group (", c.n_group,
                                  ") and at least num_experts_per_tok (", c.num_experts_per_tok, ")");
    c.n_routed_experts = spec.experts;
    MLARUN_RETURN_IF_ERROR(ValidateModelConfig(c));
  }
  MLARUN_RETURN_IF_ERROR(ValidateModelShard(lm.config, shard));
  if (spec.fp8_weights == "keep")
    lm.options.fp8_weights = Fp8Weights::kKeep;
  else if (spec.fp8_weights == "dequantize")
    lm.options.fp8_weights = Fp8Weights::kDequantize;
  else
    return InvalidArgumentError("--fp8-weights: expected keep or dequantize, got '", spec.fp8_weights, "'");
  MLARUN_ASSIGN_OR_RETURN(lm.options.lm_head, ParseLmHeadMode(spec.lm_head));
  // As the loader will hold the checkpoint's projections and lm_head.
  MLARUN_ASSIGN_OR_RETURN(const WeightFormat format, CheckpointWeightFormat(spec.model, lm.options.fp8_weights));
  lm.predicted = PredictWeightBytes(lm.config, shard, WithLmHead(format, lm.options.lm_head));
  if (lm.predicted.total() > spec.max_weight_bytes)
    return ResourceExhaustedError("the model's weights would take ", lm.predicted.total() >> 20, " MiB (limit ",
                                  spec.max_weight_bytes >> 20, " MiB): reduce --num-layers or --experts");
  lm.options.shard = shard;
  MLARUN_ASSIGN_OR_RETURN(lm.options.attention.backend, ParseDeviceFlag(spec.device));
  if (lm.options.attention.backend == Backend::kCuda) MLARUN_RETURN_IF_ERROR(SelectDeviceForSpec(spec, rank).status());
  if (const Status st = ApplyAbsorbThresholdsFile(spec.attention_thresholds, &lm.options.attention); !st.ok())
    return st.WithContext("--attention-thresholds");
  lm.options.progress = std::move(progress);
  if (on_layer)
    lm.options.on_layer = [on_layer = std::move(on_layer), bytes = lm.predicted.total()](int64_t done, int64_t n) {
      on_layer(done, n, bytes);
    };
  MLARUN_ASSIGN_OR_RETURN(lm.options.weights, ParseWeightLoading(spec.weights));
  if (spec.fail_forward_call >= 0 && (spec.fail_forward_rank < 0 || spec.fail_forward_rank == rank))
    lm.options.fail_forward_call = spec.fail_forward_call;
  MLARUN_ASSIGN_OR_RETURN(lm.model, Model::FromConfig(spec.model, lm.config, seed, lm.options));
  return lm;
}

namespace {

// Every rank's outcome of one phase: OK on every rank when all succeeded,
// else on every rank the same error, with the code of the first rank that
// failed and each failed rank's name and message (ranks that failed alike
// listed once: "rank 0 (a), rank 1 (b): message").
Status AgreeOnOutcome(Communicator& world, const Status& mine, const std::string& name, std::string_view phase) {
  const std::string note =
      mine.ok() ? std::string() : std::to_string(static_cast<int>(mine.code())) + "\t" + name + "\t" + mine.message();
  auto all = AllGatherStrings(world, note);
  if (!all.ok())
    return UnavailableError(phase, ": the ranks could not exchange their outcome: ", all.status().message());
  std::vector<std::pair<std::string, std::string>> by_message;  // (message, rank names), first seen first
  int failed = 0;
  StatusCode code = StatusCode::kOk;
  for (const std::string& n : *all) {
    if (n.empty()) continue;
    const size_t t1 = n.find('\t'), t2 = n.find('\t', t1 + 1);
    if (failed++ == 0) code = static_cast<StatusCode>(std::stoi(n.substr(0, t1)));
    const std::string who = n.substr(t1 + 1, t2 - t1 - 1), what = n.substr(t2 + 1);
    auto it = std::find_if(by_message.begin(), by_message.end(), [&](const auto& e) { return e.first == what; });
    if (it == by_message.end()) {
      by_message.emplace_back(what, who);
    } else {
      it->second += ", " + who;
    }
  }
  if (failed == 0) return Status::Ok();
  std::string message =
      std::string(phase) + " failed on " + std::to_string(failed) + " of " + std::to_string(all->size()) + " ranks: ";
  for (size_t i = 0; i < by_message.size(); ++i)
    message += (i ? "; " : "") + by_message[i].second + ": " + by_message[i].first;
  return Status(code, message);
}

}  // namespace

std::string FormatBytes(double bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) bytes /= 1024, ++unit;
  char buf[48];
  std::snprintf(buf, sizeof buf, unit == 0 ? "%.0f %s" : "%.2f %s", bytes, kUnits[unit]);
  return buf;
}

LoadProgressLog::LoadProgressLog(std::string who, double period_s, std::function<double()> now_s,
                                 std::function<void(const std::string&)> write)
    : who_(std::move(who)),
      period_s_(period_s),
      now_s_(std::move(now_s)),
      write_(std::move(write)),
      start_s_(now_s_()),
      said_s_(start_s_) {}

void LoadProgressLog::OnLayer(int64_t done, int64_t layers, int64_t weight_bytes) {
  const double now = now_s_();
  if (now - said_s_ < period_s_ || layers <= 0 || done <= 0) return;
  said_s_ = now;
  const double share = static_cast<double>(done) / static_cast<double>(layers);
  const double read = share * static_cast<double>(weight_bytes), elapsed = now - start_s_;
  const double rate = elapsed > 0 ? read / elapsed : 0;
  const double eta = rate > 0 ? (static_cast<double>(weight_bytes) - read) / rate : 0;
  char line[160];
  std::snprintf(line, sizeof line, ": loading: layer %lld/%lld, about %s of %s (%.0f%%), %s/s, ETA %.0f s",
                static_cast<long long>(done), static_cast<long long>(layers), FormatBytes(read).c_str(),
                FormatBytes(static_cast<double>(weight_bytes)).c_str(), 100 * share, FormatBytes(rate).c_str(), eta);
  write_(who_ + line);
}

StatusOr<BootstrappedRank> BootstrapRank(const DeploymentSpec& spec, MpiSession& session, std::ostream& log,
                                         std::string_view command) {
  BootstrappedRank r;
  r.name = "rank " + std::to_string(session.rank()) + " (" + session.host() + ")";
  // Ranks may run on different CPUs: each says what it found, once.
  log << std::string(command) + ": " + r.name + ": cpu " + CpuSummary() + "\n" << std::flush;
  MLARUN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> world, session.World());

  // 1. The same spec everywhere.
  MLARUN_ASSIGN_OR_RETURN(const std::vector<std::string> specs,
                          AllGatherStrings(*world, EncodeSpecFields(spec.ToFields())));
  {
    MLARUN_ASSIGN_OR_RETURN(const DeploymentSpec::Fields first, DecodeSpecFields(specs[0]));
    std::string differences;
    int differing = 0;
    for (size_t i = 1; i < specs.size(); ++i) {
      if (specs[i] == specs[0]) continue;
      MLARUN_ASSIGN_OR_RETURN(const DeploymentSpec::Fields other, DecodeSpecFields(specs[i]));
      differences += (differing++ ? "; " : "") + DescribeSpecDifference(first, other, static_cast<int>(i));
    }
    if (differing > 0)
      return InvalidArgumentError(
          "the ranks were started with different settings (every rank of a job needs the "
          "same model flags): ",
          differences);
  }
  if (spec.fail_forward_rank >= session.size())
    return InvalidArgumentError("--fail-forward-call: rank ", spec.fail_forward_rank, " is not in the world of ",
                                session.size(), " ranks");

  // 2. The layout and its process groups (alike on every rank: the specs are).
  auto layout = ParseParallelLayout(spec.parallel.empty() ? "dp1" : spec.parallel);
  if (!layout.ok()) return layout.status().WithContext("--parallel");
  r.layout = *layout;
  MLARUN_ASSIGN_OR_RETURN(r.groups, session.Groups(r.layout));

  // 2b. --device cuda: every rank its GPU, then NCCL over the groups the
  // step's device collectives use (the host's agreements stay on MPI).
  if (spec.device == "cuda") {
    auto device = SelectDeviceForSpec(spec, session.rank());
    MLARUN_RETURN_IF_ERROR(AgreeOnOutcome(*r.groups.world, device.status(), r.name, "choosing the GPU"));
    r.cuda_device = *device;
    log << std::string(command) + ": " + r.name + ": GPU " + std::to_string(r.cuda_device) + "\n" << std::flush;
    Status nccl = Status::Ok();
    for (auto [host, dev] : {std::pair{&r.groups.attn_tp, &r.groups.device_attn_tp},
                             std::pair{&r.groups.dp_peers, &r.groups.device_dp_peers}}) {
      if (!*host || (*host)->size() <= 1) continue;
      auto comm = CreateNcclCommunicator(**host, r.cuda_device);
      if (!comm.ok()) {
        nccl = comm.status();
        break;
      }
      *dev = std::move(*comm);
    }
    MLARUN_RETURN_IF_ERROR(AgreeOnOutcome(*r.groups.world, nccl, r.name, "creating the NCCL communicators"));
  }

  // 3. This rank's shard; then every rank learns whether all loaded.
  const auto t0 = std::chrono::steady_clock::now();
  const ModelShard shard = ModelShard::For(r.layout, session.rank());
  LoadProgressLog progress(
      std::string(command) + ": " + r.name, kLoadProgressPeriodS,
      [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); },
      [&log](const std::string& line) { log << line + "\n"
                                            << std::flush; });
  auto loaded = LoadModelForSpec(spec, shard, session.rank(), {}, [&progress](int64_t done, int64_t n, int64_t bytes) {
    progress.OnLayer(done, n, bytes);
  });
  const Status load_status = loaded.ok() ? Status::Ok() : loaded.status().WithContext("cannot load " + spec.model);
  MLARUN_RETURN_IF_ERROR(AgreeOnOutcome(*r.groups.world, load_status, r.name, "loading the model"));
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto all_seconds = AllGatherStrings(*r.groups.world, std::to_string(seconds));
  if (all_seconds.ok())
    for (const std::string& s : *all_seconds) seconds = std::max(seconds, std::stod(s));
  r.load_seconds = seconds;
  r.loaded = std::move(*loaded);
  return r;
}

}  // namespace mlarun
