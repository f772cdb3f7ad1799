#include "runtime/model/model_config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_paths.h"

namespace mlarun {
namespace {

const std::string kFixtures = MLARUN_FIXTURES_DIR;
const std::string kConfigFixtures = kFixtures + "/configs";
const std::string kPresets = ConfigPath("models");

ModelConfig MustParseJson(const std::string& text, const std::string& origin = "test.json") {
  StatusOr<ModelConfig> c = ParseHfConfigJson(text, origin);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

YamlModel MustParseYaml(const std::string& text, const std::string& origin = "test.yaml") {
  StatusOr<YamlModel> m = ParseModelYaml(text, origin);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *m : YamlModel{};
}

// Expects an InvalidArgumentError naming both the file and the field.
void ExpectFieldError(const Status& st, const std::string& origin, const std::string& field) {
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(origin), std::string::npos) << "origin '" << origin << "' missing: " << st;
  EXPECT_NE(st.message().find(field), std::string::npos) << "field '" << field << "' missing: " << st;
}

// HF's attention scale: qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2.
double HfSoftmaxScale(double qk_head_dim, double factor, double mscale_all_dim) {
  const double m = 0.1 * mscale_all_dim * std::log(factor) + 1.0;
  return m * m / std::sqrt(qk_head_dim);
}

TEST(ModelConfig, DeepSeekV3Preset) {
  StatusOr<YamlModel> m = LoadModelYaml(kPresets + "/deepseek-v3.yaml");
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = m->config;
  EXPECT_TRUE(ValidateModelConfig(c).ok());
  EXPECT_EQ(c.model_type, ModelType::kDeepSeekV3);
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.intermediate_size, 18432);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.num_attention_heads, 128);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.q_head_dim(), 192);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_EQ(c.topk_method, TopkMethod::kNoauxTc);
  EXPECT_EQ(c.scoring_func, ScoringFunc::kSigmoid);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.max_position_embeddings, 163840);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{1});
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.weight_dtype, DType::kBF16);
  EXPECT_EQ(c.kv_dtype, DType::kBF16);
  EXPECT_EQ(m->seed, 0u);

  EXPECT_EQ(c.rope.dim, 64);
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_EQ(c.rope.layout, RopeLayout::kInterleavedToHalf);
  EXPECT_EQ(c.rope.scaling.type, RopeScaling::Type::kYarn);
  EXPECT_DOUBLE_EQ(c.rope.scaling.factor, 40.0);
  EXPECT_EQ(c.rope.scaling.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope.scaling.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.scaling.beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.scaling.mscale, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.scaling.mscale_all_dim, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.scaling.attention_factor, 0.0);
  EXPECT_TRUE(c.rope.scaling.truncate);

  EXPECT_EQ(c.mla_shape(), DeepSeekV3MlaShape(128));
  EXPECT_EQ(c.mla_shape().d_cache(), 576);
  // DeepseekV3Attention.scaling for this config, printed by transformers 5.24.
  EXPECT_NEAR(c.softmax_scale(), 0.1352337788608801, 1e-15);
  EXPECT_NEAR(c.softmax_scale(), HfSoftmaxScale(192, 40, 1.0), 1e-15);
  for (int64_t layer = 0; layer < 3; ++layer) EXPECT_FALSE(c.IsMoeLayer(layer)) << layer;
  for (int64_t layer = 3; layer < 61; ++layer) EXPECT_TRUE(c.IsMoeLayer(layer)) << layer;
  EXPECT_TRUE(Rope::Create(c.rope).ok());
}

TEST(ModelConfig, DeepSeekV2LitePreset) {
  StatusOr<YamlModel> m = LoadModelYaml(kPresets + "/deepseek-v2-lite.yaml");
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = m->config;
  EXPECT_TRUE(ValidateModelConfig(c).ok());
  EXPECT_EQ(c.model_type, ModelType::kDeepSeekV2);
  EXPECT_EQ(c.vocab_size, 102400);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 10944);
  EXPECT_EQ(c.moe_intermediate_size, 1408);
  EXPECT_EQ(c.num_hidden_layers, 27);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.q_lora_rank, 0);  // null: q_proj
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.n_routed_experts, 64);
  EXPECT_EQ(c.n_shared_experts, 2);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  EXPECT_EQ(c.topk_method, TopkMethod::kGreedy);
  EXPECT_EQ(c.scoring_func, ScoringFunc::kSoftmax);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 1.0);
  EXPECT_EQ(c.max_position_embeddings, 163840);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope.layout, RopeLayout::kInterleaved);
  EXPECT_EQ(c.rope.scaling.type, RopeScaling::Type::kYarn);
  EXPECT_DOUBLE_EQ(c.rope.scaling.factor, 40.0);
  EXPECT_EQ(c.rope.scaling.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope.scaling.mscale, 0.707);
  EXPECT_DOUBLE_EQ(c.rope.scaling.mscale_all_dim, 0.707);
  EXPECT_EQ(c.bos_token_id, 100000);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{100001});
  EXPECT_EQ(c.weight_dtype, DType::kBF16);
  // DeepseekV2Attention.scaling for this config, printed by transformers 5.24.
  EXPECT_NEAR(c.softmax_scale(), 0.1147213867929261, 1e-15);
  EXPECT_FALSE(c.IsMoeLayer(0));
  for (int64_t layer = 1; layer < 27; ++layer) EXPECT_TRUE(c.IsMoeLayer(layer)) << layer;
}

