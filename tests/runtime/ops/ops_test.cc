// Each op's CPU implementation against a plain float64 reference written
// here, on random inputs (never zero), with outputs poisoned with NaN where
// they must be written and padding poisoned with NaN where it must not be
// read; then the params errors (the bad field named) and the CUDA backend's
// answer (UNIMPLEMENTED naming the op).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention/rope.h"
#include "base/cuda_device.h"
#include "gemm/convert.h"
#include "kv/latent_write.h"
#include "runtime/ops/elementwise.h"
#include "runtime/ops/embedding.h"
#include "runtime/ops/linear.h"
#include "runtime/ops/moe_experts.h"
#include "runtime/ops/moe_gate.h"
#include "runtime/ops/norm.h"
#include "runtime/ops/rope.h"
#include "runtime/ops/sampler.h"
#include "runtime/ops/sampling.h"
#include "tests/runtime/ops/random_values.h"

namespace mlarun {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

using testing_values::Random;
using testing_values::RandomLinear;

// What the op computes with: bf16 operands are rounded to bf16.
double Rounded(float v, DType dt) { return dt == DType::kBF16 ? Bf16ToFloat(FloatToBf16(v)) : v; }

double W(const Linear& w, int64_t o, int64_t i) {
  float v;
  LoadToF32(w.row(o) + i * static_cast<int64_t>(DTypeSize(w.dtype)), w.dtype, &v, 1);
  return v;
}

// y[r][j] = sum_i x[r][i] W[j][i], the x rounded as the op rounds them, and
// sum_i |x[r][i] W[j][i]| (what the fp32 accumulation's error scales with).
struct Ref {
  std::vector<double> v, mag;
};
Ref RefLinear(const Linear& w, const float* x, int64_t rows, int64_t ldx) {
  Ref y{std::vector<double>(static_cast<size_t>(rows * w.out)), std::vector<double>(static_cast<size_t>(rows * w.out))};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < w.out; ++j) {
      double s = 0, m = 0;
      for (int64_t i = 0; i < w.in; ++i) {
        const double term = Rounded(x[r * ldx + i], w.dtype) * W(w, j, i);
        s += term, m += std::abs(term);
      }
      y.v[static_cast<size_t>(r * w.out + j)] = s;
      y.mag[static_cast<size_t>(r * w.out + j)] = m;
    }
  return y;
}
// fp32 accumulation of terms of total magnitude `mag`.
double Tol(double mag) { return 1e-5 * mag; }

double Silu(double g) { return g / (1.0 + std::exp(-g)); }

TEST(LinearOp, MatchesReference) {
  Random r(1);
  for (DType dt : {DType::kF32, DType::kBF16})
    for (int64_t rows : {1, 3, 33, 40})
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(std::string(DTypeName(dt)) + " rows " + std::to_string(rows) + (accumulate ? " +=" : ""));
        const int64_t out = 37, in = 70, ldx = in + 5, c0 = 4, c1 = out - 3, n = c1 - c0, ldy = n + 2;
        const Linear w = RandomLinear(r, out, in, dt);
        std::vector<float> x = r.Vector(static_cast<size_t>(rows * ldx));
        for (int64_t t = 0; t < rows; ++t)
          for (int64_t i = in; i < ldx; ++i) x[static_cast<size_t>(t * ldx + i)] = kNaN;  // never read
        std::vector<float> y(static_cast<size_t>(rows * ldy), kNaN);
        std::vector<float> y0 = r.Vector(y.size());
        for (int64_t t = 0; t < rows; ++t)
          for (int64_t j = 0; j < n; ++j)
            if (accumulate) y[static_cast<size_t>(t * ldy + j)] = y0[static_cast<size_t>(t * ldy + j)];
        ASSERT_TRUE(LinearRun({.w = &w,
                               .col_begin = c0,
                               .col_end = c1,
                               .x = x.data(),
                               .rows = rows,
                               .ldx = ldx,
                               .y = y.data(),
                               .ldy = ldy,
                               .accumulate = accumulate})
                        .ok());
        const Ref ref = RefLinear(w, x.data(), rows, ldx);
        for (int64_t t = 0; t < rows; ++t) {
          for (int64_t j = 0; j < n; ++j) {
            const size_t k = static_cast<size_t>(t * out + c0 + j);
            const double want = ref.v[k] + (accumulate ? y0[static_cast<size_t>(t * ldy + j)] : 0.0);
            ASSERT_NEAR(y[static_cast<size_t>(t * ldy + j)], want, Tol(ref.mag[k] + 1)) << t << ", " << j;
          }
          for (int64_t j = n; j < ldy; ++j)
            ASSERT_TRUE(std::isnan(y[static_cast<size_t>(t * ldy + j)])) << "padding written";
        }
      }
}

TEST(LinearOp, WholeProductByDefault) {
  Random r(2);
  const Linear w = RandomLinear(r, 9, 16, DType::kF32);
  const std::vector<float> x = r.Vector(2 * 16);
  std::vector<float> y(2 * 9, kNaN);
  ASSERT_TRUE(LinearRun({.w = &w, .x = x.data(), .rows = 2, .ldx = 16, .y = y.data(), .ldy = 9}).ok());
  const Ref ref = RefLinear(w, x.data(), 2, 16);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], ref.v[i], Tol(ref.mag[i])) << i;
}

