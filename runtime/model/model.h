// A DeepSeek-V2/V3 model on one process: weights in compute layouts and the
// forward pass over a batch of sequences whose latent rows live in a
// LatentPool (kv/latent_pool.h).
//
// Compute is fp32 (norms, RoPE, softmax, residual stream, router). Linear
// layers keep their weights in ModelConfig::weight_dtype: f32 weights run f32
// products; bf16 weights run bf16 products (the activations are rounded to bf16
// on the way in, fp32 accumulation) so they use the CPU's bf16 units. The
// attention's W_UK^T / W_UV are stored in the cache dtype, split out of
// kv_b_proj at load (as vLLM and SGLang do).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "attention/mla.h"
#include "attention/rope.h"
#include "base/block_size.h"
#include "base/status.h"
#include "kv/latent_pool.h"
#include "parallel/communicator.h"
#include "parallel/layout.h"
#include "runtime/model/model_config.h"
#include "runtime/model/quantized_weights.h"
#include "runtime/model/safetensors.h"
#include "runtime/ops/linear.h"

namespace mlarun {

struct MoeLayer {
  Linear router;                   // [E, H], always f32 (HF computes the router in fp32)
  PlacedVector<float> score_bias;  // [E] e_score_correction_bias (V3), empty for V2
  int64_t expert_begin = 0;        // global id of experts[0] (sharding by expert)
  std::vector<Mlp> experts;        // this rank's experts (all of them, narrowed, by intermediate)
  Mlp shared;                      // n_shared_experts fused into one MLP (empty if none)
  bool has_shared = false;
};

struct AttentionLayer {
  Linear q_a, q_b, q;              // q_a + q_b when q_lora_rank > 0, else q
  PlacedVector<float> q_a_norm;    // [q_lora_rank]
  Linear kv_a;                     // [L + R, H]
  PlacedVector<float> kv_a_norm;   // [L]
  PlacedVector<std::byte> w_uk_t;  // [N, P, L] in the cache dtype
  PlacedVector<std::byte> w_uv;    // [N, L, V] in the cache dtype
  Linear o;                        // [H, N * V]
};

struct DecoderLayer {
  PlacedVector<float> input_norm, post_attention_norm;  // [H]
  AttentionLayer attn;
  bool moe = false;
  Mlp mlp;  // dense layers
  MoeLayer moe_mlp;
};

// Memory held by the weights, by category.
struct WeightBytes {
  int64_t attention = 0;  // projections, norms, W_UK/W_UV
  // The part of `attention` every attn-TP rank holds whole: the q_a / kv_a
  // projections, their norms and the layer norms (and a V3.2 indexer). The
  // rest (q_b, W_UK / W_UV, o_proj) is split by head.
  int64_t attention_replicated = 0;
  int64_t dense_mlp = 0;
  int64_t moe = 0;  // routed + shared experts and routers
  int64_t embedding_and_head = 0;
  int64_t total() const { return attention + dense_mlp + moe + embedding_and_head; }
  friend bool operator==(const WeightBytes&, const WeightBytes&) = default;
};
// {attention A (replicated R), dense_mlp D, moe M, embedding_and_head E}.
std::ostream& operator<<(std::ostream& os, const WeightBytes& w);

// One sequence's part of a forward step. Its tokens sit at positions
// [start_pos, start_pos + tokens.size()); its latent rows live in the pool
// blocks of `block_table` (position p in block_table[p / block_size]), which
// already hold the rows of [0, start_pos) and cover the new tokens, whose
// rows the step writes.
struct ForwardSeq {
  int64_t id = 0;  // for error messages
  std::span<const int32_t> tokens;
  int64_t start_pos = 0;
  std::span<const int32_t> block_table;
  enum class Logits : uint8_t { kNone, kLast, kAll } logits = Logits::kLast;
};

// The part of the weights one rank holds (ParallelLayout): attention heads
// split over the attn-TP group, the dense MLP and the MoE split over the whole
// world (by expert, or by intermediate dimension). Embeddings, head, norms,
// q_a / kv_a projections and the router are replicated.
struct ModelShard {
  int attn_tp_size = 1, attn_tp_rank = 0;
  int mlp_size = 1, mlp_rank = 0;
  MoeSharding moe = MoeSharding::kByExpert;