TEST(ModelConfig, TinyPreset) {
  StatusOr<YamlModel> m = LoadModelYaml(kPresets + "/tiny.yaml");
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = m->config;
  EXPECT_TRUE(ValidateModelConfig(c).ok());
  EXPECT_EQ(m->seed, 1234u);
  EXPECT_EQ(c.model_type, ModelType::kDeepSeekV3);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.intermediate_size, 128);
  EXPECT_EQ(c.moe_intermediate_size, 32);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.q_lora_rank, 32);
  EXPECT_EQ(c.kv_lora_rank, 32);
  EXPECT_EQ(c.qk_nope_head_dim, 16);
  EXPECT_EQ(c.qk_rope_head_dim, 8);
  EXPECT_EQ(c.v_head_dim, 16);
  EXPECT_EQ(c.n_routed_experts, 8);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.topk_method, TopkMethod::kNoauxTc);
  EXPECT_EQ(c.scoring_func, ScoringFunc::kSigmoid);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_EQ(c.rope.dim, 8);
  EXPECT_EQ(c.rope.layout, RopeLayout::kInterleavedToHalf);
  EXPECT_EQ(c.rope.scaling.type, RopeScaling::Type::kYarn);
  EXPECT_DOUBLE_EQ(c.rope.scaling.factor, 4.0);
  EXPECT_EQ(c.rope.scaling.original_max_position_embeddings, 1024);
  EXPECT_DOUBLE_EQ(c.rope.scaling.mscale, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.scaling.mscale_all_dim, 1.0);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{1});
  EXPECT_EQ(c.weight_dtype, DType::kF32);
  EXPECT_EQ(c.kv_dtype, DType::kBF16);
  // transformers 5.24, DeepseekV3Attention with this rope_scaling and qk_head_dim 24.
  EXPECT_NEAR(c.softmax_scale(), 0.2646422579642267, 1e-15);
  EXPECT_EQ(c.mla_shape(), (MlaShape{.h_q = 4, .d_latent = 32, .d_rope = 8, .d_nope = 16, .d_v = 16}));
  EXPECT_FALSE(c.IsMoeLayer(0));
  EXPECT_TRUE(c.IsMoeLayer(1));
  EXPECT_TRUE(c.IsMoeLayer(3));
}

// The release's config.json (legacy rope_scaling form, with quantization_config,
// architectures, auto_map and other fields mlarun ignores) gives exactly the
// preset: the YAML mirrors it field for field.
TEST(ModelConfig, HfDeepSeekV3ConfigJsonMatchesPreset) {
  StatusOr<ModelConfig> hf = LoadHfConfig(kConfigFixtures + "/deepseek-v3");
  ASSERT_TRUE(hf.ok()) << hf.status();
  StatusOr<YamlModel> yaml = LoadModelYaml(kPresets + "/deepseek-v3.yaml");
  ASSERT_TRUE(yaml.ok()) << yaml.status();
  EXPECT_EQ(*hf, yaml->config) << *hf << "\n" << yaml->config;
}

TEST(ModelConfig, HfDeepSeekV2LiteConfigJsonMatchesPreset) {
  StatusOr<ModelConfig> hf = LoadHfConfig(kConfigFixtures + "/deepseek-v2-lite");
  ASSERT_TRUE(hf.ok()) << hf.status();
  StatusOr<YamlModel> yaml = LoadModelYaml(kPresets + "/deepseek-v2-lite.yaml");
  ASSERT_TRUE(yaml.ok()) << yaml.status();
  EXPECT_EQ(*hf, yaml->config) << *hf << "\n" << yaml->config;
}

// The same model as transformers 5 writes it back (rope_parameters, dtype,
// rope_interleave, head_dim, qk_head_dim, id2label, ...).
TEST(ModelConfig, Transformers5FormMatchesLegacyForm) {
  StatusOr<ModelConfig> legacy = LoadHfConfig(kConfigFixtures + "/deepseek-v3");
  StatusOr<ModelConfig> v5 = LoadHfConfig(kConfigFixtures + "/deepseek-v3-transformers5");
  ASSERT_TRUE(legacy.ok()) << legacy.status();
  ASSERT_TRUE(v5.ok()) << v5.status();
  EXPECT_EQ(*legacy, *v5) << *legacy << "\n" << *v5;
}

TEST(ModelConfig, RopeParametersForm) {
  ModelConfig c = MustParseJson(R"({"model_type": "deepseek_v3", "max_position_embeddings": 8192,
      "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8,
                          "original_max_position_embeddings": 1024, "beta_fast": 16, "beta_slow": 2,
                          "mscale": 0.5, "mscale_all_dim": 0.25, "attention_factor": 1.25, "truncate": false}})");
  EXPECT_DOUBLE_EQ(c.rope.theta, 50000.0);
  EXPECT_EQ(c.rope.scaling.type, RopeScaling::Type::kYarn);
  EXPECT_DOUBLE_EQ(c.rope.scaling.factor, 8.0);
  EXPECT_EQ(c.rope.scaling.original_max_position_embeddings, 1024);
  EXPECT_DOUBLE_EQ(c.rope.scaling.beta_fast, 16.0);
  EXPECT_DOUBLE_EQ(c.rope.scaling.beta_slow, 2.0);
  EXPECT_DOUBLE_EQ(c.rope.scaling.mscale, 0.5);
  EXPECT_DOUBLE_EQ(c.rope.scaling.mscale_all_dim, 0.25);
  EXPECT_DOUBLE_EQ(c.rope.scaling.attention_factor, 1.25);
  EXPECT_FALSE(c.rope.scaling.truncate);
  EXPECT_NEAR(c.softmax_scale(), HfSoftmaxScale(192, 8, 0.25), 1e-15);

  // rope_type "default": no scaling; rope_theta inside the dict wins over the top level.
  c = MustParseJson(R"({"model_type": "deepseek_v3", "rope_theta": 1000,
      "rope_parameters": {"rope_type": "default", "rope_theta": 20000}})");
  EXPECT_EQ(c.rope.scaling, RopeScaling{});
  EXPECT_DOUBLE_EQ(c.rope.theta, 20000.0);
  EXPECT_DOUBLE_EQ(c.softmax_scale(), 1.0 / std::sqrt(192.0));

  // rope_parameters without rope_theta: the top-level field, then default_theta 10000.
  c = MustParseJson(
      R"({"model_type": "deepseek_v3", "rope_theta": 1000, "rope_parameters": {"rope_type": "default"}})");
  EXPECT_DOUBLE_EQ(c.rope.theta, 1000.0);
  c = MustParseJson(R"({"model_type": "deepseek_v3", "rope_parameters": null, "rope_scaling": null})");
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_EQ(c.rope.scaling.type, RopeScaling::Type::kNone);

  // A legacy dict may name the type with `rope_type` too.
  c = MustParseJson(R"({"model_type": "deepseek_v3", "rope_scaling": {"rope_type": "yarn", "factor": 2,
      "original_max_position_embeddings": 2048}})");
  EXPECT_EQ(c.rope.scaling.type, RopeScaling::Type::kYarn);
  EXPECT_DOUBLE_EQ(c.rope.scaling.factor, 2.0);
}