TEST(SiluMulOp, MatchesReference) {
  Random r(3);
  const int64_t rows = 3, inter = 11;
  std::vector<float> h = r.Vector(static_cast<size_t>(rows * 2 * inter));
  const std::vector<float> in = h;
  ASSERT_TRUE(SiluMulRun({.hidden = h.data(), .rows = rows, .inter = inter}).ok());
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < inter; ++i) {
      const size_t g = static_cast<size_t>(t * 2 * inter + i), u = g + static_cast<size_t>(inter);
      EXPECT_NEAR(h[g], Silu(in[g]) * in[u], 1e-6);
      EXPECT_EQ(h[u], in[u]) << "the up half is left as it is";
    }
}

// Mlp(x) in float64, rounding where the op rounds (x and the hidden, for
// bf16), and the magnitude of the down product's terms.
Ref RefMlp(const Mlp& m, const float* x, int64_t rows, int64_t ldx) {
  const Ref g = RefLinear(m.gate, x, rows, ldx), u = RefLinear(m.up, x, rows, ldx);
  const int64_t inter = m.intermediate();
  std::vector<float> hidden(static_cast<size_t>(rows * inter));
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = static_cast<float>(Silu(g.v[i]) * u.v[i]);
  return RefLinear(m.down, hidden.data(), rows, inter);
}
// The hidden, computed in fp32 by the op, may round to the other neighbouring
// bf16 value than the float64 one does: a 2^-8 relative change of a term.
double MlpTol(DType dt, double mag) { return (dt == DType::kBF16 ? 2e-4 : 2e-5) * mag; }

Mlp RandomMlp(Random& r, int64_t hidden, int64_t inter, DType dt) {
  return Mlp{.gate = RandomLinear(r, inter, hidden, dt),
             .up = RandomLinear(r, inter, hidden, dt),
             .down = RandomLinear(r, hidden, inter, dt)};
}

TEST(MlpOp, MatchesReference) {
  Random r(4);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dt));
    const int64_t rows = 5, H = 24, inter = 40, ldx = H + 2, ldy = H + 3;
    const Mlp m = RandomMlp(r, H, inter, dt);
    std::vector<float> x = r.Vector(static_cast<size_t>(rows * ldx));
    for (int64_t t = 0; t < rows; ++t)
      x[static_cast<size_t>(t * ldx + H)] = x[static_cast<size_t>(t * ldx + H + 1)] = kNaN;
    std::vector<float> y(static_cast<size_t>(rows * ldy), kNaN), hidden(static_cast<size_t>(rows * 2 * inter), kNaN);
    ASSERT_TRUE(
        MlpRun({.mlp = &m, .x = x.data(), .rows = rows, .ldx = ldx, .y = y.data(), .ldy = ldy, .hidden = hidden.data()})
            .ok());
    const Ref ref = RefMlp(m, x.data(), rows, ldx);
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t j = 0; j < H; ++j) {
        const size_t k = static_cast<size_t>(t * H + j);
        ASSERT_NEAR(y[static_cast<size_t>(t * ldy + j)], ref.v[k], MlpTol(dt, ref.mag[k]));
      }
      for (int64_t j = H; j < ldy; ++j) ASSERT_TRUE(std::isnan(y[static_cast<size_t>(t * ldy + j)]));
    }
  }
}

TEST(RmsNormOp, MatchesReferenceInAndOutOfPlace) {
  Random r(5);
  for (int64_t rows : {1, 20}) {  // 20: over the threshold that splits rows over threads
    const int64_t n = 45, ldx = n + 19, ldy = n + 4;
    const double eps = 1e-5;
    const std::vector<float> weight = r.Vector(static_cast<size_t>(n));
    std::vector<float> x = r.Vector(static_cast<size_t>(rows * ldx));
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t i = n; i < ldx; ++i) x[static_cast<size_t>(t * ldx + i)] = kNaN;
    std::vector<double> ref(static_cast<size_t>(rows * n));
    for (int64_t t = 0; t < rows; ++t) {
      double ss = 0;
      for (int64_t i = 0; i < n; ++i)
        ss += double{x[static_cast<size_t>(t * ldx + i)]} * x[static_cast<size_t>(t * ldx + i)];
      const double inv = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
      for (int64_t i = 0; i < n; ++i)
        ref[static_cast<size_t>(t * n + i)] =
            weight[static_cast<size_t>(i)] * x[static_cast<size_t>(t * ldx + i)] * inv;
    }
    std::vector<float> y(static_cast<size_t>(rows * ldy), kNaN);
    ASSERT_TRUE(RmsNormRun({.x = x.data(),
                            .ldx = ldx,
                            .y = y.data(),
                            .ldy = ldy,
                            .rows = rows,
                            .n = n,
                            .weight = weight.data(),
                            .eps = eps})
                    .ok());
    ASSERT_TRUE(RmsNormRun({.x = x.data(),
                            .ldx = ldx,
                            .y = x.data(),
                            .ldy = ldx,
                            .rows = rows,
                            .n = n,
                            .weight = weight.data(),
                            .eps = eps})
                    .ok());
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t i = 0; i < n; ++i) {
        const double want = ref[static_cast<size_t>(t * n + i)];
        ASSERT_NEAR(y[static_cast<size_t>(t * ldy + i)], want, 2e-6) << t << ", " << i;
        ASSERT_EQ(x[static_cast<size_t>(t * ldx + i)], y[static_cast<size_t>(t * ldy + i)]) << "in place differs";
      }
      for (int64_t i = n; i < ldy; ++i) ASSERT_TRUE(std::isnan(y[static_cast<size_t>(t * ldy + i)]));
      for (int64_t i = n; i < ldx; ++i) ASSERT_TRUE(std::isnan(x[static_cast<size_t>(t * ldx + i)]));
    }
  }
}

