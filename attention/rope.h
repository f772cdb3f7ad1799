// Rotary position embedding for the decoupled rope slice of MLA, with YaRN
// context extension, following the Hugging Face DeepSeek-V2/V3 semantics.
//
// YaRN brings two separate corrections (both used by V2 and V3):
//  * the rope frequencies are blended between interpolated (pos / factor) and
//    extrapolated values over a ramp set by beta_fast/beta_slow, and cos/sin are
//    multiplied by attention_factor = mscale(f, mscale) / mscale(f, mscale_all_dim);
//  * the softmax scale is multiplied by mscale(f, mscale_all_dim)^2
//    (MlaSoftmaxScale), where mscale(f, m) = 0.1 * m * ln(f) + 1 for f > 1.
#pragma once

#include <cstdint>
#include <ostream>
#include <vector>

#include "base/status.h"

namespace mlarun {

// How the rope slice's elements pair up. Values are frozen (configs).
enum class RopeLayout : uint8_t {
  // DeepSeek-V3 (HF apply_rotary_pos_emb_interleave, rope_interleave=true):
  // input pairs (x0,x1), (x2,x3), ...; output de-interleaved:
  // out[j] = x[2j] c_j - x[2j+1] s_j,  out[j + d/2] = x[2j+1] c_j + x[2j] s_j.
  kInterleavedToHalf = 0,
  // DeepSeek-V2 (HF apply_rotary_emb, complex pairs): output stays interleaved.
  kInterleaved = 1,
  // rotate_half (GPT-NeoX): pairs (x_j, x_{j+d/2}).
  kHalf = 2,
};

struct RopeScaling {
  enum class Type : uint8_t { kNone = 0, kYarn = 1 };
  Type type = Type::kNone;
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;            // 0 means absent
  double mscale_all_dim = 0.0;    // 0 means absent
  double attention_factor = 0.0;  // 0: derived from factor/mscale/mscale_all_dim as HF does
  bool truncate = true;

  friend bool operator==(const RopeScaling&, const RopeScaling&) = default;
};

// The widest rotary slice Rope accepts (DeepSeek's is 64): its tables are
// built when a config is validated, so a width from a bad config.json must
// not become an allocation of that size.
inline constexpr int64_t kMaxRopeDim = int64_t{1} << 16;

struct RopeConfig {
  int64_t dim = 64;        // qk_rope_head_dim; even
  double theta = 10000.0;  // rope_theta
  RopeLayout layout = RopeLayout::kInterleavedToHalf;
  RopeScaling scaling;

  friend bool operator==(const RopeConfig&, const RopeConfig&) = default;
};
std::ostream& operator<<(std::ostream& os, const RopeConfig& c);

// mscale(f, m) = 0.1 * m * ln(f) + 1 for f > 1, else 1.
double YarnMscale(double factor, double m);

// 1/sqrt(d_nope + d_rope), times mscale(factor, mscale_all_dim)^2 under YaRN
// with mscale_all_dim set. Never 1/sqrt(d_latent + d_rope).
double MlaSoftmaxScale(int64_t d_nope, int64_t d_rope, const RopeScaling& scaling);

// cos/sin of `half` pairs at `position` from the inverse frequencies, times
// attention_factor: the angle in fp32 (position x inv_freq, as HF), its cos and
// sin in double. What Rope::CosSin and the CPU RoPE op compute.
void RopeCosSin(const float* inv_freq, int64_t half, float attention_factor, int64_t position, float* cos, float* sin);

class Rope {
 public:
  // Errors name the bad field (odd dim, non-positive theta or factor, ...).
  static StatusOr<Rope> Create(const RopeConfig& config);

  const RopeConfig& config() const { return config_; }
  // Per-pair inverse frequencies [dim/2], fp32 as HF computes them.
  const std::vector<float>& inv_freq() const { return inv_freq_; }
  // Multiplier on cos/sin (1 without YaRN).
  float attention_factor() const { return attention_factor_; }

  // cos/sin for one position: [dim/2] each, already times attention_factor.
  void CosSin(int64_t position, float* cos, float* sin) const;

  // Applying it to vectors is the RoPE op (runtime/ops/rope.h), which reads
  // these tables.

 private:
  Rope(const RopeConfig& c, std::vector<float> inv_freq, float attention_factor)
      : config_(c), inv_freq_(std::move(inv_freq)), attention_factor_(attention_factor) {}
  RopeConfig config_;
  std::vector<float> inv_freq_;
  float attention_factor_ = 1.f;
};

}  // namespace mlarun