// transformers' convert_rope_params_to_dict: `rope_parameters = rope_scaling or
// rope_parameters`, so a non-empty legacy rope_scaling replaces rope_parameters
// (its rope_theta included); an empty or null one does not.
TEST(ModelConfig, LegacyRopeScalingWinsLikeTransformers) {
  ModelConfig c = MustParseJson(R"({"model_type": "deepseek_v3", "rope_theta": 5000,
      "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
      "rope_parameters": {"rope_type": "default", "rope_theta": 7000}})");
  EXPECT_EQ(c.rope.scaling.type, RopeScaling::Type::kYarn);
  EXPECT_DOUBLE_EQ(c.rope.theta, 5000.0);
  c = MustParseJson(R"({"model_type": "deepseek_v3", "rope_scaling": {},
      "rope_parameters": {"rope_type": "default", "rope_theta": 7000}})");
  EXPECT_EQ(c.rope.scaling.type, RopeScaling::Type::kNone);
  EXPECT_DOUBLE_EQ(c.rope.theta, 7000.0);
}

TEST(ModelConfig, YarnDefaults) {
  // factor absent: max_position_embeddings / original_max_position_embeddings
  // (_compute_yarn_parameters); beta_fast/beta_slow `or 32` / `or 1`; mscale and
  // mscale_all_dim absent (0).
  ModelConfig c = MustParseJson(R"({"model_type": "deepseek_v3", "max_position_embeddings": 16384,
      "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096, "beta_fast": null, "beta_slow": 0}})");
  EXPECT_DOUBLE_EQ(c.rope.scaling.factor, 4.0);
  EXPECT_DOUBLE_EQ(c.rope.scaling.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.scaling.beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.scaling.mscale, 0.0);
  EXPECT_DOUBLE_EQ(c.rope.scaling.mscale_all_dim, 0.0);
  EXPECT_TRUE(c.rope.scaling.truncate);
  // Without mscale_all_dim the softmax scale is not touched.
  EXPECT_DOUBLE_EQ(c.softmax_scale(), 1.0 / std::sqrt(192.0));
  // original_max_position_embeddings absent: max_position_embeddings
  // (standardize_rope_params), so the derived factor is 1.
  c = MustParseJson(R"({"model_type": "deepseek_v3", "max_position_embeddings": 16384,
      "rope_scaling": {"type": "yarn", "factor": 4}})");
  EXPECT_EQ(c.rope.scaling.original_max_position_embeddings, 16384);
  c = MustParseJson(R"({"model_type": "deepseek_v3", "max_position_embeddings": 16384,
      "rope_scaling": {"type": "yarn"}})");
  EXPECT_DOUBLE_EQ(c.rope.scaling.factor, 1.0);
}

// Absent fields take the dataclass defaults of transformers 5.24:
// models/deepseek_v3/configuration_deepseek_v3.py (DeepseekV3Config) and
// models/deepseek_v2/configuration_deepseek_v2.py (DeepseekV2Config); rope_theta
// from modeling_rope_utils.py (RotaryEmbeddingConfigMixin.default_theta).
TEST(ModelConfig, TransformersDefaultsV3) {
  const ModelConfig c = MustParseJson(R"({"model_type": "deepseek_v3"})");
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.intermediate_size, 18432);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.num_attention_heads, 128);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{1});
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_EQ(c.rope.layout, RopeLayout::kInterleavedToHalf);  // rope_interleave = True
  EXPECT_EQ(c.rope.scaling.type, RopeScaling::Type::kNone);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_EQ(c.weight_dtype, DType::kBF16);
  EXPECT_EQ(c.kv_dtype, DType::kBF16);
}

TEST(ModelConfig, TransformersDefaultsV2) {
  // num_experts_per_tok defaults to None there, which cannot route 64 experts.
  Status st = ParseHfConfigJson(R"({"model_type": "deepseek_v2"})", "v2.json").status();
  ExpectFieldError(st, "v2.json", "num_experts_per_tok");

  const ModelConfig c = MustParseJson(R"({"model_type": "deepseek_v2", "num_experts_per_tok": 6})");
  EXPECT_EQ(c.vocab_size, 102400);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 11008);
  EXPECT_EQ(c.num_hidden_layers, 32);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.first_k_dense_replace, 0);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.n_group, 1);     // None
  EXPECT_EQ(c.topk_group, 1);  // None
  EXPECT_EQ(c.n_routed_experts, 64);
  EXPECT_EQ(c.n_shared_experts, 2);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 1.0);
  EXPECT_EQ(c.topk_method, TopkMethod::kGreedy);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.moe_intermediate_size, 1407);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{2});
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope.layout, RopeLayout::kInterleaved);
  EXPECT_TRUE(c.IsMoeLayer(0));
}

TEST(ModelConfig, NullableFields) {
  const ModelConfig c = MustParseJson(R"({"model_type": "deepseek_v2", "num_experts_per_tok": 6,
      "q_lora_rank": null, "n_group": null, "topk_group": null, "norm_topk_prob": null,
      "bos_token_id": null, "eos_token_id": null, "torch_dtype": null, "dtype": null, "kv_dtype": null})");
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_EQ(c.weight_dtype, DType::kBF16);
  EXPECT_EQ(c.kv_dtype, DType::kBF16);
}

TEST(ModelConfig, RopeLayouts) {
  EXPECT_EQ(MustParseJson(R"({"model_type": "deepseek_v3"})").rope.layout, RopeLayout::kInterleavedToHalf);
  EXPECT_EQ(MustParseJson(R"({"model_type": "deepseek_v3", "rope_interleave": true})").rope.layout,
            RopeLayout::kInterleavedToHalf);
  EXPECT_EQ(MustParseJson(R"({"model_type": "deepseek_v3", "rope_interleave": false})").rope.layout, RopeLayout::kHalf);
  // `if self.config.rope_interleave:` -- None is falsy.
  EXPECT_EQ(MustParseJson(R"({"model_type": "deepseek_v3", "rope_interleave": null})").rope.layout, RopeLayout::kHalf);
  // V2 always rotates complex pairs; it has no rope_interleave switch.
  EXPECT_EQ(MustParseJson(R"({"model_type": "deepseek_v2", "num_experts_per_tok": 6})").rope.layout,
            RopeLayout::kInterleaved);
  EXPECT_EQ(
      MustParseJson(R"({"model_type": "deepseek_v2", "num_experts_per_tok": 6, "rope_interleave": false})").rope.layout,
      RopeLayout::kInterleaved);
}

