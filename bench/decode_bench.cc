#include "bench/decode_bench.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "base/cpu_isa.h"
#include "base/cuda_device.h"
#include "base/large_buffer.h"
#include "bench/local_cache.h"
#include "bench/timing.h"
#include "gemm/convert.h"
#include "gemm/cpu_gemm.h"
#include "parallel/mpi/mpi_world.h"
#include "runtime/grammar/grammar.h"
#include "runtime/model/model.h"
#include "runtime/ops/sampler.h"
#include "runtime/rank/bootstrap.h"

namespace mlarun {
namespace {

using Json = nlohmann::json;

// Where a step's time went, summed over the timed steps.
struct Shares {
  double attention = 0, moe = 0, dense = 0, lm_head = 0, other = 0;
  void Add(const Model::StepTimes& t) {
    attention += t.attention, moe += t.moe, dense += t.dense_mlp, lm_head += t.lm_head, other += t.other;
  }
  double total() const { return attention + moe + dense + lm_head + other; }
  Json ToJson() const {
    const double tt = total();
    return {{"attention", attention / tt}, {"moe", moe / tt},     {"dense_mlp", dense / tt},
            {"lm_head", lm_head / tt},     {"other", other / tt}, {"largest", Largest()}};
  }
  std::string Largest() const {
    const std::pair<double, const char*> parts[] = {
        {attention, "attention"}, {moe, "moe"}, {dense, "dense_mlp"}, {lm_head, "lm_head"}, {other, "other"}};
    return std::max_element(std::begin(parts), std::end(parts))->second;
  }
};

// What the timed steps read and computed, summed.
struct Cost {
  double weight_bytes = 0, cache_bytes = 0, flops = 0;
  int64_t steps = 0;
  void Add(const Model::StepTraffic& t) {
    weight_bytes += static_cast<double>(t.weight_bytes), cache_bytes += static_cast<double>(t.cache_bytes);
    flops += t.flops, ++steps;
  }
  double bytes_per_step() const { return steps ? (weight_bytes + cache_bytes) / static_cast<double>(steps) : 0; }
  double flops_per_step() const { return steps ? flops / static_cast<double>(steps) : 0; }
};

std::string Pct(double v) { return Fmt(100 * v, 0) + "%"; }

// Fills positions [0, n) of every layer of a new sequence `id` with random rows.
Status FillContext(LocalLatentCache& cache, SeqId id, int64_t n, std::mt19937& rng) {
  const LatentCacheConfig& c = cache.pool->config();
  std::normal_distribution<float> d;
  std::vector<float> kv(static_cast<size_t>(n * c.kv_lora_rank)), pe(static_cast<size_t>(n * c.rope_dim));
  for (float& v : kv) v = d(rng);
  for (float& v : pe) v = d(rng);
  std::vector<int32_t> tokens(static_cast<size_t>(n), 2);
  MLARUN_ASSIGN_OR_RETURN(const ForwardSeq s, cache.Append(id, tokens, ForwardSeq::Logits::kNone));
  for (int64_t layer = 0; layer < c.num_layers; ++layer)
    MLARUN_RETURN_IF_ERROR(
        cache.pool->WriteRows(layer, s.block_table, 0, n, kv.data(), c.kv_lora_rank, pe.data(), c.rope_dim));
  return Status::Ok();
}

// The machine's figures a run reports the model against, measured in the same
// run: what memory delivers, and the matrix product rate of the weights'
// dtype at a prefill's shape. The probe and the product's operands stay
// allocated until the run ends.
struct MachineReference {
  bool on_device = false;
  std::unique_ptr<BandwidthProbe> probe;  // host only
  ReadBandwidth bw{};
  double device_gbps = 0;
  int64_t peak_m = 0, H = 0;
  DType wt = DType::kBF16;
  std::shared_ptr<const CpuGemm> peak_gemm, peak_onednn;
  std::vector<std::byte> pa, pb, pscratch;
  std::vector<float> pc;
  double peak_gflops = 0, chosen_gflops = 0, onednn_gflops = 0;
  std::string peak_impl;
  // The instruction's peak where prefill's products run on fp32 FMAs or bf16
  // dot products (f32, bf16 and f8_e4m3 weights; host only).
  std::optional<ProductPeak> arithmetic;
};

// What the phases of one `mlarun bench decode` share: the options, the loaded
// model (owned by RunDecodeBench), the machine's figures, the JSON document
// the phases add to, and the decode rows' and the prefill's timing, random
// numbers and logits buffer.
struct DecodeRun {
  const DecodeBenchOptions& o;
  std::ostream& table;
  const ModelConfig& config;
  const WeightBytes& predicted;
  Model& model;
  int64_t moe_layers = 0;
  MachineReference ref;
  Json doc;
  Timing timing;
  WarmUpPolicy warm;
  std::mt19937 rng{7};
  int64_t bytes_per_token = 0;
  std::vector<float> host_logits;  // a device model's logits, copied out for the argmax
  // --structured: the vocabulary's grammars, where the vocabulary came from,
  // and the first (uncached) compile of the constraint.
  std::shared_ptr<GrammarCompiler> grammar;
  std::string grammar_vocab;
  double compile_ms = 0, schema_compile_ms = 0;
};

StructuredOutput BenchStructured() { return {.kind = StructuredOutput::Kind::kJsonObject, .any_whitespace = false}; }

// A schema of the usual size, whose first compile --structured reports too.
const StructuredOutput kBenchSchema{.kind = StructuredOutput::Kind::kJsonSchema,
                                    .spec = R"({"type": "object", "properties": {
  "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
  "email": {"type": "string", "maxLength": 64}, "tags": {"type": "array", "items": {"type": "string"}},
  "active": {"type": "boolean"}, "role": {"enum": ["admin", "user", "guest"]}},
  "required": ["name", "age", "active", "role"]})"};

