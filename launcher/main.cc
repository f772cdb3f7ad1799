// mlarun: the command-line entry point. The only place that exits.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "launcher/bench/attention_bench.h"

int main(int argc, char** argv) {
  CLI::App app{"mlarun: a runtime for DeepSeek-style Multi-head Latent Attention models"};
  app.require_subcommand(1);

  auto* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  mlarun::AttentionBenchOptions ab;
  std::string dtype = "bf16";
  auto* attn = bench->add_subcommand("attention", "Absorbed vs expanded MLA attention on this machine");
  attn->add_flag("--quick", ab.quick, "Decode rows and a small grid (well under a minute)");
  attn->add_flag("--json", ab.json, "Print one JSON document on stdout (the table goes to stderr)");
  attn->add_option("--svg", ab.svg_path, "Draw the query-length x context grid into this SVG file");
  attn->add_option("--dtype", dtype, "Cache and weight dtype: bf16 or f32")->capture_default_str();
  attn->add_option("--heads", ab.heads, "Query heads (128 = DeepSeek-V3 at TP 1)")->capture_default_str()->check(CLI::PositiveNumber);
  attn->add_option("--threads", ab.threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  attn->add_option("--repetitions", ab.repetitions, "Timed repetitions per point (median reported)")->check(CLI::NonNegativeNumber);
  attn->add_option("--min-time", ab.min_time_s, "Seconds per repetition")->check(CLI::NonNegativeNumber);
  attn->add_option("--contexts", ab.contexts, "Grid contexts S (cached tokens before the query block)")->delimiter(',');
  attn->add_option("--query-lens", ab.query_lens, "Grid query lengths Q")->delimiter(',');

  CLI11_PARSE(app, argc, argv);

  if (attn->parsed()) {
    auto dt = mlarun::ParseDType(dtype);
    if (!dt.ok() || (*dt != mlarun::DType::kBF16 && *dt != mlarun::DType::kF32)) {
      std::fprintf(stderr, "mlarun: --dtype must be bf16 or f32, got '%s'\n", dtype.c_str());
      return 2;
    }
    ab.dtype = *dt;
    if (ab.threads > 0) omp_set_num_threads(ab.threads);
    const mlarun::Status st = mlarun::RunAttentionBench(ab);
    if (!st.ok()) {
      std::fprintf(stderr, "mlarun bench attention: %s\n", st.ToString().c_str());
      return 1;
    }
  }
  return 0;
}
