// Starting a rank: one deployment spec -> this rank's process groups and its
// shard of the model, the same way for `mlarun worker`, `mlarun generate
// --parallel` and `mlarun bench decode`.
//
// Every rank of a job calls BootstrapRank with the spec its command line gave
// it. The ranks first compare their specs: a rank started with other model
// flags (say `--num-layers 2` on one node) would load another model and then
// wait forever in the first collective whose sizes differ, so the job is
// refused at start-up, on every rank, with the field and the ranks that
// differ. After each later phase (process groups, loading) the ranks agree
// on the outcome: either all of them go on, or all of them return the same
// error naming every rank that failed and why. Nothing is left waiting in a
// collective, and no rank aborts the others.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"
#include "parallel/layout.h"
#include "runtime/model/model.h"

namespace mlarun {

class MpiSession;

// What every rank of a job must agree on, as the command line gave it.
struct DeploymentSpec {
  std::string model;                 // checkpoint directory or configs/models/*.yaml
  std::string parallel;              // --parallel; empty: one process (dp1)
  std::string kv_dtype;              // --kv-dtype: "" keeps the model's; bf16 or fp32
  int64_t num_layers = 0;            // --num-layers (YAML models): 0 keeps the model's
  int64_t experts = 0;               // --experts (YAML models): 0 keeps the model's
  std::string weights = "mapped";    // --weights mapped|copied
  std::string attention_thresholds;  // --attention-thresholds FILE, "" for the CPU's defaults
  std::string device = "cpu";        // --device cpu|cuda
  std::string fp8_weights = "keep";  // --fp8-weights keep|dequantize (checkpoints storing F8_E4M3)
  std::string lm_head = "keep";      // --lm-head keep|int8|int4 (quantized at load where stored unquantized)
  // Refuse (RESOURCE_EXHAUSTED) a shard whose weights would take more.
  int64_t max_weight_bytes = std::numeric_limits<int64_t>::max();
  // Fault injection (--fail-forward-call N[@RANK]): the model's forward call
  // N fails on RANK (every rank when -1); -1: none.
  int64_t fail_forward_call = -1;
  int fail_forward_rank = -1;

  // (flag, value) pairs in a fixed order: what the ranks compare.
  using Fields = std::vector<std::pair<std::string, std::string>>;
  Fields ToFields() const;
};

// `--fail-forward-call N[@RANK]`: sets spec->fail_forward_call = N (>= 0) and
// spec->fail_forward_rank = RANK (>= 0; -1 without "@RANK"). INVALID_ARGUMENT
// naming the flag for anything else; `spec` is unchanged then.
Status ParseFailForwardCall(std::string_view text, DeploymentSpec* spec);

// The first field in which `other` (rank `other_rank`'s) differs from `first`
// (rank 0's), as "--num-layers: rank 1 has '2', rank 0 has '4'"; "" when
// they agree.
std::string DescribeSpecDifference(const DeploymentSpec::Fields& first, const DeploymentSpec::Fields& other,
                                   int other_rank);
// Fields as text, and back (the exchange between ranks).
std::string EncodeSpecFields(const DeploymentSpec::Fields& fields);
StatusOr<DeploymentSpec::Fields> DecodeSpecFields(std::string_view text);

// `--device`: the backend it names (cpu or cuda), INVALID_ARGUMENT naming
// the flag otherwise.
StatusOr<Backend> ParseDeviceFlag(std::string_view device);

// For --device cuda: makes this rank's GPU current (its node-local rank
// modulo the visible GPUs) and returns its index; a clear UNAVAILABLE when
// there is no usable GPU or the build has no CUDA. -1 for the CPU.
StatusOr<int> SelectDeviceForSpec(const DeploymentSpec& spec, int rank);

struct LoadedModel {
  ModelConfig config;
  WeightBytes predicted;  // this shard's weights, before anything is allocated
  ModelOptions options;
  std::unique_ptr<Model> model;
};

// This process's shard of the spec's model: the configuration with the
// spec's overrides, checked against the shard and max_weight_bytes before
// anything is allocated, then the weights. No MPI: single-process commands
// call it directly, BootstrapRank on every rank.
// `progress` gets loading progress lines (ModelOptions::progress),
// `on_layer` each layer loaded (ModelOptions::on_layer) with the shard's
// predicted weight bytes.
StatusOr<LoadedModel> LoadModelForSpec(const DeploymentSpec& spec, const ModelShard& shard, int rank = 0,
                                       std::function<void(const std::string&)> progress = {},
                                       std::function<void(int64_t, int64_t, int64_t)> on_layer = {});

// A rank's loading progress for the log: at most one line per `period_s`
// (never per tensor): the layers loaded, the share of the weight bytes that
// is, the rate and the time left at that rate. Feed it LoadModelForSpec's
// on_layer; `now_s` is a steady clock in seconds.
class LoadProgressLog {
 public:
  LoadProgressLog(std::string who, double period_s, std::function<double()> now_s,
                  std::function<void(const std::string&)> write);
  void OnLayer(int64_t done, int64_t layers, int64_t weight_bytes);

 private:
  const std::string who_;
  const double period_s_;
  const std::function<double()> now_s_;
  const std::function<void(const std::string&)> write_;
  const double start_s_;
  double said_s_;
};

// "1.23 GiB" (binary units from KiB up; bytes below).
std::string FormatBytes(double bytes);

struct BootstrappedRank {
  ParallelLayout layout;
  ProcessGroups groups;
  LoadedModel loaded;
  std::string name;         // "rank 3 (host)", for logs and errors
  double load_seconds = 0;  // loading the weights (slowest rank)
  int cuda_device = -1;     // --device cuda: this rank's GPU
};

// See the top of this file. `command` names the caller in log lines
// ("mlarun worker"); `log` gets this rank's CPU line.
StatusOr<BootstrappedRank> BootstrapRank(const DeploymentSpec& spec, MpiSession& session, std::ostream& log,
                                         std::string_view command);

}  // namespace mlarun
