// `mlarun worker`: a model served on the ranks of mpirun for a coordinator
// (launcher/worker/).
#include "launcher/worker/worker.h"

#include <omp.h>

#include <cstdio>
#include <memory>

#include "launcher/commands/commands.h"
#include "launcher/serve/serve.h"
#include "parallel/mpi/mpi_world.h"

namespace mlarun::commands {
namespace {

struct WorkerFlags {
  WorkerOptions wo;
  int threads = 0;
  std::string fail_forward_call;
  std::string config_path;
  SecurityFlags security;
  // Owned by the app: whether a flag was given, against the --config file.
  CLI::Option *coordinator = nullptr, *model = nullptr, *parallel = nullptr, *kv_dtype = nullptr,
              *cache_bytes = nullptr, *memory_gib = nullptr, *max_batched_tokens = nullptr;
};

int RunWorkerCommand(WorkerFlags& f, ProcessArgs args) {
  // A rank of `mlarun serve` leaves with it (before anything slow, such as
  // loading the model, can keep it behind).
  if (const Status st = WatchServeProcess(); !st.ok()) return ExitStatus("worker", st);
  WorkerOptions& wo = f.wo;
  DeploymentConfig dc;
  if (!LoadDeploymentFile(f.config_path, &dc)) return 2;
  FillUnset(f.coordinator, wo.coordinator, dc.coordinator);
  FillUnset(f.model, wo.deployment.model, dc.model);
  FillUnset(f.parallel, wo.deployment.parallel, dc.parallel);
  FillUnset(f.kv_dtype, wo.deployment.kv_dtype, dc.kv_dtype);
  if (f.cache_bytes->count() == 0 && f.memory_gib->count() == 0) {  // a flag overrides both file keys
    if (dc.cache_bytes > 0) wo.engine.cache_budget_bytes = dc.cache_bytes;
    if (dc.memory_gib > 0) wo.memory_gib = dc.memory_gib;
  }
  if (f.max_batched_tokens->count() == 0 && dc.max_batched_tokens > 0)
    wo.engine.max_num_batched_tokens = dc.max_batched_tokens;
  ClientSecurity client;
  if (!LoadSecurity("worker", f.security, SecurityRole::kWorker, &wo.worker_secret, &client, nullptr)) return 2;
  wo.tls = client.tls;
  if (wo.deployment.model.empty()) {
    std::fprintf(stderr, "mlarun worker: --model (or model: in --config) is required\n");
    return 2;
  }
  if (!f.fail_forward_call.empty()) {
    if (const Status st = ParseFailForwardCall(f.fail_forward_call, &wo.deployment); !st.ok()) {
      std::fprintf(stderr, "mlarun worker: %s\n", std::string(st.message()).c_str());
      return 2;
    }
  }
  if (f.threads > 0) omp_set_num_threads(f.threads);
  // A prefill or decode job may share one MPMD launch with the other role's
  // job (`mlarun serve --prefill-parallel`): each context its own job.
  auto session = MpiSession::Init(args.argc, args.argv, wo.role != "mixed");
  if (!session.ok()) {
    std::fprintf(stderr, "mlarun worker: %s\n", session.status().ToString().c_str());
    return 2;
  }
  return RunWorker(wo, **session);
}

}  // namespace

void AddWorkerCommand(CLI::App& app, CommandTable& table) {
  auto f = std::make_shared<WorkerFlags>();
  WorkerOptions& wo = f->wo;
  auto* worker = app.add_subcommand("worker", "Serve a model on the ranks of mpirun for a coordinator");
  f->coordinator = worker->add_option("--coordinator", wo.coordinator, "Coordinator host:port")->capture_default_str();
  f->model = worker->add_option("--model", wo.deployment.model, "Checkpoint directory or configs/models/*.yaml");
  f->parallel = worker->add_option("--parallel", wo.deployment.parallel, "dp=D,attn_tp=T[,moe=expert|intermediate]")
                    ->capture_default_str();
  f->kv_dtype = worker->add_option("--kv-dtype", wo.deployment.kv_dtype, "Latent cache dtype: bf16 or fp32");
  worker->add_option("--num-layers", wo.deployment.num_layers, "Reduced depth for YAML models")
      ->check(CLI::PositiveNumber);
  f->cache_bytes = worker->add_option("--cache-bytes", wo.engine.cache_budget_bytes, "Latent cache budget per rank")
                       ->capture_default_str();
  f->memory_gib = worker
                      ->add_option("--memory-gib", wo.memory_gib,
                                   "Memory per rank: the cache gets what the weights and the prefill workspace leave "
                                   "(as mlarun memory predicts)")
                      ->check(CLI::PositiveNumber)
                      ->excludes(f->cache_bytes);
  f->max_batched_tokens =
      worker->add_option("--max-batched-tokens", wo.engine.max_num_batched_tokens, "Tokens per step")
          ->capture_default_str();
  worker->add_option("--max-num-seqs", wo.engine.max_num_seqs, "Running requests per group")->capture_default_str();
  worker->add_option("--block-size", wo.engine.block_size, "Tokens per cache block")->capture_default_str();
  worker->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", wo.engine.enable_prefix_caching,
                   "Reuse cached prompt prefixes (default on)");
  AddWeightsFlag(worker, wo.deployment.weights);
  AddAttentionThresholdsFlag(worker, wo.deployment.attention_thresholds);
  AddDeviceFlag(worker, wo.deployment.device);
  AddFp8WeightsFlag(worker, wo.deployment.fp8_weights);
  AddLmHeadFlag(worker, wo.deployment.lm_head);
  worker
      ->add_option("--transfer", wo.transfer,
                   "Move cache blocks of requests that move between DP groups over UCX: off (compute them "
                   "again), shm (ranks of one host) or any (any transport UCX finds)")
      ->check(CLI::IsMember({"off", "shm", "any"}))
      ->capture_default_str();
  worker
      ->add_option("--role", wo.role,
                   "What the job's DP groups serve: mixed, prefill (new requests, handed to a decode group after "
                   "their first token) or decode (requests handed over)")
      ->check(CLI::IsMember({"mixed", "prefill", "decode"}))
      ->capture_default_str();
  worker->add_option("--threads", f->threads, "CPU threads per rank (default: all)")->check(CLI::NonNegativeNumber);
  worker->add_option("--fail-forward-call", f->fail_forward_call,
                     "Fault injection for tests: model step N (0-based) fails with INTERNAL on world rank RANK "
                     "(every rank without @RANK); form N[@RANK]");
  worker->add_option("--config", f->config_path, "Deployment file (configs/deploy/*.yaml); flags override it");
  AddSecurityFlags(worker, f->security, SecurityRole::kWorker);
  table.Add(worker, [f](ProcessArgs args) { return RunWorkerCommand(*f, args); });
}

}  // namespace mlarun::commands
