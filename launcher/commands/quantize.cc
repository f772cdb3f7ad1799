// `mlarun quantize`: a bf16 / f32 / fp8 checkpoint rewritten as a
// compressed-tensors int8 / int4 one (runtime/model/quantize_checkpoint.h).
#include <cstdio>
#include <memory>
#include <string>

#include "launcher/commands/commands.h"
#include "runtime/model/quantize_checkpoint.h"

namespace mlarun::commands {
namespace {

struct QuantizeFlags {
  std::string model, out, format, lm_head = "keep";
  int64_t group = -1;  // -1: the format's default
  bool asymmetric = false;
  int threads = 0;
};

// The stderr progress line, at most once a second and at the end.
void PrintProgress(const QuantizeProgress& p, double& last_printed) {
  if (!p.finished && p.seconds - last_printed < 1.0) return;
  last_printed = p.seconds;
  std::fprintf(stderr, "\rquantize: %lld/%lld tensors, %.2f/%.2f GB, %.1f s%s", static_cast<long long>(p.tensors_done),
               static_cast<long long>(p.tensors_total), static_cast<double>(p.bytes_done) / 1e9,
               static_cast<double>(p.bytes_total) / 1e9, p.seconds, p.finished ? "\n" : "");
  std::fflush(stderr);
}

int RunQuantize(const QuantizeFlags& f) {
  QuantizeCheckpointOptions o;
  o.model_dir = f.model, o.out_dir = f.out;
  o.dtype = f.format == "int8" ? DType::kInt8 : DType::kInt4;
  o.group = f.group >= 0 ? f.group : DefaultQuantizeGroup(o.dtype);
  o.symmetric = !f.asymmetric;
  o.lm_head = f.lm_head == "int8" ? LmHeadMode::kInt8 : f.lm_head == "int4" ? LmHeadMode::kInt4 : LmHeadMode::kKeep;
  o.threads = f.threads;
  auto last = std::make_shared<double>(-1e9);
  o.progress = [last](const QuantizeProgress& p) { PrintProgress(p, *last); };
  o.note = [](const std::string& s) { std::fprintf(stderr, "quantize: note: %s\n", s.c_str()); };
  const Status s = QuantizeCheckpoint(o);
  if (!s.ok()) {
    std::fprintf(stderr, "\nmlarun quantize: %s\n", s.ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "quantize: wrote %s\n", f.out.c_str());
  return 0;
}

}  // namespace

void AddQuantizeCommand(CLI::App& app, CommandTable& table) {
  auto f = std::make_shared<QuantizeFlags>();
  auto* cmd = app.add_subcommand(
      "quantize", "Write a compressed-tensors int8 / int4 checkpoint (as llm-compressor's W8A16 / W4A16) of a model");
  cmd->add_option("--model", f->model, "Hugging Face DeepSeek-V2 / V3 checkpoint directory (bf16, f32 or fp8)")
      ->required();
  cmd->add_option("--out", f->out, "Output directory (created; must not exist or be empty)")->required();
  cmd->add_option("--format", f->format, "int8 (int-quantized) or int4 (pack-quantized)")
      ->required()
      ->check(CLI::IsMember({"int8", "int4"}));
  cmd->add_option("--group-size", f->group,
                  "Elements per scale along the input (even; 0 = per channel). Default: int4 128, int8 per channel");
  cmd->add_flag("--asymmetric", f->asymmetric, "Per-group zero points (default symmetric)");
  cmd->add_option("--lm-head", f->lm_head, "The output layer: keep (as stored), int8 or int4")
      ->check(CLI::IsMember({"keep", "int8", "int4"}))
      ->capture_default_str();
  cmd->add_option("--threads", f->threads, "Tensors quantized at once (default: one per CPU)");
  table.Add(cmd, [f](ProcessArgs) { return RunQuantize(*f); });
}

}  // namespace mlarun::commands
