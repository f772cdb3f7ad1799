#include "attention/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

namespace mlarun {

std::ostream& operator<<(std::ostream& os, const RopeConfig& c) {
  os << "rope{dim=" << c.dim << " theta=" << c.theta << " layout=" << static_cast<int>(c.layout);
  if (c.scaling.type == RopeScaling::Type::kYarn)
    os << " yarn{factor=" << c.scaling.factor << " orig_max=" << c.scaling.original_max_position_embeddings
       << " beta_fast=" << c.scaling.beta_fast << " beta_slow=" << c.scaling.beta_slow << " mscale=" << c.scaling.mscale
       << " mscale_all_dim=" << c.scaling.mscale_all_dim << "}";
  return os << "}";
}

double YarnMscale(double factor, double m) {
  if (factor <= 1.0) return 1.0;
  return 0.1 * m * std::log(factor) + 1.0;
}

double MlaSoftmaxScale(int64_t d_nope, int64_t d_rope, const RopeScaling& s) {
  double scale = 1.0 / std::sqrt(static_cast<double>(d_nope + d_rope));
  if (s.type == RopeScaling::Type::kYarn && s.mscale_all_dim != 0.0) {
    const double m = YarnMscale(s.factor, s.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

StatusOr<Rope> Rope::Create(const RopeConfig& c) {
  if (c.dim <= 0 || c.dim % 2 != 0) return InvalidArgumentError("rope: dim must be positive and even, got ", c.dim);
  if (c.dim > kMaxRopeDim) return InvalidArgumentError("rope: dim must be at most ", kMaxRopeDim, ", got ", c.dim);
  if (!(c.theta > 1.0)) return InvalidArgumentError("rope: theta must be > 1, got ", c.theta);
  if (c.layout != RopeLayout::kInterleavedToHalf && c.layout != RopeLayout::kInterleaved &&
      c.layout != RopeLayout::kHalf)
    return InvalidArgumentError("rope: unknown layout ", static_cast<int>(c.layout));
  const int64_t half = c.dim / 2;
  // HF: pos_freqs = theta ** (arange(0, dim, 2).float() / dim) in fp32, inv = 1 / pos_freqs.
  std::vector<float> pos_freqs(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(c.dim);
    pos_freqs[static_cast<size_t>(j)] = static_cast<float>(std::pow(c.theta, static_cast<double>(exponent)));
  }
  std::vector<float> inv(static_cast<size_t>(half));
  float attention_factor = 1.f;
  if (c.scaling.type == RopeScaling::Type::kNone) {
    for (int64_t j = 0; j < half; ++j) inv[static_cast<size_t>(j)] = 1.f / pos_freqs[static_cast<size_t>(j)];
  } else if (c.scaling.type == RopeScaling::Type::kYarn) {
    const RopeScaling& s = c.scaling;
    if (!(s.factor > 0.0)) return InvalidArgumentError("rope: yarn factor must be positive, got ", s.factor);
    if (s.original_max_position_embeddings <= 0)
      return InvalidArgumentError("rope: yarn original_max_position_embeddings must be positive, got ",
                                  s.original_max_position_embeddings);
    if (!(s.beta_fast > 0.0) || !(s.beta_slow > 0.0))
      return InvalidArgumentError("rope: yarn beta_fast and beta_slow must be positive, got ", s.beta_fast, " and ",
                                  s.beta_slow);
    if (s.attention_factor != 0.0) {
      attention_factor = static_cast<float>(s.attention_factor);
    } else if (s.mscale != 0.0 && s.mscale_all_dim != 0.0) {
      attention_factor = static_cast<float>(YarnMscale(s.factor, s.mscale) / YarnMscale(s.factor, s.mscale_all_dim));
    } else {
      attention_factor = static_cast<float>(YarnMscale(s.factor, 1.0));
    }
    // Correction range in python floats (double), as HF.
    auto correction_dim = [&](double rotations) {
      return (static_cast<double>(c.dim) *
              std::log(static_cast<double>(s.original_max_position_embeddings) / (rotations * 2 * std::numbers::pi))) /
             (2 * std::log(c.theta));
    };
    double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
    if (s.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(c.dim - 1));
    if (low == high) high += 0.001;
    const float lo = static_cast<float>(low), span = static_cast<float>(high - low);
    const float factor = static_cast<float>(s.factor);
    for (int64_t j = 0; j < half; ++j) {
      const float pf = pos_freqs[static_cast<size_t>(j)];
      const float extrapolation = 1.f / pf;
      const float interpolation = 1.f / (factor * pf);
      const float ramp = std::clamp((static_cast<float>(j) - lo) / span, 0.f, 1.f);
      const float extrapolation_factor = 1.f - ramp;
      inv[static_cast<size_t>(j)] = interpolation * (1.f - extrapolation_factor) + extrapolation * extrapolation_factor;
    }
  } else {
    return InvalidArgumentError("rope: unknown scaling type ", static_cast<int>(c.scaling.type));
  }
  return Rope(c, std::move(inv), attention_factor);
}

void RopeCosSin(const float* inv_freq, int64_t half, float attention_factor, int64_t position, float* cos, float* sin) {
  const float p = static_cast<float>(position);
  for (int64_t j = 0; j < half; ++j) {
    const float angle = p * inv_freq[j];  // fp32 product, as HF
    cos[j] = static_cast<float>(std::cos(static_cast<double>(angle))) * attention_factor;
    sin[j] = static_cast<float>(std::sin(static_cast<double>(angle))) * attention_factor;
  }
}

void Rope::CosSin(int64_t position, float* cos, float* sin) const {
  RopeCosSin(inv_freq_.data(), static_cast<int64_t>(inv_freq_.size()), attention_factor_, position, cos, sin);
}

}  // namespace mlarun