TEST(ModelConfig, Gating) {
  // V3: sigmoid + noaux_tc whether or not the file says so.
  ModelConfig c = MustParseJson(R"({"model_type": "deepseek_v3"})");
  EXPECT_EQ(c.scoring_func, ScoringFunc::kSigmoid);
  EXPECT_EQ(c.topk_method, TopkMethod::kNoauxTc);
  c = MustParseJson(R"({"model_type": "deepseek_v3", "scoring_func": "sigmoid", "topk_method": "noaux_tc"})");
  EXPECT_EQ(c.scoring_func, ScoringFunc::kSigmoid);
  EXPECT_EQ(c.topk_method, TopkMethod::kNoauxTc);
  // V2: softmax; greedy or group-limited greedy.
  c = MustParseJson(R"({"model_type": "deepseek_v2", "num_experts_per_tok": 6, "scoring_func": "softmax"})");
  EXPECT_EQ(c.scoring_func, ScoringFunc::kSoftmax);
  EXPECT_EQ(c.topk_method, TopkMethod::kGreedy);
  // DeepSeek-V2 (236B): 160 experts in 8 groups, 3 groups kept, top-6.
  c = MustParseJson(R"({"model_type": "deepseek_v2", "n_routed_experts": 160, "num_experts_per_tok": 6,
      "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3})");
  EXPECT_EQ(c.topk_method, TopkMethod::kGroupLimitedGreedy);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 3);
  // attribute_map aliases: V2 num_experts, V3 num_local_experts.
  c = MustParseJson(R"({"model_type": "deepseek_v2", "num_experts": 16, "num_experts_per_tok": 2})");
  EXPECT_EQ(c.n_routed_experts, 16);
  c = MustParseJson(R"({"model_type": "deepseek_v3", "num_local_experts": 64})");
  EXPECT_EQ(c.n_routed_experts, 64);
}