// A vocabulary for timing masks when the model has no tokenizer: the 256
// bytes, then word-like tokens (a leading space half the time, 1 to 8
// letters, now and then a digit or a punctuation mark), as most of a BPE
// vocabulary is.
std::vector<std::string> SyntheticVocabulary(int64_t n) {
  std::mt19937 rng(11);
  std::vector<std::string> vocab;
  for (int b = 0; b < 256 && static_cast<int64_t>(vocab.size()) < n; ++b) vocab.push_back(std::string(1, char(b)));
  const std::string letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                    other = "0123456789.,:;!?-_'\"(){}[]";
  while (static_cast<int64_t>(vocab.size()) < n) {
    std::string t = rng() % 2 ? " " : "";
    const int len = 1 + static_cast<int>(rng() % 8);
    for (int i = 0; i < len; ++i)
      t += rng() % 10 == 0 ? other[rng() % other.size()] : letters[rng() % (i == 0 ? letters.size() : 26)];
    vocab.push_back(std::move(t));
  }
  return vocab;
}

// --structured: the model's tokenizer, else a synthetic vocabulary, and
// the constraint's first compile.
Status SetUpStructured(DecodeRun& run) {
  if (run.o.structured.empty()) return Status::Ok();
  const ModelConfig& c = run.config;
  auto g = GrammarCompiler::ForModel(run.o.deployment.model, c.vocab_size, c.eos_token_ids);
  if (g.ok()) {
    run.grammar_vocab = "the model's tokenizer";
  } else if (g.status().code() == StatusCode::kNotFound) {
    g = GrammarCompiler::FromVocabulary(SyntheticVocabulary(c.vocab_size), c.vocab_size, c.eos_token_ids);
    run.grammar_vocab = "a synthetic vocabulary of " + std::to_string(c.vocab_size) + " tokens";
  }
  MLARUN_RETURN_IF_ERROR(g.status());
  run.grammar = *g;
  const auto t0 = std::chrono::steady_clock::now();
  MLARUN_RETURN_IF_ERROR(run.grammar->Compile(BenchStructured()).status());
  const auto t1 = std::chrono::steady_clock::now();
  MLARUN_RETURN_IF_ERROR(run.grammar->Compile(kBenchSchema).status());
  const auto t2 = std::chrono::steady_clock::now();
  run.compile_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  run.schema_compile_ms = std::chrono::duration<double, std::milli>(t2 - t1).count();
  return Status::Ok();
}

// A greedy sampler under the benchmark's constraint.
StatusOr<std::unique_ptr<Sampler>> ConstrainedSampler(DecodeRun& run) {
  auto s = std::make_unique<Sampler>(SamplingParams{});
  MLARUN_ASSIGN_OR_RETURN(auto constraint, run.grammar->Compile(BenchStructured()));
  s->SetConstraint(std::move(constraint));
  return s;
}

// The reference bandwidth (run.ref.bw, with the probe that measures it again
// next to every timed decode step; on a GPU the device's copy bandwidth).
Status MeasureBandwidth(DecodeRun& run) {
  MachineReference& m = run.ref;
  m.on_device = !run.model.memory().host_accessible();
  if (m.on_device) {
    MLARUN_ASSIGN_OR_RETURN(m.device_gbps, MeasureCudaCopyGBps());
    m.bw.plain_gb_per_s = m.bw.product_gb_per_s = m.device_gbps;
  } else {
    MLARUN_ASSIGN_OR_RETURN(m.probe, BandwidthProbe::Create());
    MLARUN_ASSIGN_OR_RETURN(m.bw, m.probe->Best());
  }
  return Status::Ok();
}

// The matrix product peak of the weights' dtype at a prefill's shape
// (run.ref; on a GPU only the product's description, not measured).
Status MeasureGemmPeak(DecodeRun& run) {
  MachineReference& m = run.ref;
  const int64_t H = run.config.hidden_size, peak_m = std::max<int64_t>(run.o.prefill_tokens, 256);
  const DType wt = run.config.weight_dtype;
  m.H = H, m.peak_m = peak_m, m.wt = wt;
  const GemmDesc peak_desc{.m = peak_m,
                           .n = H,
                           .k = H,
                           .a_type = wt,
                           .b_type = wt,
                           .c_type = DType::kF32,
                           .lda = H,
                           .b_stride_k = 1,
                           .b_stride_n = H,
                           .ldc = H};
  MLARUN_ASSIGN_OR_RETURN(m.peak_gemm, CpuGemm::Get(peak_desc));
  // The peak is the faster of the product the runtime picks and oneDNN's
  // (where it can build one), so a kernel of ours is measured against a
  // reference it did not choose.
  if (!m.on_device && m.peak_gemm->impl() != GemmImpl::kOneDnn)
    if (auto g = CpuGemm::Get(peak_desc, GemmImpl::kOneDnn); g.ok()) m.peak_onednn = *g;
  const size_t es = DTypeSize(wt);
  std::vector<std::byte>&pa = m.pa, &pb = m.pb, &pscratch = m.pscratch;
  std::vector<float>& pc = m.pc;
  pa.resize(static_cast<size_t>(peak_m * H) * es);
  pb.resize(static_cast<size_t>(H * H) * es);
  pscratch.resize(std::max(m.peak_gemm->scratch_bytes(), m.peak_onednn ? m.peak_onednn->scratch_bytes() : 0) + 64);
  pc.resize(static_cast<size_t>(peak_m * H));
  {
    std::vector<float> fill(static_cast<size_t>(H * H));
    std::mt19937 prng(3);
    std::normal_distribution<float> nd;
    for (float& v : fill) v = nd(prng);
    StoreFromF32(fill.data(), pb.data(), wt, H * H);
    StoreFromF32(fill.data(), pa.data(), wt, std::min<int64_t>(H * H, peak_m * H));
  }
  m.peak_impl = m.peak_gemm->impl_name();
  if (!m.on_device) {
    auto gflops_of = [&](const CpuGemm& g) -> StatusOr<double> {
      MLARUN_ASSIGN_OR_RETURN(const double ms,
                              TimeMs(
                                  "gemm_peak", [&] { return g.Run(pa.data(), pb.data(), pc.data(), pscratch.data()); },
                                  Timing{.repetitions = 5, .min_time_s = 0.2, .warm_up = true}));
      return 2.0 * static_cast<double>(peak_m * H * H) / (ms * 1e-3) * 1e-9;
    };
    if (wt == DType::kF32 || wt == DType::kBF16 || wt == DType::kF8E4M3)
      m.arithmetic = MeasureProductPeak(wt != DType::kF32);
    MLARUN_ASSIGN_OR_RETURN(m.chosen_gflops, gflops_of(*m.peak_gemm));
    m.peak_gflops = m.chosen_gflops;
    if (m.peak_onednn) {
      MLARUN_ASSIGN_OR_RETURN(m.onednn_gflops, gflops_of(*m.peak_onednn));
      if (m.onednn_gflops > m.peak_gflops) m.peak_gflops = m.onednn_gflops, m.peak_impl = m.peak_onednn->impl_name();
    }
  }
  return Status::Ok();
}

