#include "bench/attention_bench.h"

#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>

#include "attention/mla.h"
#include "base/block_size.h"
#include "base/cpu_isa.h"
#include "bench/synthetic_batch.h"
#include "bench/timing.h"
#include "gemm/convert.h"
#include "gemm/cpu_gemm.h"
#include "runtime/rank/thresholds.h"

namespace mlarun {
namespace {

using Json = nlohmann::json;

// ---- Attention runs ---------------------------------------------------------

// One batch of `batch` sequences, each `q_len` new tokens over `context`
// cached tokens, and prepared plans for both paths.
class PathPair {
 public:
  PathPair(const AttentionBenchOptions& o, int64_t batch, int64_t q_len, int64_t context, uint64_t seed)
      : shape_(DeepSeekV3MlaShape(o.heads)),
        q_len_(q_len),
        context_(context),
        batch_size_(batch),
        batch_(SyntheticSpec{
            .shape = shape_,
            .dtype = o.dtype,
            .block_size = kDefaultBlockSize,
            .seqs = std::vector<SyntheticSeq>(static_cast<size_t>(batch), SyntheticSeq{q_len, context + q_len}),
            .seed = seed,
            .shuffle_blocks = true,
            .poison = false,
            .spare_blocks = 0}) {}

  Status Prepare(MlaPath path) {
    MlaConfig c{.path = path};
    const MlaParams p = batch_.params();
    MLARUN_ASSIGN_OR_RETURN(plans_[Index(path)], MlaMakePlan(p, c));
    return Status::Ok();
  }
  Status Run(MlaPath path) {
    const MlaPlan& plan = *plans_[Index(path)];
    WorkspaceView ws = workspace_.Reserve(plan.workspace_bytes);
    if (plan.workspace_bytes > 0 && ws.data == nullptr)
      return ResourceExhaustedError("cannot allocate ", plan.workspace_bytes, " bytes of workspace");
    return MlaRun(batch_.params(), plan, ws);
  }
  // All outputs of the batch, as the last run left them.
  std::vector<double> Outputs() const {
    std::vector<double> all;
    for (int64_t i = 0; i < batch_size_; ++i) {
      auto o = batch_.SeqOut(i);
      all.insert(all.end(), o.begin(), o.end());
    }
    return all;
  }
  double AbsorbedFlops() const {
    return static_cast<double>(batch_size_) * MlaAbsorbedFlops(shape_, q_len_, context_ + q_len_);
  }
  double ExpandedFlops() const {
    return static_cast<double>(batch_size_) * MlaExpandedFlops(shape_, q_len_, context_ + q_len_);
  }