  static ModelShard For(const ParallelLayout& layout, int rank) {
    return ModelShard{.attn_tp_size = layout.attn_tp,
                      .attn_tp_rank = layout.attn_tp_rank(rank),
                      .mlp_size = layout.world(),
                      .mlp_rank = rank,
                      .moe = layout.moe};
  }
  friend bool operator==(const ModelShard&, const ModelShard&) = default;
};
// Checks that `config` can be split as `shard` says: heads divisible by the
// attn-TP size, experts (or their intermediate dimension) by the world, the
// dense and shared-expert intermediate dimensions by the world. Errors name
// the field and the numbers.
Status ValidateModelShard(const ModelConfig& config, const ModelShard& shard);

// What one rank's weights of `config` occupy under `shard`, from the shapes
// alone (no allocation): equals Model::weight_bytes() of the loaded model.
//
// `projection_dtype`: a what-if for the decoder layers' projection matrices
// (q / kv / o projections, dense MLP, experts). kF8E4M3 sizes them as the
// DeepSeek-V3 release stores them, e4m3 plus one fp32 scale per 128 x 128
// block: what a model loaded from such a checkpoint with Fp8Weights::kKeep
// holds, where a shard's slice of a tensor that does not start on a 128
// boundary is sized in weight_dtype (that tensor is dequantized at load).
// W_UK / W_UV stay in the cache dtype, embeddings and head in weight_dtype,
// norms and router in fp32.
WeightBytes PredictWeightBytes(const ModelConfig& config, const ModelShard& shard = {},
                               std::optional<DType> projection_dtype = std::nullopt);

// How a model's Linear layers are held, for PredictWeightBytes: what a
// checkpoint's storage and the loader make of them.
struct WeightFormat {
  // The projections' dtype: kF8E4M3 (as above), kInt8 / kInt4, or a float
  // dtype; nullopt: config.weight_dtype.
  std::optional<DType> projection_dtype;
  // kInt8 / kInt4: elements of `in` per fp32 scale (<= 0: one per output
  // channel), per-group fp32 offsets held (asymmetric), and which Linear
  // modules are held so by their Hugging Face name ("lm_head",
  // "model.layers.3.mlp.experts.7.down_proj"); empty: every decoder-layer
  // projection, not lm_head. A shard's column slice that does not start (or
  // end) on a group is held in weight_dtype (the loader dequantizes it), as
  // is kv_b_proj (it becomes W_UK / W_UV), always.
  int64_t group = 128;
  bool offsets = false;
  std::function<bool(std::string_view module)> quantized;
  // lm_head's own int8 / int4 format where it has one (compressed-tensors
  // "mixed-precision"); it applies when `quantized("lm_head")`.
  std::shared_ptr<const WeightFormat> lm_head;
  // Compares the numbers; `quantized` (a function) is not compared.
  friend bool operator==(const WeightFormat& a, const WeightFormat& b) {
    return a.projection_dtype == b.projection_dtype && a.group == b.group && a.offsets == b.offsets;
  }
};
// What loading a checkpoint of quantization scheme `s` holds (kNone: no
// integer projections; an fp8 checkpoint is known by its tensors' dtype).
WeightFormat WeightFormatOf(const QuantScheme& s);
// PredictWeightBytes for projections held as `f` says; with kInt8 / kInt4,
// each quantized matrix as the loader keeps it (Linear::bytes): packed
// values, rows x ceil(cols / group) fp32 scales, as many offsets when
// asymmetric.
WeightBytes PredictWeightBytes(const ModelConfig& config, const ModelShard& shard, const WeightFormat& f);

// The default group size of `dtype`, as llm-compressor's presets: int4 128
// (W4A16), int8 per channel (0).
int64_t DefaultQuantizeGroup(DType dtype);

// The output layer: as the checkpoint stores it, or int8 / int4. For `mlarun
// quantize` (what it writes) and for loading (ModelOptions::lm_head: an
// lm_head stored unquantized is quantized at load by QuantizeLinear,
// symmetric, in DefaultQuantizeGroup groups; one stored int8 / int4 stays as
// it is). Values are frozen.
enum class LmHeadMode : uint8_t { kKeep = 0, kInt8 = 1, kInt4 = 2 };
// "keep", "int8" or "int4"; the error names the flag.
StatusOr<LmHeadMode> ParseLmHeadMode(std::string_view name);
// `f` plus lm_head as quantizing it at load holds it (int8 / int4 in
// DefaultQuantizeGroup groups, no offsets); `f` itself where `mode` is kKeep
// or `f` already holds lm_head quantized.
WeightFormat WithLmHead(WeightFormat f, LmHeadMode mode);

// The latent cache a model of `config` needs: its layers, row width and
// cache dtype, with this budget and block size.
LatentCacheConfig CacheConfigFor(const ModelConfig& config, int64_t budget_bytes, int64_t block_size);

// The collectives and token counts of one step across ranks.
struct ParallelStep {
  Communicator* attn_tp = nullptr;   // this DP group (all-reduce of o_proj and MLP outputs)
  Communicator* dp_peers = nullptr;  // one rank per DP group (gather / reduce-scatter of hidden states)
  // A device runner's collectives on device buffers (NCCL) over the same
  // ranks; nullptr: attn_tp / dp_peers take them (the CPU's, in host memory).
  // The step's failure agreement always uses attn_tp / dp_peers.
  Communicator* device_attn_tp = nullptr;
  Communicator* device_dp_peers = nullptr;
  std::vector<int64_t> dp_tokens;  // tokens of every DP group this step, by dp_rank
  int dp_rank = 0;
  // This rank as error messages name it, e.g. "rank 3 (node1)".
  std::string rank_name;
};

// How checkpoint weights stored in the dtype they are used in get into
// memory. Values are frozen (they are flag values).
enum class WeightLoading : uint8_t {
  // Read in place from the memory-mapped files: nothing is copied at load, no
  // second resident copy. The page cache backs them, in its own page sizes:
  // 2 MiB where it holds 2 MiB folios (the mapping asks for them, so pages it
  // faults in come that way), 4 KiB where earlier reads left small ones.
  kMapped = 0,
  // Copied into huge-page buffers of the model's own, each tensor's file
  // pages dropped from the process as it is copied (the resident set never
  // holds both). For a page cache of 4 KiB pages that cannot be evicted, and
  // immune to the kernel reclaiming cold file pages; costs the copy at load.
  kCopied = 1,
};
// "mapped" or "copied"; the error names the flag value.
StatusOr<WeightLoading> ParseWeightLoading(std::string_view name);
std::string_view WeightLoadingName(WeightLoading w);

// How the decoder layers' projections (q / kv / o, dense MLP, experts,
// shared experts) that a checkpoint stores as F8_E4M3 with `_scale_inv` block
// scales (the DeepSeek-V3 release) are held. Values are frozen.
enum class Fp8Weights : uint8_t {
  // As stored: the e4m3 bytes read in place from the mapped files (copied
  // with WeightLoading::kCopied), the block scales copied into fp32 buffers of
  // the model's own; the products decode them (docs/fp8-weights.md). A shard
  // whose slice of a tensor does not start on a 128 boundary gets that
  // tensor dequantized to config.weight_dtype instead (logged).
  kKeep = 0,
  // Dequantized to config.weight_dtype at load.
  kDequantize = 1,
};

// How Linear layers a checkpoint stores as int8 / int4 (config.json's
// quantization_config) are held. Values are frozen.
enum class IntWeights : uint8_t {
  // As int8 / int4 Linears (runtime/ops/linear.h): the values read in place
  // from the mapped files where the stored layout is mlarun's (compressed-
  // tensors; copied with WeightLoading::kCopied), the scales (and offsets)
  // in fp32 buffers of the model's own. A shard whose column slice does not
  // start and end on groups gets that matrix dequantized to
  // config.weight_dtype (logged); kv_b_proj is always dequantized.
  kKeep = 0,
  // Dequantized to config.weight_dtype at load (a reference for tests).
  kDequantize = 1,
};
// The integer scheme of the checkpoint in `dir` (config.json's
// quantization_config; kNone without a config.json).
StatusOr<QuantScheme> CheckpointQuantScheme(const std::string& dir);
// How loading `ckpt` (of scheme `scheme`) with these options holds its
// projections: the integer scheme unless `ints` dequantizes, f8_e4m3 when
// they are stored F8_E4M3 and `fp8` keeps them, else the config's
// weight_dtype (projection_dtype unset).
WeightFormat HeldWeightFormat(const Checkpoint& ckpt, const QuantScheme& scheme, Fp8Weights fp8, IntWeights ints);
// The same for the checkpoint at `path`, from config.json and the
// safetensors headers only (WeightFormat{} for a YAML or config.json path:
// no weights to look at).
StatusOr<WeightFormat> CheckpointWeightFormat(const std::string& path, Fp8Weights fp8 = Fp8Weights::kKeep,
                                              IntWeights ints = IntWeights::kKeep);

struct ModelOptions {
  // The attention's dispatch thresholds and tiles, and the backend every op
  // of the model runs on (attention.backend: the one place it is set).
  MlaConfig attention;
  WeightLoading weights = WeightLoading::kMapped;
  Fp8Weights fp8_weights = Fp8Weights::kKeep;  // checkpoints with F8_E4M3 projections
  // Checkpoints whose Linear layers are stored as integers (compressed-
  // tensors, AWQ, GPTQ: docs/quantized-weights.md).
  IntWeights int_weights = IntWeights::kKeep;
  // lm_head quantized at load where the checkpoint stores it unquantized
  // (LmHeadMode; logged with its bytes before and after).
  LmHeadMode lm_head = LmHeadMode::kKeep;
  // Where the weights the ops read, the step's buffers and the workspaces
  // live: the backend's device memory (MemoryFor(attention.backend)) when
  // null. Loading places every weight there (PlaceWeights); on the host's
  // memory nothing moves. Must outlive the model.
  DeviceMemory* memory = nullptr;
  ModelShard shard;                                  // default: the whole model
  std::function<void(const std::string&)> progress;  // loading progress (may be empty)
  // Called after each decoder layer is loaded: (layers loaded, layers). May be empty.
  std::function<void(int64_t, int64_t)> on_layer;
  // Testing: the Forward call with this 0-based index (counted per Model)
  // fails with INTERNAL on this process, in its first layer after the
  // attention, as a kernel failure would. -1: never.
  int64_t fail_forward_call = -1;
};

// Overrides applied to a model's config when loading it.
struct ModelOverrides {
  std::optional<DType> kv_dtype;      // --kv-dtype
  std::optional<int64_t> num_layers;  // reduced depth (YAML models only)
};
// From the command line's --kv-dtype ("" keeps the model's; bf16 or fp32) and
// --num-layers (0 keeps the model's). The error names the flag.
StatusOr<ModelOverrides> ParseModelOverrides(const std::string& kv_dtype, int64_t num_layers);

class Model {
 public:
  ~Model();