// The run's model, machine and reference figures: the JSON document's
// leading fields.
void DescribeJson(DecodeRun& run) {
  const DecodeBenchOptions& o = run.o;
  const ModelConfig& config = run.config;
  const MachineReference& m = run.ref;
  Json& doc = run.doc;
  doc["model"] = o.deployment.model;
  doc["layers"] = config.num_hidden_layers;
  doc["moe_layers"] = run.moe_layers;
  doc["routed_experts"] = config.n_routed_experts;
  doc["weight_dtype"] = std::string(DTypeName(config.weight_dtype));
  doc["projection_dtype"] =
      std::string(DTypeName(run.model.weight_format().projection_dtype.value_or(config.weight_dtype)));
  doc["weights"] = o.deployment.weights;
  doc["weight_bytes_in_place"] = run.model.weight_bytes_in_place();
  doc["kv_dtype"] = std::string(DTypeName(config.kv_dtype));
  doc["weight_bytes"] = run.predicted.total();
  doc["threads"] = omp_get_max_threads();
  doc["cpu"] = CpuJson();
  doc["date"] = Today();
  doc["device"] = o.deployment.device;
  if (m.on_device)
    doc["read_bandwidth"] = {{"device_copy_gb_per_s", m.device_gbps}};
  else
    doc["read_bandwidth"] = {{"plain_gb_per_s", m.bw.plain_gb_per_s},
                             {"product_gb_per_s", m.bw.product_gb_per_s},
                             {"bytes", m.probe->bytes()},
                             {"threads", m.probe->threads()}};
  doc["gemm_peak"] = {{"m", m.peak_m},
                      {"n", m.H},
                      {"k", m.H},
                      {"dtype", std::string(DTypeName(m.wt))},
                      {"impl", m.peak_impl},
                      {"gflop_per_s", m.peak_gflops},
                      {"chosen_impl", m.peak_gemm->impl_name()},
                      {"chosen_gflop_per_s", m.chosen_gflops}};
  if (m.arithmetic)
    doc["arithmetic_peak"] = {{"gflop_per_s", m.arithmetic->gflop_per_s},
                              {"instruction", m.arithmetic->instruction},
                              {"threads", m.arithmetic->threads}};
  if (m.peak_onednn) {
    doc["gemm_peak"]["onednn_impl"] = m.peak_onednn->impl_name();
    doc["gemm_peak"]["onednn_gflop_per_s"] = m.onednn_gflops;
  }
  doc["decode"] = Json::array();
}

// The same, as the table's first lines.
void DescribeText(DecodeRun& run) {
  const DecodeBenchOptions& o = run.o;
  const ModelConfig& config = run.config;
  const MachineReference& m = run.ref;
  std::ostream& table = run.table;
  table << "mlarun bench decode: " << o.deployment.model << ", " << config.num_hidden_layers << " layers ("
        << run.moe_layers << " MoE, " << config.n_routed_experts << " routed experts, top-"
        << config.num_experts_per_tok << "), weights "
        << DTypeName(run.model.weight_format().projection_dtype.value_or(config.weight_dtype)) << " "
        << (run.predicted.total() >> 20) << " MiB, cache " << DTypeName(config.kv_dtype) << ", "
        << omp_get_max_threads() << " threads, " << Today() << "\n"
        << "  cpu: " << CpuSummary() << "\n";
  if (m.on_device)
    table << "  device: " << o.deployment.device << ", copy bandwidth " << Fmt(m.device_gbps, 1)
          << " GB/s (read + write of a 1 GiB device-to-device copy, median of 5)\n";
  else
    table << "  memory read bandwidth: " << Fmt(m.bw.plain_gb_per_s, 1) << " GB/s plain read, "
          << Fmt(m.bw.product_gb_per_s, 1) << " GB/s streaming bf16 weights through a one-row product ("
          << (m.probe->bytes() >> 20) << " MiB, " << m.probe->threads()
          << " threads, best of 3 each; a pass of each is measured again before every timed step)\n"
          << "  matrix product peak: " << Fmt(m.peak_gflops, 1) << " GFLOP/s (" << DTypeName(m.wt) << " " << m.peak_m
          << " x " << m.H << " x " << m.H << ", " << m.peak_impl
          << (m.peak_onednn ? "; " + m.peak_gemm->impl_name() + " " + Fmt(m.chosen_gflops, 1) + ", " +
                                  m.peak_onednn->impl_name() + " " + Fmt(m.onednn_gflops, 1)
                            : std::string())
          << ")\n";
  if (m.arithmetic)
    table << "  arithmetic peak: " << Fmt(m.arithmetic->gflop_per_s, 1) << " GFLOP/s (" << m.arithmetic->instruction
          << " on registers, " << m.arithmetic->threads << " threads)\n";
}