TEST(ModelConfig, TokenIds) {
  EXPECT_EQ(MustParseJson(R"({"model_type": "deepseek_v3", "eos_token_id": 7})").eos_token_ids,
            std::vector<int64_t>{7});
  EXPECT_EQ(MustParseJson(R"({"model_type": "deepseek_v3", "eos_token_id": [1, 5, 9]})").eos_token_ids,
            (std::vector<int64_t>{1, 5, 9}));
  EXPECT_TRUE(MustParseJson(R"({"model_type": "deepseek_v3", "eos_token_id": []})").eos_token_ids.empty());
  EXPECT_EQ(MustParseJson(R"({"model_type": "deepseek_v3", "bos_token_id": 42})").bos_token_id, 42);
  const ModelConfig y = MustParseYaml("model_type: deepseek_v3\neos_token_id: [3, 4]\nbos_token_id: ~\n").config;
  EXPECT_EQ(y.eos_token_ids, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(y.bos_token_id, -1);
}

TEST(ModelConfig, Dtypes) {
  auto weight = [](const std::string& fields) {
    return MustParseJson(R"({"model_type": "deepseek_v3")" + fields + "}").weight_dtype;
  };
  EXPECT_EQ(weight(""), DType::kBF16);
  EXPECT_EQ(weight(R"(, "torch_dtype": "bfloat16")"), DType::kBF16);
  EXPECT_EQ(weight(R"(, "torch_dtype": "float32")"), DType::kF32);
  // fp16 widens exactly to fp32; bf16 would lose mantissa bits.
  EXPECT_EQ(weight(R"(, "torch_dtype": "float16")"), DType::kF32);
  EXPECT_EQ(weight(R"(, "dtype": "float32")"), DType::kF32);
  // transformers 5: dtype wins over the legacy torch_dtype.
  EXPECT_EQ(weight(R"(, "dtype": "float32", "torch_dtype": "bfloat16")"), DType::kF32);
  EXPECT_EQ(weight(R"(, "dtype": null, "torch_dtype": "float32")"), DType::kF32);

  auto kv = [](const std::string& name) {
    return MustParseJson(R"({"model_type": "deepseek_v3", "kv_dtype": ")" + name + R"("})").kv_dtype;
  };
  EXPECT_EQ(kv("bf16"), DType::kBF16);
  EXPECT_EQ(kv("fp32"), DType::kF32);
  EXPECT_EQ(kv("f32"), DType::kF32);
}

TEST(ModelConfig, MoeLayerFreq) {
  const ModelConfig c = MustParseJson(
      R"({"model_type": "deepseek_v3", "num_hidden_layers": 8, "first_k_dense_replace": 1, "moe_layer_freq": 2})");
  const std::vector<bool> expected = {false, false, true, false, true, false, true, false};
  for (int64_t layer = 0; layer < 8; ++layer) EXPECT_EQ(c.IsMoeLayer(layer), expected[layer]) << layer;
  // No routed experts: no MoE layer at all (and no routing constraints).
  const ModelConfig dense = MustParseJson(
      R"({"model_type": "deepseek_v2", "n_routed_experts": 0, "num_hidden_layers": 4, "moe_intermediate_size": 0})");
  for (int64_t layer = 0; layer < 4; ++layer) EXPECT_FALSE(dense.IsMoeLayer(layer));
}

struct BadCase {
  const char* json;  // fields after "model_type"
  const char* field;
};

TEST(ModelConfig, JsonErrorsNameFileAndField) {
  const BadCase v3_cases[] = {
      {R"("hidden_size": "big")", "hidden_size"},
      {R"("hidden_size": 3.5)", "hidden_size"},
      {R"("hidden_size": 7168.0)", "hidden_size"},
      {R"("hidden_size": null)", "hidden_size"},
      {R"("hidden_size": -5)", "hidden_size"},
      {R"("hidden_size": 18446744073709551615)", "hidden_size"},
      {R"("vocab_size": 0)", "vocab_size"},
      {R"("num_hidden_layers": 0, "first_k_dense_replace": 0)", "num_hidden_layers"},
      {R"("num_attention_heads": -1)", "num_attention_heads"},
      {R"("kv_lora_rank": 0)", "kv_lora_rank"},
      {R"("q_lora_rank": -3)", "q_lora_rank"},
      {R"("max_position_embeddings": 0)", "max_position_embeddings"},
      {R"("qk_rope_head_dim": 63)", "qk_rope_head_dim"},
      {R"("rms_norm_eps": 0)", "rms_norm_eps"},
      {R"("rms_norm_eps": "tiny")", "rms_norm_eps"},
      {R"("routed_scaling_factor": -1)", "routed_scaling_factor"},
      {R"("norm_topk_prob": 1)", "norm_topk_prob"},
      {R"("tie_word_embeddings": "no")", "tie_word_embeddings"},
      {R"("rope_interleave": 1)", "rope_interleave"},
      {R"("rope_theta": "big")", "rope_theta"},
      {R"("rope_theta": 1)", "rope_theta"},
      {R"("rope_scaling": "yarn")", "rope_scaling"},
      {R"("rope_scaling": {"type": "linear", "factor": 4})", "rope_scaling.type"},
      {R"("rope_scaling": {"type": "dynamic", "factor": 4})", "dynamic"},
      {R"("rope_parameters": {"rope_type": "llama3", "factor": 8})", "rope_parameters.rope_type"},
      {R"("rope_parameters": {"rope_type": "yarn", "factor": -1})", "rope_parameters.factor"},
      {R"("rope_parameters": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0})",
       "rope_parameters.original_max_position_embeddings"},
      {R"("rope_parameters": {"rope_type": "yarn", "factor": 4, "beta_fast": "x"})", "rope_parameters.beta_fast"},
      {R"("rope_parameters": {"rope_type": "default", "rope_theta": 0.5})", "rope_parameters.rope_theta"},
      {R"("topk_method": "greedy")", "topk_method"},
      {R"("topk_method": null)", "topk_method"},
      {R"("scoring_func": "softmax")", "scoring_func"},
      {R"("hidden_act": "gelu")", "hidden_act"},
      {R"("attention_bias": true)", "attention_bias"},
      {R"("n_group": 3)", "n_group"},
      {R"("n_group": 0)", "n_group"},
      {R"("n_group": 256)", "n_group"},  // one expert per group: noaux_tc needs top-2
      {R"("topk_group": 9)", "topk_group"},
      {R"("num_experts_per_tok": 300)", "num_experts_per_tok"},
      {R"("num_experts_per_tok": 129, "topk_group": 4)", "num_experts_per_tok"},  // > 4 groups x 32
      {R"("num_experts_per_tok": null)", "num_experts_per_tok"},
      {R"("first_k_dense_replace": 70)", "first_k_dense_replace"},
      {R"("first_k_dense_replace": -1)", "first_k_dense_replace"},
      {R"("moe_layer_freq": 0)", "moe_layer_freq"},
      {R"("n_shared_experts": -1)", "n_shared_experts"},
      {R"("eos_token_id": "x")", "eos_token_id"},
      {R"("eos_token_id": [1, "x"])", "eos_token_id[1]"},
      {R"("eos_token_id": [1, -2])", "eos_token_id"},
      {R"("bos_token_id": 1.5)", "bos_token_id"},
      {R"("torch_dtype": "int8")", "torch_dtype"},
      {R"("torch_dtype": 16)", "torch_dtype"},
      {R"("dtype": "float8_e4m3fn")", "dtype"},
      {R"("kv_dtype": "f16")", "kv_dtype"},
      {R"("kv_dtype": 2)", "kv_dtype"},
  };
  for (const BadCase& bad : v3_cases) {
    const std::string text = std::string(R"({"model_type": "deepseek_v3", )") + bad.json + "}";
    SCOPED_TRACE(text);
    ExpectFieldError(ParseHfConfigJson(text, "/models/x/config.json").status(), "/models/x/config.json", bad.field);
  }
  const BadCase v2_cases[] = {
      {R"("num_experts_per_tok": 6, "topk_method": "noaux_tc")", "topk_method"},
      {R"("num_experts_per_tok": 6, "topk_method": "best")", "topk_method"},
      {R"("num_experts_per_tok": 6, "scoring_func": "sigmoid")", "scoring_func"},
      // 8 groups of 8, 1 kept: top-9 cannot be met.
      {R"("num_experts_per_tok": 9, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 1)",
       "num_experts_per_tok"},
      {R"("num_experts_per_tok": 6, "n_group": 5, "topk_method": "group_limited_greedy")", "n_group"},
      {R"("num_experts_per_tok": 6, "moe_intermediate_size": 0)", "moe_intermediate_size"},
  };
  for (const BadCase& bad : v2_cases) {
    const std::string text = std::string(R"({"model_type": "deepseek_v2", )") + bad.json + "}";
    SCOPED_TRACE(text);
    ExpectFieldError(ParseHfConfigJson(text, "v2-config.json").status(), "v2-config.json", bad.field);
  }
}

TEST(ModelConfig, ModelTypeErrors) {
  ExpectFieldError(ParseHfConfigJson(R"({"model_type": "llama"})", "a.json").status(), "a.json", "model_type");
  ExpectFieldError(ParseHfConfigJson(R"({"model_type": "llama"})", "a.json").status(), "a.json", "llama");
  ExpectFieldError(ParseHfConfigJson(R"({"hidden_size": 64})", "a.json").status(), "a.json", "model_type");
  ExpectFieldError(ParseHfConfigJson(R"({"model_type": 3})", "a.json").status(), "a.json", "model_type");
  ExpectFieldError(ParseModelYaml("model_type: mixtral\n", "m.yaml").status(), "m.yaml", "model_type");
  // The message lists every accepted model_type.
  for (const char* text : {R"({"model_type": "llama"})", R"({"hidden_size": 64})"}) {
    const std::string message = ParseHfConfigJson(text, "a.json").status().message();
    for (const char* type : {"'deepseek_v3'", "'deepseek_v32'", "'deepseek_v2'"})
      EXPECT_NE(message.find(type), std::string::npos) << type << " not in " << message;
  }
}

TEST(ModelConfig, MalformedFiles) {
  for (const char* text : {"{", "", "{\"model_type\": \"deepseek_v3\",}", "[1, 2]", "42", "{\"a\": nan}"}) {
    SCOPED_TRACE(text);
    Status st = ParseHfConfigJson(text, "broken.json").status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("broken.json"), std::string::npos) << st;
  }
  for (const char* text : {"model_type: [deepseek_v3", "a: b: c", "- 1\n- 2\n", "", "just text", "{a: 1"}) {
    SCOPED_TRACE(text);
    Status st = ParseModelYaml(text, "broken.yaml").status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("broken.yaml"), std::string::npos) << st;
  }
}