TEST(EmbeddingOp, RowsByIdInEveryDtype) {
  Random r(6);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const int64_t vocab = 50, width = 13, ld = 16, n = 7, ld_out = 15;
    std::vector<float> src = r.Vector(static_cast<size_t>(vocab * ld));
    std::vector<std::byte> table(static_cast<size_t>(vocab * ld) * DTypeSize(dt));
    StoreFromF32(src.data(), table.data(), dt, vocab * ld);
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (int32_t& id : ids) id = r.Int(0, static_cast<int>(vocab) - 1);
    ids[3] = static_cast<int32_t>(vocab) - 1;
    std::vector<float> out(static_cast<size_t>(n * ld_out), kNaN);
    const EmbeddingParams p{.table = table.data(),
                            .dtype = dt,
                            .num_rows = vocab,
                            .width = width,
                            .ld = ld,
                            .ids = ids.data(),
                            .n = n,
                            .out = out.data(),
                            .ld_out = ld_out};
    ASSERT_TRUE(EmbeddingRun(p).ok());
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < width; ++j)
        ASSERT_EQ(out[static_cast<size_t>(i * ld_out + j)],
                  static_cast<float>(Rounded(src[static_cast<size_t>(ids[static_cast<size_t>(i)] * ld + j)], dt)));
      for (int64_t j = width; j < ld_out; ++j) ASSERT_TRUE(std::isnan(out[static_cast<size_t>(i * ld_out + j)]));
    }
    // A bad id is named, and nothing is written.
    std::fill(out.begin(), out.end(), kNaN);
    ids[2] = static_cast<int32_t>(vocab);
    const Status st = EmbeddingRun(p);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("ids[2]"), std::string::npos) << st;
    for (float v : out) ASSERT_TRUE(std::isnan(v));
  }
}

TEST(ElementwiseOps, AddAndCopyRows) {
  Random r(7);
  std::vector<float> y = r.Vector(29);
  const std::vector<float> x = r.Vector(29), y0 = y;
  ASSERT_TRUE(AddRun({.y = y.data(), .x = x.data(), .n = 29}).ok());
  for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(y[i], y0[i] + x[i]);

  // k_pe out of rows of [kv_c | k_pe].
  const int64_t rows = 4, L = 9, R = 6;
  const std::vector<float> kv = r.Vector(static_cast<size_t>(rows * (L + R)));
  std::vector<float> k_pe(static_cast<size_t>(rows * (R + 1)), kNaN);
  ASSERT_TRUE(
      CopyRowsRun({.x = kv.data() + L, .ldx = L + R, .y = k_pe.data(), .ldy = R + 1, .rows = rows, .cols = R}).ok());
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t j = 0; j < R; ++j)
      EXPECT_EQ(k_pe[static_cast<size_t>(t * (R + 1) + j)], kv[static_cast<size_t>(t * (L + R) + L + j)]);
    EXPECT_TRUE(std::isnan(k_pe[static_cast<size_t>(t * (R + 1) + R)]));
  }
}

TEST(RopeOp, MatchesReferenceInEveryLayout) {
  Random r(8);
  for (RopeLayout layout : {RopeLayout::kInterleavedToHalf, RopeLayout::kInterleaved, RopeLayout::kHalf}) {
    SCOPED_TRACE(static_cast<int>(layout));
    RopeConfig config{.dim = 16, .theta = 10000.0, .layout = layout, .scaling = {}};
    config.scaling = RopeScaling{.type = RopeScaling::Type::kYarn,
                                 .factor = 4,
                                 .original_max_position_embeddings = 64,
                                 .mscale = 1,
                                 .mscale_all_dim = 0.5};
    auto rope = Rope::Create(config);
    ASSERT_TRUE(rope.ok()) << rope.status();
    const int64_t T = 5, heads = 3, dim = 16, offset = 4, stride_head = dim + 6, stride_token = heads * stride_head + 2;
    std::vector<int32_t> positions(static_cast<size_t>(T));
    for (int32_t& p : positions) p = r.Int(0, 300);
    // Each head's slice after `offset` floats (the nope part, never touched);
    // everything but the slices is NaN.
    std::vector<float> x(static_cast<size_t>(T * stride_token), kNaN);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < dim; ++j)
          x[static_cast<size_t>(t * stride_token + h * stride_head + offset + j)] = r.Next();
    const std::vector<float> in = x;
    ASSERT_TRUE(RopeRun(WithRopeTables({.x = x.data() + offset,
                                        .n_tokens = T,
                                        .n_heads = heads,
                                        .stride_token = stride_token,
                                        .stride_head = stride_head,
                                        .positions = positions.data()},
                                       *rope))
                    .ok());
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const float* a = in.data() + t * stride_token + h * stride_head + offset;
        const float* got = x.data() + t * stride_token + h * stride_head + offset;
        std::vector<double> want(static_cast<size_t>(dim));
        for (int64_t j = 0; j < half; ++j) {
          // The angle as HF forms it, in fp32; the rotation in float64.
          const float angle =
              static_cast<float>(positions[static_cast<size_t>(t)]) * rope->inv_freq()[static_cast<size_t>(j)];
          const double c = std::cos(double{angle}) * rope->attention_factor(),
                       s = std::sin(double{angle}) * rope->attention_factor();
          const size_t J = static_cast<size_t>(j), Hf = static_cast<size_t>(half);
          if (layout == RopeLayout::kInterleavedToHalf) {
            want[J] = a[2 * J] * c - a[2 * J + 1] * s;
            want[J + Hf] = a[2 * J + 1] * c + a[2 * J] * s;
          } else if (layout == RopeLayout::kInterleaved) {
            want[2 * J] = a[2 * J] * c - a[2 * J + 1] * s;
            want[2 * J + 1] = a[2 * J] * s + a[2 * J + 1] * c;
          } else {
            want[J] = a[J] * c - a[J + Hf] * s;
            want[J + Hf] = a[J + Hf] * c + a[J] * s;
          }
        }
        for (int64_t j = 0; j < dim; ++j)
          ASSERT_NEAR(got[j], want[static_cast<size_t>(j)], 1e-6) << t << ", " << h << ", " << j;
      }
    for (size_t i = 0; i < x.size(); ++i) {
      if (std::isnan(in[i])) {
        ASSERT_TRUE(std::isnan(x[i])) << "wrote outside the slices at " << i;
      }
    }
  }
}