  // A Hugging Face checkpoint directory (config.json + safetensors), or a YAML
  // file from configs/models/ (random weights from its seed).
  static StatusOr<std::unique_ptr<Model>> Load(const std::string& dir_or_yaml, const ModelOverrides& overrides = {},
                                               const ModelOptions& options = {});
  // The config alone, overrides applied, as Load would use it: from a
  // checkpoint directory, its config.json (or any config.json file), or a
  // YAML file (whose weight seed goes to `seed` if given). Reads no weights.
  static StatusOr<ModelConfig> LoadConfig(const std::string& path, const ModelOverrides& overrides = {},
                                          uint64_t* seed = nullptr);
  // Load with the config already read (and possibly changed further, e.g.
  // fewer experts of a YAML model): random weights from `seed` for a YAML
  // path, else the checkpoint's weights.
  static StatusOr<std::unique_ptr<Model>> FromConfig(const std::string& dir_or_yaml, const ModelConfig& config,
                                                     uint64_t seed, const ModelOptions& options = {});

  // Loads every weight from a Hugging Face checkpoint, checking names and
  // shapes; missing and unexpected tensors are errors naming the tensor.
  // Weights stored in the dtype they are used in (config.weight_dtype) are
  // read in place from the mapped files, with no copy; the model then keeps
  // `ckpt` alive. Others (bf16 used as f32, f16, fp8 with its block scales,
  // the split W_UK / W_UV) are converted into buffers of the model's own.
  static StatusOr<std::unique_ptr<Model>> FromCheckpoint(const ModelConfig& config,
                                                         std::shared_ptr<const Checkpoint> ckpt,
                                                         const ModelOptions& options = {});
  // Random weights from a seed (YAML models): deterministic, scaled like a
  // trained model (linear N(0, 1/fan_in)-like, norms near 1).
  static StatusOr<std::unique_ptr<Model>> Random(const ModelConfig& config, uint64_t seed,
                                                 const ModelOptions& options = {});