TEST(ModelConfig, YamlErrorsNameFileAndField) {
  const BadCase cases[] = {
      {"hidden_size: big", "hidden_size"},
      {"hidden_size: '7168'", "hidden_size"},  // quoted: a string, as in JSON
      {"hidden_size: 3.5", "hidden_size"},
      {"hidden_size: -5", "hidden_size"},
      {"hidden_size: [1, 2]", "hidden_size"},
      {"hidden_size: {a: 1}", "hidden_size"},
      {"norm_topk_prob: yes", "norm_topk_prob"},  // YAML 1.2: only true/false
      {"rms_norm_eps: .inf", "rms_norm_eps"},
      {"rope_scaling: {type: ntk, factor: 2}", "rope_scaling.type"},
      {"hidden_act: relu", "hidden_act"},
      {"n_group: 3", "n_group"},
      {"seed: -1", "seed"},
      {"seed: 1.5", "seed"},
      {"seed: abc", "seed"},
  };
  for (const BadCase& bad : cases) {
    const std::string text = std::string("model_type: deepseek_v3\n") + bad.json + "\n";
    SCOPED_TRACE(text);
    ExpectFieldError(ParseModelYaml(text, "configs/models/bad.yaml").status(), "configs/models/bad.yaml", bad.field);
  }
}

TEST(ModelConfig, MissingFiles) {
  EXPECT_EQ(LoadHfConfig("/nonexistent/model").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(LoadModelYaml("/nonexistent/model.yaml").status().code(), StatusCode::kNotFound);
  EXPECT_NE(LoadHfConfig("/nonexistent/model").status().message().find("/nonexistent/model/config.json"),
            std::string::npos);
}

// One model written both ways parses to the same ModelConfig.
TEST(ModelConfig, YamlAndJsonAgree) {
  const std::string json = R"({
    "model_type": "deepseek_v2", "vocab_size": 1000, "hidden_size": 96, "intermediate_size": 192,
    "moe_intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 6, "q_lora_rank": null,
    "kv_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 10,
    "n_routed_experts": 12, "n_shared_experts": 0, "num_experts_per_tok": 3,
    "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "norm_topk_prob": true,
    "routed_scaling_factor": 16.0, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 500000,
    "rope_scaling": {"type": "yarn", "factor": 2.5, "original_max_position_embeddings": 512, "mscale": 0.707,
                     "mscale_all_dim": 0.707},
    "bos_token_id": 5, "eos_token_id": [6, 7], "tie_word_embeddings": true, "torch_dtype": "float32",
    "kv_dtype": "fp32", "seed": 9})";
  const std::string yaml = R"(# same model, YAML
model_type: deepseek_v2
vocab_size: 1000
hidden_size: 96
intermediate_size: 192
moe_intermediate_size: 48
num_hidden_layers: 3
num_attention_heads: 6
q_lora_rank: ~
kv_lora_rank: 24
qk_nope_head_dim: 12
qk_rope_head_dim: 4
v_head_dim: 10
n_routed_experts: 0xc
n_shared_experts: 0
num_experts_per_tok: 3
topk_method: "group_limited_greedy"
n_group: 4
topk_group: 2
norm_topk_prob: True
routed_scaling_factor: 16
first_k_dense_replace: 1
moe_layer_freq: 1
rms_norm_eps: 1e-5
max_position_embeddings: 2048
rope_theta: 5.0e+5
rope_scaling:
  type: yarn
  factor: 2.5
  original_max_position_embeddings: 512
  mscale: 0.707
  mscale_all_dim: 0.707
bos_token_id: 5
eos_token_id:
  - 6
  - 7
tie_word_embeddings: true
torch_dtype: float32
kv_dtype: fp32
seed: 9
)";
  const ModelConfig from_json = MustParseJson(json);
  const YamlModel from_yaml = MustParseYaml(yaml);
  EXPECT_EQ(from_json, from_yaml.config) << from_json << "\n" << from_yaml.config;
  EXPECT_EQ(from_yaml.seed, 9u);
  EXPECT_EQ(from_json.n_routed_experts, 12);
  EXPECT_EQ(from_json.kv_dtype, DType::kF32);
  EXPECT_TRUE(from_json.tie_word_embeddings);
  // A changed field breaks equality.
  ModelConfig other = from_json;
  other.rope.scaling.mscale = 1.0;
  EXPECT_FALSE(other == from_json);
}

// DeepSeek-V3.2's config.json: the V3 architecture plus the lightning indexer
// of DeepSeek Sparse Attention (DeepseekV32Config, transformers 5.x).
const char kDeepSeekV32Json[] = R"({
  "model_type": "deepseek_v32", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
  "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
  "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
  "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
  "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true, "routed_scaling_factor": 2.5,
  "first_k_dense_replace": 3, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048})";

// kDeepSeekV32Json with its model_type replaced.
std::string WithModelType(const std::string& type) {
  std::string text = kDeepSeekV32Json;
  const std::string from = R"("model_type": "deepseek_v32")";
  text.replace(text.find(from), from.size(), R"("model_type": ")" + type + R"(")");
  return text;
}

TEST(ModelConfig, DeepSeekV32ConfigJson) {
  const ModelConfig c = MustParseJson(kDeepSeekV32Json);
  EXPECT_EQ(c.model_type, ModelType::kDeepSeekV3);
  EXPECT_TRUE(c.has_indexer());
  EXPECT_EQ(c.index_n_heads, 64);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_topk, 2048);
  // The V3 fields parse as in a deepseek_v3 config (compared whole below).
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.topk_method, TopkMethod::kNoauxTc);
  EXPECT_TRUE(ValidateModelConfig(c).ok());

  // The same text as deepseek_v3: the index_* keys are ignored there, and
  // everything else parses identically.
  const ModelConfig v3 = MustParseJson(WithModelType("deepseek_v3"));
  EXPECT_FALSE(v3.has_indexer());
  EXPECT_EQ(v3.index_n_heads, 0);
  EXPECT_EQ(v3.index_head_dim, 0);
  EXPECT_EQ(v3.index_topk, 0);
  ModelConfig without_indexer = c;
  without_indexer.index_n_heads = without_indexer.index_head_dim = without_indexer.index_topk = 0;
  EXPECT_EQ(without_indexer, v3) << without_indexer << "\n" << v3;
  EXPECT_FALSE(c == v3);  // the index fields take part in equality

  // YAML goes through the same parser.
  const ModelConfig y =
      MustParseYaml("model_type: deepseek_v32\nindex_n_heads: 16\nindex_head_dim: 64\nindex_topk: 512\n").config;
  EXPECT_TRUE(y.has_indexer());
  EXPECT_EQ(y.index_n_heads, 16);
  EXPECT_EQ(y.index_head_dim, 64);
  EXPECT_EQ(y.index_topk, 512);
}

