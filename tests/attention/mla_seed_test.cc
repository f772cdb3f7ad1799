// The exact facts of the MLA derivation: absorbed and expanded formulations
// agree in double, and the causal mask sees 3*5 + 3*4/2 = 21 pairs for a
// 3-token block over a 5-token prefix, counted from the kernels themselves.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "attention/mla.h"
#include "bench/synthetic_batch.h"

namespace mlarun {
namespace {

using Mat = std::vector<std::vector<double>>;

Mat Random(int rows, int cols, std::mt19937_64& rng) {
  std::normal_distribution<double> d;
  Mat m(rows, std::vector<double>(cols));
  for (auto& r : m)
    for (auto& v : r) v = d(rng);
  return m;
}
Mat MatMul(const Mat& a, const Mat& b) {
  Mat c(a.size(), std::vector<double>(b[0].size(), 0.0));
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t k = 0; k < b.size(); ++k)
      for (size_t j = 0; j < b[0].size(); ++j) c[i][j] += a[i][k] * b[k][j];
  return c;
}
Mat T(const Mat& a) {
  Mat t(a[0].size(), std::vector<double>(a.size()));
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < a[0].size(); ++j) t[j][i] = a[i][j];
  return t;
}
Mat Softmax(Mat a) {
  for (auto& r : a) {
    double mx = *std::max_element(r.begin(), r.end()), sum = 0;
    for (auto& v : r) sum += (v = std::exp(v - mx));
    for (auto& v : r) v /= sum;
  }
  return a;
}
double MaxDiff(const Mat& a, const Mat& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < a[0].size(); ++j) m = std::max(m, std::abs(a[i][j] - b[i][j]));
  return m;
}

TEST(MlaSeed, AbsorbedAndExpandedAgreeInDouble) {
  std::mt19937_64 rng(42);
  const int queries = 3, context = 5, rank = 4, key_dim = 2, value_dim = 3, rope_dim = 2;
  const Mat c = Random(context, rank, rng), q = Random(queries, key_dim, rng);
  const Mat q_rope = Random(queries, rope_dim, rng), k_rope = Random(context, rope_dim, rng);
  const Mat uk = Random(rank, key_dim, rng), uv = Random(rank, value_dim, rng);
  const double scale = 1.0 / std::sqrt(key_dim + rope_dim);  // never 1/sqrt(rank + rope_dim)
  const Mat rope_scores = MatMul(q_rope, T(k_rope));
  Mat expanded = MatMul(q, T(MatMul(c, uk))), absorbed = MatMul(MatMul(q, T(uk)), T(c));
  for (int i = 0; i < queries; ++i)
    for (int j = 0; j < context; ++j) {
      expanded[i][j] = (expanded[i][j] + rope_scores[i][j]) * scale;
      absorbed[i][j] = (absorbed[i][j] + rope_scores[i][j]) * scale;
    }
  EXPECT_LT(MaxDiff(absorbed, expanded), 1e-12);
  const Mat a = Softmax(expanded), a_abs = Softmax(absorbed);
  EXPECT_LT(MaxDiff(a, a_abs), 1e-12);
  EXPECT_LT(MaxDiff(MatMul(a, MatMul(c, uv)), MatMul(MatMul(a_abs, c), uv)), 1e-12);
}

TEST(MlaSeed, CausalPairsFromTheMask) {
  int64_t pairs = 0;
  for (int64_t j = 0; j < 3; ++j) pairs += CausalVisibleKeys(/*prefix=*/5, j);
  EXPECT_EQ(pairs, 3 * 5 + 3 * 4 / 2);
  EXPECT_EQ(pairs, 21);
}

// With every cache row identical, all visible scores of a query row are equal
// and exp(lse - score) is the number of keys the kernel attended to.
TEST(MlaSeed, CausalPairsFromTheKernels) {
  const MlaShape shape{.h_q = 2, .d_latent = 8, .d_rope = 4, .d_nope = 6, .d_v = 5};
  for (MlaPath path : {MlaPath::kAbsorbed, MlaPath::kExpanded}) {
    SyntheticBatch batch(
        SyntheticSpec{.shape = shape, .dtype = DType::kF32, .block_size = 4, .seqs = {{3, 8}}, .seed = 7});
    std::mt19937_64 rng(3);
    std::normal_distribution<float> d;
    std::vector<float> row(static_cast<size_t>(shape.d_cache()));
    for (float& v : row) v = d(rng);
    for (int64_t pos = 0; pos < 8; ++pos) batch.SetRow(0, pos, row);
    MlaParams p = batch.params();
    Workspace ws;
    ASSERT_TRUE(MlaForward(p, MlaConfig{.path = path, .kv_tile_rows = 64}, ws).ok());
    const auto rows = batch.SeqRows(0), q = batch.SeqQueries(0), wuk = batch.WukT(), lse = batch.SeqLse(0);
    for (int64_t h = 0; h < shape.h_q; ++h) {
      double pairs = 0;
      for (int64_t j = 0; j < 3; ++j) {
        const double* qj = &q[static_cast<size_t>((j * shape.h_q + h) * shape.d_qk())];
        double score = 0;
        for (int64_t pn = 0; pn < shape.d_nope; ++pn) {
          double k = 0;
          for (int64_t l = 0; l < shape.d_latent; ++l)
            k += rows[static_cast<size_t>(l)] * wuk[static_cast<size_t>((h * shape.d_nope + pn) * shape.d_latent + l)];
          score += qj[pn] * k;
        }
        for (int64_t r = 0; r < shape.d_rope; ++r)
          score += qj[shape.d_nope + r] * rows[static_cast<size_t>(shape.d_latent + r)];
        pairs += std::exp(lse[static_cast<size_t>(j * shape.h_q + h)] - score * p.softmax_scale);
      }
      EXPECT_NEAR(pairs, 21.0, 1e-3) << "path " << static_cast<int>(path) << " head " << h;
    }
  }
}

}  // namespace
}  // namespace mlarun
