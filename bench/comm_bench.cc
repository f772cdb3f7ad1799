#include "bench/comm_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench/timing.h"
#include "parallel/layout.h"
#include "parallel/mpi/mpi_world.h"
#include "runtime/engine/rank_runner.h"
#include "runtime/model/model.h"

namespace mlarun {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// One collective of the step, as it is timed and reported.
struct Collective {
  std::string name;   // "attn_tp_all_reduce", ...
  std::string op;     // all_reduce, all_gather, reduce_scatter, broadcast
  std::string group;  // attn_tp, dp_peers, world
  Communicator* comm = nullptr;
  int64_t calls_per_step = 0;
  int64_t bytes = 0;       // nccl-tests' size of one call (see the header)
  double bus_factor = 1;   // busbw / algbw
  int64_t sent_bytes = 0;  // what this rank puts into one call (CommStats)
  CommStats::Entry CommStats::*stat = nullptr;
  std::function<Status()> call;
  // Measured.
  double time_s = 0;
};

// Every rank's local verdict, agreed on by the world: OK on every rank, or
// the same error on every rank naming the first failing rank.
Status Agree(Communicator& world, const Status& local) {
  std::string mine = local.ok() ? "" : std::to_string(static_cast<int>(local.code())) + "|" + local.message();
  MLARUN_ASSIGN_OR_RETURN(std::vector<std::string> all, AllGatherStrings(world, mine));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    const size_t bar = all[r].find('|');
    const int code = std::atoi(all[r].substr(0, bar).c_str());
    const std::string text = "rank " + std::to_string(r) + ": " + all[r].substr(bar + 1);
    return Status(code > 0 && code <= static_cast<int>(StatusCode::kUnauthenticated) ? static_cast<StatusCode>(code)
                                                                                     : StatusCode::kInternal,
                  text);
  }
  return Status::Ok();
}

// The options every rank checks by itself, before any collective but the
// agreement.
StatusOr<ModelConfig> CheckOptions(const CommBenchOptions& o, const ParallelLayout& layout, int world) {
  if (layout.world() != world)
    return InvalidArgumentError("--parallel ", o.parallel, " needs ", layout.world(), " ranks, the job has ", world);
  if (o.batches.empty()) return InvalidArgumentError("--batch: give at least one batch size");
  for (int64_t b : o.batches)
    if (b <= 0) return InvalidArgumentError("--batch ", b, ": tokens per DP group must be positive");
  if (o.repetitions <= 0) return InvalidArgumentError("--repetitions ", o.repetitions, ": must be positive");
  MLARUN_ASSIGN_OR_RETURN(ModelConfig config, Model::LoadConfig(o.model));
  for (int64_t b : o.batches)
    if (static_cast<double>(b) * static_cast<double>(config.hidden_size) * layout.dp > double{1 << 30})
      return InvalidArgumentError("--batch ", b, ": ", b, " x hidden_size ", config.hidden_size, " x dp ", layout.dp,
                                  " elements exceed what one collective call here may carry");
  return config;
}

// Times c.call: one untimed call, then o.repetitions calls each after a world
// barrier. Sets c.time_s to the median over repetitions of the slowest
// rank's time.
Status TimeCollective(Collective& c, Communicator& world, int repetitions) {
  MLARUN_RETURN_IF_ERROR(c.call());
  std::vector<double> mine(static_cast<size_t>(repetitions));
  for (double& t : mine) {
    MLARUN_RETURN_IF_ERROR(world.Barrier());
    const auto t0 = Clock::now();
    MLARUN_RETURN_IF_ERROR(c.call());
    t = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  const int n = world.size();
  std::vector<double> all(mine.size() * static_cast<size_t>(n));
  MLARUN_RETURN_IF_ERROR(
      world.AllGather(mine.data(), static_cast<int64_t>(mine.size() * sizeof(double)), all.data(), CommType::kU8));
  std::vector<double> slowest(mine.size(), 0);
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < mine.size(); ++i)
      slowest[i] = std::max(slowest[i], all[static_cast<size_t>(r) * mine.size() + i]);
  c.time_s = Median(slowest);
  return Status::Ok();
}

std::string Fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

