// mlarun: the command-line entry point. The only place that exits.
#include <omp.h>
#include <pthread.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <thread>

#include "bench/attention_bench.h"
#include "bench/comm_bench.h"
#include "bench/decode_bench.h"
#include "bench/gemm_bench.h"
#include "bench/memory_bench.h"
#include "bench/serve_bench.h"
#include "bench/tokenize_bench.h"
#include "launcher/cli_typos.h"
#include "launcher/env.h"
#include "launcher/generate/generate.h"
#include "launcher/memory/memory.h"
#include "launcher/serve/serve.h"
#include "launcher/tokenize/tokenize.h"
#include "launcher/worker/worker.h"
#include "parallel/layout.h"
#include "parallel/mpi/mpi_world.h"
#include "serving/client/client.h"
#include "serving/coordinator/coordinator.h"
#include "serving/sim/sim_worker.h"

// The sampling flags `generate` and `submit` share (vLLM's SamplingParams names).
void AddSamplingFlags(CLI::App* cmd, mlarun::SamplingParams& p) {
  cmd->add_option("--max-tokens", p.max_tokens, "Tokens to generate at most")->capture_default_str();
  cmd->add_option("--temperature", p.temperature, "0: greedy")->capture_default_str();
  cmd->add_option("--top-p", p.top_p, "Nucleus sampling mass")->capture_default_str();
  cmd->add_option("--top-k", p.top_k, "Keep the k most likely tokens (0: off)")->capture_default_str();
  cmd->add_option("--seed", p.seed, "Per-request random seed")->capture_default_str();
  cmd->add_option("--stop-token-ids", p.stop_token_ids, "Stop at any of these ids")->delimiter(',');
  cmd->add_flag("--ignore-eos", p.ignore_eos, "Do not stop at the model's eos_token_id");
  cmd->add_option("--logprobs", p.logprobs, "Also report the N most likely tokens of each step (0-20)")
      ->capture_default_str();
  cmd->add_option("--prompt-logprobs", p.prompt_logprobs,
                  "Also report each prompt token's logprob and its position's N most likely tokens (0-20; -1: off)")
      ->capture_default_str();
}

// Flags several commands share, with one help text each.
void AddWeightsFlag(CLI::App* app, std::string& weights) {
  app->add_option("--weights", weights, "Checkpoint weights: mapped (read in place) or copied (huge-page copies)")
      ->capture_default_str();
}
void AddDeviceFlag(CLI::App* app, std::string& device) {
  app->add_option("--device", device,
                  "Where the model runs: cpu, or cuda (one GPU per rank: the rank on its node picks it; NCCL between "
                  "ranks)")
      ->capture_default_str();
}
void AddFp8WeightsFlag(CLI::App* app, std::string& fp8) {
  app->add_option("--fp8-weights", fp8,
                  "Checkpoints whose projections are F8_E4M3 (DeepSeek-V3's release): keep them fp8 in memory, or "
                  "dequantize to the config's dtype at load")
      ->capture_default_str();
}
void AddAttentionThresholdsFlag(CLI::App* app, std::string& path) {
  app->add_option(
      "--attention-thresholds", path,
      "Absorbed/expanded dispatch thresholds measured on this machine (bench attention --write-thresholds)");
}

