// mlarun: the command-line entry point. The only place that exits.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "launcher/bench/attention_bench.h"
#include "launcher/bench/decode_bench.h"
#include "launcher/generate.h"
#include "parallel/mpi/mpi_world.h"

#include <iostream>

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

  mlarun::DecodeBenchOptions db;
  int decode_threads = 0;
  auto* dec = bench->add_subcommand("decode", "Decode and prefill throughput of one process, and where a step goes");
  dec->add_option("--model", db.model, "Checkpoint directory or configs/models/*.yaml")->capture_default_str();
  dec->add_option("--num-layers", db.num_layers, "Reduced depth (YAML models)")->check(CLI::PositiveNumber);
  dec->add_option("--experts", db.experts, "Routed experts kept (YAML models), so large shapes fit in memory")->check(CLI::PositiveNumber);
  dec->add_option("--batch", db.batches, "Batch sizes")->delimiter(',')->capture_default_str();
  dec->add_option("--context", db.contexts, "Context lengths (tokens already cached per sequence)")->delimiter(',')->capture_default_str();
  dec->add_option("--prefill-tokens", db.prefill_tokens, "Tokens per prefill chunk")->capture_default_str()->check(CLI::PositiveNumber);
  dec->add_option("--repetitions", db.repetitions, "Timed steps per point (median)")->capture_default_str()->check(CLI::PositiveNumber);
  dec->add_option("--kv-dtype", db.kv_dtype, "Latent cache dtype: bf16 or fp32");
  dec->add_option("--threads", decode_threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  dec->add_flag("--json", db.json, "One JSON document on stdout (the table goes to stderr)");
  dec->add_option("--parallel", db.parallel, "Under mpirun: dp=D,attn_tp=T[,moe=...] (decode only)");

  mlarun::GenerateOptions gen;
  auto* generate = app.add_subcommand("generate", "Generate tokens with a model on this process");
  generate->add_option("--model", gen.model, "Hugging Face checkpoint directory, or configs/models/*.yaml")->required();
  auto* ids_opt = generate->add_option("--prompt-ids", gen.prompt_ids, "One prompt as token ids: 1,2,3")->delimiter(',');
  auto* file_opt = generate->add_option("--prompts", gen.prompts_path, "JSON lines: prompt_ids and sampling fields");
  ids_opt->excludes(file_opt);
  generate->add_option("--max-tokens", gen.sampling.max_tokens, "Tokens to generate at most")->capture_default_str();
  generate->add_option("--temperature", gen.sampling.temperature, "0: greedy")->capture_default_str();
  generate->add_option("--top-p", gen.sampling.top_p, "Nucleus sampling mass")->capture_default_str();
  generate->add_option("--top-k", gen.sampling.top_k, "Keep the k most likely tokens (0: off)")->capture_default_str();
  generate->add_option("--seed", gen.sampling.seed, "Per-request random seed")->capture_default_str();
  generate->add_option("--stop-token-ids", gen.sampling.stop_token_ids, "Stop at any of these ids")->delimiter(',');
  generate->add_flag("--ignore-eos", gen.sampling.ignore_eos, "Do not stop at the model's eos_token_id");
  generate->add_flag("--json", gen.json, "One JSON object per request, in input order");
  generate->add_option("--kv-dtype", gen.kv_dtype, "Latent cache dtype: bf16 or fp32 (default: the model's)");
  generate->add_option("--num-layers", gen.num_layers, "Reduced depth for YAML models")->check(CLI::PositiveNumber);
  generate->add_option("--threads", gen.threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  generate->add_option("--max-batched-tokens", gen.engine.max_num_batched_tokens, "Tokens per step")->capture_default_str();
  generate->add_option("--max-num-seqs", gen.engine.max_num_seqs, "Running requests at once")->capture_default_str();
  generate->add_option("--cache-bytes", gen.engine.cache_budget_bytes, "Latent cache budget in bytes")->capture_default_str();
  generate->add_option("--block-size", gen.engine.block_size, "Tokens per cache block")->capture_default_str();
  generate->add_option("--parallel", gen.parallel, "Run on the ranks of mpirun: dp=D,attn_tp=T[,moe=expert|intermediate]");

  CLI11_PARSE(app, argc, argv);

  if (dec->parsed()) {
    if (decode_threads > 0) omp_set_num_threads(decode_threads);
    mlarun::Status st;
    if (db.parallel.empty()) {
      st = mlarun::RunDecodeBench(db);
    } else {
      auto session = mlarun::MpiSession::Init(&argc, &argv);
      st = session.ok() ? mlarun::RunDecodeBenchParallel(db, **session) : session.status();
    }
    if (!st.ok()) {
      std::fprintf(stderr, "mlarun bench decode: %s\n", st.ToString().c_str());
      return 1;
    }
    return 0;
  }
  if (generate->parsed()) {
    if (gen.prompt_ids.empty() && gen.prompts_path.empty()) {
      std::fprintf(stderr, "mlarun generate: give --prompt-ids or --prompts\n");
      return 2;
    }
    if (gen.threads > 0) omp_set_num_threads(gen.threads);
    if (gen.parallel.empty()) return mlarun::RunGenerate(gen, std::cout, std::cerr);
    auto session = mlarun::MpiSession::Init(&argc, &argv);
    if (!session.ok()) {
      std::fprintf(stderr, "mlarun generate: %s\n", session.status().ToString().c_str());
      return 2;
    }
    return mlarun::RunGenerateParallel(gen, **session, std::cout, std::cerr);
  }

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