// Host only: bf16 weights against fp8, measured, printed and added to the
// document.
Status WeightStreamingSection(DecodeRun& run) {
  std::ostream& table = run.table;
  // bf16 weights against the fp8 the DeepSeek-V3 release ships (docs/fp8-weights.md): the same values, at
  // decode's row counts, on a [n, 7168] weight (V3's hidden size) of 512 MiB in bf16; and int8 / int4
  // weights of that shape (docs/quantized-weights.md).
  MLARUN_ASSIGN_OR_RETURN(const WeightStreaming ws,
                          MeasureWeightStreaming(7168, int64_t{512} << 20, {1, 2, 4, 8, 16, 32},
                                                 Timing{.repetitions = 5, .min_time_s = 0.2}));
  Json rows = Json::array();
  table << "  weight streaming, one [" << ws.n << ", " << ws.k << "] weight (bf16 " << (ws.bf16_bytes >> 20)
        << " MiB, fp8 " << (ws.fp8_bytes >> 20) << " MiB with its scales; int8 " << (ws.int8_bytes >> 20)
        << " MiB and int4 " << (ws.int4_bytes >> 20)
        << " MiB in groups of 128, with scales, int4 with offsets), median of 5 (weight GB/s, time x / bf16):\n";
  for (const WeightStreamRow& r : ws.rows) {
    table << "    rows " << r.rows << ": bf16 " << Fmt(r.bf16_gb_per_s, 1) << " GB/s (" << r.bf16_impl << "), fp8 "
          << Fmt(r.fp8_gb_per_s, 1) << " GB/s (" << r.fp8_impl << ") ratio " << Fmt(r.fp8_ms / r.bf16_ms, 2)
          << ", int8 " << Fmt(r.int8_gb_per_s, 1) << " GB/s (" << r.int8_impl << ") ratio "
          << Fmt(r.int8_ms / r.bf16_ms, 2) << ", int4 " << Fmt(r.int4_gb_per_s, 1) << " GB/s (" << r.int4_impl
          << ") ratio " << Fmt(r.int4_ms / r.bf16_ms, 2) << "\n";
    rows.push_back({{"rows", r.rows},
                    {"bf16_ms", r.bf16_ms},
                    {"fp8_ms", r.fp8_ms},
                    {"int8_ms", r.int8_ms},
                    {"int4_ms", r.int4_ms},
                    {"bf16_gb_per_s", r.bf16_gb_per_s},
                    {"fp8_gb_per_s", r.fp8_gb_per_s},
                    {"int8_gb_per_s", r.int8_gb_per_s},
                    {"int4_gb_per_s", r.int4_gb_per_s},
                    {"bf16_impl", r.bf16_impl},
                    {"fp8_impl", r.fp8_impl},
                    {"int8_impl", r.int8_impl},
                    {"int4_impl", r.int4_impl}});
  }
  run.doc["weight_streaming"] = {{"n", ws.n},
                                 {"k", ws.k},
                                 {"bf16_bytes", ws.bf16_bytes},
                                 {"fp8_bytes", ws.fp8_bytes},
                                 {"int8_bytes", ws.int8_bytes},
                                 {"int4_bytes", ws.int4_bytes},
                                 {"rows", rows}};
  return Status::Ok();
}

// A cache for `seqs` sequences of up to `per_seq` tokens each.
StatusOr<LocalLatentCache> MakeCache(DecodeRun& run, int64_t seqs, int64_t per_seq) {
  LatentCacheConfig cc = run.model.CacheConfig(0, 64);
  cc.enable_prefix_caching = false;
  cc.budget_bytes = seqs * ((per_seq + 63) / 64 + 1) * 64 * run.bytes_per_token;
  return LocalLatentCache::Create(cc, run.model.memory());
}

// One decode row as measured: the warm-up steps it discarded, where the
// timed steps' time went and what they read, and per timed step its time,
// the bandwidth pass before it and the fraction of that pass's bound.
struct DecodeRowTimes {
  int discarded = 0;
  Shares shares;
  Cost cost;
  std::vector<double> step_s, pass_gbs, fraction;
  // --structured: the interleaved plain and constrained steps, and each
  // constrained one's mask fills.
  std::vector<double> plain_s, constrained_s, mask_fill_s;
};

// --structured: o.repetitions rounds of one plain and one constrained step
// back to back (their order alternating), without the bandwidth passes of
// the main timed steps, which leave the caches cold; each constrained step
// with its mask fills.
template <typename Step>
Status TimeStructuredRounds(int repetitions, Step& decode_step, bool& constrain, DecodeRowTimes& m) {
  for (int r = 0; r < repetitions; ++r) {
    for (int k = 0; k < 2; ++k) {
      constrain = (r + k) % 2 == 1;
      const GrammarMaskStats before = GrammarMaskTotals();
      const auto t0 = std::chrono::steady_clock::now();
      const Status st = decode_step();
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const bool constrained = constrain;
      constrain = false;
      MLARUN_RETURN_IF_ERROR(st);
      (constrained ? m.constrained_s : m.plain_s).push_back(t);
      if (constrained) m.mask_fill_s.push_back(GrammarMaskTotals().seconds - before.seconds);
    }
  }
  return Status::Ok();
}