// The security flags of the serving commands: file paths, read after parsing
// (secrets never travel on the command line).
struct SecurityFlags {
  std::string worker_secret_file, auth_token_file;
  mlarun::TlsFiles tls;
};
enum class SecurityRole { kCoordinator, kWorker, kClient };
void AddSecurityFlags(CLI::App* cmd, SecurityFlags& f, SecurityRole role) {
  using R = SecurityRole;
  if (role == R::kCoordinator) {
    cmd->add_option("--worker-secret-file", f.worker_secret_file,
                    "File holding the worker link's shared secret (trimmed); workers must present it "
                    "(it or --tls-ca is required when --listen is beyond loopback)");
    cmd->add_option("--auth-token-file", f.auth_token_file,
                    "Client API tokens, one per line (TOKEN [NAME]): clients must send `authorization: Bearer TOKEN`");
    cmd->add_option("--tls-cert", f.tls.cert, "TLS: the coordinator's certificate chain (PEM)");
    cmd->add_option("--tls-key", f.tls.key, "TLS: its private key (PEM)");
    cmd->add_option("--tls-ca", f.tls.ca,
                    "TLS: workers with a client certificate signed by this CA (PEM) need no secret");
    return;
  }
  if (role == R::kWorker) {
    cmd->add_option("--worker-secret-file", f.worker_secret_file,
                    "File holding the coordinator's worker secret (as its --worker-secret-file)");
    cmd->add_option("--tls-cert", f.tls.cert, "TLS: this worker's client certificate (PEM; needs --tls-ca)");
    cmd->add_option("--tls-key", f.tls.key, "TLS: its private key (PEM)");
  } else {
    cmd->add_option(
        "--auth-token-file", f.auth_token_file,
        "File holding the client API token: its first line's token (a line of the coordinator's --auth-token-file)");
  }
  cmd->add_option("--tls-ca", f.tls.ca, "TLS to the coordinator, trusting the CA (PEM) that signed its certificate");
}
// Reads what the flags name (`worker_secret`: null for clients, which have no
// such flag; `client` or `coordinator`: the side's); false, with the reason
// printed, when a file cannot be used.
bool LoadSecurity(const char* cmd, const SecurityFlags& f, SecurityRole role, std::string* worker_secret,
                  mlarun::ClientSecurity* client, mlarun::CoordinatorOptions* coordinator) {
  auto fail = [&](const mlarun::Status& st) {
    std::fprintf(stderr, "mlarun %s: %s\n", cmd, st.ToString().c_str());
    return false;
  };
  if (!f.worker_secret_file.empty() && worker_secret != nullptr) {
    auto secret = mlarun::ReadSecretFile("--worker-secret-file", f.worker_secret_file);
    if (!secret.ok()) return fail(secret.status());
    *worker_secret = *secret;
  }
  auto tls = role == SecurityRole::kCoordinator ? mlarun::LoadServerTls(f.tls) : mlarun::LoadClientTls(f.tls);
  if (!tls.ok()) return fail(tls.status());
  if (coordinator != nullptr) {
    coordinator->tls = *tls;
    if (!f.auth_token_file.empty()) {
      auto tokens = mlarun::AuthTokens::ReadFile(f.auth_token_file);
      if (!tokens.ok()) return fail(tokens.status());
      coordinator->auth_tokens = std::move(*tokens);
    }
    return true;
  }
  client->tls = *tls;
  if (!f.auth_token_file.empty()) {
    auto token = mlarun::ReadClientTokenFile(f.auth_token_file);
    if (!token.ok()) return fail(token.status());
    client->token = *token;
  }
  return true;
}