  const ModelConfig& config() const { return config_; }
  WeightBytes weight_bytes() const;
  // The part of weight_bytes() read in place from the mapped checkpoint
  // (not copied at load): 0 for a YAML model.
  int64_t weight_bytes_in_place() const;
  // True when the projections are held as f8_e4m3 (an fp8 checkpoint loaded
  // with Fp8Weights::kKeep): what PredictWeightBytes' projection_dtype is then.
  bool holds_fp8_projections() const;
  // How the Linear layers are held (a checkpoint's integer format, fp8, or
  // weight_dtype): PredictWeightBytes(config(), shard, weight_format())
  // equals weight_bytes().
  const WeightFormat& weight_format() const { return weight_format_; }
  DType lm_head_dtype() const { return lm_head_.dtype; }
  // A cache configuration matching this model (layers, widths, dtype).
  LatentCacheConfig CacheConfig(int64_t budget_bytes, int64_t block_size = kDefaultBlockSize) const;

  // Runs one step: writes the new tokens' latent rows into `pool` and
  // returns logits [rows, vocab] for the rows the sequences ask for, in
  // sequence order (kLast: one row, kAll: one per token). Not thread-safe
  // (it reuses internal buffers); blocks until done.
  //
  // With `parallel`, the step is one rank's part of a step of all ranks:
  // `seqs` are this DP group's (possibly none: the rank still joins every
  // collective), attention runs on this rank's heads, and the MLP / MoE runs
  // on this rank's shard for every DP group's tokens.
  //
  // Errors. A computation that fails on one rank (a kernel, a workspace, a
  // bad batch) does not leave the others waiting: that rank still joins every
  // collective of the step, and at its end all ranks learn of the failure
  // and return the same Status, whose message names the rank that failed
  // (its ParallelStep::rank_name) and why; last_step_failure() holds it. An
  // error of a collective itself is returned at once, only where it was seen,
  // and last_step_failure() stays OK: the ranks can no longer be relied upon
  // to meet again. Without `parallel` every error is a computation failure.
  StatusOr<std::vector<float>> Forward(std::span<const ForwardSeq> seqs, LatentPool& pool,
                                       const ParallelStep* parallel = nullptr);
  // The same, the logits in the model's own buffer in memory() (valid until
  // the next step; on a device, device memory): after the first steps of a
  // shape, a step allocates nothing.
  StatusOr<std::span<const float>> ForwardInto(std::span<const ForwardSeq> seqs, LatentPool& pool,
                                               const ParallelStep* parallel = nullptr);
  // OK, or the computation failure the last Forward returned (see Forward).
  const Status& last_step_failure() const { return last_failure_; }
  const ModelShard& shard() const { return options_.shard; }
  // The backend the model's ops run on (ModelOptions::attention.backend).
  Backend backend() const { return options_.attention.backend; }
  // The memory its weights and step buffers are in (ModelOptions::memory).
  DeviceMemory& memory() const { return *memory_; }

