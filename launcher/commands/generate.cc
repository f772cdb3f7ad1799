// `mlarun generate`: requests through a model on this process, or on the
// ranks of mpirun with --parallel (launcher/generate/).
#include "launcher/generate/generate.h"

#include <omp.h>

#include <cstdio>
#include <iostream>
#include <memory>

#include "launcher/commands/commands.h"
#include "parallel/mpi/mpi_world.h"

namespace mlarun::commands {

void AddGenerateCommand(CLI::App& app, CommandTable& table) {
  auto gen = std::make_shared<GenerateOptions>();
  auto* generate = app.add_subcommand("generate", "Generate tokens with a model on this process");
  generate->add_option("--model", gen->deployment.model, "Hugging Face checkpoint directory, or configs/models/*.yaml")
      ->required();
  auto* ids_opt =
      generate->add_option("--prompt-ids", gen->prompt_ids, "One prompt as token ids: 1,2,3")->delimiter(',');
  auto* file_opt = generate->add_option("--prompts", gen->prompts_path, "JSON lines: prompt_ids and sampling fields");
  ids_opt->excludes(file_opt);
  AddSamplingFlags(generate, gen->sampling);
  generate->add_flag("--json", gen->json, "One JSON object per request, in input order");
  generate->add_option("--kv-dtype", gen->deployment.kv_dtype,
                       "Latent cache dtype: bf16 or fp32 (default: the model's)");
  generate->add_option("--num-layers", gen->deployment.num_layers, "Reduced depth for YAML models")
      ->check(CLI::PositiveNumber);
  generate->add_option("--threads", gen->threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  generate->add_option("--max-batched-tokens", gen->engine.max_num_batched_tokens, "Tokens per step")
      ->capture_default_str();
  generate->add_option("--max-num-seqs", gen->engine.max_num_seqs, "Running requests at once")->capture_default_str();
  generate->add_option("--cache-bytes", gen->engine.cache_budget_bytes, "Latent cache budget in bytes")
      ->capture_default_str();
  generate->add_option("--block-size", gen->engine.block_size, "Tokens per cache block")->capture_default_str();
  generate->add_option("--parallel", gen->deployment.parallel,
                       "Run on the ranks of mpirun: dp=D,attn_tp=T[,moe=expert|intermediate]");
  AddWeightsFlag(generate, gen->deployment.weights);
  AddAttentionThresholdsFlag(generate, gen->deployment.attention_thresholds);
  AddDeviceFlag(generate, gen->deployment.device);
  AddFp8WeightsFlag(generate, gen->deployment.fp8_weights);
  AddLmHeadFlag(generate, gen->deployment.lm_head);

  table.Add(generate, [gen](ProcessArgs args) {
    if (gen->prompt_ids.empty() && gen->prompts_path.empty()) {
      std::fprintf(stderr, "mlarun generate: give --prompt-ids or --prompts\n");
      return 2;
    }
    if (gen->threads > 0) omp_set_num_threads(gen->threads);
    if (gen->deployment.parallel.empty()) return RunGenerate(*gen, std::cout, std::cerr);
    auto session = MpiSession::Init(args.argc, args.argv);
    if (!session.ok()) {
      std::fprintf(stderr, "mlarun generate: %s\n", session.status().ToString().c_str());
      return 2;
    }
    return RunGenerateParallel(*gen, **session, std::cout, std::cerr);
  });
}

}  // namespace mlarun::commands