// Decode at `batch` sequences of `context` cached tokens each: warmed up
// until stable, then o.repetitions timed steps (and --structured's rounds).
StatusOr<DecodeRowTimes> TimeDecodeRow(DecodeRun& run, int64_t batch, int64_t context) {
  const DecodeBenchOptions& o = run.o;
  const ModelConfig& config = run.config;
  Model& model = run.model;
  const bool on_device = run.ref.on_device;
  const std::unique_ptr<BandwidthProbe>& probe = run.ref.probe;
  const ReadBandwidth& bw = run.ref.bw;
  std::vector<float>& host_logits = run.host_logits;
  const int64_t per_seq = context + run.warm.max_calls + o.repetitions + 2;
  MLARUN_ASSIGN_OR_RETURN(LocalLatentCache cache, MakeCache(run, batch, per_seq));
  for (int64_t s = 0; s < batch; ++s) MLARUN_RETURN_IF_ERROR(FillContext(cache, s, context, run.rng));
  // Decode: one new token per sequence per step.
  std::vector<int32_t> tok(static_cast<size_t>(batch), 3);
  DecodeRowTimes m;
  // --structured: the next tokens come from the engine's Sampler, greedy,
  // plain or under the constraint (a fresh one once it has ended).
  const bool structured = run.grammar != nullptr;
  bool constrain = false;
  std::vector<std::unique_ptr<Sampler>> plain, constrained;
  for (int64_t s = 0; structured && s < batch; ++s) {
    plain.push_back(std::make_unique<Sampler>(SamplingParams{}));
    MLARUN_ASSIGN_OR_RETURN(auto c, ConstrainedSampler(run));
    constrained.push_back(std::move(c));
  }
  auto next_token = [&](int64_t s, const float* row) -> StatusOr<int32_t> {
    if (!structured) return static_cast<int32_t>(std::max_element(row, row + config.vocab_size) - row);
    std::unique_ptr<Sampler>& sampler = (constrain ? constrained : plain)[static_cast<size_t>(s)];
    if (constrain && sampler->constraint()->terminated()) {
      MLARUN_ASSIGN_OR_RETURN(sampler, ConstrainedSampler(run));
    }
    return static_cast<int32_t>(
        sampler->Sample(std::span<const float>(row, static_cast<size_t>(config.vocab_size))).token);
  };
  auto decode_step = [&]() -> Status {
    std::vector<ForwardSeq> seqs;
    for (int64_t s = 0; s < batch; ++s) {
      MLARUN_ASSIGN_OR_RETURN(ForwardSeq fs, cache.Append(s, std::span<const int32_t>(&tok[static_cast<size_t>(s)], 1),
                                                          ForwardSeq::Logits::kLast));
      seqs.push_back(fs);
    }
    MLARUN_ASSIGN_OR_RETURN(std::span<const float> logits, model.ForwardInto(seqs, *cache.pool));
    if (on_device) {
      host_logits.resize(logits.size());
      MLARUN_RETURN_IF_ERROR(model.memory().CopyOut(host_logits.data(), logits.data(), logits.size() * sizeof(float)));
      logits = host_logits;
    }
    for (int64_t s = 0; s < batch; ++s) {  // feed back the argmax, as greedy decoding would
      MLARUN_ASSIGN_OR_RETURN(tok[static_cast<size_t>(s)], next_token(s, logits.data() + s * config.vocab_size));
    }
    if (constrain) return Status::Ok();
    m.shares.Add(model.last_step_times());
    m.cost.Add(model.last_step_traffic());
    return Status::Ok();
  };
  MLARUN_ASSIGN_OR_RETURN(m.discarded, WarmUpUntilStable(decode_step, run.warm));
  m.shares = {};
  m.cost = {};
  // Timed steps, each right after a bandwidth pass: the ratio is taken
  // pair by pair, as the memory this machine gets drifts.
  for (int r = 0; r < o.repetitions; ++r) {
    ReadBandwidth pass = bw;
    if (!on_device) {
      MLARUN_ASSIGN_OR_RETURN(pass, probe->Pass());
    }
    const auto t0 = std::chrono::steady_clock::now();
    MLARUN_RETURN_IF_ERROR(decode_step());
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const Model::StepTraffic& tr = model.last_step_traffic();
    m.step_s.push_back(t);
    m.pass_gbs.push_back(pass.bound_gb_per_s());
    m.fraction.push_back(static_cast<double>(tr.weight_bytes + tr.cache_bytes) / t * 1e-9 / pass.bound_gb_per_s());
  }
  if (structured) {
    constrain = true;  // the constrained path's first fills, untimed
    for (int i = 0; i < 2; ++i) MLARUN_RETURN_IF_ERROR(decode_step());
    constrain = false;
    MLARUN_RETURN_IF_ERROR(TimeStructuredRounds(o.repetitions, decode_step, constrain, m));
  }
  return m;
}

// A decode row's figures, added to the document and printed as a table row.
void ReportDecodeRow(DecodeRun& run, int64_t batch, int64_t context, const DecodeRowTimes& m) {
  const Shares& shares = m.shares;
  const Cost& cost = m.cost;
  const double step_ms = Median(m.step_s) * 1e3, row_gbs = Median(m.pass_gbs);
  const double tps = static_cast<double>(batch) / (step_ms * 1e-3);
  const double bytes = cost.bytes_per_step();
  const double bound_tps = static_cast<double>(batch) / (bytes / (row_gbs * 1e9));
  const double of_bound = Median(m.fraction);
  const Json js = shares.ToJson();
  run.doc["decode"].push_back({{"batch", batch},
                               {"context", context},
                               {"tokens_per_s", tps},
                               {"step_ms", step_ms},
                               {"warm_up_steps_discarded", m.discarded},
                               {"timed_steps", cost.steps},
                               {"weight_bytes_per_step", cost.weight_bytes / static_cast<double>(cost.steps)},
                               {"cache_bytes_per_step", cost.cache_bytes / static_cast<double>(cost.steps)},
                               {"read_bandwidth_gb_per_s", row_gbs},
                               {"bandwidth_bound_tokens_per_s", bound_tps},
                               {"fraction_of_bound", of_bound},
                               {"share", js}});
  run.table << "    " << std::setw(5) << batch << " " << std::setw(7) << context << " | " << std::setw(7) << Fmt(tps, 2)
            << " " << std::setw(8) << Fmt(step_ms, 1) << " " << std::setw(8) << m.discarded << " | " << std::setw(7)
            << Fmt(bytes * 1e-6, 0) << " " << std::setw(5) << Fmt(row_gbs, 1) << " " << std::setw(12)
            << Fmt(bound_tps, 2) << " " << std::setw(9) << Pct(of_bound) << " | " << std::setw(4)
            << Pct(js["attention"]) << " " << std::setw(5) << Pct(js["moe"]) << " " << std::setw(6)
            << Pct(js["dense_mlp"]) << " " << std::setw(8) << Pct(js["lm_head"]) << " " << std::setw(6)
            << Pct(js["other"]) << "  largest: " << shares.Largest() << "\n";
  if (m.constrained_s.empty()) return;
  const double plain_ms = Median(m.plain_s) * 1e3, constrained_ms = Median(m.constrained_s) * 1e3,
               fill_ms = Median(m.mask_fill_s) * 1e3;
  run.doc["decode"].back()["structured"] = {{"kind", run.o.structured},
                                            {"unconstrained_step_ms", plain_ms},
                                            {"step_ms", constrained_ms},
                                            {"mask_fill_ms_per_step", fill_ms}};
  run.table << "      " << run.o.structured << " (interleaved, no bandwidth pass): step " << Fmt(constrained_ms, 2)
            << " ms, unconstrained " << Fmt(plain_ms, 2) << " ms, mask fill " << Fmt(fill_ms, 3) << " ms per step\n";
}