// DeepseekV32Config: index_head_dim=128, index_n_heads=64, index_topk=2048;
// the rest are DeepseekV3Config's defaults.
TEST(ModelConfig, TransformersDefaultsV32) {
  const ModelConfig c = MustParseJson(R"({"model_type": "deepseek_v32"})");
  EXPECT_TRUE(c.has_indexer());
  EXPECT_EQ(c.index_n_heads, 64);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_topk, 2048);
  ModelConfig without_indexer = c;
  without_indexer.index_n_heads = without_indexer.index_head_dim = without_indexer.index_topk = 0;
  EXPECT_EQ(without_indexer, MustParseJson(R"({"model_type": "deepseek_v3"})"));
  // One key given, the others defaulted.
  const ModelConfig partial = MustParseJson(R"({"model_type": "deepseek_v32", "index_topk": 1024})");
  EXPECT_EQ(partial.index_n_heads, 64);
  EXPECT_EQ(partial.index_head_dim, 128);
  EXPECT_EQ(partial.index_topk, 1024);
  EXPECT_TRUE(MustParseYaml("model_type: deepseek_v32\n").config.has_indexer());
}

TEST(ModelConfig, DeepSeekV32ErrorsNameFileAndField) {
  const BadCase cases[] = {
      {R"("index_n_heads": "64")", "index_n_heads"},
      {R"("index_n_heads": 0)", "index_n_heads"},
      {R"("index_n_heads": -1)", "index_n_heads"},
      {R"("index_n_heads": null)", "index_n_heads"},
      {R"("index_head_dim": "wide")", "index_head_dim"},
      {R"("index_head_dim": 0)", "index_head_dim"},
      {R"("index_head_dim": 64.5)", "index_head_dim"},
      {R"("index_topk": "all")", "index_topk"},
      {R"("index_topk": 0)", "index_topk"},
      // Everything else is checked as for deepseek_v3.
      {R"("scoring_func": "softmax")", "scoring_func"},
      {R"("topk_method": "greedy")", "topk_method"},
  };
  for (const BadCase& bad : cases) {
    const std::string text = std::string(R"({"model_type": "deepseek_v32", )") + bad.json + "}";
    SCOPED_TRACE(text);
    ExpectFieldError(ParseHfConfigJson(text, "/models/v32/config.json").status(), "/models/v32/config.json", bad.field);
  }
  ExpectFieldError(ParseModelYaml("model_type: deepseek_v32\nindex_topk: 0\n", "v32.yaml").status(), "v32.yaml",
                   "index_topk");
  ExpectFieldError(ParseModelYaml("model_type: deepseek_v32\nindex_head_dim: '128'\n", "v32.yaml").status(), "v32.yaml",
                   "index_head_dim");
}

TEST(ModelConfig, IndexKeysIgnoredOutsideV32) {
  const ModelConfig v3 =
      MustParseJson(R"({"model_type": "deepseek_v3", "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048})");
  EXPECT_FALSE(v3.has_indexer());
  EXPECT_EQ(v3.index_n_heads, 0);
  EXPECT_EQ(v3.index_head_dim, 0);
  EXPECT_EQ(v3.index_topk, 0);
  EXPECT_EQ(v3, MustParseJson(R"({"model_type": "deepseek_v3"})"));
  // Not even read there, so a value that deepseek_v32 would refuse is no error.
  EXPECT_FALSE(MustParseJson(R"({"model_type": "deepseek_v3", "index_n_heads": "x", "index_topk": 0})").has_indexer());
  EXPECT_FALSE(
      MustParseJson(R"({"model_type": "deepseek_v2", "num_experts_per_tok": 6, "index_n_heads": 64})").has_indexer());
  EXPECT_FALSE(MustParseYaml("model_type: deepseek_v3\nindex_n_heads: 64\n").config.has_indexer());
}

TEST(ModelConfig, ValidateCodeBuiltConfigs) {
  ModelConfig c = MustParseJson(R"({"model_type": "deepseek_v3"})");
  ASSERT_TRUE(ValidateModelConfig(c).ok());
  ModelConfig bad = c;
  bad.rope.dim = 32;
  EXPECT_NE(ValidateModelConfig(bad).message().find("qk_rope_head_dim"), std::string::npos);
  bad = c;
  bad.scoring_func = ScoringFunc::kSoftmax;
  EXPECT_NE(ValidateModelConfig(bad).message().find("scoring_func"), std::string::npos);
  bad = c;
  bad.weight_dtype = DType::kF16;
  EXPECT_NE(ValidateModelConfig(bad).message().find("weight_dtype"), std::string::npos);
  bad = c;
  bad.kv_dtype = DType::kF8E4M3;
  EXPECT_NE(ValidateModelConfig(bad).message().find("kv_dtype"), std::string::npos);
  bad = c;
  bad.rope.scaling.type = RopeScaling::Type::kYarn;
  bad.rope.scaling.factor = 0.0;
  EXPECT_NE(ValidateModelConfig(bad).message().find("factor"), std::string::npos);
  bad = c;
  bad.index_n_heads = 64;  // an indexer without a key width or token budget
  EXPECT_NE(ValidateModelConfig(bad).message().find("index_head_dim"), std::string::npos);
  bad.index_head_dim = 128;
  EXPECT_NE(ValidateModelConfig(bad).message().find("index_topk"), std::string::npos);
  bad.index_topk = 2048;
  EXPECT_TRUE(ValidateModelConfig(bad).ok());
  bad.index_n_heads = -1;
  EXPECT_NE(ValidateModelConfig(bad).message().find("index_n_heads"), std::string::npos);
  bad = c;
  bad.moe_layer_freq = 0;
  EXPECT_EQ(ValidateModelConfig(bad).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(bad.IsMoeLayer(4));  // no division by zero
}

TEST(ModelConfig, PrintsOneLine) {
  StatusOr<YamlModel> m = LoadModelYaml(kPresets + "/deepseek-v3.yaml");
  ASSERT_TRUE(m.ok()) << m.status();
  std::ostringstream os;
  os << m->config;
  const std::string s = os.str();
  EXPECT_EQ(s.find('\n'), std::string::npos) << s;
  for (const char* part : {"deepseek_v3", "hidden=7168", "layers=61", "kv_lora=512", "routed=256", "noaux_tc",
                           "sigmoid", "yarn", "factor=40", "eos=[1]", "weights=bf16", "kv=bf16"})
    EXPECT_NE(s.find(part), std::string::npos) << part << " not in " << s;
  EXPECT_EQ(s.find("indexer"), std::string::npos) << s;
  std::ostringstream v32;
  v32 << MustParseJson(kDeepSeekV32Json);
  EXPECT_NE(v32.str().find("deepseek_v3 "), std::string::npos) << v32.str();
  EXPECT_NE(v32.str().find("indexer{heads=64 dim=128 topk=2048}"), std::string::npos) << v32.str();
}

}  // namespace
}  // namespace mlarun