// Every rank checks the options, then the world agrees, so that a refusal
// reaches every rank and none waits in a collective the others skip. The
// ranks also compare the options themselves. Sets `layout` and `config`.
Status AgreeOnOptions(const CommBenchOptions& o, Communicator& world, ParallelLayout& layout, ModelConfig& config) {
  Status local = [&]() -> Status {
    MLARUN_ASSIGN_OR_RETURN(layout, ParseParallelLayout(o.parallel));
    MLARUN_ASSIGN_OR_RETURN(config, CheckOptions(o, layout, world.size()));
    return Status::Ok();
  }();
  MLARUN_RETURN_IF_ERROR(Agree(world, local));
  std::ostringstream mine;
  mine << o.model << "|" << o.parallel << "|" << o.repetitions;
  for (int64_t b : o.batches) mine << "," << b;
  MLARUN_ASSIGN_OR_RETURN(std::vector<std::string> all, AllGatherStrings(world, mine.str()));
  for (size_t r = 1; r < all.size(); ++r)
    if (all[r] != all[0])
      return InvalidArgumentError("rank ", r, " was started with other options (", all[r], ") than rank 0 (", all[0],
                                  ")");
  return Status::Ok();
}

// The buffers of one batch's collectives: T x H rows per rank, the layout's
// dp groups and W ranks.
struct StepBuffers {
  StepBuffers(int64_t T, int64_t H, int dp, int W)
      : rows(T * H),
        ar_buf(static_cast<size_t>(rows), 1.f),
        x(static_cast<size_t>(rows), 1.f),
        x_all(static_cast<size_t>(dp * rows)),
        y_all(static_cast<size_t>(dp * rows), 1.f),
        y_local(static_cast<size_t>(rows)),
        counts(static_cast<size_t>(dp), rows),
        report(static_cast<size_t>(LockstepReport::kWords), 1),
        reports(static_cast<size_t>(W * LockstepReport::kWords)),
        plan_words(DecodePlanWords(T)),
        plan(static_cast<size_t>(plan_words), 1) {}
  const int64_t rows;
  std::vector<float> ar_buf;
  std::vector<float> x, x_all;
  std::vector<float> y_all, y_local;
  const std::vector<int64_t> counts;
  std::vector<int64_t> report;
  std::vector<int64_t> reports;
  const int64_t plan_words;
  std::vector<int64_t> plan;
};

// The collectives of one decode step under `layout` (header: which ones, and
// their sizes), calling into `buf`, which must outlive them.
std::vector<Collective> StepCollectives(StepBuffers& buf, ProcessGroups& groups, Communicator& world,
                                        const ParallelLayout& layout, int64_t L) {
  const int64_t rows = buf.rows, plan_words = buf.plan_words;
  const int64_t fp = 4, word = 8;
  const int W = layout.world(), dp = layout.dp, tp = layout.attn_tp;
  std::vector<Collective> cs;
  if (tp > 1)
    cs.push_back({.name = "attn_tp_all_reduce",
                  .op = "all_reduce",
                  .group = "attn_tp",
                  .comm = groups.attn_tp.get(),
                  .calls_per_step = 2 * L,
                  .bytes = rows * fp,
                  .bus_factor = 2.0 * (tp - 1) / tp,
                  .sent_bytes = rows * fp,
                  .stat = &CommStats::all_reduce,
                  .call = [&buf, &groups] {
                    return groups.attn_tp->AllReduceSum(buf.ar_buf.data(), buf.rows, CommType::kF32);
                  }});
  if (dp > 1) {
    cs.push_back({.name = "dp_all_gather_v",
                  .op = "all_gather",
                  .group = "dp_peers",
                  .comm = groups.dp_peers.get(),
                  .calls_per_step = L,
                  .bytes = dp * rows * fp,
                  .bus_factor = 1.0 * (dp - 1) / dp,
                  .sent_bytes = rows * fp,
                  .stat = &CommStats::all_gather,
                  .call = [&buf, &groups] {
                    return groups.dp_peers->AllGatherV(buf.x.data(), buf.counts, buf.x_all.data(), CommType::kF32);
                  }});
    cs.push_back({.name = "dp_reduce_scatter_v",
                  .op = "reduce_scatter",
                  .group = "dp_peers",
                  .comm = groups.dp_peers.get(),
                  .calls_per_step = L,
                  .bytes = dp * rows * fp,
                  .bus_factor = 1.0 * (dp - 1) / dp,
                  .sent_bytes = dp * rows * fp,
                  .stat = &CommStats::reduce_scatter,
                  .call = [&buf, &groups] {
                    return groups.dp_peers->ReduceScatterSumV(buf.y_all.data(), buf.counts, buf.y_local.data(),
                                                              CommType::kF32);
                  }});
  }
  cs.push_back({.name = "lockstep_all_gather",
                .op = "all_gather",
                .group = "world",
                .comm = &world,
                .calls_per_step = 1,
                .bytes = W * LockstepReport::kWords * word,
                .bus_factor = 1.0 * (W - 1) / W,
                .sent_bytes = LockstepReport::kWords * word,
                .stat = &CommStats::all_gather,
                .call = [&buf, &world] {
                  return world.AllGather(buf.report.data(), LockstepReport::kWords, buf.reports.data(), CommType::kI64);
                }});
  if (tp > 1)
    cs.push_back({.name = "plan_broadcast",
                  .op = "broadcast",
                  .group = "attn_tp",
                  .comm = groups.attn_tp.get(),
                  .calls_per_step = 1,
                  .bytes = (1 + plan_words) * word,
                  .bus_factor = 1,
                  .sent_bytes = groups.attn_tp->rank() == 0 ? (1 + plan_words) * word : 0,
                  .stat = &CommStats::broadcast,
                  .call = [&buf, &groups]() -> Status {
                    int64_t n = buf.plan_words;
                    MLARUN_RETURN_IF_ERROR(groups.attn_tp->Broadcast(&n, 1, CommType::kI64, 0));
                    return groups.attn_tp->Broadcast(buf.plan.data(), n, CommType::kI64, 0);
                  }});
  return cs;
}