// Every batch x context decode row, after the table's header.
Status DecodeSection(DecodeRun& run) {
  run.table
      << "  decode (one token per sequence per step; each timed step follows a bandwidth pass: GB/s is their median,\n"
      << "  of bound the median over steps of (bytes the step read / its time) / the pass's bandwidth):\n"
      << "    batch context |   tok/s  step ms  warm-up | MB/step  GB/s  bound tok/s  of bound | attn   moe  dense  "
         "lm_head  other\n";
  run.bytes_per_token = run.model.CacheConfig(0, 64).bytes_per_token();
  for (int64_t batch : run.o.batches) {
    for (int64_t context : run.o.contexts) {
      if (batch < 1 || context < 1) return InvalidArgumentError("--batch and --context values must be positive");
      MLARUN_ASSIGN_OR_RETURN(const DecodeRowTimes m, TimeDecodeRow(run, batch, context));
      ReportDecodeRow(run, batch, context, m);
    }
  }
  return Status::Ok();
}

// Page sizes after the decode steps touched every weight: with 4 KiB pages
// a step pays a TLB miss per 4 KiB and the prefetchers stop at each page.
void PageSizesSection(DecodeRun& run) {
  const HugePageUse hp = ProcessHugePageUse();
  const int64_t in_place = run.model.weight_bytes_in_place();
  run.doc["huge_pages"] = {{"weights_in_place_bytes", in_place},
                           {"file_pmd_mapped_bytes", hp.file_bytes},
                           {"anon_huge_bytes", hp.anon_bytes}};
  run.table << "  pages: " << (in_place >> 20) << " MiB of weights read in place from the mapped checkpoint; "
            << (hp.file_bytes >> 20) << " MiB of file mappings and " << (hp.anon_bytes >> 20)
            << " MiB of own memory on 2 MiB pages\n";
}

// The prefill as measured: the warm-up steps it discarded, the median step
// time, and where the timed steps' time went and what they computed.
struct PrefillTimes {
  int discarded = 0;
  double ms = 0;
  Shares shares;
  Cost cost;
};

// Prefill: a fresh prompt of prefill_tokens, one step, as the engine runs
// a prompt that fits its token budget.
StatusOr<PrefillTimes> TimePrefill(DecodeRun& run) {
  Model& model = run.model;
  const int64_t P = run.o.prefill_tokens;
  MLARUN_ASSIGN_OR_RETURN(auto pcache, MakeCache(run, 1, P + 1));
  std::vector<int32_t> prompt(static_cast<size_t>(P));
  for (auto& t : prompt) t = static_cast<int32_t>(2 + run.rng() % static_cast<uint32_t>(run.config.vocab_size - 2));
  PrefillTimes m;
  SeqId next_id = 0;
  auto prefill_step = [&]() -> Status {
    const SeqId id = next_id++;
    MLARUN_ASSIGN_OR_RETURN(const ForwardSeq s, pcache.Append(id, prompt, ForwardSeq::Logits::kLast));
    MLARUN_ASSIGN_OR_RETURN(const auto logits, model.ForwardInto(std::span<const ForwardSeq>(&s, 1), *pcache.pool));
    m.shares.Add(model.last_step_times());
    m.cost.Add(model.last_step_traffic());
    return pcache.blocks->Release(id);
  };
  MLARUN_ASSIGN_OR_RETURN(m.discarded, WarmUpUntilStable(prefill_step, run.warm));
  m.shares = {};
  m.cost = {};
  MLARUN_ASSIGN_OR_RETURN(m.ms, TimeMs("prefill", prefill_step, run.timing));
  return m;
}

// The prefill's figures, added to the document and printed.
void ReportPrefill(DecodeRun& run, const PrefillTimes& m) {
  const int64_t P = run.o.prefill_tokens;
  const bool on_device = run.ref.on_device;
  const double peak_gflops = run.ref.peak_gflops, prefill_ms = m.ms;
  const double arith = run.ref.arithmetic ? run.ref.arithmetic->gflop_per_s : 0;
  const double prefill_tps = static_cast<double>(P) / (prefill_ms * 1e-3);
  const double gflops = m.cost.flops_per_step() / (prefill_ms * 1e-3) * 1e-9;
  const Json ps = m.shares.ToJson();
  run.doc["prefill"] = {{"tokens", P},
                        {"tokens_per_s", prefill_tps},
                        {"step_ms", prefill_ms},
                        {"warm_up_steps_discarded", m.discarded},
                        {"flops_per_step", m.cost.flops_per_step()},
                        {"gflop_per_s", gflops},
                        {"fraction_of_gemm_peak", on_device ? Json() : Json(gflops / peak_gflops)},
                        {"fraction_of_arithmetic_peak", arith > 0 ? Json(gflops / arith) : Json()},
                        {"share", ps}};
  run.table << "  prefill (a " << P << "-token prompt, no cached prefix, one step):\n"
            << "    tok/s " << Fmt(prefill_tps, 1) << ", step " << Fmt(prefill_ms, 1) << " ms (" << m.discarded
            << " warm-up steps discarded), " << Fmt(m.cost.flops_per_step() * 1e-9, 1) << " GFLOP/step at "
            << Fmt(gflops, 1) << " GFLOP/s"
            << (on_device ? std::string() : " = " + Pct(gflops / peak_gflops) + " of the product peak")
            << (arith > 0 ? ", " + Pct(gflops / arith) + " of the arithmetic peak" : std::string()) << "; attn "
            << Pct(ps["attention"]) << ", moe " << Pct(ps["moe"]) << ", dense " << Pct(ps["dense_mlp"]) << ", lm_head "
            << Pct(ps["lm_head"]) << ", other " << Pct(ps["other"]) << "; largest: " << m.shares.Largest() << "\n";
}