 private:
  static int Index(MlaPath p) { return p == MlaPath::kAbsorbed ? 0 : 1; }
  MlaShape shape_;
  int64_t q_len_, context_, batch_size_;
  SyntheticBatch batch_;
  std::optional<MlaPlan> plans_[2];
  Workspace workspace_;
};

double MaxRelDiff(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return den > 0 ? num / den : num;
}

double VerifyTolerance(DType t) { return t == DType::kBF16 ? 3e-2 : 1e-4; }

// ---- The GEMM library on the same shapes ------------------------------------

struct GemmCall {
  std::shared_ptr<const CpuGemm> gemm;
  const void *a, *b;
  void* c;
};

// The GEMM library on the absorbed decode path's own matrix shapes (folds per
// head; scores [N, L+R] x [L+R, S] and values [N, S] x [S, L] per sequence),
// operands contiguous, spread over the cores the way the kernel spreads them
// (heads or sequences over threads when there are enough, else each product on
// all threads).
class SameShapeGemms {
 public:
  Status Prepare(const MlaShape& s, DType dt, int64_t batch, int64_t keys) {
    s_ = s, dt_ = dt, batch_ = batch, keys_ = keys, es_ = DTypeSize(dt);
    const int64_t N = s.h_q, L = s.d_latent, W = s.d_cache(), P = s.d_nope, V = s.d_v;
    q_nope_ = RandomBuf(batch * N * P), w_uk_ = RandomBuf(N * P * L), q_abs_ = RandomBuf(batch * N * W);
    keys_buf_ = RandomBuf(batch * keys * W), probs_ = RandomBuf(batch * N * keys), o_lat_ = RandomBuf(batch * N * L);
    w_uv_ = RandomBuf(N * L * V);
    q_fold_.resize(static_cast<size_t>(batch * N * W) * es_);
    scores_.resize(static_cast<size_t>(batch * N * keys));
    out_lat_.resize(static_cast<size_t>(batch * N * L));
    out_.resize(static_cast<size_t>(batch * N * V));
    MLARUN_ASSIGN_OR_RETURN(fold1_, CpuGemm::Get(GemmDesc{.m = batch,
                                                          .n = L,
                                                          .k = P,
                                                          .a_type = dt,
                                                          .b_type = dt,
                                                          .c_type = dt,
                                                          .lda = N * P,
                                                          .b_stride_k = L,
                                                          .b_stride_n = 1,
                                                          .ldc = N * W}));
    MLARUN_ASSIGN_OR_RETURN(fold2_, CpuGemm::Get(GemmDesc{.m = batch,
                                                          .n = V,
                                                          .k = L,
                                                          .a_type = dt,
                                                          .b_type = dt,
                                                          .c_type = DType::kF32,
                                                          .lda = N * L,
                                                          .b_stride_k = V,
                                                          .b_stride_n = 1,
                                                          .ldc = N * V}));
    MLARUN_ASSIGN_OR_RETURN(qk_, CpuGemm::Get(GemmDesc{.m = N,
                                                       .n = keys,
                                                       .k = W,
                                                       .a_type = dt,
                                                       .b_type = dt,
                                                       .c_type = DType::kF32,
                                                       .lda = W,
                                                       .b_stride_k = 1,
                                                       .b_stride_n = W,
                                                       .ldc = keys}));
    MLARUN_ASSIGN_OR_RETURN(pv_, CpuGemm::Get(GemmDesc{.m = N,
                                                       .n = L,
                                                       .k = keys,
                                                       .a_type = dt,
                                                       .b_type = dt,
                                                       .c_type = DType::kF32,
                                                       .lda = keys,
                                                       .b_stride_k = W,
                                                       .b_stride_n = 1,
                                                       .ldc = L}));
    scratch_each_ = 64;
    for (const auto& g : {fold1_, fold2_, qk_, pv_}) scratch_each_ = std::max(scratch_each_, g->scratch_bytes() + 64);
    scratch_.resize(scratch_each_ * static_cast<size_t>(omp_get_max_threads()));
    return Status::Ok();
  }

  double Flops() const {
    const double N = static_cast<double>(s_.h_q), L = static_cast<double>(s_.d_latent), b = static_cast<double>(batch_);
    const double keys = static_cast<double>(keys_);
    return 2.0 * b * N * static_cast<double>(s_.d_nope) * L +
           b * (2.0 * N * keys * static_cast<double>(s_.d_cache()) + 2.0 * N * keys * L) +
           2.0 * b * N * L * static_cast<double>(s_.d_v);
  }

  Status Run() {
    const int64_t N = s_.h_q, L = s_.d_latent, W = s_.d_cache(), P = s_.d_nope, V = s_.d_v;
    ErrorOnce err;
#pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < N; ++h)
      err.Set(fold1_->Run(At(q_nope_, h * P), At(w_uk_, h * P * L), q_fold_.data() + h * W * static_cast<int64_t>(es_),
                          Scratch()));
    auto seq = [&](int64_t i) {
      Status st =
          qk_->Run(At(q_abs_, i * N * W), At(keys_buf_, i * keys_ * W), scores_.data() + i * N * keys_, Scratch());
      if (st.ok())
        st = pv_->Run(At(probs_, i * N * keys_), At(keys_buf_, i * keys_ * W), out_lat_.data() + i * N * L, Scratch());
      return st;
    };
    if (batch_ >= omp_get_max_threads()) {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < batch_; ++i) err.Set(seq(i));
    } else {
      for (int64_t i = 0; i < batch_; ++i) err.Set(seq(i));
    }
#pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < N; ++h)
      err.Set(fold2_->Run(At(o_lat_, h * L), At(w_uv_, h * L * V), out_.data() + h * V, Scratch()));
    return err.Get();
  }