// A command's exit status: 0 when `st` is OK, else `st` on stderr and 2 for
// bad input (InvalidArgument), 1 for anything else.
int ExitStatus(const char* cmd, const mlarun::Status& st) {
  if (st.ok()) return 0;
  std::fprintf(stderr, "mlarun %s: %s\n", cmd, st.ToString().c_str());
  return st.code() == mlarun::StatusCode::kInvalidArgument ? 2 : 1;
}

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

  mlarun::DecodeBenchOptions db;
  int decode_threads = 0;
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
  AddWeightsFlag(dec, db.deployment.weights);
  AddDeviceFlag(dec, db.deployment.device);
  AddFp8WeightsFlag(dec, db.deployment.fp8_weights);
  dec->add_option("--threads", decode_threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  dec->add_flag("--json", db.json, "One JSON document on stdout (the table goes to stderr)");
  dec->add_option("--parallel", db.deployment.parallel, "Under mpirun: dp=D,attn_tp=T[,moe=...] (decode only)");

  mlarun::MemoryBenchOptions mb;
  int memory_threads = 0;
  auto* bench_mem = bench->add_subcommand(
      "memory", "The memory's streaming read bandwidth, as bench decode measures it next to each step");
  bench_mem->add_option("--passes", mb.passes, "Timed passes (after one untimed)")->capture_default_str();
  bench_mem->add_option("--bytes", mb.bytes, "Buffer bytes (default: 4 x the last-level cache, 1-2 GiB)");
  bench_mem->add_option("--threads", memory_threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  bench_mem->add_flag("--json", mb.json, "One JSON document on stdout (the table goes to stderr)");

  mlarun::GemmBenchOptions gb;
  int gemm_threads = 0;
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
  bench_gemm->add_option("--threads", gemm_threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  bench_gemm->add_flag("--json", gb.json, "One JSON document on stdout (the table goes to stderr)");

  mlarun::CommBenchOptions cb;
  auto* comm = bench->add_subcommand(
      "comm", "Under mpirun: a layout's collectives at one decode step's sizes (time, algbw, busbw)");
  comm->add_option("--model", cb.model, "Checkpoint directory or configs/models/*.yaml (its config only)")
      ->capture_default_str();
  comm->add_option("--parallel", cb.parallel, "dp=D,attn_tp=T (its world must be the job's size)")->required();
  comm->add_option("--batch", cb.batches, "Tokens per DP group per step")->delimiter(',')->capture_default_str();
  comm->add_option("--repetitions", cb.repetitions, "Timed calls per collective (median)")->capture_default_str();
  comm->add_flag("--json", cb.json, "One JSON document on stdout (the table goes to stderr)");

  mlarun::ServeBenchOptions sb;
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
  SecurityFlags sb_security;
  AddSecurityFlags(serve, sb_security, SecurityRole::kClient);

  mlarun::GenerateOptions gen;
  auto* generate = app.add_subcommand("generate", "Generate tokens with a model on this process");
  generate->add_option("--model", gen.deployment.model, "Hugging Face checkpoint directory, or configs/models/*.yaml")
      ->required();
  auto* ids_opt =
      generate->add_option("--prompt-ids", gen.prompt_ids, "One prompt as token ids: 1,2,3")->delimiter(',');
  auto* file_opt = generate->add_option("--prompts", gen.prompts_path, "JSON lines: prompt_ids and sampling fields");
  ids_opt->excludes(file_opt);
  AddSamplingFlags(generate, gen.sampling);
  generate->add_flag("--json", gen.json, "One JSON object per request, in input order");
  generate->add_option("--kv-dtype", gen.deployment.kv_dtype,
                       "Latent cache dtype: bf16 or fp32 (default: the model's)");
  generate->add_option("--num-layers", gen.deployment.num_layers, "Reduced depth for YAML models")
      ->check(CLI::PositiveNumber);
  generate->add_option("--threads", gen.threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  generate->add_option("--max-batched-tokens", gen.engine.max_num_batched_tokens, "Tokens per step")
      ->capture_default_str();
  generate->add_option("--max-num-seqs", gen.engine.max_num_seqs, "Running requests at once")->capture_default_str();
  generate->add_option("--cache-bytes", gen.engine.cache_budget_bytes, "Latent cache budget in bytes")
      ->capture_default_str();
  generate->add_option("--block-size", gen.engine.block_size, "Tokens per cache block")->capture_default_str();
  generate->add_option("--parallel", gen.deployment.parallel,
                       "Run on the ranks of mpirun: dp=D,attn_tp=T[,moe=expert|intermediate]");
  AddWeightsFlag(generate, gen.deployment.weights);
  AddAttentionThresholdsFlag(generate, gen.deployment.attention_thresholds);
  AddDeviceFlag(generate, gen.deployment.device);
  AddFp8WeightsFlag(generate, gen.deployment.fp8_weights);

  std::string config_path;
  mlarun::MemoryOptions mem;
  auto* memory = app.add_subcommand(
      "memory", "Per-rank memory under TP and DP-attention layouts: predicted, or beside a live run");
  memory->add_option("--model", mem.model, "Checkpoint directory, config.json, or configs/models/*.yaml");
  memory->add_option("--world", mem.world, "Ranks")->capture_default_str()->check(CLI::PositiveNumber);
  memory->add_option("--layouts", mem.layouts, "tpN, dpN, dpAxtpB or dp=A,attn_tp=B (default: tpW, dpW, dp2xtpW/2)")
      ->delimiter(',');
  memory->add_option("--hbm-gib,--memory-gib", mem.memory_gib, "Memory per rank in GiB (H200: 141)")
      ->capture_default_str();
  memory->add_option("--kv-dtype", mem.kv_dtype, "Latent cache dtype: bf16 or fp32 (default: the model's)");
  memory->add_option(
      "--weight-dtype", mem.weight_dtype,
      "Projection weights: bf16 or fp32 (what mlarun holds; default the model's) or fp8 (the release's block-fp8)");
  memory->add_option("--num-layers", mem.num_layers, "Reduced depth (YAML models)")->check(CLI::PositiveNumber);
  memory->add_option("--block-size", mem.block_size, "Tokens per cache block")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  memory->add_option("--chunk-rows", mem.chunk_rows, "Rows of the expanded path's up-projection chunk")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  memory->add_flag("--json", mem.json, "One JSON document instead of the tables");
  memory->add_option("--json-out", mem.json_path, "Also write the JSON document to this file");
  memory->add_option("--svg", mem.svg_path,
                     "Draw per-rank memory by category and the max cached tokens into this SVG file");
  memory->add_flag("--measure", mem.measure, "Compare with a live deployment (GetStats from --coordinator)");
  auto* m_coord = memory->add_option("--coordinator", mem.coordinator, "Coordinator host:port (with --measure)");
  memory->add_option("--requests", mem.requests_path, "With --measure: the request set submitted (JSON lines)");
  memory->add_option("--results", mem.results_path, "With --measure: its `mlarun submit --json` output");
  memory->add_option("--timeout", mem.timeout_s, "With --measure: seconds to wait for the ranks' reports to settle")
      ->capture_default_str();
  memory->add_option("--config", config_path, "Deployment file (configs/deploy/*.yaml): the coordinator address");
  SecurityFlags mem_security;
  AddSecurityFlags(memory, mem_security, SecurityRole::kClient);

  // ---- Serving: coordinator, workers, clients -------------------------------
  mlarun::CoordinatorOptions co;
  std::string policy = "prefix_affinity";
  auto* coord = app.add_subcommand("coordinator", "Serve the client API and route requests to the workers' DP groups");
  auto* c_listen =
      coord->add_option("--listen", co.listen, "host:port to bind (loopback by default)")->capture_default_str();
  auto* c_policy =
      coord->add_option("--policy", policy, "round_robin | least_loaded | prefix_affinity")->capture_default_str();
  coord->add_option("--max-queued", co.max_queued, "Requests waiting for a group before RESOURCE_EXHAUSTED")
      ->capture_default_str();
  coord
      ->add_option("--queue-timeout-s", co.queue_timeout_s,
                   "Longest wait of a request for a DP group to register when none is connected")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  coord
      ->add_option("--lost-group-wait-s", co.lost_group_wait_s,
                   "After the last group went away, how long its unanswered requests wait for one to come back")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  coord
      ->add_option("--stall-timeout-s", co.stall_timeout_s,
                   "A group with requests in flight that sends nothing this long is taken as stalled and dropped")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  coord->add_option("--config", config_path, "Deployment file (configs/deploy/*.yaml); flags override it");
  auto* c_http = coord
                     ->add_option("--http", co.http_listen,
                                  "Serve the OpenAI-compatible HTTP API and /metrics on host:port (off unless given; "
                                  "127.0.0.1:8000 when given without a value)")
                     ->expected(0, 1);
  coord->add_option("--model", co.http_model,
                    "With --http: the model (configs/models/*.yaml, checkpoint or tokenizer directory); only its "
                    "tokenizer, chat template and name are read");
  coord->add_option("--served-model-name", co.served_model_name,
                    "With --http: the model name clients send (default: --model's basename without .yaml)");
  coord->add_option("--http-threads", co.http_threads, "With --http: handler threads (one per open connection)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  coord->add_option("--http-max-body-bytes", co.http_max_body_bytes, "With --http: larger request bodies get 413")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1024}, int64_t{1} << 40));
  coord
      ->add_option("--http-request-timeout-s", co.http_request_timeout_s,
                   "With --http: each request's deadline (504 when it passes); 0: none")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  SecurityFlags c_security;
  AddSecurityFlags(coord, c_security, SecurityRole::kCoordinator);

  mlarun::WorkerOptions wo;
  auto* worker = app.add_subcommand("worker", "Serve a model on the ranks of mpirun for a coordinator");
  auto* w_coord = worker->add_option("--coordinator", wo.coordinator, "Coordinator host:port")->capture_default_str();
  auto* w_model = worker->add_option("--model", wo.deployment.model, "Checkpoint directory or configs/models/*.yaml");
  auto* w_par = worker->add_option("--parallel", wo.deployment.parallel, "dp=D,attn_tp=T[,moe=expert|intermediate]")
                    ->capture_default_str();
  auto* w_kv = worker->add_option("--kv-dtype", wo.deployment.kv_dtype, "Latent cache dtype: bf16 or fp32");
  worker->add_option("--num-layers", wo.deployment.num_layers, "Reduced depth for YAML models")
      ->check(CLI::PositiveNumber);
  auto* w_cache = worker->add_option("--cache-bytes", wo.engine.cache_budget_bytes, "Latent cache budget per rank")
                      ->capture_default_str();
  auto* w_mem = worker
                    ->add_option("--memory-gib", wo.memory_gib,
                                 "Memory per rank: the cache gets what the weights and the prefill workspace leave (as "
                                 "mlarun memory predicts)")
                    ->check(CLI::PositiveNumber)
                    ->excludes(w_cache);
  auto* w_mbt = worker->add_option("--max-batched-tokens", wo.engine.max_num_batched_tokens, "Tokens per step")
                    ->capture_default_str();
  worker->add_option("--max-num-seqs", wo.engine.max_num_seqs, "Running requests per group")->capture_default_str();
  worker->add_option("--block-size", wo.engine.block_size, "Tokens per cache block")->capture_default_str();
  AddWeightsFlag(worker, wo.deployment.weights);
  AddAttentionThresholdsFlag(worker, wo.deployment.attention_thresholds);
  AddDeviceFlag(worker, wo.deployment.device);
  AddFp8WeightsFlag(worker, wo.deployment.fp8_weights);
  int worker_threads = 0;
  worker->add_option("--threads", worker_threads, "CPU threads per rank (default: all)")->check(CLI::NonNegativeNumber);
  std::string fail_forward_call;
  worker->add_option("--fail-forward-call", fail_forward_call,
                     "Fault injection for tests: model step N (0-based) fails with INTERNAL on world rank RANK "
                     "(every rank without @RANK); form N[@RANK]");
  worker->add_option("--config", config_path, "Deployment file (configs/deploy/*.yaml); flags override it");
  SecurityFlags w_security;
  AddSecurityFlags(worker, w_security, SecurityRole::kWorker);

  mlarun::SimWorkerOptions so;
  auto* sim = app.add_subcommand("sim-worker", "Simulated DP groups without a model (tests, examples, benchmarks)");
  sim->add_option("--coordinator", so.coordinator, "Coordinator host:port")->capture_default_str();
  sim->add_option("--groups", so.groups, "DP groups to simulate")->capture_default_str()->check(CLI::PositiveNumber);
  sim->add_option("--tokens-per-s", so.tokens_per_s, "Per group; 0: as fast as possible")->capture_default_str();
  sim->add_option("--worker-id", so.worker_id, "Worker id to register with")->capture_default_str();
  sim->add_option("--vocab-size", so.vocab_size, "Vocabulary size")->capture_default_str();
  SecurityFlags s_security;
  AddSecurityFlags(sim, s_security, SecurityRole::kWorker);
  sim->add_option("--block-size", so.block_size, "Tokens per cache block")->capture_default_str();
  sim->add_option("--cache-blocks", so.cache_blocks, "Simulated cache blocks per group")->capture_default_str();
  sim->add_option("--max-position-embeddings", so.max_position_embeddings, "Longest prompt + max_tokens accepted")
      ->capture_default_str();
  sim->add_option("--eos-token-id", so.eos_token_id, "Stop at this id unless ignore_eos (-1: never)")
      ->capture_default_str();

  mlarun::SubmitOptions sub;
  auto* submit = app.add_subcommand("submit", "Send one request to a coordinator");
  auto* s_coord = submit->add_option("--coordinator", sub.coordinator, "Coordinator host:port")->capture_default_str();
  auto* s_ids = submit->add_option("--prompt-ids", sub.prompt_ids, "Prompt token ids: 1,2,3")->delimiter(',');
  auto* s_file = submit->add_option("--prompts", sub.prompts_path, "JSON lines, sent --concurrency at a time");
  s_ids->excludes(s_file);
  submit->add_option("--concurrency", sub.concurrency, "Requests in flight at once (with --prompts)")
      ->capture_default_str();
  AddSamplingFlags(submit, sub.sampling);
  submit->add_option("--request-id", sub.request_id, "Request id (default: the coordinator picks one)")
      ->excludes(s_file);
  submit->add_flag("--stream", sub.stream, "Print each token as it arrives")->excludes(s_file);
  submit->add_flag("--json", sub.json, "The object mlarun generate prints, plus dp_group");
  submit->add_option("--timeout", sub.timeout_s, "Deadline in seconds")->capture_default_str();
  submit->add_option("--config", config_path, "Deployment file (configs/deploy/*.yaml); flags override it");
  SecurityFlags sub_security;
  AddSecurityFlags(submit, sub_security, SecurityRole::kClient);

  mlarun::StatsOptions st;
  auto* stats = app.add_subcommand("stats", "Per-rank memory and load, per-group routing, from a coordinator");
  auto* t_coord = stats->add_option("--coordinator", st.coordinator, "Coordinator host:port")->capture_default_str();
  stats->add_flag("--json", st.json, "The GetStats response as JSON");
  stats->add_option("--timeout", st.timeout_s, "Deadline in seconds")->capture_default_str();
  stats->add_option("--config", config_path, "Deployment file (configs/deploy/*.yaml); flags override it");
  SecurityFlags st_security;
  AddSecurityFlags(stats, st_security, SecurityRole::kClient);

  mlarun::text::TokenizeOptions tk;
  auto* tokenize = app.add_subcommand(
      "tokenize", "The model's tokenizer: one JSON string per stdin line -> one JSON array of ids per stdout line");
  tokenize
      ->add_option("--model", tk.model, "Checkpoint or tokenizer directory, tokenizer.json, or configs/models/*.yaml")
      ->required();
  tokenize->add_flag("--decode", tk.decode, "The reverse: one JSON array of ids per line -> one JSON string");
  tokenize->add_flag("!--no-special-tokens", tk.add_special_tokens,
                     "Encoding: without the post-processor's tokens (bos), as add_special_tokens=False");
  tokenize->add_flag("--skip-special-tokens", tk.skip_special_tokens, "Decoding: leave special tokens out");

  mlarun::text::TokenizeBenchOptions tb;
  auto* tok_bench = bench->add_subcommand("tokenize", "Encoding speed of the model's tokenizer on one thread");
  tok_bench->add_option("--model", tb.model, "As for mlarun tokenize")->required();
  tok_bench->add_option("--text", tb.text_file, "The text to encode (a file)")->required();
  tok_bench->add_option("--mode", tb.mode, "whole: one Encode of the file; lines: one per line")
      ->capture_default_str()
      ->check(CLI::IsMember({"whole", "lines"}));
  tok_bench->add_option("--runs", tb.runs, "Timed runs (the median is reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  tok_bench->add_flag("--json", tb.json, "One JSON object instead of the text report");

  mlarun::ServeOptions sv;
  sv.coordinator.listen = "127.0.0.1:0";
  std::string sv_policy = "prefix_affinity", sv_auth_tokens;
  int sv_threads = 0;
  auto* serve_cmd = app.add_subcommand(
      "serve", "One machine: the coordinator here and the workers as a supervised mpirun job, until SIGINT/SIGTERM");
  serve_cmd->add_option("--model", sv.model, "Checkpoint directory or configs/models/*.yaml")->required();
  serve_cmd->add_option("--parallel", sv.parallel, "The worker job's layout: dp=D,attn_tp=T[,moe=...]")
      ->capture_default_str();
  sv.coordinator.http_listen = "127.0.0.1:8000";
  serve_cmd
      ->add_option("--http", sv.coordinator.http_listen,
                   "host:port of the OpenAI-compatible HTTP API (loopback by default; \"\" turns it off)")
      ->capture_default_str();
  serve_cmd->add_option("--served-model-name", sv.coordinator.served_model_name,
                        "The model name HTTP clients send (default: --model's basename without .yaml)");
  serve_cmd->add_option("--grpc", sv.coordinator.listen, "host:port of the gRPC client API (port 0: a free one)")
      ->capture_default_str();
  serve_cmd->add_option("--policy", sv_policy, "round_robin | least_loaded | prefix_affinity")->capture_default_str();
  serve_cmd->add_option("--auth-token-file", sv_auth_tokens,
                        "Client tokens (TOKEN [NAME] per line): the client API then needs Authorization: Bearer TOKEN");
  serve_cmd->add_option("--threads", sv_threads, "CPU threads per rank (default: the cores divided among the ranks)")
      ->check(CLI::NonNegativeNumber);
  serve_cmd->add_option("--worker-arg", sv.worker_args,
                        "One more `mlarun worker` argument, e.g. --worker-arg=--kv-dtype --worker-arg=fp32 (repeat)");
  serve_cmd->add_option("--mpirun-arg", sv.mpirun_args, "One more mpirun argument before -np (repeat)");
  serve_cmd->add_option("--ready-timeout-s", sv.ready_timeout_s, "The first job's groups must all register within this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve_cmd
      ->add_option("--restart-backoff-max-s", sv.restart_backoff_max_s,
                   "A job that died is started again after 1 s, doubling up to this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);

  if (const auto typo = mlarun::FindTypo(app, argc, argv)) {
    std::fprintf(stderr, "mlarun %s\nRun with --help for more information.\n", typo->c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help is 0; every usage error is 2
  }
  if (const mlarun::Status env = mlarun::ApplyEnvironmentOverrides(); !env.ok()) {
    std::fprintf(stderr, "mlarun: %s\n", env.ToString().c_str());
    return 2;
  }

  // A deployment file fills what the flags left unset.
  mlarun::DeploymentConfig dc;
  if (!config_path.empty()) {
    auto loaded = mlarun::LoadDeploymentConfig(config_path);
    if (!loaded.ok()) {
      std::fprintf(stderr, "mlarun: %s\n", loaded.status().ToString().c_str());
      return 2;
    }
    dc = *loaded;
  }
  auto fill = [](CLI::Option* opt, std::string& target, const std::string& from) {
    if (opt->count() == 0 && !from.empty()) target = from;
  };
  if (coord->parsed()) {
    fill(c_listen, co.listen, dc.listen);
    fill(c_policy, policy, dc.policy);
    auto p = mlarun::ParseRoutingPolicy(policy);
    if (!p.ok()) {
      std::fprintf(stderr, "mlarun coordinator: %s\n", p.status().ToString().c_str());
      return 2;
    }
    co.policy = *p;
    co.log_groups = true;
    if (!LoadSecurity("coordinator", c_security, SecurityRole::kCoordinator, &co.worker_secret, nullptr, &co)) return 2;
    if (c_http->count() > 0 && co.http_listen.empty()) co.http_listen = "127.0.0.1:8000";
    // SIGINT / SIGTERM are taken by one thread with sigwait (blocked here,
    // before gRPC starts its threads, so they inherit the mask): Shutdown is
    // not something a signal handler may call.
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    auto server = mlarun::Coordinator::Start(co);
    if (!server.ok()) {
      std::fprintf(stderr, "mlarun coordinator: %s\n", server.status().ToString().c_str());
      return 1;
    }
    std::fprintf(stderr, "mlarun coordinator: listening on %s, policy %s\n", (*server)->address().c_str(),
                 std::string(mlarun::RoutingPolicyName(co.policy)).c_str());
    if (c_http->count() > 0)
      std::fprintf(stderr, "mlarun coordinator: HTTP API on http://%s\n", (*server)->http_address().c_str());
    std::thread stopper([&] {
      int sig = 0;
      sigwait(&stop_signals, &sig);
      (*server)->Shutdown();
    });
    stopper.join();
    (*server)->Wait();
    return 0;
  }
  if (worker->parsed()) {
    fill(w_coord, wo.coordinator, dc.coordinator);
    fill(w_model, wo.deployment.model, dc.model);
    fill(w_par, wo.deployment.parallel, dc.parallel);
    fill(w_kv, wo.deployment.kv_dtype, dc.kv_dtype);
    if (w_cache->count() == 0 && w_mem->count() == 0) {  // a flag overrides both file keys
      if (dc.cache_bytes > 0) wo.engine.cache_budget_bytes = dc.cache_bytes;
      if (dc.memory_gib > 0) wo.memory_gib = dc.memory_gib;
    }
    if (w_mbt->count() == 0 && dc.max_batched_tokens > 0) wo.engine.max_num_batched_tokens = dc.max_batched_tokens;
    mlarun::ClientSecurity w_client;
    if (!LoadSecurity("worker", w_security, SecurityRole::kWorker, &wo.worker_secret, &w_client, nullptr)) return 2;
    wo.tls = w_client.tls;
    if (wo.deployment.model.empty()) {
      std::fprintf(stderr, "mlarun worker: --model (or model: in --config) is required\n");
      return 2;
    }
    if (!fail_forward_call.empty()) {
      if (const mlarun::Status st = mlarun::ParseFailForwardCall(fail_forward_call, &wo.deployment); !st.ok()) {
        std::fprintf(stderr, "mlarun worker: %s\n", std::string(st.message()).c_str());
        return 2;
      }
    }
    if (worker_threads > 0) omp_set_num_threads(worker_threads);
    auto session = mlarun::MpiSession::Init(&argc, &argv);
    if (!session.ok()) {
      std::fprintf(stderr, "mlarun worker: %s\n", session.status().ToString().c_str());
      return 2;
    }
    return mlarun::RunWorker(wo, **session);
  }
  if (sim->parsed()) {
    mlarun::ClientSecurity s_client;
    if (!LoadSecurity("sim-worker", s_security, SecurityRole::kWorker, &so.worker_secret, &s_client, nullptr)) return 2;
    so.tls = s_client.tls;
    static std::atomic<bool> stop{false};
    std::signal(SIGINT, [](int) { stop = true; });
    std::signal(SIGTERM, [](int) { stop = true; });
    return mlarun::RunSimWorker(so, &stop, std::cerr);
  }
  if (tokenize->parsed()) return mlarun::text::RunTokenize(tk, std::cin, std::cout, std::cerr);
  if (tok_bench->parsed()) return mlarun::text::RunTokenizeBench(tb, std::cout, std::cerr);
  if (serve_cmd->parsed()) {
    auto p = mlarun::ParseRoutingPolicy(sv_policy);
    if (!p.ok()) {
      std::fprintf(stderr, "mlarun serve: %s\n", p.status().ToString().c_str());
      return 2;
    }
    sv.coordinator.policy = *p;
    sv.coordinator.log_groups = true;
    if (!sv_auth_tokens.empty()) {
      auto tokens = mlarun::AuthTokens::ReadFile(sv_auth_tokens);
      if (!tokens.ok()) {
        std::fprintf(stderr, "mlarun serve: %s\n", tokens.status().ToString().c_str());
        return 2;
      }
      sv.coordinator.auth_tokens = std::move(*tokens);
    }
    if (sv_threads == 0) {
      auto layout = mlarun::ParseParallelLayout(sv.parallel);
      const int ranks = layout.ok() ? layout->world() : 1;
      sv_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks);
    }
    sv.worker_args.insert(sv.worker_args.begin(), {"--threads", std::to_string(sv_threads)});
    // As for the coordinator: SIGINT / SIGTERM go to one sigwait thread
    // (blocked before any thread starts; the worker job starts with them
    // unblocked).
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    static std::atomic<bool> stop{false};
    std::thread([stop_signals] {
      int sig = 0;
      sigwait(&stop_signals, &sig);
      std::fprintf(stderr, "mlarun serve: SIG%s: stopping\n", sigabbrev_np(sig));
      stop = true;
    }).detach();
    return mlarun::RunServe(sv, &stop, std::cerr);
  }
  if (submit->parsed()) {
    fill(s_coord, sub.coordinator, dc.coordinator);
    if (!LoadSecurity("submit", sub_security, SecurityRole::kClient, nullptr, &sub.security, nullptr)) return 2;
    if (sub.prompt_ids.empty() && sub.prompts_path.empty()) {
      std::fprintf(stderr, "mlarun submit: give --prompt-ids or --prompts\n");
      return 2;
    }
    return mlarun::RunSubmit(sub, std::cout, std::cerr);
  }
  if (memory->parsed()) {
    fill(m_coord, mem.coordinator, dc.coordinator);
    if (!LoadSecurity("memory", mem_security, SecurityRole::kClient, nullptr, &mem.security, nullptr)) return 2;
    if (mem.measure && mem.coordinator.empty()) {
      std::fprintf(stderr, "mlarun memory: --measure needs --coordinator (or coordinator: in --config)\n");
      return 2;
    }
    const mlarun::Status st =
        mem.measure ? mlarun::RunMemoryMeasure(mem, std::cout) : mlarun::RunMemory(mem, std::cout);
    if (!st.ok()) {
      std::fprintf(stderr, "mlarun memory: %s\n", st.ToString().c_str());
      return st.code() == mlarun::StatusCode::kInvalidArgument || st.code() == mlarun::StatusCode::kNotFound ? 2 : 1;
    }
    return 0;
  }
  if (stats->parsed()) {
    fill(t_coord, st.coordinator, dc.coordinator);
    if (!LoadSecurity("stats", st_security, SecurityRole::kClient, nullptr, &st.security, nullptr)) return 2;
    return mlarun::RunStats(st, std::cout, std::cerr);
  }

  if (dec->parsed()) {
    if (decode_threads > 0) omp_set_num_threads(decode_threads);
    mlarun::Status st;
    if (db.deployment.parallel.empty()) {
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
  if (bench_gemm->parsed()) {
    if (gemm_threads > 0) omp_set_num_threads(gemm_threads);
    return ExitStatus("bench gemm", mlarun::RunGemmBench(gb, std::cout, std::cerr));
  }
  if (bench_mem->parsed()) {
    if (memory_threads > 0) omp_set_num_threads(memory_threads);
    return ExitStatus("bench memory", mlarun::RunMemoryBench(mb, std::cout, std::cerr));
  }
  if (comm->parsed()) {
    auto session = mlarun::MpiSession::Init(&argc, &argv);
    return ExitStatus("bench comm", session.ok() ? mlarun::RunCommBench(cb, **session, cb.json ? std::cerr : std::cout)
                                                 : session.status());
  }
  if (generate->parsed()) {
    if (gen.prompt_ids.empty() && gen.prompts_path.empty()) {
      std::fprintf(stderr, "mlarun generate: give --prompt-ids or --prompts\n");
      return 2;
    }
    if (gen.threads > 0) omp_set_num_threads(gen.threads);
    if (gen.deployment.parallel.empty()) return mlarun::RunGenerate(gen, std::cout, std::cerr);
    auto session = mlarun::MpiSession::Init(&argc, &argv);
    if (!session.ok()) {
      std::fprintf(stderr, "mlarun generate: %s\n", session.status().ToString().c_str());
      return 2;
    }
    return mlarun::RunGenerateParallel(gen, **session, std::cout, std::cerr);
  }

  if (serve->parsed()) {
    if (!LoadSecurity("bench serve", sb_security, SecurityRole::kClient, nullptr, &sb.security, nullptr)) return 2;
    return ExitStatus("bench serve", mlarun::RunServeBench(sb, std::cout, sb.json ? std::cerr : std::cout));
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