// What the phases of `mlarun bench decode --parallel` share on one rank: the
// options, the bootstrapped rank's layout, groups and model (owned by
// RunDecodeBenchParallel), the JSON document and the rows' timing and random
// numbers.
struct ParallelRun {
  const DecodeBenchOptions& o;
  std::ostream& table;
  const ParallelLayout& layout;
  ProcessGroups& groups;
  Model& model;
  bool root = false;
  int64_t H = 0, layers = 0;
  Json doc;
  Timing timing;
  std::mt19937 rng;
};

// This DP group's `b` sequences of `context` cached tokens each: one warm-up
// step, then the communicators' counters cleared and o.repetitions timed
// steps. Returns the median step in ms.
StatusOr<double> TimeParallelDecodeRow(ParallelRun& run, int64_t b, int64_t context) {
  const DecodeBenchOptions& o = run.o;
  const ParallelLayout& layout = run.layout;
  ProcessGroups& groups = run.groups;
  Model& model = run.model;
  LatentCacheConfig cc = model.CacheConfig(0, 64);
  cc.enable_prefix_caching = false;
  const int64_t bytes_per_token =
      cc.num_layers * (cc.kv_lora_rank + cc.rope_dim) * static_cast<int64_t>(DTypeSize(cc.dtype));
  cc.budget_bytes = b * ((context + o.repetitions + 2 + 63) / 64 + 1) * 64 * bytes_per_token;
  MLARUN_ASSIGN_OR_RETURN(LocalLatentCache cache, LocalLatentCache::Create(cc, model.memory()));
  for (int64_t s = 0; s < b; ++s) MLARUN_RETURN_IF_ERROR(FillContext(cache, s, context, run.rng));
  std::vector<int32_t> tok(static_cast<size_t>(b), 3);
  const ParallelStep step{.attn_tp = groups.attn_tp.get(),
                          .dp_peers = groups.dp_peers.get(),
                          .device_attn_tp = groups.device_attn_tp.get(),
                          .device_dp_peers = groups.device_dp_peers.get(),
                          .dp_tokens = std::vector<int64_t>(static_cast<size_t>(layout.dp), b),
                          .dp_rank = groups.dp_rank()};
  auto decode_step = [&]() -> Status {
    std::vector<ForwardSeq> seqs;
    for (int64_t s = 0; s < b; ++s) {
      MLARUN_ASSIGN_OR_RETURN(ForwardSeq fs, cache.Append(s, std::span<const int32_t>(&tok[static_cast<size_t>(s)], 1),
                                                          ForwardSeq::Logits::kLast));
      seqs.push_back(fs);
    }
    return model.ForwardInto(seqs, *cache.pool, &step).status();
  };
  MLARUN_RETURN_IF_ERROR(decode_step());  // warm-up
  groups.attn_tp->mutable_stats().Clear();
  groups.dp_peers->mutable_stats().Clear();
  for (auto* dev : {groups.device_attn_tp.get(), groups.device_dp_peers.get()})
    if (dev != nullptr) dev->mutable_stats().Clear();
  return TimeMs("parallel_decode_step", decode_step, run.timing);
}

// The row's communication against the layout's prediction, every rank
// checking its own (the job agrees on the verdict); the row added to the
// document and printed on rank 0. INTERNAL when some rank's bytes differ.
Status ReportParallelDecodeRow(ParallelRun& run, int64_t batch, int64_t b, int64_t context, double step_ms) {
  const ParallelLayout& layout = run.layout;
  ProcessGroups& groups = run.groups;
  const int64_t H = run.H, layers = run.layers;
  // Bytes this rank put into each kind of collective, per step, and the
  // layout's prediction: per layer, the attn-TP group all-reduces the
  // o_proj and MLP outputs of its b tokens; across DP groups each rank
  // contributes its b hidden rows to the gather and sends all B rows of
  // partial MLP output into the reduce-scatter.
  const double steps = run.o.repetitions;
  // (On a GPU the layers' collectives are the device communicators'.)
  auto per_step = [&](auto member) {
    int64_t bytes = 0;
    for (auto* c :
         {groups.attn_tp.get(), groups.dp_peers.get(), groups.device_attn_tp.get(), groups.device_dp_peers.get()})
      if (c != nullptr) bytes += (c->stats().*member).bytes;
    return static_cast<double>(bytes) / steps;
  };
  const double ar = per_step(&CommStats::all_reduce), ag = per_step(&CommStats::all_gather),
               rs = per_step(&CommStats::reduce_scatter);
  const int64_t fp = 4;
  // Plus, per step, one fp32 flag summed over each communicator of more
  // than one rank: whether any rank's computation failed (Model::Forward).
  const double flag_pred = (layout.attn_tp > 1 ? fp : 0) + (layout.dp > 1 ? fp : 0);
  const double ar_pred = (layout.attn_tp > 1 ? static_cast<double>(layers * 2 * b * H * fp) : 0) + flag_pred;
  const double ag_pred = layout.dp > 1 ? static_cast<double>(layers * b * H * fp) : 0;
  const double rs_pred = layout.dp > 1 ? static_cast<double>(layers * batch * H * fp) : 0;
  const bool agree = ar == ar_pred && ag == ag_pred && rs == rs_pred;
  // Every rank checks its own; the job agrees on the verdict.
  float mismatches = agree ? 0.f : 1.f;
  MLARUN_RETURN_IF_ERROR(groups.world->AllReduceSum(&mismatches, 1, CommType::kF32));
  run.doc["rows"].push_back(
      {{"batch", batch},
       {"context", context},
       {"decode_tokens_per_s", batch / (step_ms * 1e-3)},
       {"decode_step_ms", step_ms},
       {"bytes_per_step", {{"all_reduce", ar}, {"all_gather", ag}, {"reduce_scatter", rs}}},
       {"predicted_bytes_per_step", {{"all_reduce", ar_pred}, {"all_gather", ag_pred}, {"reduce_scatter", rs_pred}}},
       {"ranks_disagreeing_with_prediction", static_cast<int>(mismatches)}});
  if (run.root)
    run.table << "  " << std::setw(5) << batch << " " << std::setw(7) << context << " | " << std::setw(12) << std::fixed
              << std::setprecision(2) << batch / (step_ms * 1e-3) << " " << std::setw(8) << std::setprecision(1)
              << step_ms << " | " << std::setprecision(0) << ar << " (" << ar_pred << ")  " << ag << " (" << ag_pred
              << ")  " << rs << " (" << rs_pred << ")" << (mismatches > 0 ? "  MISMATCH on some rank" : "") << "\n";
  if (mismatches > 0)
    return InternalError("communication bytes differ from the layout's prediction on ", mismatches, " ranks");
  return Status::Ok();
}

}  // namespace