namespace mlarun {
namespace {

// Sizes whose weights cannot exist are refused at parse time, naming the
// fields, the tensor and its bytes, before anything is allocated.
TEST(ModelConfigSizes, TensorsBeyondTheLimitAreRefused) {
  struct Case {
    std::string json, fields, bytes;
  };
  const Case cases[] = {
      {R"("vocab_size": 1099511627776, "hidden_size": 64)", "vocab_size x hidden_size",
       "140737488355328 bytes"},  // bf16
      {R"("hidden_size": 4611686018427387904)", "vocab_size x hidden_size", "bytes"},
      {R"("moe_intermediate_size": 4611686018427387904, "hidden_size": 4611686018427387904)",
       "vocab_size x hidden_size", "bytes"},
      {R"("num_attention_heads": 4194304, "v_head_dim": 4194304)", "num_attention_heads", "bytes"},
      {R"("kv_lora_rank": 9223372036854775807)", "kv_lora_rank", "bytes"},
  };
  for (const Case& c : cases) {
    const std::string text = std::string(R"({"model_type": "deepseek_v3", )") + c.json + "}";
    SCOPED_TRACE(text);
    const Status st = ParseHfConfigJson(text, "/m/config.json").status();
    ExpectFieldError(st, "/m/config.json", c.fields);
    EXPECT_NE(st.message().find(c.bytes), std::string::npos) << st;
    EXPECT_NE(st.message().find("2^40"), std::string::npos) << st;
  }
}

TEST(ModelConfigSizes, CountsAndTotalsBeyondTheLimitAreRefused) {
  const std::pair<std::string, std::string> cases[] = {
      {R"("num_hidden_layers": 100000000000)", "num_hidden_layers must be at most 65536"},
      {R"("num_nextn_predict_layers": 70000)", "num_nextn_predict_layers must be at most 65536"},
      {R"("n_routed_experts": 4294967296, "n_group": 1, "topk_group": 1)", "n_routed_experts must be at most 65536"},
      {R"("n_shared_experts": 9223372036854775807)", "n_shared_experts must be at most 65536"},
      // Every tensor within 2^40 elements, but 65536 layers of 65536 experts of them.
      {R"("num_hidden_layers": 65536, "first_k_dense_replace": 0, "n_routed_experts": 65536, "n_group": 1,
          "topk_group": 1, "moe_intermediate_size": 1048576, "hidden_size": 1048576, "vocab_size": 16)",
       "bytes (2^60)"},
      {R"("hidden_size": -1)", "hidden_size must be positive"},
      {R"("vocab_size": 0)", "vocab_size must be positive"},
  };
  for (const auto& [json, expect] : cases) {
    const std::string text = std::string(R"({"model_type": "deepseek_v3", )") + json + "}";
    SCOPED_TRACE(text);
    const Status st = ParseHfConfigJson(text, "c.json").status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(expect), std::string::npos) << st;
  }
  // YAML goes through the same checks.
  const Status st =
      ParseModelYaml("model_type: deepseek_v3\nvocab_size: 1099511627776\nhidden_size: 64\n", "m.yaml").status();
  ExpectFieldError(st, "m.yaml", "vocab_size x hidden_size");
}

TEST(ModelConfigSizes, RealModelsAreWithinTheLimits) {
  for (const char* preset : {"/deepseek-v3.yaml", "/deepseek-v2-lite.yaml", "/tiny.yaml"}) {
    SCOPED_TRACE(preset);
    StatusOr<YamlModel> m = LoadModelYaml(kPresets + preset);
    ASSERT_TRUE(m.ok()) << m.status();
    double total = 0;
    for (const WeightTensorSize& t : WeightTensorSizes(m->config)) total += t.total_bytes();
    EXPECT_GT(total, 0);
  }
  // DeepSeek-V3: 1.3 TB of bf16 weights, all of them matrices but the norms.
  StatusOr<YamlModel> v3 = LoadModelYaml(kPresets + "/deepseek-v3.yaml");
  ASSERT_TRUE(v3.ok());
  double total = 0;
  for (const WeightTensorSize& t : WeightTensorSizes(v3->config)) total += t.total_bytes();
  EXPECT_GT(total, 1.2e12);
  EXPECT_LT(total, 1.5e12);
  EXPECT_TRUE(MustParseJson(R"({"model_type": "deepseek_v3"})").num_hidden_layers == 61);
}

// YAML model files are mlarun's own format: an unknown key is an error naming
// it (with the closest known key); config.json keeps ignoring foreign keys.
TEST(ModelConfigYamlKeys, UnknownKeysAreErrors) {
  const std::pair<std::string, std::string> cases[] = {
      {"hiden_size: 64", "hiden_size: unknown key (did you mean 'hidden_size'?)"},
      {"architectures: [DeepseekV3ForCausalLM]", "architectures: unknown key"},
      {"rope_scaling: {type: yarn, factr: 4}", "rope_scaling.factr: unknown key (did you mean 'rope_scaling.factor'?)"},
      {"rope_parameters: {rope_type: default, extra: 1}", "rope_parameters.extra: unknown key"},
  };
  for (const auto& [line, expect] : cases) {
    const std::string text = "model_type: deepseek_v3\n" + line + "\n";
    SCOPED_TRACE(text);
    const Status st = ParseModelYaml(text, "models/x.yaml").status();
    ExpectFieldError(st, "models/x.yaml", expect);
  }
  EXPECT_TRUE(MustParseJson(R"({"model_type": "deepseek_v3", "architectures": ["X"], "hiden_size": 1})").hidden_size ==
              7168);
  // Every key the parser reads is accepted, including the aliases and the
  // keys of other model types.
  MustParseYaml(
      "model_type: deepseek_v3\nnum_local_experts: 16\nrope_interleave: false\ntorch_dtype: bfloat16\n"
      "index_n_heads: 4\nseed: 3\nrope_parameters: {rope_type: default, rope_theta: 10000}\n");
  MustParseYaml(
      "model_type: deepseek_v2\nnum_experts: 16\nnum_experts_per_tok: 2\nrope_scaling: {type: yarn, "
      "factor: 2, original_max_position_embeddings: 1024, beta_fast: 32, beta_slow: 1, mscale: 1, "
      "mscale_all_dim: 1, attention_factor: 1, truncate: true}\n");
}

}  // namespace
}  // namespace mlarun
