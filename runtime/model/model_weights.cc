// Building a Model's weights: one walk over the architecture, fed either by a
// Hugging Face checkpoint or by a seeded random generator, so the two can never
// disagree on names, shapes or layouts.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "runtime/model/model.h"

namespace mlarun {
namespace {

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // [rows, cols] row-major into `out` as `dtype`. `random_std`: the standard
  // deviation a random source uses (checkpoints ignore it).
  virtual Status Matrix(const std::string& name, int64_t rows, int64_t cols, DType dtype, void* out,
                        double random_std) = 0;
  // [n] fp32. Random sources draw `center + spread * U`, U of unit variance.
  virtual Status Vector(const std::string& name, int64_t n, float* out, double center, double spread) = 0;
};

class CheckpointSource final : public WeightSource {
 public:
  explicit CheckpointSource(const Checkpoint& c) : ckpt_(c) {}
  Status Matrix(const std::string& name, int64_t rows, int64_t cols, DType dtype, void* out, double) override {
    used_.insert(name);
    const int64_t shape[2] = {rows, cols};
    return ckpt_.Load(name, shape, dtype, out);
  }
  Status Vector(const std::string& name, int64_t n, float* out, double, double) override {
    used_.insert(name);
    const int64_t shape[1] = {n};
    return ckpt_.Load(name, shape, DType::kF32, out);
  }
  // Tensors the checkpoint has that the architecture does not use.
  Status CheckNoneLeft(const ModelConfig& c) const {
    for (const std::string& name : ckpt_.Names()) {
      if (used_.count(name)) continue;
      static const std::string kScale = "_scale_inv";
      if (name.size() > kScale.size() && name.ends_with(kScale) && used_.count(name.substr(0, name.size() - kScale.size())))
        continue;  // consumed with its fp8 weight
      if (name.ends_with("rotary_emb.inv_freq")) continue;  // a buffer some exports include
      int64_t layer = -1;
      if (std::sscanf(name.c_str(), "model.layers.%ld.", &layer) == 1 && layer >= c.num_hidden_layers &&
          layer < c.num_hidden_layers + c.num_nextn_predict_layers)
        continue;  // multi-token-prediction modules: not used for decoding
      return InvalidArgumentError("checkpoint ", ckpt_.dir(), ": unexpected tensor '", name,
                                  "' (not part of the architecture in config.json)");
    }
    return Status::Ok();
  }

 private:
  const Checkpoint& ckpt_;
  std::set<std::string> used_;
};

// Deterministic uniform draws (unit variance scaled), independent of thread
// count: each tensor gets a stream from (seed, name), each chunk of it a
// sub-stream from the chunk index.
class RandomSource final : public WeightSource {
 public:
  explicit RandomSource(uint64_t seed) : seed_(seed) {}
  Status Matrix(const std::string& name, int64_t rows, int64_t cols, DType dtype, void* out, double std) override {
    Fill(name, rows * cols, 0.0, std, dtype, out);
    return Status::Ok();
  }
  Status Vector(const std::string& name, int64_t n, float* out, double center, double spread) override {
    Fill(name, n, center, spread, DType::kF32, out);
    return Status::Ok();
  }

 private:
  static uint64_t SplitMix(uint64_t& x) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  void Fill(const std::string& name, int64_t n, double center, double stddev, DType dtype, void* out) const {
    uint64_t h = seed_ ^ 0x6d6c6172756e5f77ull;
    for (char ch : name) h = (h ^ static_cast<unsigned char>(ch)) * 0x100000001b3ull;
    constexpr int64_t kChunk = 1 << 16;
    const double a = std::sqrt(3.0) * stddev;  // U(-a, a) has standard deviation `stddev`
    const size_t es = DTypeSize(dtype);
#pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      uint64_t state = h ^ (static_cast<uint64_t>(c0) * 0x9e3779b97f4a7c15ull);
      float buf[256];
      for (int64_t i = c0; i < std::min(n, c0 + kChunk); i += 256) {
        const int64_t m = std::min<int64_t>(256, std::min(n, c0 + kChunk) - i);
        for (int64_t j = 0; j < m; ++j) {
          const double u = static_cast<double>(SplitMix(state) >> 11) * 0x1.0p-53;  // [0, 1)
          buf[j] = static_cast<float>(center + a * (2.0 * u - 1.0));
        }
        StoreFromF32(buf, static_cast<std::byte*>(out) + i * static_cast<int64_t>(es), dtype, m);
      }
    }
  }
  uint64_t seed_;
};

Linear MakeLinear(int64_t out, int64_t in, DType dtype) {
  Linear l{.out = out, .in = in, .dtype = dtype, .data = {}};
  l.data.resize(static_cast<size_t>(out * in) * DTypeSize(dtype));
  return l;
}