// Times each collective (TimeCollective), and checks what this rank put into
// the calls; the world agrees on the verdict.
Status TimeAndCheck(std::vector<Collective>& cs, Communicator& world, int repetitions) {
  // Time each, and check what this rank put into the calls.
  int mismatches_here = 0;
  std::string mismatch;
  for (Collective& c : cs) {
    const CommStats::Entry before = c.comm->stats().*c.stat;
    MLARUN_RETURN_IF_ERROR(TimeCollective(c, world, repetitions));
    const CommStats::Entry after = c.comm->stats().*c.stat;
    const int64_t calls = repetitions + 1;
    // The lock-step gather shares the world's stats with the timing's own
    // gather of the times (repetitions x 8 bytes, once).
    int64_t own = after.bytes - before.bytes;
    if (c.comm == &world && c.stat == &CommStats::all_gather) own -= repetitions * 8;
    if (own != calls * c.sent_bytes) {
      ++mismatches_here;
      mismatch =
          c.name + ": " + std::to_string(own / calls) + " bytes per call, predicted " + std::to_string(c.sent_bytes);
    }
  }
  return Agree(world, mismatches_here == 0
                          ? Status::Ok()
                          : InternalError("bytes sent differ from the layout's prediction: ", mismatch));
}

// One batch's timed collectives: a row of the document, and on rank 0 the
// table's lines.
Json ReportBatch(std::ostream& table, bool root, int dp, int64_t T, const std::vector<Collective>& cs) {
  Json row = {{"batch", T}, {"tokens_per_step", dp * T}, {"collectives", Json::array()}};
  double step_s = 0, step_bytes = 0, step_bus_bytes = 0;
  if (root)
    table << "  batch " << T << " per DP group (" << dp * T << " tokens per step)\n"
          << "    collective            group    n  calls/step       bytes    time us  algbw GB/s  busbw GB/s\n";
  for (const Collective& c : cs) {
    const double algbw = static_cast<double>(c.bytes) / c.time_s / 1e9;
    const double busbw = algbw * c.bus_factor;
    step_s += static_cast<double>(c.calls_per_step) * c.time_s;
    step_bytes += static_cast<double>(c.calls_per_step * c.bytes);
    step_bus_bytes += static_cast<double>(c.calls_per_step) * static_cast<double>(c.bytes) * c.bus_factor;
    row["collectives"].push_back({{"name", c.name},
                                  {"op", c.op},
                                  {"group", c.group},
                                  {"ranks", c.comm->size()},
                                  {"calls_per_step", c.calls_per_step},
                                  {"bytes", c.bytes},
                                  {"bus_bytes", static_cast<double>(c.bytes) * c.bus_factor},
                                  {"rank0_sent_bytes", c.sent_bytes},
                                  {"time_us", c.time_s * 1e6},
                                  {"algbw_gbps", algbw},
                                  {"busbw_gbps", busbw},
                                  {"step_time_us", static_cast<double>(c.calls_per_step) * c.time_s * 1e6}});
    if (root)
      table << "    " << std::left << std::setw(20) << c.name << "  " << std::setw(8) << c.group << std::right
            << std::setw(2) << c.comm->size() << "  " << std::setw(10) << c.calls_per_step << "  " << std::setw(10)
            << c.bytes << "  " << std::setw(9) << Fixed(c.time_s * 1e6, 1) << "  " << std::setw(10) << Fixed(algbw, 3)
            << "  " << std::setw(10) << Fixed(busbw, 3) << "\n";
  }
  row["step_bytes"] = step_bytes;
  row["step_bus_bytes"] = step_bus_bytes;
  row["step_bus_bytes_per_token"] = step_bus_bytes / static_cast<double>(dp * T);
  row["step_time_ms"] = step_s * 1e3;
  if (root)
    table << "    per step: " << Fixed(step_bytes, 0) << " bytes, " << Fixed(step_bus_bytes, 0) << " bus bytes ("
          << Fixed(step_bus_bytes / static_cast<double>(dp * T), 0) << " per token), " << Fixed(step_s * 1e3, 3)
          << " ms in collectives\n";
  return row;
}

}  // namespace