  // Per-step time breakdown of the last Forward (seconds), for benchmarks.
  struct StepTimes {
    double attention = 0, moe = 0, dense_mlp = 0, lm_head = 0, other = 0;
  };
  const StepTimes& last_step_times() const { return times_; }

  // Bytes the last Forward had to read on this rank, for the bandwidth bound
  // of a step: the weights it touched (every attention projection and W_UK /
  // W_UV of a layer with tokens, the dense MLPs, the router and the routed
  // experts of this rank that some token chose, the shared experts, the
  // embedding rows, lm_head when logits were asked for) and the latent-cache
  // rows its attention covered (each sequence's keys, every layer, once);
  // and its arithmetic (multiply-add = 2): 2 x rows x out x in per weight
  // product and the attention's on the path each sequence took
  // (MlaAbsorbedFlops / MlaExpandedFlops).
  struct StepTraffic {
    int64_t weight_bytes = 0, cache_bytes = 0;
    double flops = 0;
  };
  const StepTraffic& last_step_traffic() const { return traffic_; }

  // Experts the MoE layers of the last Forward chose: per MoE layer (in layer
  // order), [tokens, num_experts_per_tok] ids, each token's ids ascending.
  // For tests and debugging.
  const std::vector<std::vector<int32_t>>& last_routing() const { return routing_; }

