// DeepSeek-V3's memory per rank of an 8-rank layout, by hand from the shapes
// of the release (configs/models/deepseek-v3.yaml), for the memory tests to
// pin the planner's and `mlarun memory`'s numbers against. No mlarun code is
// used: every shape is written out here.
//
//   hidden 7168, vocab 129280, 61 layers: the first 3 dense (intermediate
//   18432), 58 MoE (256 routed experts and 1 shared, each of intermediate
//   2048, a router [256, 7168] and a score bias [256] in fp32);
//   128 heads: q_lora 1536, kv_lora 512, rope 64, nope 128, v 128.
//   Projections in bf16 (2 B) or fp8 (1 B per element plus one fp32 scale
//   per 128 x 128 block, partial blocks counted whole, as in the release);
//   W_UK / W_UV in the bf16 cache dtype; embeddings and lm_head bf16; norms fp32.
//   Over the 8 ranks the MLPs are split 8 ways: whole experts (32 per rank),
//   the shared expert's and the dense MLP's intermediate dimension.
//   Cache: (512 + 64) x 2 B per layer per token; blocks of 64 tokens.
//   Prefill workspace: 65,536 rows of the latent (576) and this rank's heads'
//   keys (192) and values (128), bf16.
#pragma once

#include <cstdint>

namespace mlarun::v3_by_hand {

inline constexpr int64_t kHidden = 7168, kVocab = 129280, kLayers = 61, kDenseLayers = 3, kMoeLayers = 58;
inline constexpr int64_t kWorld = 8, kBlockTokens = 64;

// One projection [rows, cols].
constexpr int64_t Proj(int64_t rows, int64_t cols, bool fp8) {
  if (!fp8) return rows * cols * 2;
  return rows * cols + ((rows + 127) / 128) * ((cols + 127) / 128) * 4;
}
// gate [inter, hidden], up [inter, hidden], down [hidden, inter].
constexpr int64_t Mlp(int64_t inter, bool fp8) { return 2 * Proj(inter, kHidden, fp8) + Proj(kHidden, inter, fp8); }

struct Rank {
  int64_t attention_replicated = 0, attention_split = 0, dense_mlp = 0, moe = 0, embedding_and_head = 0;
  int64_t workspace = 0;
  constexpr int64_t weights() const {
    return attention_replicated + attention_split + dense_mlp + moe + embedding_and_head;
  }
};

// One rank of dp x attn_tp = 8 (moe split by expert).
constexpr Rank ByHand(int64_t attn_tp, bool fp8) {
  const int64_t heads = 128 / attn_tp;
  Rank r;
  // q_a [1536, 7168] and kv_a [576, 7168]; norms q_a 1536, kv_a 512, input and post-attention 7168 each.
  r.attention_replicated =
      kLayers * (Proj(1536, kHidden, fp8) + Proj(576, kHidden, fp8) + (1536 + 512 + 2 * kHidden) * 4);
  // q_b [heads x 192, 1536], W_UK and W_UV [heads x 128 x 512] each (bf16), o [7168, heads x 128].
  r.attention_split =
      kLayers * (Proj(heads * 192, 1536, fp8) + heads * 2 * 128 * 512 * 2 + Proj(kHidden, heads * 128, fp8));
  r.dense_mlp = kDenseLayers * Mlp(18432 / kWorld, fp8);
  r.moe = kMoeLayers * ((256 / kWorld) * Mlp(2048, fp8) + Mlp(2048 / kWorld, fp8) + 256 * kHidden * 4 + 256 * 4);
  // embed_tokens and lm_head [129280, 7168] bf16, the final norm fp32.
  r.embedding_and_head = 2 * kVocab * kHidden * 2 + kHidden * 4;
  r.workspace = int64_t{65536} * (576 + heads * (192 + 128)) * 2;
  return r;
}

inline constexpr int64_t kCacheBytesPerToken = kLayers * (512 + 64) * 2;  // 70,272
inline constexpr int64_t kBlockBytes = kBlockTokens * kCacheBytesPerToken;

// The cache that fits beside `r` in `memory` bytes per rank.
struct Cache {
  int64_t budget = 0, blocks = 0, tokens = 0;
};
constexpr Cache CacheOf(const Rank& r, int64_t memory) {
  Cache c;
  c.budget = memory - r.weights() - r.workspace;
  c.blocks = c.budget > 0 ? c.budget / kBlockBytes : 0;
  c.tokens = c.blocks * kBlockTokens;
  return c;
}

}  // namespace mlarun::v3_by_hand