int64_t DecodePlanWords(int64_t seqs) {
  // Header (has_work, five cache counters, the sequence count), then per
  // sequence: id, start_pos, the token count, one token, the block count and
  // the blocks of its context plus the new token.
  const int64_t blocks = (kPlanContextTokens + 1 + kPlanBlockTokens - 1) / kPlanBlockTokens;
  return 7 + seqs * (5 + blocks);
}

std::string TransportFromEnvironment() {
  std::string out;
  for (const char* var : {"OMPI_MCA_pml", "OMPI_MCA_btl", "UCX_TLS"}) {
    const char* v = std::getenv(var);
    if (v == nullptr || *v == '\0') continue;
    std::string key = var;
    key = key.rfind("OMPI_MCA_", 0) == 0 ? key.substr(9) : "ucx_tls";
    out += (out.empty() ? "" : " ") + key + "=" + v;
  }
  return out.empty() ? "default" : out;
}

Status RunCommBench(const CommBenchOptions& o, MpiSession& session, std::ostream& table) {
  MLARUN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> world, session.World());
  ModelConfig config;
  ParallelLayout layout;
  MLARUN_RETURN_IF_ERROR(AgreeOnOptions(o, *world, layout, config));
  MLARUN_ASSIGN_OR_RETURN(ProcessGroups groups, session.Groups(layout));
  const bool root = groups.rank == 0;
  const int64_t H = config.hidden_size, L = config.num_hidden_layers;
  const int W = layout.world(), dp = layout.dp, tp = layout.attn_tp;
  const std::string transport = TransportFromEnvironment();

  Json doc;
  doc["model"] = o.model;
  doc["hidden_size"] = H;
  doc["layers"] = L;
  doc["layout"] = o.parallel;
  doc["dp"] = dp;
  doc["attn_tp"] = tp;
  doc["world"] = W;
  doc["transport"] = transport;
  doc["repetitions"] = o.repetitions;
  doc["host"] = session.host();
  doc["rows"] = Json::array();
  if (root)
    table << "mlarun bench comm --parallel dp=" << dp << ",attn_tp=" << tp << ": " << o.model << " (hidden_size " << H
          << ", " << L << " layers), " << W << " ranks, transport " << transport << ", median of " << o.repetitions
          << " (slowest rank each)\n";

  for (const int64_t T : o.batches) {
    StepBuffers buf(T, H, dp, W);
    std::vector<Collective> cs = StepCollectives(buf, groups, *world, layout, L);
    MLARUN_RETURN_IF_ERROR(TimeAndCheck(cs, *world, o.repetitions));
    doc["rows"].push_back(ReportBatch(table, root, dp, T, cs));
  }
  if (o.json && root) std::cout << doc.dump(2) << std::endl;
  return Status::Ok();
}

}  // namespace mlarun