 private:
  explicit Model(const ModelConfig& c, const ModelOptions& o);
  Status Init();  // shapes, rope, memory
  // Copies every weight the ops read into memory_ when the host cannot
  // address it (a no-op on the host's memory). The last step of loading.
  Status PlaceWeights();
  Status MoeForward(const MoeLayer& moe, const float* X, int64_t T, float* Y);
  // Forward on this rank: returns its computation's status; a failed
  // collective goes to *collective and ends the step at once.
  Status ForwardImpl(std::span<const ForwardSeq> seqs, LatentPool& pool, const ParallelStep* parallel, Communicator* tp,
                     Communicator* peers, int64_t call, Status* collective);
  // ForwardImpl's phases, over one step's state (model.cc). A computation
  // failure goes to Step::st and the step goes on joining the collectives;
  // those returning bool return false when a collective failed
  // (*Step::collective), which ends the step at once.
  struct Step;
  // The batch checked and laid out (tokens, positions, cache slots, block
  // tables), the collectives' counts, then CarveBuffers.
  bool PrepareStep(Step& step);
  // Checks the batch against the pool and the model; query_start, seq_lens,
  // the block table width and the logit rows.
  void DescribeBatch(Step& step);
  // The step's buffers out of the StepScratch, the batch arrays on the
  // device, and the attention's batch description.
  bool CarveBuffers(Step& step);
  // Layer li's attention, o_proj's partial sums all-reduced over the attn-TP
  // group, added to the hidden states.
  bool AttentionBlock(const DecoderLayer& layer, int64_t li, Step& step);
  // This group's tokens through layer li's attention, into o_out (this
  // rank's heads' part of o_proj).
  Status Attention(const DecoderLayer& layer, int64_t li, Step& step);
  // Input norm, the query and key-latent projections and their norms, RoPE.
  Status AttentionProjections(const DecoderLayer& layer, const Step& step);
  // The post-attention norm, the dense MLP or the MoE over every DP group's
  // tokens (all-gathered over the peers, reduce-scattered back, all-reduced
  // in the group), added to the hidden states.
  bool MlpBlock(const DecoderLayer& layer, Step& step);
  // The final norm and lm_head over the rows the sequences ask for.
  Status ComputeLogits(const Step& step);

  ModelConfig config_;
  ModelOptions options_;
  std::unique_ptr<Rope> rope_;
  Linear embed_;    // [vocab, H] in the weight dtype; rows are looked up, never multiplied
  Linear lm_head_;  // [vocab, H]; the same bytes as embed_ when tie_word_embeddings
  PlacedVector<float> final_norm_;
  PlacedVector<float> rope_inv_freq_;  // rope_'s, on the device
  std::vector<DecoderLayer> layers_;
  WeightFormat weight_format_;  // set by the loader
  StepTimes times_;
  StepTraffic traffic_;
  Status last_failure_;
  int64_t forward_calls_ = 0;
  std::vector<std::vector<int32_t>> routing_;
  DeviceMemory* memory_ = nullptr;  // Init: options_.memory or the backend's
  Workspace attn_ws_;
  // A step's buffers (model.cc: activations, the MoE's, ForwardInto's
  // logits), reused across steps: grown to the largest step seen, never
  // shrunk.
  struct StepScratch;
  std::unique_ptr<StepScratch> scratch_;
  size_t routing_layers_ = 0;  // entries of routing_ this step filled

  friend class ModelLoader;
};

}  // namespace mlarun
