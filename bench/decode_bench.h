// `mlarun bench decode`: decode and prefill throughput of one process, next
// to what the machine allows, and where a step's time goes (attention, MoE,
// dense MLP, lm_head, the rest), for a model from a checkpoint or a
// configs/models/*.yaml file (optionally at reduced depth and with fewer
// routed experts, so DeepSeek-V3 shapes fit in memory).
//
// In the same run it measures the memory's streaming read bandwidth and the
// matrix-product rate of the weights' dtype, and reports each decode row
// against its bandwidth bound: the bytes the step read (Model::StepTraffic:
// the weights it touched, including only the routed experts some token
// chose, and the cache rows) over the bandwidth; and the prefill of one
// prompt against the product peak. Every row first runs until its step time
// has settled (WarmUpUntilStable) and says how many steps that discarded.
//
// The context of each sequence is written into the latent cache directly
// (random rows): a decode step's cost does not depend on the values it
// attends over, and prefilling 32 x 4096 tokens first would take longer than
// the measurement.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "runtime/rank/bootstrap.h"

namespace mlarun {

struct DecodeBenchOptions {
  // The model (--num-layers, --experts: YAML only), larger models refused
  // (they would not fit next to the cache); with `parallel`, under mpirun
  // (decode only).
  DeploymentSpec deployment{.model = "configs/models/deepseek-v3.yaml", .max_weight_bytes = int64_t{16} << 30};
  std::vector<int64_t> batches = {1, 8, 32};
  std::vector<int64_t> contexts = {512, 4096};
  int64_t prefill_tokens = 512;  // the prompt of the prefill measurement
  int repetitions = 5;           // timed steps per point (median)
  // "json_object": every decode row also times steps whose sequences are
  // each constrained by that structured output (greedy, through the
  // engine's Sampler), interleaved with unconstrained ones drawn by the same
  // Sampler unconstrained, and reports both and the mask fill per step. The
  // model's tokenizer gives the vocabulary, else a synthetic one of the
  // model's vocab_size. "": off.
  std::string structured;
  bool json = false;
};

Status RunDecodeBench(const DecodeBenchOptions& o);

// Under mpirun: every rank loads its shard, each DP group decodes batch / dp
// sequences, and rank 0 reports decode tokens/s per layout and this rank's
// communication bytes per step by collective next to what the layout predicts
// (every rank checks its own against the prediction).
class MpiSession;
Status RunDecodeBenchParallel(const DecodeBenchOptions& o, MpiSession& session);

}  // namespace mlarun
