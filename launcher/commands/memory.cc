// `mlarun memory`: per-rank memory predicted for layouts, or with --measure
// beside a live deployment's reports (launcher/memory/).
#include "launcher/memory/memory.h"

#include <cstdio>
#include <iostream>
#include <memory>

#include "launcher/commands/commands.h"

namespace mlarun::commands {
namespace {

struct MemoryFlags {
  MemoryOptions mem;
  std::string config_path;
  SecurityFlags security;
  CLI::Option* coordinator = nullptr;  // owned by the app
};

int RunMemoryCommand(MemoryFlags& f) {
  MemoryOptions& mem = f.mem;
  DeploymentConfig dc;
  if (!LoadDeploymentFile(f.config_path, &dc)) return 2;
  FillUnset(f.coordinator, mem.coordinator, dc.coordinator);
  if (!LoadSecurity("memory", f.security, SecurityRole::kClient, nullptr, &mem.security, nullptr)) return 2;
  if (mem.measure && mem.coordinator.empty()) {
    std::fprintf(stderr, "mlarun memory: --measure needs --coordinator (or coordinator: in --config)\n");
    return 2;
  }
  const Status st = mem.measure ? RunMemoryMeasure(mem, std::cout) : RunMemory(mem, std::cout);
  if (!st.ok()) {
    std::fprintf(stderr, "mlarun memory: %s\n", st.ToString().c_str());
    return st.code() == StatusCode::kInvalidArgument || st.code() == StatusCode::kNotFound ? 2 : 1;
  }
  return 0;
}

}  // namespace

void AddMemoryCommand(CLI::App& app, CommandTable& table) {
  auto f = std::make_shared<MemoryFlags>();
  MemoryOptions& mem = f->mem;
  auto* memory = app.add_subcommand(
      "memory", "Per-rank memory under TP and DP-attention layouts: predicted, or beside a live run");
  memory->add_option("--model", mem.model, "Checkpoint directory, config.json, or configs/models/*.yaml");
  memory->add_option("--world", mem.world, "Ranks")->capture_default_str()->check(CLI::PositiveNumber);
  memory
      ->add_option("--layouts", mem.layouts,
                   "tpN, dpN, dpAxtpB or dp=A,attn_tp=B (default: tpW, dpW, dp2xtpW/2); a prefill/decode split "
                   "p:LAYOUT+d:LAYOUT, short pN+dN or pAxtpB+dCxtpD (p2+d2 = p:dp2+d:dp2), its jobs' ranks adding "
                   "up to --world, each job sharding the MoE over its own ranks (mlarun serve --prefill-parallel)")
      ->delimiter(',');
  memory
      ->add_option("--prompt-tokens", mem.prompt_tokens,
                   "A prefill group's cache counted in prompts of this many tokens held at once")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  memory
      ->add_option("--context-tokens", mem.context_tokens,
                   "A decode or mixed group's cache counted in running sequences of this many tokens (default: "
                   "--prompt-tokens + 1024)")
      ->check(CLI::PositiveNumber);
  memory->add_option("--hbm-gib,--memory-gib", mem.memory_gib, "Memory per rank in GiB (H200: 141)")
      ->capture_default_str();
  memory->add_option("--kv-dtype", mem.kv_dtype, "Latent cache dtype: bf16 or fp32 (default: the model's)");
  memory->add_option(
      "--weight-dtype", mem.weight_dtype,
      "Projection weights: bf16 or fp32 (what mlarun holds; default the model's, or a quantized checkpoint's "
      "format), fp8 (the release's block-fp8), int8 or int4 (fp32 scales per --group-size elements)");
  memory
      ->add_option("--group-size", mem.group_size,
                   "With --weight-dtype int8 / int4: elements per scale (0: one per output channel)")
      ->capture_default_str();
  memory
      ->add_option("--lm-head", mem.lm_head,
                   "The output layer: keep (as stored), or int8 / int4 as `--lm-head` quantizes it at load")
      ->capture_default_str();
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
  memory->add_flag("--measure", mem.measure,
                   "Compare with a live deployment (GetStats from --coordinator): each worker job against its own "
                   "layout, a split's prefill and decode jobs too");
  f->coordinator = memory->add_option("--coordinator", mem.coordinator, "Coordinator host:port (with --measure)");
  memory->add_option("--requests", mem.requests_path, "With --measure: the request set submitted (JSON lines)");
  memory->add_option("--results", mem.results_path, "With --measure: its `mlarun submit --json` output");
  memory->add_option("--timeout", mem.timeout_s, "With --measure: seconds to wait for the ranks' reports to settle")
      ->capture_default_str();
  memory->add_option("--config", f->config_path, "Deployment file (configs/deploy/*.yaml): the coordinator address");
  AddSecurityFlags(memory, f->security, SecurityRole::kClient);
  table.Add(memory, [f](ProcessArgs) { return RunMemoryCommand(*f); });
}

}  // namespace mlarun::commands
