// `mlarun bench comm`: the collectives one decode step of a model runs under
// a layout, at the message sizes that step produces, timed over the
// transport in use (whatever mpirun's MCA settings chose: TCP, shared
// memory, UCX).
//
// For each --batch T (tokens per DP group per step; every group runs T), with
// H = hidden_size and L = num_hidden_layers, a step runs (runtime/model/
// model.cc, runtime/engine/rank_runner.cc):
//   per layer, on the attn-TP group (attn_tp > 1): two fp32 all-reduces of
//     T x H (the o_proj and the MLP outputs);
//   per layer, on the DP peers (dp > 1): an fp32 all-gather-v of every
//     group's T x H hidden rows and a reduce-scatter-v of all dp x T x H
//     partial MLP outputs back to each group's T x H;
//   once, on the world: the lock-step all-gather of LockstepReport::kWords
//     int64 words per rank;
//   once, on the attn-TP group (attn_tp > 1): the leader's plan broadcast,
//     its length (1 int64) then a decode plan of T sequences of
//     kPlanContextTokens cached tokens (StepPlan::Encode's words).
// The per-step failure flags (one fp32 summed per communicator) are left out.
//
// Each collective is run once untimed, then `repetitions` times, each after a
// world barrier; a repetition's time is the slowest rank's, and the reported
// time is the median over repetitions. Sizes and bandwidths follow nccl-tests
// (doc/PERFORMANCE.md): `bytes` is the all-reduce's buffer, the all-gather's
// gathered buffer, the reduce-scatter's input, the broadcast's buffer;
// algbw = bytes / time; busbw = algbw x 2(n-1)/n for the all-reduce,
// x (n-1)/n for the all-gather and reduce-scatter, x 1 for the broadcast.
// bus bytes (bytes x that factor) is what each rank moves over the links in
// a ring, the figure to compare layouts by. Every rank also checks the bytes
// it put into each call (CommStats) against the prediction.
//
// Collective on the world: every rank calls it with the same options. A bad
// option or a layout that does not match the job's size is refused on every
// rank before any timed collective, with the same error.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "base/status.h"

namespace mlarun {

class MpiSession;

struct CommBenchOptions {
  std::string model = "configs/models/deepseek-v2-lite.yaml";  // YAML or checkpoint dir: its config only
  std::string parallel;                                        // dp=D,attn_tp=T; its world must be the job's size
  std::vector<int64_t> batches = {1, 8, 32};                   // tokens per DP group per step
  int repetitions = 20;                                        // timed calls per collective (median)
  bool json = false;  // one JSON document on rank 0's stdout; the table to stderr
};

// Cached tokens per sequence of the plan the broadcast carries (its block
// table has one entry per kPlanBlockTokens).
inline constexpr int64_t kPlanContextTokens = 512;
inline constexpr int64_t kPlanBlockTokens = 64;

// The plan's words for `seqs` decode sequences (StepPlan::Encode).
int64_t DecodePlanWords(int64_t seqs);

// The transport as the environment names it: "pml=ob1 btl=self,vader,tcp"
// from OMPI_MCA_pml / OMPI_MCA_btl (and UCX_TLS) when set, else "default".
std::string TransportFromEnvironment();

// See the top of this file. `table` gets rank 0's table.
Status RunCommBench(const CommBenchOptions& o, MpiSession& session, std::ostream& table);

}  // namespace mlarun