Status LoadLinear(WeightSource& src, const std::string& name, int64_t out, int64_t in, DType dtype, Linear* l) {
  *l = MakeLinear(out, in, dtype);
  return src.Matrix(name, out, in, dtype, l->data.data(), 1.0 / std::sqrt(static_cast<double>(in)));
}

Status LoadMlp(WeightSource& src, const std::string& prefix, int64_t hidden, int64_t inter, DType dtype, Mlp* m) {
  const size_t es = DTypeSize(dtype);
  const double std_in = 1.0 / std::sqrt(static_cast<double>(hidden));
  m->gate_up = MakeLinear(2 * inter, hidden, dtype);
  MLARUN_RETURN_IF_ERROR(src.Matrix(prefix + "gate_proj.weight", inter, hidden, dtype, m->gate_up.data.data(), std_in));
  MLARUN_RETURN_IF_ERROR(src.Matrix(prefix + "up_proj.weight", inter, hidden, dtype,
                                    m->gate_up.data.data() + static_cast<size_t>(inter * hidden) * es, std_in));
  return LoadLinear(src, prefix + "down_proj.weight", hidden, inter, dtype, &m->down);
}

Status LoadNorm(WeightSource& src, const std::string& name, int64_t n, std::vector<float>* v) {
  v->resize(static_cast<size_t>(n));
  return src.Vector(name, n, v->data(), 1.0, 0.1);
}

}  // namespace

class ModelLoader {
 public:
  static Status Build(Model& m, WeightSource& src) {
    const ModelConfig& c = m.config_;
    const DType wt = c.weight_dtype, kv = c.kv_dtype;
    const int64_t H = c.hidden_size, N = c.num_attention_heads, L = c.kv_lora_rank, R = c.qk_rope_head_dim;
    const int64_t P = c.qk_nope_head_dim, V = c.v_head_dim, Dq = c.q_head_dim();
    auto progress = [&](const std::string& s) {
      if (m.options_.progress) m.options_.progress(s);
    };
    m.embed_ = MakeLinear(c.vocab_size, H, wt);
    MLARUN_RETURN_IF_ERROR(src.Matrix("model.embed_tokens.weight", c.vocab_size, H, wt, m.embed_.data.data(), 1.0));
    MLARUN_RETURN_IF_ERROR(LoadNorm(src, "model.norm.weight", H, &m.final_norm_));
    if (c.tie_word_embeddings) {
      m.lm_head_ = m.embed_;
    } else {
      MLARUN_RETURN_IF_ERROR(LoadLinear(src, "lm_head.weight", c.vocab_size, H, wt, &m.lm_head_));
    }
    m.layers_.resize(static_cast<size_t>(c.num_hidden_layers));
    std::vector<float> kv_b;
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      progress("loading layer " + std::to_string(i + 1) + "/" + std::to_string(c.num_hidden_layers));
      DecoderLayer& layer = m.layers_[static_cast<size_t>(i)];
      const std::string p = "model.layers." + std::to_string(i) + ".";
      MLARUN_RETURN_IF_ERROR(LoadNorm(src, p + "input_layernorm.weight", H, &layer.input_norm));
      MLARUN_RETURN_IF_ERROR(LoadNorm(src, p + "post_attention_layernorm.weight", H, &layer.post_attention_norm));
      AttentionLayer& a = layer.attn;
      const std::string ap = p + "self_attn.";
      if (c.q_lora_rank > 0) {
        MLARUN_RETURN_IF_ERROR(LoadLinear(src, ap + "q_a_proj.weight", c.q_lora_rank, H, wt, &a.q_a));
        MLARUN_RETURN_IF_ERROR(LoadNorm(src, ap + "q_a_layernorm.weight", c.q_lora_rank, &a.q_a_norm));
        MLARUN_RETURN_IF_ERROR(LoadLinear(src, ap + "q_b_proj.weight", N * Dq, c.q_lora_rank, wt, &a.q_b));
      } else {
        MLARUN_RETURN_IF_ERROR(LoadLinear(src, ap + "q_proj.weight", N * Dq, H, wt, &a.q));
      }
      MLARUN_RETURN_IF_ERROR(LoadLinear(src, ap + "kv_a_proj_with_mqa.weight", L + R, H, wt, &a.kv_a));
      MLARUN_RETURN_IF_ERROR(LoadNorm(src, ap + "kv_a_layernorm.weight", L, &a.kv_a_norm));
      // kv_b_proj [N * (P + V), L]: per head P rows of W_UK^T, then V rows of W_UV^T.
      kv_b.resize(static_cast<size_t>(N * (P + V) * L));
      MLARUN_RETURN_IF_ERROR(src.Matrix(ap + "kv_b_proj.weight", N * (P + V), L, DType::kF32, kv_b.data(),
                                        1.0 / std::sqrt(static_cast<double>(L))));
      const size_t kes = DTypeSize(kv);
      a.w_uk_t.resize(static_cast<size_t>(N * P * L) * kes);
      a.w_uv.resize(static_cast<size_t>(N * L * V) * kes);
      std::vector<float> col(static_cast<size_t>(V));
      for (int64_t h = 0; h < N; ++h) {
        const float* head = kv_b.data() + h * (P + V) * L;
        StoreFromF32(head, a.w_uk_t.data() + static_cast<size_t>(h * P * L) * kes, kv, P * L);
        for (int64_t l = 0; l < L; ++l) {  // W_UV[h][l][v] = kv_b[h * (P + V) + P + v][l]
          for (int64_t v = 0; v < V; ++v) col[static_cast<size_t>(v)] = head[(P + v) * L + l];
          StoreFromF32(col.data(), a.w_uv.data() + static_cast<size_t>((h * L + l) * V) * kes, kv, V);
        }
      }
      MLARUN_RETURN_IF_ERROR(LoadLinear(src, ap + "o_proj.weight", H, N * V, wt, &a.o));

      const std::string mp = p + "mlp.";
      layer.moe = c.IsMoeLayer(i);
      if (!layer.moe) {
        MLARUN_RETURN_IF_ERROR(LoadMlp(src, mp, H, c.intermediate_size, wt, &layer.mlp));
        continue;
      }
      MoeLayer& moe = layer.moe_mlp;
      const int64_t E = c.n_routed_experts;
      MLARUN_RETURN_IF_ERROR(LoadLinear(src, mp + "gate.weight", E, H, DType::kF32, &moe.router));
      if (c.model_type == ModelType::kDeepSeekV3) {
        moe.score_bias.resize(static_cast<size_t>(E));
        MLARUN_RETURN_IF_ERROR(src.Vector(mp + "gate.e_score_correction_bias", E, moe.score_bias.data(), 0.0, 0.1));
      }
      moe.experts.resize(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e)
        MLARUN_RETURN_IF_ERROR(LoadMlp(src, mp + "experts." + std::to_string(e) + ".", H, c.moe_intermediate_size, wt,
                                       &moe.experts[static_cast<size_t>(e)]));
      moe.has_shared = c.n_shared_experts > 0;
      if (moe.has_shared)
        MLARUN_RETURN_IF_ERROR(
            LoadMlp(src, mp + "shared_experts.", H, c.moe_intermediate_size * c.n_shared_experts, wt, &moe.shared));
    }
    return Status::Ok();
  }
};