// The gate in float64: the spec in moe_gate.h, written out.
void RefGate(const MoeGateParams& p, std::vector<int32_t>& experts, std::vector<double>& weights) {
  const int64_t E = p.num_experts, K = p.top_k, G = p.n_group, per = E / G;
  experts.assign(static_cast<size_t>(p.tokens * K), -1);
  weights.assign(static_cast<size_t>(p.tokens * K), 0);
  for (int64_t t = 0; t < p.tokens; ++t) {
    const float* l = p.logits + t * E;
    std::vector<double> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
    double mx = -INFINITY, sum = 0;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, double{l[e]});
    for (int64_t e = 0; e < E; ++e) sum += std::exp(l[e] - mx);
    for (int64_t e = 0; e < E; ++e) {
      score[static_cast<size_t>(e)] =
          p.scoring == ScoringFunc::kSigmoid ? 1.0 / (1.0 + std::exp(-double{l[e]})) : std::exp(l[e] - mx) / sum;
      choice[static_cast<size_t>(e)] = score[static_cast<size_t>(e)] + (p.bias ? p.bias[e] : 0.0);
    }
    if (p.method != TopkMethod::kGreedy && G > 1) {
      std::vector<std::pair<double, int64_t>> groups;
      for (int64_t g = 0; g < G; ++g) {
        std::vector<double> s(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        std::sort(s.rbegin(), s.rend());
        groups.push_back({p.method == TopkMethod::kNoauxTc ? s[0] + s[1] : s[0], g});
      }
      std::sort(groups.begin(), groups.end(), [](auto a, auto b) { return a.first > b.first; });
      for (int64_t i = p.topk_group; i < G; ++i)
        for (int64_t e = 0; e < per; ++e)
          choice[static_cast<size_t>(groups[static_cast<size_t>(i)].second * per + e)] =
              p.method == TopkMethod::kNoauxTc ? -INFINITY : 0.0;
    }
    std::vector<int32_t> order(static_cast<size_t>(E));
    for (int32_t e = 0; e < E; ++e) order[static_cast<size_t>(e)] = e;
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return choice[static_cast<size_t>(a)] > choice[static_cast<size_t>(b)];
    });
    double total = 0;
    for (int64_t k = 0; k < K; ++k) total += score[static_cast<size_t>(order[static_cast<size_t>(k)])];
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = order[static_cast<size_t>(k)];
      experts[static_cast<size_t>(t * K + k)] = e;
      weights[static_cast<size_t>(t * K + k)] =
          score[static_cast<size_t>(e)] / (p.norm_topk_prob && K > 1 ? total : 1.0) * p.routed_scaling_factor;
    }
  }
}

TEST(MoeGateOp, MatchesReferenceForV2AndV3Routing) {
  Random r(9);
  struct Case {
    const char* name;
    ScoringFunc scoring;
    TopkMethod method;
    int64_t n_group, topk_group;
    bool bias, norm;
  };
  for (const Case& c :
       {Case{"v2 greedy", ScoringFunc::kSoftmax, TopkMethod::kGreedy, 1, 1, false, false},
        Case{"v2 group-limited", ScoringFunc::kSoftmax, TopkMethod::kGroupLimitedGreedy, 4, 2, false, true},
        Case{"v3 noaux_tc", ScoringFunc::kSigmoid, TopkMethod::kNoauxTc, 4, 2, true, true},
        Case{"v3 one group", ScoringFunc::kSigmoid, TopkMethod::kNoauxTc, 1, 1, true, false}}) {
    SCOPED_TRACE(c.name);
    const int64_t T = 6, E = 16, K = 3;
    const std::vector<float> logits = r.Vector(static_cast<size_t>(T * E)), bias = r.Vector(static_cast<size_t>(E));
    std::vector<int32_t> experts(static_cast<size_t>(T * K), -7);
    std::vector<float> weights(static_cast<size_t>(T * K), kNaN);
    const MoeGateParams p{.logits = logits.data(),
                          .tokens = T,
                          .num_experts = E,
                          .bias = c.bias ? bias.data() : nullptr,
                          .scoring = c.scoring,
                          .method = c.method,
                          .top_k = K,
                          .n_group = c.n_group,
                          .topk_group = c.topk_group,
                          .norm_topk_prob = c.norm,
                          .routed_scaling_factor = 2.5,
                          .experts = experts.data(),
                          .weights = weights.data()};
    ASSERT_TRUE(MoeGateRun(p).ok());
    std::vector<int32_t> want_experts;
    std::vector<double> want_weights;
    RefGate(p, want_experts, want_weights);
    for (size_t i = 0; i < experts.size(); ++i) {
      ASSERT_EQ(experts[i], want_experts[i]) << i;
      ASSERT_NEAR(weights[i], want_weights[i], 1e-5) << i;
    }
  }
}

