// `mlarun bench attention|decode|accuracy|memory|gemm|comm|transfer|serve|rebalance|disagg|tokenize`:
// the benchmarks of bench/, one subcommand each.
#include <omp.h>

#include <cstdio>
#include <iostream>
#include <memory>

#include "bench/accuracy_bench.h"
#include "bench/attention_bench.h"
#include "bench/comm_bench.h"
#include "bench/decode_bench.h"
#include "bench/disagg_bench.h"
#include "bench/gemm_bench.h"
#include "bench/memory_bench.h"
#include "bench/rebalance_bench.h"
#include "bench/serve_bench.h"
#include "bench/tokenize_bench.h"
#include "bench/transfer_bench.h"
#include "launcher/commands/commands.h"
#include "parallel/mpi/mpi_world.h"

namespace mlarun::commands {
namespace {

void AddBenchAttention(CLI::App* bench, CommandTable& table) {
  struct Flags {
    AttentionBenchOptions ab;
    std::string dtype = "bf16";
  };
  auto f = std::make_shared<Flags>();
  AttentionBenchOptions& ab = f->ab;
  auto* attn = bench->add_subcommand("attention", "Absorbed vs expanded MLA attention on this machine");
  attn->add_flag("--quick", ab.quick, "Decode rows and a small grid (well under a minute)");
  attn->add_flag("--json", ab.json, "Print one JSON document on stdout (the table goes to stderr)");
  attn->add_option("--svg", ab.svg_path, "Draw the query-length x context grid into this SVG file");
  attn->add_option("--dtype", f->dtype, "Cache and weight dtype: bf16 or f32")->capture_default_str();
  attn->add_option("--heads", ab.heads, "Query heads (128 = DeepSeek-V3 at TP 1)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  attn->add_option("--threads", ab.threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  attn->add_option("--repetitions", ab.repetitions, "Timed repetitions per point (median reported)")
      ->check(CLI::NonNegativeNumber);
  attn->add_option("--min-time", ab.min_time_s, "Seconds per repetition")->check(CLI::NonNegativeNumber);
  attn->add_option("--contexts", ab.contexts, "Grid contexts S (cached tokens before the query block)")->delimiter(',');
  attn->add_option("--query-lens", ab.query_lens, "Grid query lengths Q")->delimiter(',');
  attn->add_option("--write-thresholds", ab.write_thresholds,
                   "Write the suggested dispatch thresholds to this file (for --attention-thresholds)");
  table.Add(attn, [f](ProcessArgs) {
    auto dt = ParseDType(f->dtype);
    if (!dt.ok() || (*dt != DType::kBF16 && *dt != DType::kF32)) {
      std::fprintf(stderr, "mlarun: --dtype must be bf16 or f32, got '%s'\n", f->dtype.c_str());
      return 2;
    }
    f->ab.dtype = *dt;
    if (f->ab.threads > 0) omp_set_num_threads(f->ab.threads);
    const Status st = RunAttentionBench(f->ab);
    if (!st.ok()) {
      std::fprintf(stderr, "mlarun bench attention: %s\n", st.ToString().c_str());
      return 1;
    }
    return 0;
  });
}

void AddBenchDecode(CLI::App* bench, CommandTable& table) {
  struct Flags {
    DecodeBenchOptions db;
    int threads = 0;
  };
  auto f = std::make_shared<Flags>();
  DecodeBenchOptions& db = f->db;
  auto* dec = bench->add_subcommand("decode", "Decode and prefill throughput of one process, and where a step goes");
  dec->add_option("--model", db.deployment.model, "Checkpoint directory or configs/models/*.yaml")
      ->capture_default_str();
  dec->add_option("--num-layers", db.deployment.num_layers, "Reduced depth (YAML models)")->check(CLI::PositiveNumber);
  dec->add_option("--experts", db.deployment.experts,
                  "Routed experts kept (YAML models), so large shapes fit in memory")
      ->check(CLI::PositiveNumber);
  dec->add_option("--batch", db.batches, "Batch sizes")->delimiter(',')->capture_default_str();
  dec->add_option("--context", db.contexts, "Context lengths (tokens already cached per sequence)")
      ->delimiter(',')
      ->capture_default_str();
  dec->add_option("--prefill-tokens", db.prefill_tokens, "Prompt tokens of the prefill measurement")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  dec->add_option("--repetitions", db.repetitions, "Timed steps per point (median)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  dec->add_option("--kv-dtype", db.deployment.kv_dtype, "Latent cache dtype: bf16 or fp32");
  dec->add_option("--structured", db.structured,
                  "Also time decode steps with every sequence constrained (json_object), interleaved")
      ->check(CLI::IsMember({"json_object"}));
  AddWeightsFlag(dec, db.deployment.weights);
  AddDeviceFlag(dec, db.deployment.device);
  AddFp8WeightsFlag(dec, db.deployment.fp8_weights);
  AddLmHeadFlag(dec, db.deployment.lm_head);
  dec->add_option("--threads", f->threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  dec->add_flag("--json", db.json, "One JSON document on stdout (the table goes to stderr)");
  dec->add_option("--parallel", db.deployment.parallel, "Under mpirun: dp=D,attn_tp=T[,moe=...] (decode only)");
  table.Add(dec, [f](ProcessArgs args) {
    if (f->threads > 0) omp_set_num_threads(f->threads);
    Status st;
    if (f->db.deployment.parallel.empty()) {
      st = RunDecodeBench(f->db);
    } else {
      auto session = MpiSession::Init(args.argc, args.argv);
      st = session.ok() ? RunDecodeBenchParallel(f->db, **session) : session.status();
    }
    if (!st.ok()) {
      std::fprintf(stderr, "mlarun bench decode: %s\n", st.ToString().c_str());
      return 1;
    }
    return 0;
  });
}

void AddBenchAccuracy(CLI::App* bench, CommandTable& table) {
  struct Flags {
    AccuracyBenchOptions ab;
    int threads = 0;
  };
  auto f = std::make_shared<Flags>();
  AccuracyBenchOptions& ab = f->ab;
  auto* acc = bench->add_subcommand(
      "accuracy", "Logits of models (and llama.cpp logits files) against a reference model's, on the same ids");
  acc->add_option("--model", ab.models, "Checkpoint directory or configs/models/*.yaml to compare (repeatable)");
  acc->add_option("--reference", ab.reference, "The reference model (e.g. the bf16 checkpoint)");
  acc->add_option("--positions", ab.positions, "Positions compared (random ids)")->capture_default_str();
  acc->add_option("--sequence-length", ab.sequence_length, "Tokens per sequence (each from an empty cache)")
      ->capture_default_str();
  acc->add_option("--chunk-tokens", ab.chunk_tokens,
                  "Tokens per forward within a sequence (1: every position a decode step; 0: the whole sequence)")
      ->capture_default_str();
  acc->add_option("--seed", ab.seed, "Seed of the random ids")->capture_default_str();
  acc->add_option("--llama-logits", ab.llama_logits,
                  "Logits file of bench/llama_logits.cpp (with FILE.ids) to compare (repeatable)");
  acc->add_option("--write-ids", ab.write_ids, "Write the run's ids to this file (for llama_logits) and stop");
  acc->add_option("--threads", f->threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  acc->add_flag("--json", ab.json, "One JSON document on stdout (the table goes to stderr)");
  table.Add(acc, [f](ProcessArgs) {
    const Status valid = ValidateAccuracyOptions(f->ab);
    if (!valid.ok()) {
      std::fprintf(stderr, "mlarun bench accuracy: %s\n", valid.message().c_str());
      return 2;
    }
    if (f->threads > 0) omp_set_num_threads(f->threads);
    return ExitStatus("bench accuracy", RunAccuracyBench(f->ab, std::cout, std::cerr));
  });
}

void AddBenchMemory(CLI::App* bench, CommandTable& table) {
  struct Flags {
    MemoryBenchOptions mb;
    int threads = 0;
  };
  auto f = std::make_shared<Flags>();
  auto* bench_mem = bench->add_subcommand(
      "memory", "The memory's streaming read bandwidth, as bench decode measures it next to each step");
  bench_mem->add_option("--passes", f->mb.passes, "Timed passes (after one untimed)")->capture_default_str();
  bench_mem->add_option("--bytes", f->mb.bytes, "Buffer bytes (default: 4 x the last-level cache, 1-2 GiB)");
  bench_mem->add_option("--threads", f->threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  bench_mem->add_flag("--json", f->mb.json, "One JSON document on stdout (the table goes to stderr)");
  table.Add(bench_mem, [f](ProcessArgs) {
    if (f->threads > 0) omp_set_num_threads(f->threads);
    return ExitStatus("bench memory", RunMemoryBench(f->mb, std::cout, std::cerr));
  });
}

void AddBenchGemm(CLI::App* bench, CommandTable& table) {
  struct Flags {
    GemmBenchOptions gb;
    int threads = 0;
  };
  auto f = std::make_shared<Flags>();
  GemmBenchOptions& gb = f->gb;
  auto* bench_gemm =
      bench->add_subcommand("gemm", "Our matrix-product kernels against each other and oneDNN, by row count");
  bench_gemm->add_option("--rows", gb.rows, "Row counts of A (m), comma-separated")
      ->delimiter(',')
      ->capture_default_str();
  bench_gemm->add_option("--n", gb.n, "B's columns, a weight's rows (default: a weight of 4 x the last-level cache)");
  bench_gemm->add_option("--k", gb.k, "The inner dimension")->capture_default_str();
  bench_gemm->add_option("--dtype", gb.dtype, "A and B: bf16 or f32")->capture_default_str();
  bench_gemm->add_option("--layout", gb.layout, "weight: B [n, k] as a weight is stored; rows: B [k, n]")
      ->capture_default_str();
  bench_gemm->add_option("--impl", gb.impls, "Implementations: auto, small, packed, tiles, onednn")
      ->delimiter(',')
      ->capture_default_str();
  bench_gemm->add_option("--repetitions", gb.repetitions, "Timed repetitions (the median is reported)")
      ->capture_default_str();
  bench_gemm->add_option("--threads", f->threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  bench_gemm->add_flag("--json", gb.json, "One JSON document on stdout (the table goes to stderr)");
  table.Add(bench_gemm, [f](ProcessArgs) {
    if (f->threads > 0) omp_set_num_threads(f->threads);
    return ExitStatus("bench gemm", RunGemmBench(f->gb, std::cout, std::cerr));
  });
}

void AddBenchComm(CLI::App* bench, CommandTable& table) {
  auto cb = std::make_shared<CommBenchOptions>();
  auto* comm = bench->add_subcommand(
      "comm", "Under mpirun: a layout's collectives at one decode step's sizes (time, algbw, busbw)");
  comm->add_option("--model", cb->model, "Checkpoint directory or configs/models/*.yaml (its config only)")
      ->capture_default_str();
  comm->add_option("--parallel", cb->parallel, "dp=D,attn_tp=T (its world must be the job's size)")->required();
  comm->add_option("--batch", cb->batches, "Tokens per DP group per step")->delimiter(',')->capture_default_str();
  comm->add_option("--repetitions", cb->repetitions, "Timed calls per collective (median)")->capture_default_str();
  comm->add_flag("--json", cb->json, "One JSON document on stdout (the table goes to stderr)");
  table.Add(comm, [cb](ProcessArgs args) {
    auto session = MpiSession::Init(args.argc, args.argv);
    return ExitStatus("bench comm",
                      session.ok() ? RunCommBench(*cb, **session, cb->json ? std::cerr : std::cout) : session.status());
  });
}

void AddBenchTransfer(CLI::App* bench, CommandTable& table) {
  auto tb = std::make_shared<TransferBenchOptions>();
  auto* transfer = bench->add_subcommand(
      "transfer", "Under mpirun -np 2: latent blocks fetched over UCX from rank 0's pool by rank 1 (time, GB/s)");
  transfer->add_option("--sizes", tb->sizes, "Bytes per fetch, rounded up to whole blocks")
      ->delimiter(',')
      ->capture_default_str();
  transfer->add_option("--block-tokens", tb->block_tokens, "Tokens per block (576 bf16 values each)")
      ->capture_default_str();
  transfer->add_option("--repetitions", tb->repetitions, "Timed fetches per size (median)")->capture_default_str();
  transfer->add_option("--path", tb->path, "any (peer failure handling; TCP within a host) or shm (one host)")
      ->capture_default_str();
  transfer->add_flag("--process-memory", tb->process_memory,
                     "Pools in process memory registered after the fact (default: allocated by UCX)");
  transfer->add_flag("--scattered", tb->scattered, "Every other block: one get per block instead of one per fetch");
  transfer->add_flag("--json", tb->json, "One JSON document on stdout (the table goes to stderr)");
  table.Add(transfer, [tb](ProcessArgs args) {
    auto session = MpiSession::Init(args.argc, args.argv);
    return ExitStatus("bench transfer", session.ok()
                                            ? RunTransferBench(*tb, **session, tb->json ? std::cerr : std::cout)
                                            : session.status());
  });
}

void AddBenchServe(CLI::App* bench, CommandTable& table) {
  struct Flags {
    ServeBenchOptions sb;
    SecurityFlags security;
  };
  auto f = std::make_shared<Flags>();
  ServeBenchOptions& sb = f->sb;
  auto* serve =
      bench->add_subcommand("serve", "The serving path over loopback: client load, coordinator overhead, routing");
  serve
      ->add_option("--clients", sb.clients,
                   "Concurrent client threads (default 64; load rows use at least 4 per group)")
      ->check(CLI::PositiveNumber);
  serve->add_option("--requests", sb.requests, "Requests per load row (default 512)")->check(CLI::PositiveNumber);
  serve->add_option("--max-tokens", sb.max_tokens, "Tokens per request (default 16)")->check(CLI::Range(1, 1024));
  serve->add_option("--groups", sb.groups, "Simulated DP groups of the load rows (default 4,64,256)")->delimiter(',');
  serve->add_option("--tokens-per-s", sb.tokens_per_s, "Per simulated group; 0: as fast as possible")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  serve->add_option("--policy", sb.policies, "round_robin,least_loaded,prefix_affinity or all (default all)")
      ->delimiter(',');
  serve->add_option("--coordinator", sb.coordinator,
                    "Drive this running deployment (host:port) instead of an in-process one");
  serve->add_flag("--quick", sb.quick, "Small numbers (well under a minute)");
  serve->add_flag("--json", sb.json, "One JSON document on stdout (the tables go to stderr)");
  serve->add_flag("--http", sb.http,
                  "Only the HTTP API against gRPC on one in-process coordinator (overhead, then load)");
  AddSecurityFlags(serve, f->security, SecurityRole::kClient);
  table.Add(serve, [f](ProcessArgs) {
    if (!LoadSecurity("bench serve", f->security, SecurityRole::kClient, nullptr, &f->sb.security, nullptr)) return 2;
    return ExitStatus("bench serve", RunServeBench(f->sb, std::cout, f->sb.json ? std::cerr : std::cout));
  });
}

void AddBenchRebalance(CLI::App* bench, CommandTable& table) {
  auto rb = std::make_shared<RebalanceBenchOptions>();
  auto* cmd = bench->add_subcommand(
      "rebalance", "Coordinator rebalancing off vs on: a skewed open-loop workload on simulated DP groups");
  cmd->add_option("--groups", rb->groups, "Simulated DP group counts (default 2,4)")->delimiter(',');
  cmd->add_option("--rounds", rb->rounds,
                  "Off/on pairs per group count, the same workload (default 3; 1 with --quick)");
  cmd->add_option("--duration-s", rb->duration_s, "Arrival window of one run in seconds (default 20; 2 with --quick)");
  cmd->add_option("--rate", rb->rate, "Poisson arrivals per second per group (default 8)");
  cmd->add_option("--long-fraction", rb->long_fraction, "Share of long requests")->capture_default_str();
  cmd->add_option("--short-tokens", rb->short_tokens, "Tokens of a short request (default 32; 16 with --quick)");
  cmd->add_option("--long-tokens", rb->long_tokens, "Tokens of a long request (default 1024; 128 with --quick)");
  cmd->add_option("--tokens-per-s", rb->tokens_per_s, "Per simulated group: the per-token part of a step")
      ->capture_default_str();
  cmd->add_option("--step-ms", rb->step_ms, "Per simulated step: its fixed part")->capture_default_str();
  cmd->add_option("--threshold", rb->threshold, "The coordinator's rebalance threshold when on (requests in flight)")
      ->capture_default_str();
  cmd->add_option("--policy", rb->policy, "Routing: round_robin, least_loaded or prefix_affinity")
      ->capture_default_str();
  cmd->add_option("--seed", rb->seed, "Workload seed (arrivals, prompts, long or short)")->capture_default_str();
  cmd->add_flag("--quick", rb->quick, "Small numbers (well under 30 s)");
  cmd->add_flag("--json", rb->json, "One JSON document on stdout (the tables go to stderr)");
  table.Add(cmd, [rb](ProcessArgs) {
    return ExitStatus("bench rebalance", RunRebalanceBench(*rb, std::cout, rb->json ? std::cerr : std::cout));
  });
}

void AddBenchDisagg(CLI::App* bench, CommandTable& table) {
  auto db = std::make_shared<DisaggBenchOptions>();
  auto* cmd = bench->add_subcommand(
      "disagg", "Prefill + decode groups vs as many mixed groups: open-loop prompt mixes on simulated DP groups");
  cmd->add_option("--groups", db->groups, "Simulated DP groups in each layout (disagg: half prefill, the rest decode)")
      ->capture_default_str();
  cmd->add_option("--rounds", db->rounds,
                  "Mixed/disagg pairs per workload, the same requests (default 3; 1 with --quick)");
  cmd->add_option("--duration-s", db->duration_s,
                  "Arrival window of one run in seconds (default 20; 1.5 with --quick)");
  cmd->add_option("--rate", db->rate, "Poisson arrivals per second, across the groups")->capture_default_str();
  cmd->add_option("--prefill-tokens-per-s", db->prefill_tokens_per_s, "Per simulated group: the cost of prompt tokens")
      ->capture_default_str();
  cmd->add_option("--max-batched-tokens", db->max_batched_tokens, "Prompt tokens a simulated step computes at most")
      ->capture_default_str();
  cmd->add_option("--tokens-per-s", db->tokens_per_s, "Per simulated group: the per-token part of a decode step")
      ->capture_default_str();
  cmd->add_option("--step-ms", db->step_ms, "Per simulated step: its fixed part")->capture_default_str();
  cmd->add_option("--transfer-gbps", db->transfer_gbps,
                  "Simulated block moves (0: moved requests are computed again on their decode group)")
      ->capture_default_str();
  cmd->add_option("--short-fraction", db->short_fraction, "Share of short prompts in the prefill-heavy workload")
      ->capture_default_str();
  cmd->add_option("--long-prompt-min", db->long_prompt_min, "Shortest long prompt (default 1024; 512 with --quick)");
  cmd->add_option("--long-prompt-max", db->long_prompt_max, "Longest long prompt (default 4096; 1024 with --quick)");
  cmd->add_option("--short-prompt-min", db->short_prompt_min, "Shortest short prompt")->capture_default_str();
  cmd->add_option("--short-prompt-max", db->short_prompt_max, "Longest short prompt")->capture_default_str();
  cmd->add_option("--output-min", db->output_min, "Fewest tokens generated (default 64; 16 with --quick)");
  cmd->add_option("--output-max", db->output_max, "Most tokens generated (default 256; 32 with --quick)");
  cmd->add_option("--seed", db->seed, "Workload seed (arrivals, prompts, outputs)")->capture_default_str();
  cmd->add_flag("--quick", db->quick, "Small numbers (well under 30 s)");
  cmd->add_flag("--json", db->json, "One JSON document on stdout (the tables go to stderr)");
  table.Add(cmd, [db](ProcessArgs) {
    return ExitStatus("bench disagg", RunDisaggBench(*db, std::cout, db->json ? std::cerr : std::cout));
  });
}

void AddBenchTokenize(CLI::App* bench, CommandTable& table) {
  auto tb = std::make_shared<text::TokenizeBenchOptions>();
  auto* tok_bench = bench->add_subcommand("tokenize", "Encoding speed of the model's tokenizer");
  tok_bench->add_option("--model", tb->model, "As for mlarun tokenize")->required();
  tok_bench->add_option("--text", tb->text_file, "The text to encode (a file)")->required();
  tok_bench->add_option("--mode", tb->mode, "whole: one Encode of the file; lines: one per line")
      ->capture_default_str()
      ->check(CLI::IsMember({"whole", "lines"}));
  tok_bench->add_option("--runs", tb->runs, "Timed runs (the median is reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  tok_bench->add_option("--threads", tb->threads, "Threads encoding the whole text each, on one tokenizer")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  tok_bench->add_flag("--json", tb->json, "One JSON object instead of the text report");
  table.Add(tok_bench, [tb](ProcessArgs) { return text::RunTokenizeBench(*tb, std::cout, std::cerr); });
}

}  // namespace

void AddBenchCommands(CLI::App& app, CommandTable& table) {
  auto* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  AddBenchAttention(bench, table);
  AddBenchDecode(bench, table);
  AddBenchAccuracy(bench, table);
  AddBenchMemory(bench, table);
  AddBenchGemm(bench, table);
  AddBenchComm(bench, table);
  AddBenchTransfer(bench, table);
  AddBenchServe(bench, table);
  AddBenchRebalance(bench, table);
  AddBenchDisagg(bench, table);
  AddBenchTokenize(bench, table);
}

}  // namespace mlarun::commands