StatusOr<std::unique_ptr<Model>> Model::FromCheckpoint(const ModelConfig& config, const Checkpoint& ckpt,
                                                       const ModelOptions& options) {
  std::unique_ptr<Model> m(new Model(config, options));
  MLARUN_RETURN_IF_ERROR(m->Init());
  CheckpointSource src(ckpt);
  MLARUN_RETURN_IF_ERROR(ModelLoader::Build(*m, src));
  MLARUN_RETURN_IF_ERROR(src.CheckNoneLeft(config));
  return m;
}

StatusOr<std::unique_ptr<Model>> Model::Random(const ModelConfig& config, uint64_t seed, const ModelOptions& options) {
  std::unique_ptr<Model> m(new Model(config, options));
  MLARUN_RETURN_IF_ERROR(m->Init());
  RandomSource src(seed);
  MLARUN_RETURN_IF_ERROR(ModelLoader::Build(*m, src));
  return m;
}

StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& path, const ModelOverrides& overrides,
                                             const ModelOptions& options) {
  const bool yaml = path.ends_with(".yaml") || path.ends_with(".yml");
  if (yaml) {
    MLARUN_ASSIGN_OR_RETURN(YamlModel ym, LoadModelYaml(path));
    if (overrides.kv_dtype) ym.config.kv_dtype = *overrides.kv_dtype;
    if (overrides.num_layers) {
      if (*overrides.num_layers < 1 || *overrides.num_layers > ym.config.num_hidden_layers)
        return InvalidArgumentError("model ", path, ": --num-layers must be in [1, ", ym.config.num_hidden_layers,
                                    "], got ", *overrides.num_layers);
      ym.config.num_hidden_layers = *overrides.num_layers;
      ym.config.first_k_dense_replace = std::min(ym.config.first_k_dense_replace, ym.config.num_hidden_layers);
    }
    return Random(ym.config, ym.seed, options);
  }
  if (overrides.num_layers)
    return InvalidArgumentError("model ", path, ": --num-layers applies to YAML models only (a checkpoint has all its layers)");
  MLARUN_ASSIGN_OR_RETURN(ModelConfig config, LoadHfConfig(path));
  if (overrides.kv_dtype) config.kv_dtype = *overrides.kv_dtype;
  MLARUN_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(path));
  return FromCheckpoint(config, *ckpt, options);
}

}  // namespace mlarun