TEST(MoeExpertsOp, MatchesReferenceWithSplitItemsAndOtherRanksExperts) {
  Random r(10);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dt));
    // f32 gate/up/down of [768, 512] are 1.5 MiB: two column items each.
    const int64_t T = 6, H = 512, inter = 768, E = 8, K = 3, begin = 2, local = 4;
    std::vector<Mlp> experts;
    for (int64_t e = 0; e < local; ++e) experts.push_back(RandomMlp(r, H, dt == DType::kF32 ? inter : 96, dt));
    const Mlp shared = RandomMlp(r, H, 64, dt);
    const std::vector<float> x = r.Vector(static_cast<size_t>(T * H));
    std::vector<int32_t> route(static_cast<size_t>(T * K));
    std::vector<float> weights = r.Vector(route.size());
    for (int64_t t = 0; t < T; ++t) {  // distinct experts per token, some on other ranks
      std::vector<int32_t> ids(static_cast<size_t>(E));
      for (int32_t e = 0; e < E; ++e) ids[static_cast<size_t>(e)] = e;
      std::shuffle(ids.begin(), ids.end(), r.rng());
      std::copy(ids.begin(), ids.begin() + K, route.begin() + t * K);
    }
    route[0] = begin, route[1] = begin + 1, route[2] = 0;  // local experts and another rank's
    std::vector<float> y(static_cast<size_t>(T * H), kNaN);
    const MoeExpertsParams p{.experts = experts.data(),
                             .num_local = local,
                             .expert_begin = begin,
                             .num_experts = E,
                             .shared = &shared,
                             .x = x.data(),
                             .tokens = T,
                             .hidden = H,
                             .route_experts = route.data(),
                             .route_weights = weights.data(),
                             .top_k = K,
                             .y = y.data()};
    MoePlan plan;
    ASSERT_TRUE(MoeReplan(p, plan).ok());
    std::vector<int32_t> chosen;
    for (int32_t e : route)
      if (e >= begin && e < begin + local && std::find(chosen.begin(), chosen.end(), e) == chosen.end())
        chosen.push_back(e);
    EXPECT_EQ(plan.routed_jobs, chosen.size());
    EXPECT_EQ(plan.jobs.size(), chosen.size() + 1);
    if (dt == DType::kF32) {
      EXPECT_GT(plan.up_items.size(), 2 * plan.jobs.size()) << "no product was split";
    }
    Workspace ws;
    WorkspaceView view = ws.Reserve(plan.workspace_bytes);
    std::memset(view.data, 0xff, view.bytes);  // NaN everywhere the run has to write first
    ASSERT_TRUE(MoeExpertsRun(p, plan, view).ok());

    const Ref shared_ref = RefMlp(shared, x.data(), T, H);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> want(shared_ref.v.begin() + t * H, shared_ref.v.begin() + (t + 1) * H);
      std::vector<double> mag(shared_ref.mag.begin() + t * H, shared_ref.mag.begin() + (t + 1) * H);
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = route[static_cast<size_t>(t * K + k)];
        if (e < begin || e >= begin + local) continue;
        const Ref o = RefMlp(experts[static_cast<size_t>(e - begin)], x.data() + t * H, 1, H);
        const double w = weights[static_cast<size_t>(t * K + k)];
        for (int64_t j = 0; j < H; ++j) {
          want[static_cast<size_t>(j)] += w * o.v[static_cast<size_t>(j)];
          mag[static_cast<size_t>(j)] += std::abs(w) * o.mag[static_cast<size_t>(j)];
        }
      }
      for (int64_t j = 0; j < H; ++j)
        ASSERT_NEAR(y[static_cast<size_t>(t * H + j)], want[static_cast<size_t>(j)],
                    MlpTol(dt, mag[static_cast<size_t>(j)]))
            << t << ", " << j;
    }

    // Re-planning the same routes into the same plan gives the same plan.
    const size_t bytes = plan.workspace_bytes, items = plan.up_items.size();
    ASSERT_TRUE(MoeReplan(p, plan).ok());
    EXPECT_EQ(plan.workspace_bytes, bytes);
    EXPECT_EQ(plan.up_items.size(), items);
  }
}

TEST(SampleOp, RunsEachRowsSampler) {
  Random r(11);
  const int64_t rows = 3, vocab = 40, ld = 43;
  std::vector<float> logits = r.Vector(static_cast<size_t>(rows * ld));
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = vocab; j < ld; ++j) logits[static_cast<size_t>(t * ld + j)] = kNaN;
  const SamplingParams greedy{.temperature = 0.0}, warm{.temperature = 0.8, .top_k = 10, .seed = 7},
      nucleus{.temperature = 1.2, .top_p = 0.9, .seed = 8};
  Sampler a(greedy), b(warm), c(nucleus), a2(greedy), b2(warm), c2(nucleus);
  Sampler* samplers[] = {&a, &b, &c};
  Sampler* expected[] = {&a2, &b2, &c2};
  for (int step = 0; step < 4; ++step) {
    SampledToken out[rows];
    ASSERT_TRUE(
        SampleRun({.logits = logits.data(), .rows = rows, .vocab = vocab, .ld = ld, .samplers = samplers, .out = out})
            .ok());
    for (int64_t t = 0; t < rows; ++t) {
      const SampledToken want =
          expected[t]->Sample(std::span<const float>(logits.data() + t * ld, static_cast<size_t>(vocab)));
      EXPECT_EQ(out[t].token, want.token) << step << ", " << t;
      EXPECT_EQ(out[t].logprob, want.logprob) << step << ", " << t;
    }
  }
  Sampler* missing[] = {&a, nullptr, &c};
  SampledToken out[rows];
  const Status st =
      SampleRun({.logits = logits.data(), .rows = rows, .vocab = vocab, .ld = ld, .samplers = missing, .out = out});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("samplers[1]"), std::string::npos) << st;
}