 private:
  // First error of a parallel loop.
  class ErrorOnce {
   public:
    void Set(const Status& s) {
      if (s.ok()) return;
#pragma omp critical(mlarun_bench_error)
      if (status_.ok()) status_ = s;
    }
    Status Get() const { return status_; }

   private:
    Status status_;
  };

  std::vector<std::byte> RandomBuf(int64_t n) {
    std::normal_distribution<float> dist;
    std::vector<float> f(static_cast<size_t>(n));
    for (float& v : f) v = dist(rng_);
    std::vector<std::byte> out(f.size() * es_);
    StoreFromF32(f.data(), out.data(), dt_, n);
    return out;
  }
  const std::byte* At(const std::vector<std::byte>& v, int64_t elems) const {
    return v.data() + elems * static_cast<int64_t>(es_);
  }
  void* Scratch() { return scratch_.data() + scratch_each_ * static_cast<size_t>(omp_get_thread_num()); }

  MlaShape s_;
  DType dt_ = DType::kBF16;
  int64_t batch_ = 0, keys_ = 0;
  size_t es_ = 2, scratch_each_ = 0;
  std::mt19937 rng_{3};
  std::vector<std::byte> q_nope_, w_uk_, q_abs_, keys_buf_, probs_, o_lat_, w_uv_, q_fold_, scratch_;
  std::vector<float> scores_, out_lat_, out_;
  std::shared_ptr<const CpuGemm> fold1_, fold2_, qk_, pv_;
};

// GFLOP/s of the 2048^3 product, and the implementation that ran it.
StatusOr<std::pair<double, std::string>> SquareGemmPeak(DType dt, const Timing& t) {
  const int64_t n = 2048;
  MLARUN_ASSIGN_OR_RETURN(auto g, CpuGemm::Get(GemmDesc{.m = n,
                                                        .n = n,
                                                        .k = n,
                                                        .a_type = dt,
                                                        .b_type = dt,
                                                        .c_type = DType::kF32,
                                                        .lda = n,
                                                        .b_stride_k = n,
                                                        .b_stride_n = 1,
                                                        .ldc = n}));
  std::vector<float> f(static_cast<size_t>(n * n));
  std::mt19937 rng(5);
  std::normal_distribution<float> dist;
  for (float& v : f) v = dist(rng);
  std::vector<std::byte> a(f.size() * DTypeSize(dt)), scratch(g->scratch_bytes() + 64);
  StoreFromF32(f.data(), a.data(), dt, n * n);
  std::vector<float> c(static_cast<size_t>(n * n));
  MLARUN_ASSIGN_OR_RETURN(
      double ms, TimeMs(
                     "gemm_square_2048", [&] { return g->Run(a.data(), a.data(), c.data(), scratch.data()); }, t));
  return std::make_pair(2.0 * n * n * n / (ms * 1e-3) / 1e9, g->impl_name());
}

// ---- Report helpers -----------------------------------------------------------

struct GridCell {
  int64_t context, q_len;
  double absorbed_ms = NAN, expanded_ms = NAN;
};

void WriteSvg(const std::string& path, const std::vector<int64_t>& contexts, const std::vector<int64_t>& qs,
              const std::vector<GridCell>& cells, const std::string& title) {
  const int cw = 76, ch = 44, left = 90, top = 60;
  const int width = left + cw * static_cast<int>(qs.size()) + 20,
            height = top + ch * static_cast<int>(contexts.size()) + 70;
  std::ofstream f(path);
  f << "<svg xmlns='http://www.w3.org/2000/svg' width='" << width << "' height='" << height
    << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n";
  f << "<text x='" << left << "' y='20' font-size='14'>" << title << "</text>\n";
  f << "<text x='" << left << "' y='40'>query length Q &#8594;  (cell: winner, and how many times faster)</text>\n";
  for (size_t j = 0; j < qs.size(); ++j)
    f << "<text x='" << left + cw * static_cast<int>(j) + cw / 2 << "' y='" << top - 6 << "' text-anchor='middle'>"
      << qs[j] << "</text>\n";
  for (size_t i = 0; i < contexts.size(); ++i) {
    const int y = top + ch * static_cast<int>(i);
    f << "<text x='" << left - 8 << "' y='" << y + ch / 2 + 4 << "' text-anchor='end'>S=" << contexts[i] << "</text>\n";
    for (size_t j = 0; j < qs.size(); ++j) {
      const int x = left + cw * static_cast<int>(j);
      const GridCell* c = nullptr;
      for (const auto& g : cells)
        if (g.context == contexts[i] && g.q_len == qs[j]) c = &g;
      std::string fill = "#dddddd", label = "-";
      if (c && std::isfinite(c->absorbed_ms) && std::isfinite(c->expanded_ms)) {
        const bool abs_wins = c->absorbed_ms <= c->expanded_ms;
        const double ratio = abs_wins ? c->expanded_ms / c->absorbed_ms : c->absorbed_ms / c->expanded_ms;
        const double k = std::min(1.0, std::log10(ratio) / 2.0);  // saturates at 100x
        const int shade = static_cast<int>(235 - 150 * k);
        std::ostringstream col;
        col << "rgb(" << (abs_wins ? shade - 60 : 255) << "," << shade << "," << (abs_wins ? 255 : shade - 60) << ")";
        fill = col.str();
        label = std::string(abs_wins ? "abs " : "exp ") + Fmt(ratio, ratio < 10 ? 1 : 0) + "x";
      } else if (c && std::isfinite(c->expanded_ms)) {
        fill = "rgb(255,200,140)";
        label = "exp (abs skipped)";
      }
      f << "<rect x='" << x << "' y='" << y << "' width='" << cw - 2 << "' height='" << ch - 2 << "' fill='" << fill
        << "'/>\n";
      f << "<text x='" << x + cw / 2 << "' y='" << y + ch / 2 + 4 << "' text-anchor='middle' font-size='"
        << (label.size() > 10 ? 9 : 12) << "'>" << label << "</text>\n";
    }
  }
  f << "<text x='" << left << "' y='" << height - 20
    << "'>blue: absorbed faster; orange: expanded faster; gray: not measured (Q &gt; max or absorbed already &gt;2x "
       "slower)</text>\n";
  f << "</svg>\n";
}

// Of the measured query lengths (and "never"), the threshold whose choice of
// path is slowest relative to the faster path by the smallest factor over the
// grid rows it governs (S = 0 for no_prefix, S > 0 otherwise); ties within 2%
// go to the smaller geometric-mean slowdown. Null when no row applies.
Json SuggestThreshold(const std::vector<GridCell>& cells, const std::vector<int64_t>& qs, bool no_prefix) {
  std::vector<int64_t> candidates = qs;
  candidates.push_back(qs.back() + 1);
  Json best = nullptr;
  for (int64_t T : candidates) {
    double worst = 1, log_sum = 0;
    int n = 0;
    for (const GridCell& c : cells) {
      if ((c.context == 0) != no_prefix) continue;
      const double abs_ms = std::isfinite(c.absorbed_ms) ? c.absorbed_ms : INFINITY;
      const double chosen = c.q_len < T ? abs_ms : c.expanded_ms;
      const double r = chosen / std::min(abs_ms, c.expanded_ms);
      worst = std::max(worst, r);
      log_sum += std::log(r);
      ++n;
    }
    if (n == 0) return nullptr;
    const double geomean = std::exp(log_sum / n);
    if (best.is_null() || worst < best["worst_slowdown"].get<double>() / 1.02 ||
        (worst <= best["worst_slowdown"].get<double>() * 1.02 && geomean < best["geomean_slowdown"].get<double>()))
      best = {{"threshold", T}, {"worst_slowdown", worst}, {"geomean_slowdown", geomean}};
  }
  return best;
}

// What the phases of one `mlarun bench attention` share: the options, the
// timing and grid they resolve to, the attention shape, the JSON document the
// phases add to, and the grid's measured cells.
struct AttentionRun {
  const AttentionBenchOptions& o;
  std::ostream& table;
  Timing timing, heavy;
  std::vector<int64_t> contexts, qs;
  MlaShape shape;
  int threads = 0;
  Json doc;
  std::vector<GridCell> cells;
};

// The timing and the grid's contexts and query lengths, defaults filled in
// (query lengths sorted); INVALID_ARGUMENT for a negative context or a query
// length below 1.
Status ResolveOptions(AttentionRun& run) {
  const AttentionBenchOptions& o = run.o;
  run.timing = Timing{.repetitions = o.repetitions > 0 ? o.repetitions : (o.quick ? 1 : 3),
                      .min_time_s = o.min_time_s > 0 ? o.min_time_s : (o.quick ? 0.05 : 0.3)};
  run.heavy = Timing{.repetitions = run.timing.repetitions, .min_time_s = 0, .warm_up = false};
  std::vector<int64_t>&contexts = run.contexts, &qs = run.qs;
  contexts = o.contexts, qs = o.query_lens;
  if (contexts.empty())
    contexts = o.quick ? std::vector<int64_t>{0, 256, 1024} : std::vector<int64_t>{0, 256, 1024, 4096, 16384};
  if (qs.empty())
    qs = o.quick ? std::vector<int64_t>{1, 4, 16, 64, 256}
                 : std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
  for (int64_t v : contexts)
    if (v < 0) return InvalidArgumentError("--contexts must be >= 0, got ", v);
  for (int64_t v : qs)
    if (v <= 0) return InvalidArgumentError("--query-lens must be positive, got ", v);
  std::sort(qs.begin(), qs.end());
  return Status::Ok();
}

// The machine, the shape, the timing and the square GEMM peak: the
// document's leading fields and the table's first lines.
Status Describe(AttentionRun& run) {
  const AttentionBenchOptions& o = run.o;
  const MlaShape& shape = run.shape;
  std::ostream& table = run.table;
  Json& doc = run.doc;
  doc["machine"] = {{"cpu", CpuModel()}, {"threads", run.threads}, {"kernels", CpuJson()}};
  doc["date"] = Today();
  doc["dtype"] = std::string(DTypeName(o.dtype));
  doc["shape"] = {{"heads", shape.h_q},
                  {"kv_lora_rank", shape.d_latent},
                  {"qk_rope_head_dim", shape.d_rope},
                  {"qk_nope_head_dim", shape.d_nope},
                  {"v_head_dim", shape.d_v}};
  doc["timing"] = {
      {"repetitions", run.timing.repetitions}, {"statistic", "median"}, {"min_time_s", run.timing.min_time_s}};
  table << "mlarun bench attention: " << shape << " dtype " << DTypeName(o.dtype) << ", " << run.threads << " threads, "
        << CpuModel() << ", " << Today() << "\ncpu: " << CpuSummary() << "\n";

  MLARUN_ASSIGN_OR_RETURN(const auto peak_impl, SquareGemmPeak(o.dtype, run.timing));
  const double peak = peak_impl.first;
  doc["gemm_peak_gflops"] = peak;
  doc["gemm_peak_impl"] = peak_impl.second;
  table << "GEMM peak (2048^3, " << DTypeName(o.dtype) << ", " << peak_impl.second << "): " << Fmt(peak, 1)
        << " GFLOP/s\n\n";
  return Status::Ok();
}

// What a decode row measured: the absorbed path's median time over the
// rounds, the library's GFLOP/s on the same shapes and the median per-round
// fraction of it, and the naive path's time.
struct DecodeTimes {
  double abs_ms = 0, same = 0, fraction = 0, naive_ms = 0;
};

// Times a verified pair: the absorbed path and the library alternately for
// `rounds` rounds, then the naive path.
StatusOr<DecodeTimes> TimeDecodeRow(AttentionRun& run, PathPair& pair, int64_t batch, int64_t context, int rounds) {
  // The kernel and the library on the same shapes, alternated round by
  // round so both see the same machine load; the fraction is the median of
  // the per-round ratios.
  SameShapeGemms lib;
  MLARUN_RETURN_IF_ERROR(lib.Prepare(run.shape, run.o.dtype, batch, context + 1));
  const Timing one{.repetitions = 1, .min_time_s = run.timing.min_time_s};
  std::vector<double> abs_runs, lib_runs, ratios;
  for (int round = 0; round < rounds; ++round) {
    MLARUN_ASSIGN_OR_RETURN(const double a_ms,
                            TimeMs(
                                "decode_absorbed", [&] { return pair.Run(MlaPath::kAbsorbed); }, one));
    MLARUN_ASSIGN_OR_RETURN(const double l_ms, TimeMs(
                                                   "gemm_same_shapes", [&] { return lib.Run(); }, one));
    abs_runs.push_back(a_ms);
    lib_runs.push_back(lib.Flops() / (l_ms * 1e-3) / 1e9);
    ratios.push_back(pair.AbsorbedFlops() / (a_ms * 1e-3) / 1e9 / lib_runs.back());
  }
  DecodeTimes t{.abs_ms = Median(abs_runs), .same = Median(lib_runs), .fraction = Median(ratios)};
  MLARUN_ASSIGN_OR_RETURN(t.naive_ms, TimeMs(
                                          "decode_naive", [&] { return pair.Run(MlaPath::kExpanded); }, run.heavy));
  return t;
}

// One decode row: batch `batch`, one token over 4096 cached tokens, both
// paths verified against each other, timed, added to the document and
// printed.
Status DecodeRow(AttentionRun& run, int64_t batch, int rounds) {
  const AttentionBenchOptions& o = run.o;
  const int64_t context = 4096;
  PathPair pair(o, batch, 1, context, 100 + static_cast<uint64_t>(batch));
  MLARUN_RETURN_IF_ERROR(pair.Prepare(MlaPath::kAbsorbed));
  MLARUN_RETURN_IF_ERROR(pair.Prepare(MlaPath::kExpanded));
  MLARUN_RETURN_IF_ERROR(pair.Run(MlaPath::kExpanded));
  const auto naive_out = pair.Outputs();
  MLARUN_RETURN_IF_ERROR(pair.Run(MlaPath::kAbsorbed));
  const double diff = MaxRelDiff(pair.Outputs(), naive_out);
  if (diff > VerifyTolerance(o.dtype))
    return InternalError("decode batch ", batch, ": absorbed and naive outputs differ by ", diff);
  MLARUN_ASSIGN_OR_RETURN(const DecodeTimes t, TimeDecodeRow(run, pair, batch, context, rounds));
  const double abs_ms = t.abs_ms, naive_ms = t.naive_ms, same = t.same, fraction = t.fraction;
  const double abs_gflops = pair.AbsorbedFlops() / (abs_ms * 1e-3) / 1e9;
  const double predicted = pair.ExpandedFlops() / pair.AbsorbedFlops();
  run.doc["decode"].push_back({{"batch", batch},
                               {"context", context},
                               {"absorbed_ms", abs_ms},
                               {"naive_ms", naive_ms},
                               {"measured_ratio", naive_ms / abs_ms},
                               {"predicted_ratio", predicted},
                               {"absorbed_gflops", abs_gflops},
                               {"gemm_same_shapes_gflops", same},
                               {"fraction_of_same_shapes", fraction},
                               {"rounds", rounds},
                               {"paths_max_rel_diff", diff}});
  run.table << "  " << std::setw(5) << batch << "  " << std::setw(11) << Fmt(abs_ms, 3) << "  " << std::setw(8)
            << Fmt(naive_ms, 1) << "  " << std::setw(14) << Fmt(naive_ms / abs_ms, 1) << "  " << std::setw(15)
            << Fmt(predicted, 1) << "  " << std::setw(16) << Fmt(abs_gflops, 1) << "  " << std::setw(24) << Fmt(same, 1)
            << "  " << std::setw(8) << Fmt(fraction * 100, 0) << "%\n";
  return Status::Ok();
}

// Decode: one token over 4096 cached tokens, at batch 1 and 32.
Status DecodeSection(AttentionRun& run) {
  const MlaShape& shape = run.shape;
  const double per_token_abs =
      MlaAbsorbedFlops(shape, 1, 1) - 2.0 * shape.h_q * shape.d_latent * (shape.d_nope + shape.d_v);
  const double per_token_naive = 2.0 * shape.h_q * shape.d_latent * (shape.d_nope + shape.d_v);
  const int rounds = run.o.quick ? 1 : 7;
  run.table << "decode, context 4096 (FLOP per context token: absorbed " << Fmt(per_token_abs, 0)
            << ", naive up-projection " << Fmt(per_token_naive, 0) << ")\n";
  run.table << "  batch  absorbed_ms  naive_ms  measured_ratio  predicted_ratio  absorbed_GFLOP/s  "
               "gemm_same_shapes_GFLOP/s  fraction\n";
  run.doc["decode"] = Json::array();
  for (int64_t batch : {int64_t{1}, int64_t{32}}) MLARUN_RETURN_IF_ERROR(DecodeRow(run, batch, rounds));
  return Status::Ok();
}

// One grid cell, batch 1: the expanded path, and the absorbed path when
// `run_abs`, verified against each other and timed. `diff` gets how far apart
// their outputs are (NaN when the absorbed path is skipped).
StatusOr<GridCell> MeasureGridCell(AttentionRun& run, int64_t S, int64_t Q, bool run_abs, double& diff) {
  GridCell cell{S, Q};
  PathPair pair(run.o, 1, Q, S, static_cast<uint64_t>(S * 7919 + Q));
  MLARUN_RETURN_IF_ERROR(pair.Prepare(MlaPath::kExpanded));
  if (run_abs) MLARUN_RETURN_IF_ERROR(pair.Prepare(MlaPath::kAbsorbed));
  MLARUN_RETURN_IF_ERROR(pair.Run(MlaPath::kExpanded));
  const auto exp_out = pair.Outputs();
  const bool expanded_heavy = pair.ExpandedFlops() > 2e10;
  MLARUN_ASSIGN_OR_RETURN(cell.expanded_ms, TimeMs(
                                                "grid_expanded", [&] { return pair.Run(MlaPath::kExpanded); },
                                                expanded_heavy ? run.heavy : run.timing));
  diff = NAN;
  if (run_abs) {
    MLARUN_RETURN_IF_ERROR(pair.Run(MlaPath::kAbsorbed));
    diff = MaxRelDiff(pair.Outputs(), exp_out);
    if (diff > VerifyTolerance(run.o.dtype))
      return InternalError("grid S=", S, " Q=", Q, ": absorbed and expanded outputs differ by ", diff);
    const bool absorbed_heavy = pair.AbsorbedFlops() > 2e10;
    MLARUN_ASSIGN_OR_RETURN(cell.absorbed_ms, TimeMs(
                                                  "grid_absorbed", [&] { return pair.Run(MlaPath::kAbsorbed); },
                                                  absorbed_heavy ? run.heavy : run.timing));
  }
  return cell;
}

// The Q x S grid, batch 1, with the crossover of each S.
Status GridSection(AttentionRun& run) {
  std::ostream& table = run.table;
  Json& doc = run.doc;
  // The Q x S grid, batch 1. Past the crossover the absorbed path is skipped
  // once it is more than 2x slower twice in a row (its cost grows as Q x S).
  table << "\ngrid, batch 1 (ms; context S = cached tokens before the query block)\n";
  table << "  S      Q      absorbed_ms   expanded_ms   winner\n";
  doc["grid"] = Json::array();
  doc["crossover"] = Json::array();
  for (int64_t S : run.contexts) {
    int slower = 0;
    int64_t crossover = -1;  // none yet
    for (int64_t Q : run.qs) {
      const bool run_abs = slower < 2;
      double diff = NAN;
      MLARUN_ASSIGN_OR_RETURN(const GridCell cell, MeasureGridCell(run, S, Q, run_abs, diff));
      if (run_abs) slower = cell.absorbed_ms > 2 * cell.expanded_ms ? slower + 1 : 0;
      const bool exp_wins = !(cell.absorbed_ms <= cell.expanded_ms);
      if (exp_wins && crossover < 0) crossover = Q;
      if (!exp_wins) crossover = -1;  // the crossover is where expanded starts winning for good
      run.cells.push_back(cell);
      doc["grid"].push_back({{"context", S},
                             {"query_len", Q},
                             {"absorbed_ms", OrNull(cell.absorbed_ms)},
                             {"expanded_ms", cell.expanded_ms},
                             {"paths_max_rel_diff", OrNull(diff)}});
      table << "  " << std::setw(6) << S << " " << std::setw(5) << Q << "  " << std::setw(12)
            << Fmt(cell.absorbed_ms, 3) << "  " << std::setw(12) << Fmt(cell.expanded_ms, 3) << "   "
            << (exp_wins ? "expanded" : "absorbed") << "\n";
    }
    doc["crossover"].push_back({{"context", S}, {"query_len", crossover < 0 ? Json(nullptr) : Json(crossover)}});
  }
  return Status::Ok();
}

// The crossovers and the suggested thresholds next to the configured ones;
// with o.write_thresholds, the suggestion written there.
Status ThresholdsSection(AttentionRun& run) {
  const AttentionBenchOptions& o = run.o;
  std::ostream& table = run.table;
  Json& doc = run.doc;
  // Suggested thresholds, for blocks over a cached prefix (S > 0) and for
  // blocks without one (S = 0).
  const Json with_prefix = SuggestThreshold(run.cells, run.qs, /*no_prefix=*/false);
  const Json no_prefix = SuggestThreshold(run.cells, run.qs, /*no_prefix=*/true);
  doc["suggested_absorb_below_query_len"] = with_prefix;
  doc["suggested_absorb_below_query_len_no_prefix"] = no_prefix;
  const AbsorbThresholds configured = DefaultAbsorbThresholds(ActiveCpuIsa());
  doc["configured_absorb_below_query_len"] = configured.with_prefix;
  doc["configured_absorb_below_query_len_no_prefix"] = configured.no_prefix;
  table << "\ncrossover (smallest Q from which the expanded path wins):";
  for (const auto& c : doc["crossover"])
    table << "  S=" << c["context"] << ": "
          << (c["query_len"].is_null() ? std::string("none measured") : "Q=" + c["query_len"].dump());
  auto describe = [&](const char* what, const Json& j, int64_t configured) {
    table << "\nsuggested " << what << ": ";
    if (j.is_null()) {
      table << "- (no such row measured)";
    } else {
      table << j["threshold"] << " (worst slowdown on those rows " << Fmt(j["worst_slowdown"].get<double>(), 3)
            << "x, geometric mean " << Fmt(j["geomean_slowdown"].get<double>(), 4) << "x)";
    }
    table << "; default of the " << CpuIsaName(ActiveCpuIsa()) << " kernels " << configured;
  };
  describe("absorb_below_query_len", with_prefix, configured.with_prefix);
  describe("absorb_below_query_len_no_prefix", no_prefix, configured.no_prefix);
  table << "\n";
  if (!o.write_thresholds.empty()) {
    if (with_prefix.is_null() || no_prefix.is_null())
      return InvalidArgumentError("--write-thresholds needs grid rows with S = 0 and S > 0 (--contexts)");
    const AbsorbThresholds t{.with_prefix = with_prefix["threshold"].get<int64_t>(),
                             .no_prefix = no_prefix["threshold"].get<int64_t>()};
    MLARUN_RETURN_IF_ERROR(WriteAbsorbThresholds(o.write_thresholds, t));
    table << "thresholds written to " << o.write_thresholds << " (use with --attention-thresholds)\n";
  }
  return Status::Ok();
}

}  // namespace

Status RunAttentionBench(const AttentionBenchOptions& o) {
  AttentionRun run{.o = o, .table = o.json ? std::cerr : std::cout};
  MLARUN_RETURN_IF_ERROR(ResolveOptions(run));

  InitBenchmarkLibrary();

  run.shape = DeepSeekV3MlaShape(o.heads);
  run.threads = omp_get_max_threads();
  MLARUN_RETURN_IF_ERROR(Describe(run));
  MLARUN_RETURN_IF_ERROR(DecodeSection(run));
  MLARUN_RETURN_IF_ERROR(GridSection(run));
  MLARUN_RETURN_IF_ERROR(ThresholdsSection(run));

  if (!o.svg_path.empty()) {
    WriteSvg(o.svg_path, run.contexts, run.qs, run.cells,
             "MLA absorbed vs expanded, " + std::string(DTypeName(o.dtype)) + ", " + std::to_string(run.shape.h_q) +
                 " heads, batch 1, " + std::to_string(run.threads) + " threads, " + Today());
    run.table << "grid drawn to " << o.svg_path << "\n";
  }
  if (o.json) std::cout << run.doc.dump(2) << std::endl;
  return Status::Ok();
}

}  // namespace mlarun