Status RunDecodeBench(const DecodeBenchOptions& o) {
  MLARUN_ASSIGN_OR_RETURN(LoadedModel bm, LoadModelForSpec(o.deployment, ModelShard{}));
  DecodeRun run{.o = o,
                .table = o.json ? std::cerr : std::cout,
                .config = bm.config,
                .predicted = bm.predicted,
                .model = *bm.model,
                .timing = Timing{.repetitions = o.repetitions, .min_time_s = 0, .warm_up = false}};
  for (int64_t i = 0; i < run.config.num_hidden_layers; ++i) run.moe_layers += run.config.IsMoeLayer(i);
  InitBenchmarkLibrary();

  // The machine, in the same run: what memory delivers, and the matrix
  // product rate of the weights' dtype at a prefill's shape.
  // On a GPU the reference is the device's copy bandwidth (measured once)
  // and the CPU's product peak is not measured.
  MLARUN_RETURN_IF_ERROR(MeasureBandwidth(run));
  MLARUN_RETURN_IF_ERROR(MeasureGemmPeak(run));

  DescribeJson(run);
  DescribeText(run);
  if (!run.ref.on_device) {
    MLARUN_RETURN_IF_ERROR(WeightStreamingSection(run));
  }
  MLARUN_RETURN_IF_ERROR(SetUpStructured(run));
  if (run.grammar != nullptr) {
    run.doc["structured"] = {{"kind", o.structured},
                             {"vocabulary", run.grammar_vocab},
                             {"compile_ms", run.compile_ms},
                             {"schema_compile_ms", run.schema_compile_ms}};
    run.table << "  structured output: " << o.structured << " over " << run.grammar_vocab << ", compiled in "
              << Fmt(run.compile_ms, 1) << " ms (a 6-property JSON schema: " << Fmt(run.schema_compile_ms, 1)
              << " ms)\n";
  }
  MLARUN_RETURN_IF_ERROR(DecodeSection(run));
  PageSizesSection(run);
  MLARUN_ASSIGN_OR_RETURN(const PrefillTimes prefill, TimePrefill(run));
  ReportPrefill(run, prefill);
  if (o.json) std::cout << run.doc.dump(2) << std::endl;
  return Status::Ok();
}

Status RunDecodeBenchParallel(const DecodeBenchOptions& o, MpiSession& session) {
  if (!o.structured.empty()) return InvalidArgumentError("--structured is for one process (no --parallel)");
  std::ostream& table = o.json ? std::cerr : std::cout;
  // Every rank returns with the same outcome (see runtime/rank/bootstrap.h).
  MLARUN_ASSIGN_OR_RETURN(BootstrappedRank boot,
                          BootstrapRank(o.deployment, session, std::cerr, "mlarun bench decode"));
  const ParallelLayout& layout = boot.layout;
  ProcessGroups& groups = boot.groups;
  LoadedModel* bm = &boot.loaded;
  const bool root = groups.rank == 0;
  const ModelConfig& config = bm->config;
  InitBenchmarkLibrary();
  ParallelRun run{.o = o,
                  .table = table,
                  .layout = layout,
                  .groups = groups,
                  .model = *bm->model,
                  .root = root,
                  .H = config.hidden_size,
                  .layers = config.num_hidden_layers,
                  .timing = Timing{.repetitions = o.repetitions, .min_time_s = 0, .warm_up = false},
                  .rng = std::mt19937(7 + static_cast<uint32_t>(groups.dp_rank()))};
  const int64_t layers = run.layers;
  Json& doc = run.doc;
  doc["model"] = o.deployment.model;
  doc["layout"] = o.deployment.parallel;
  doc["world"] = layout.world();
  doc["layers"] = layers;
  doc["weight_bytes_rank0"] = bm->predicted.total();
  doc["rows"] = Json::array();
  if (root)
    table << "mlarun bench decode --parallel " << layout << ": " << o.deployment.model << ", " << layers << " layers, "
          << layout.world() << " ranks on " << omp_get_max_threads()
          << " threads each (oversubscribed cores show the shape of the costs, not their speed)\n"
          << "  batch context | decode tok/s  step ms | bytes/step on rank 0, measured (predicted): all-reduce  "
             "all-gather  reduce-scatter\n";
  for (int64_t batch : o.batches) {
    if (batch % layout.dp != 0) return InvalidArgumentError("--batch ", batch, " is not divisible by dp=", layout.dp);
    const int64_t b = batch / layout.dp;  // this DP group's sequences
    for (int64_t context : o.contexts) {
      MLARUN_ASSIGN_OR_RETURN(const double step_ms, TimeParallelDecodeRow(run, b, context));
      MLARUN_RETURN_IF_ERROR(ReportParallelDecodeRow(run, batch, b, context, step_ms));
    }
  }
  if (o.json && root) std::cout << doc.dump(2) << std::endl;
  return Status::Ok();
}

}  // namespace mlarun