// Each row's token scored against a float64 log-softmax of the row, its most
// likely tokens listed best first; NaN padding past vocab is never read.
TEST(ScoreOp, ScoresEachRowsTokenAgainstFloat64) {
  Random r(13);
  const int64_t rows = 4, vocab = 300, ld = 301, top = 3;
  std::vector<float> logits = r.Vector(static_cast<size_t>(rows * ld));
  for (int64_t t = 0; t < rows; ++t) logits[static_cast<size_t>(t * ld + vocab)] = kNaN;
  logits[2 * ld + 17] = -std::numeric_limits<float>::infinity();  // row 2 scores a token of no probability
  const std::vector<int32_t> tokens = {5, 299, 17, 0};
  std::vector<SampledToken> out(static_cast<size_t>(rows));
  ASSERT_TRUE(ScoreRun({.logits = logits.data(),
                        .rows = rows,
                        .vocab = vocab,
                        .ld = ld,
                        .tokens = tokens.data(),
                        .top = top,
                        .out = out.data()})
                  .ok());
  for (int64_t t = 0; t < rows; ++t) {
    SCOPED_TRACE("row " + std::to_string(t));
    const float* row = logits.data() + t * ld;
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < vocab; ++j) mx = std::max(mx, static_cast<double>(row[j]));
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<double>(row[j]) - mx);
    auto ref = [&](int64_t j) { return static_cast<double>(row[j]) - mx - std::log(sum); };
    const SampledToken& s = out[static_cast<size_t>(t)];
    EXPECT_EQ(s.token, tokens[static_cast<size_t>(t)]);
    if (t == 2) {
      EXPECT_EQ(s.logprob, kNoProbabilityLogprob);
    } else {
      EXPECT_NEAR(s.logprob, ref(tokens[static_cast<size_t>(t)]), 1e-9);
    }
    std::vector<int64_t> order(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
    ASSERT_EQ(s.num_top, top);
    for (int64_t k = 0; k < top; ++k) {
      EXPECT_EQ(s.top[static_cast<size_t>(k)].token, order[static_cast<size_t>(k)]) << k;
      EXPECT_NEAR(s.top[static_cast<size_t>(k)].logprob, ref(order[static_cast<size_t>(k)]), 1e-9) << k;
    }
  }
  // A token outside the vocabulary, or too many alternatives: named.
  const int32_t bad[1] = {300};
  EXPECT_NE(ScoreRun({.logits = logits.data(), .rows = 1, .vocab = vocab, .ld = ld, .tokens = bad, .out = out.data()})
                .message()
                .find("tokens[0] = 300"),
            std::string::npos);
  EXPECT_NE(ScoreRun({.logits = logits.data(),
                      .rows = 1,
                      .vocab = vocab,
                      .ld = ld,
                      .tokens = tokens.data(),
                      .top = kMaxTopLogprobs + 1,
                      .out = out.data()})
                .message()
                .find("top (21)"),
            std::string::npos);
}

TEST(LatentWriteOp, CpuWritesTheSlotsRows) {
  Random r(12);
  for (DType dt : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(DTypeName(dt));
    const int64_t L = 10, R = 4, bs = 4, blocks = 5, stride_token = L + R + 2, stride_block = bs * stride_token + 3;
    const int64_t n = 6, es = static_cast<int64_t>(DTypeSize(dt));
    std::vector<std::byte> cache(static_cast<size_t>(blocks * stride_block * es), std::byte{0xff});
    const std::vector<std::byte> poison = cache;
    const std::vector<int64_t> slots = {3, 17, -1, 4, 19, 8};
    const std::vector<float> kv = r.Vector(static_cast<size_t>(n * (L + 1))), pe = r.Vector(static_cast<size_t>(n * R));
    LatentWriteParams p{.cache = cache.data(),
                        .dtype = dt,
                        .block_size = bs,
                        .num_blocks = blocks,
                        .stride_block = stride_block,
                        .stride_token = stride_token,
                        .d_latent = L,
                        .d_rope = R,
                        .n = n,
                        .slots = slots.data(),
                        .kv_c = kv.data(),
                        .kv_c_stride = L + 1,
                        .k_pe = pe.data(),
                        .k_pe_stride = R};
    ASSERT_TRUE(LatentWriteRun(p).ok());
    std::vector<char> written(cache.size() / static_cast<size_t>(es), 0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t s = slots[static_cast<size_t>(t)];
      if (s < 0) continue;
      const int64_t row = (s / bs) * stride_block + (s % bs) * stride_token;
      for (int64_t j = 0; j < L + R; ++j) {
        float got;
        LoadToF32(cache.data() + (row + j) * es, dt, &got, 1);
        const float v = j < L ? kv[static_cast<size_t>(t * (L + 1) + j)] : pe[static_cast<size_t>(t * R + j - L)];
        ASSERT_EQ(got, static_cast<float>(Rounded(v, dt))) << t << ", " << j;
        written[static_cast<size_t>(row + j)] = 1;
      }
    }
    for (size_t i = 0; i < written.size(); ++i) {
      if (!written[i]) {
        ASSERT_EQ(std::memcmp(cache.data() + i * static_cast<size_t>(es), poison.data() + i * static_cast<size_t>(es),
                              static_cast<size_t>(es)),
                  0)
            << "element " << i << " written";
      }
    }

    // A slot beyond the layer's blocks: named, nothing written.
    std::vector<std::byte> before = cache;
    std::vector<int64_t> bad = slots;
    bad[3] = blocks * bs;
    p.slots = bad.data();
    const Status st = LatentWriteRun(p);
    EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
    EXPECT_NE(st.message().find("slots[3]"), std::string::npos) << st;
    EXPECT_EQ(cache, before);
  }
}

// Every op's params errors name the field; the CUDA backend answers
// UNIMPLEMENTED naming the op (no CUDA implementation of these ops yet).
void ExpectNamed(const Status& st, const std::string& field) {
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(field), std::string::npos) << "'" << field << "' not in: " << st;
}
// A build without nvcc answers UNIMPLEMENTED for the CUDA backend (with a
// GPU build these host pointers must not reach it: ops_cuda_test runs it).
void ExpectNoCuda(const Status& st, const std::string& op) {
  EXPECT_EQ(st.code(), StatusCode::kUnimplemented) << st;
  EXPECT_EQ(st.message().rfind(op + ":", 0), 0u) << st;
  EXPECT_NE(st.message().find("no CUDA backend"), std::string::npos) << st;
}

TEST(OpsErrors, BadParamsAreNamedAndCudaIsUnimplemented) {
  Random r(13);
  const Linear w = RandomLinear(r, 8, 16, DType::kF32);
  const Mlp m = RandomMlp(r, 16, 8, DType::kF32);
  std::vector<float> x = r.Vector(64), y(64), h(64), weight = r.Vector(16);
  const LinearParams lin{.w = &w, .x = x.data(), .rows = 2, .ldx = 16, .y = y.data(), .ldy = 8};
  auto with = [](auto p, auto&& f) {
    f(p);
    return p;
  };
  ExpectNamed(LinearRun(with(lin, [](LinearParams& p) { p.ldx = 15; })), "ldx");
  ExpectNamed(LinearRun(with(lin, [](LinearParams& p) { p.ldy = 7; })), "ldy");
  ExpectNamed(LinearRun(with(lin, [](LinearParams& p) { p.col_end = 9; })), "col_end");
  ExpectNamed(LinearRun(with(lin, [](LinearParams& p) { p.w = nullptr; })), "w is null");
  if (!CudaBuilt()) ExpectNoCuda(LinearRun(with(lin, [](LinearParams& p) { p.backend = Backend::kCuda; })), "linear");

  const MlpParams mlp{.mlp = &m, .x = x.data(), .rows = 2, .ldx = 16, .y = y.data(), .ldy = 16, .hidden = h.data()};
  ExpectNamed(MlpRun(with(mlp, [](MlpParams& p) { p.hidden = nullptr; })), "hidden");
  ExpectNamed(MlpRun(with(mlp, [](MlpParams& p) { p.ldy = 15; })), "ldy");
  if (!CudaBuilt()) ExpectNoCuda(MlpRun(with(mlp, [](MlpParams& p) { p.backend = Backend::kCuda; })), "mlp");
  if (!CudaBuilt())
    ExpectNoCuda(SiluMulRun({.hidden = h.data(), .rows = 2, .inter = 8, .backend = Backend::kCuda}), "silu_mul");

  const RmsNormParams norm{
      .x = x.data(), .ldx = 16, .y = y.data(), .ldy = 16, .rows = 2, .n = 16, .weight = weight.data()};
  ExpectNamed(RmsNormRun(with(norm, [](RmsNormParams& p) { p.ldy = 8; })), "ldy");
  ExpectNamed(RmsNormRun(with(norm, [&](RmsNormParams& p) { p.y = x.data(), p.ldy = 32; })), "in place");
  ExpectNamed(RmsNormRun(with(norm, [](RmsNormParams& p) { p.weight = nullptr; })), "weight");
  if (!CudaBuilt())
    ExpectNoCuda(RmsNormRun(with(norm, [](RmsNormParams& p) { p.backend = Backend::kCuda; })), "rms_norm");

  const int32_t ids[2] = {1, 2};
  const EmbeddingParams emb{.table = x.data(),
                            .dtype = DType::kF32,
                            .num_rows = 4,
                            .width = 16,
                            .ld = 16,
                            .ids = ids,
                            .n = 2,
                            .out = y.data(),
                            .ld_out = 16};
  ExpectNamed(EmbeddingRun(with(emb, [](EmbeddingParams& p) { p.ld_out = 15; })), "ld_out");
  ExpectNamed(EmbeddingRun(with(emb, [](EmbeddingParams& p) { p.dtype = DType::kF16; })), "dtype");
  if (!CudaBuilt())
    ExpectNoCuda(EmbeddingRun(with(emb, [](EmbeddingParams& p) { p.backend = Backend::kCuda; })), "embedding");

  ExpectNamed(AddRun({.y = y.data(), .x = nullptr, .n = 4}), "x and y");
  if (!CudaBuilt()) ExpectNoCuda(AddRun({.y = y.data(), .x = x.data(), .n = 4, .backend = Backend::kCuda}), "add");
  const CopyRowsParams copy{.x = x.data(), .ldx = 8, .y = y.data(), .ldy = 8, .rows = 2, .cols = 8};
  ExpectNamed(CopyRowsRun(with(copy, [](CopyRowsParams& p) { p.ldx = 7; })), "ldx");
  if (!CudaBuilt())
    ExpectNoCuda(CopyRowsRun(with(copy, [](CopyRowsParams& p) { p.backend = Backend::kCuda; })), "copy_rows");

  auto rope = Rope::Create(RopeConfig{.dim = 8, .scaling = {}});
  ASSERT_TRUE(rope.ok());
  const int32_t pos[2] = {0, 5};
  const RopeParams rp = WithRopeTables(
      {.x = x.data(), .n_tokens = 2, .n_heads = 2, .stride_token = 16, .stride_head = 8, .positions = pos}, *rope);
  ExpectNamed(RopeRun(with(rp, [](RopeParams& p) { p.stride_head = 7; })), "stride_head");
  ExpectNamed(RopeRun(with(rp, [](RopeParams& p) { p.stride_token = 15; })), "stride_token");
  ExpectNamed(RopeRun(with(rp, [](RopeParams& p) { p.dim = 7; })), "dim");
  ExpectNamed(RopeRun(with(rp, [](RopeParams& p) { p.inv_freq = nullptr; })), "inv_freq");
  if (!CudaBuilt()) ExpectNoCuda(RopeRun(with(rp, [](RopeParams& p) { p.backend = Backend::kCuda; })), "rope");

  int32_t experts[6];
  float weights[6];
  const MoeGateParams gate{
      .logits = x.data(), .tokens = 2, .num_experts = 8, .top_k = 3, .experts = experts, .weights = weights};
  ExpectNamed(MoeGateRun(with(gate, [](MoeGateParams& p) { p.top_k = 9; })), "top_k");
  ExpectNamed(MoeGateRun(with(gate, [](MoeGateParams& p) { p.n_group = 3; })), "n_group");
  ExpectNamed(MoeGateRun(with(
                  gate, [](MoeGateParams& p) { p.method = TopkMethod::kNoauxTc, p.n_group = 4, p.topk_group = 5; })),
              "topk_group");
  if (!CudaBuilt())
    ExpectNoCuda(MoeGateRun(with(gate, [](MoeGateParams& p) { p.backend = Backend::kCuda; })), "moe_gate");

  int32_t route[6] = {0, 1, 2, 3, 4, 5};
  const MoeExpertsParams moe{.experts = &m,
                             .num_local = 1,
                             .expert_begin = 0,
                             .num_experts = 8,
                             .x = x.data(),
                             .tokens = 2,
                             .hidden = 16,
                             .route_experts = route,
                             .route_weights = weights,
                             .top_k = 3,
                             .y = y.data()};
  MoePlan plan;
  ExpectNamed(MoeReplan(with(moe, [](MoeExpertsParams& p) { p.expert_begin = 8; }), plan), "expert_begin");
  route[4] = 8;
  ExpectNamed(MoeReplan(moe, plan), "route_experts[4]");
  route[4] = 4;
  ExpectNamed(MoeReplan(with(moe, [](MoeExpertsParams& p) { p.hidden = 15; }), plan), "expert 0");
  ASSERT_TRUE(MoeReplan(moe, plan).ok());
  ExpectNamed(MoeExpertsRun(moe, plan, {}), "workspace");
  ExpectNamed(MoeExpertsRun(with(moe, [](MoeExpertsParams& p) { p.tokens = 1; }), plan, {}), "plan");
  Workspace ws;
  if (!CudaBuilt())
    ExpectNoCuda(MoeExpertsRun(with(moe, [](MoeExpertsParams& p) { p.backend = Backend::kCuda; }), plan,
                               ws.Reserve(plan.workspace_bytes)),
                 "moe_experts");

  Sampler s(SamplingParams{});
  Sampler* samplers[1] = {&s};
  SampledToken out[1];
  ExpectNamed(SampleRun({.logits = x.data(), .rows = 1, .vocab = 16, .ld = 8, .samplers = samplers, .out = out}), "ld");
  if (!CudaBuilt())
    ExpectNoCuda(SampleRun({.logits = x.data(),
                            .rows = 1,
                            .vocab = 16,
                            .ld = 16,
                            .samplers = samplers,
                            .out = out,
                            .backend = Backend::kCuda}),
                 "sample");

  std::vector<std::byte> cache(4096);
  const int64_t slot = 0;
  const LatentWriteParams lw{.cache = cache.data(),
                             .dtype = DType::kF32,
                             .block_size = 4,
                             .num_blocks = 2,
                             .stride_block = 4 * 12,
                             .stride_token = 12,
                             .d_latent = 8,
                             .d_rope = 4,
                             .n = 1,
                             .slots = &slot,
                             .kv_c = x.data(),
                             .kv_c_stride = 8,
                             .k_pe = x.data(),
                             .k_pe_stride = 4};
  ExpectNamed(LatentWriteRun(with(lw, [](LatentWriteParams& p) { p.dtype = DType::kF16; })), "dtype");
  ExpectNamed(LatentWriteRun(with(lw, [](LatentWriteParams& p) { p.stride_token = 11; })), "strides");
  ExpectNamed(LatentWriteRun(with(lw, [](LatentWriteParams& p) { p.num_blocks = 0; })), "num_blocks");
  ExpectNamed(LatentWriteRun(with(lw, [](LatentWriteParams& p) { p.kv_c_stride = 7; })), "kv_c_stride");
}

}  // namespace
}  // namespace mlarun
