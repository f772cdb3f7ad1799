// The CUDA ops against the CPU ops (llama.cpp test-backend-ops style): each op
// runs through its Run entry on both backends over a grid of shapes (odd
// sizes, 1 to 300 rows, f32 and bf16 weights, column ranges, accumulation,
// strided rows) on the same random inputs (never zero); padding that must not
// be read holds NaN (or, for logits, a value that would win), outputs that
// must be written start as NaN, padding that must not be written must still
// be NaN after. Agreement is reported per op and dtype as the normalized max
// error (max |cpu - cuda| / max |cpu|) and the cosine similarity. Without a
// GPU these skip.
//
// OpsMath tests hold the host-device functions the kernels share with the
// CPU (runtime/ops/*_math.h) to independent formulations and, for the greedy
// sampler's reduction, to Sampler::Sample bit for bit; they run in every
// build.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention/rope.h"
#include "base/cuda_device.h"
#include "base/device_memory.h"
#include "gemm/convert.h"
#include "runtime/ops/elementwise.h"
#include "runtime/ops/embedding.h"
#include "runtime/ops/linear.h"
#include "runtime/ops/moe_experts.h"
#include "runtime/ops/moe_gate.h"
#include "runtime/ops/moe_gate_math.h"
#include "runtime/ops/norm.h"
#include "runtime/ops/rope.h"
#include "runtime/ops/rope_math.h"
#include "runtime/ops/sampler.h"
#include "runtime/ops/sampling.h"
#include "runtime/ops/sampling_math.h"
#include "tests/runtime/ops/random_values.h"

namespace mlarun {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

using testing_values::Random;
using testing_values::RandomLinear;

// ---------------------------------------------------------------------------
// Host tests of the shared rules (every build).

// The choice order as a stable sort: larger keys first (NaN as -inf), ties in
// index order.
std::vector<int64_t> StableChoiceOrder(const std::vector<float>& v) {
  std::vector<int64_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  auto key = [&](int64_t i) { return std::isnan(v[static_cast<size_t>(i)]) ? -kInf : v[static_cast<size_t>(i)]; };
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return key(a) > key(b); });
  return idx;
}

// Values with many ties, both zeros, infinities and NaN.
std::vector<float> TieHeavy(Random& r, size_t n) {
  const float levels[] = {0.5f, 0.5f, -1.f, 2.f, -0.f, 0.f, -kInf, kInf, kNaN, 0.25f};
  std::vector<float> v(n);
  for (float& x : v) x = levels[r.Int(0, 9)];
  return v;
}

TEST(OpsMath, GateRankIsTheStableChoiceOrder) {
  Random r(101);
  for (size_t n : {1, 2, 5, 16, 37, 256})
    for (int rep = 0; rep < 20; ++rep) {
      const std::vector<float> v = rep % 2 ? TieHeavy(r, n) : r.Vector(n);
      const std::vector<int64_t> order = StableChoiceOrder(v);
      for (size_t pos = 0; pos < n; ++pos)
        ASSERT_EQ(GateRank(v.data(), static_cast<int64_t>(n), order[pos]), static_cast<int64_t>(pos))
            << "n " << n << " rep " << rep;
    }
}

TEST(OpsMath, GateGroupScoreIsTheBestOrTheSumOfTheTwoBest) {
  Random r(102);
  for (size_t n : {1, 2, 3, 8, 32})
    for (int rep = 0; rep < 20; ++rep) {
      const std::vector<float> v = rep % 2 ? TieHeavy(r, n) : r.Vector(n);
      const std::vector<int64_t> order = StableChoiceOrder(v);
      const float best = v[static_cast<size_t>(order[0])];
      const float two = n == 1 ? 0.f + best : (0.f + best) + v[static_cast<size_t>(order[1])];
      const float v2 = GateGroupScore(v.data(), static_cast<int64_t>(n), false);
      const float v3 = GateGroupScore(v.data(), static_cast<int64_t>(n), true);
      EXPECT_TRUE(v2 == best || (std::isnan(v2) && std::isnan(best))) << v2 << " vs " << best;
      EXPECT_TRUE(v3 == two || (std::isnan(v3) && std::isnan(two))) << v3 << " vs " << two;
    }
}

TEST(OpsMath, GateScoresAreTheDoubleExponentialRounded) {
  for (float x : {-20.f, -1.5f, -0.1f, 0.f, 0.3f, 4.f, 30.f}) {
    EXPECT_EQ(GateExp(x), static_cast<float>(std::exp(static_cast<double>(x))));
    EXPECT_EQ(GateSigmoid(x), 1.f / (1.f + static_cast<float>(std::exp(-static_cast<double>(x)))));
  }
}

TEST(OpsMath, RopePairsCoverTheSliceOnceAsTheLayoutsSay) {
  for (RopeLayout layout : {RopeLayout::kInterleavedToHalf, RopeLayout::kInterleaved, RopeLayout::kHalf})
    for (int64_t half : {1, 4, 32}) {
      std::vector<int> in(static_cast<size_t>(2 * half)), out(static_cast<size_t>(2 * half));
      for (int64_t j = 0; j < half; ++j) {
        const RopePair q = RopePairOf(layout, j, half);
        ++in[static_cast<size_t>(q.in_a)], ++in[static_cast<size_t>(q.in_b)];
        ++out[static_cast<size_t>(q.out_a)], ++out[static_cast<size_t>(q.out_b)];
        const bool pairs_adjacent = layout != RopeLayout::kHalf;
        EXPECT_EQ(q.in_a, pairs_adjacent ? 2 * j : j);
        EXPECT_EQ(q.in_b, pairs_adjacent ? 2 * j + 1 : j + half);
        EXPECT_EQ(q.out_a, layout == RopeLayout::kInterleaved ? 2 * j : j);
        EXPECT_EQ(q.out_b, layout == RopeLayout::kInterleaved ? 2 * j + 1 : j + half);
      }
      for (int64_t i = 0; i < 2 * half; ++i) {
        EXPECT_EQ(in[static_cast<size_t>(i)], 1) << i;
        EXPECT_EQ(out[static_cast<size_t>(i)], 1) << i;
      }
    }
  float a = 0, b = 0;
  RopeRotate(0.75f, -0.5f, 0.6f, 0.8f, a, b);
  EXPECT_FLOAT_EQ(a, 0.75f * 0.6f + 0.5f * 0.8f);
  EXPECT_FLOAT_EQ(b, -0.5f * 0.6f + 0.75f * 0.8f);
}

// Logit rows that exercise the greedy sampler's edges: kind 0 random, 1 a tie
// at the max (the lower id wins), 2 NaNs of both signs around the max, 3 all
// NaN, 4 all -inf, 5 two +inf, 6 -0 and +0 as the max with all else -inf,
// 7 values far below the max (weights that underflow to 0).
std::vector<float> GreedyEdgeRow(Random& r, int kind, int64_t vocab) {
  std::vector<float> row(static_cast<size_t>(vocab));
  for (float& x : row) x = r.Normal(3.f);
  if (vocab == 0) return row;
  auto at = [&](int64_t i) -> float& { return row[static_cast<size_t>(i % vocab)]; };
  switch (kind) {
    case 1:
      at(vocab - 1) = at(vocab / 3) = 40.f;
      break;
    case 2:
      at(0) = kNaN, at(vocab / 2) = -kNaN, at(vocab / 2 + 1) = 35.f, at(vocab - 1) = kNaN;
      break;
    case 3:
      std::fill(row.begin(), row.end(), kNaN);
      break;
    case 4:
      std::fill(row.begin(), row.end(), -kInf);
      break;
    case 5:
      at(vocab / 4) = kInf, at(vocab - 2) = kInf;
      break;
    case 6:
      std::fill(row.begin(), row.end(), -kInf);
      at(4) = -0.f, at(9) = 0.f;
      break;
    case 7:
      for (int64_t i = 0; i < vocab; i += 2) row[static_cast<size_t>(i)] = -1000.f;
      at(vocab / 5) = 800.f;
      break;
    default:
      break;
  }
  return row;
}

TEST(OpsMath, SamplerGreedyReduceGivesSampleBitForBit) {
  Random r(103);
  for (int64_t vocab : {0, 1, 3, 255, 256, 257, 1000, 4099, 129280})
    for (int kind = 0; kind < 8; ++kind) {
      SCOPED_TRACE("vocab " + std::to_string(vocab) + " kind " + std::to_string(kind));
      const std::vector<float> row = GreedyEdgeRow(r, kind, vocab);
      Sampler direct(SamplingParams{.temperature = 0.0, .seed = 5});
      Sampler reduced(SamplingParams{.temperature = 0.0, .seed = 5});
      ASSERT_TRUE(reduced.greedy());
      const SampledToken want = direct.Sample(row);
      const GreedyReduction g = SamplerGreedyReduce(row.data(), vocab);
      const SampledToken got = reduced.SampleGreedyFrom(g.argmax, g.weight_sum);
      EXPECT_EQ(got.token, want.token);
      EXPECT_EQ(std::memcmp(&got.logprob, &want.logprob, sizeof(double)), 0) << got.logprob << " vs " << want.logprob;
    }
  EXPECT_FALSE(Sampler(SamplingParams{.temperature = 0.5}).greedy());
  EXPECT_TRUE(Sampler(SamplingParams{.temperature = kMinSamplingTemperature / 2}).greedy());
}

TEST(OpsMath, CudaMoePlansAddTheSlotListsToTheWorkspace) {
  Random r(104);
  const int64_t T = 5, H = 16, E = 4, K = 2;
  const Linear gate = Linear::Owned(8, H, DType::kF32), up = Linear::Owned(8, H, DType::kF32),
               down = Linear::Owned(H, 8, DType::kF32);
  const Mlp m{.gate = gate, .up = up, .down = down};
  const std::vector<Mlp> experts(static_cast<size_t>(E), m);
  const std::vector<int32_t> route = {0, 1, 1, 2, 0, 2, 1, 3, 0, 1};
  const std::vector<float> x = r.Vector(static_cast<size_t>(T * H)), w = r.Vector(route.size());
  std::vector<float> y(x.size());
  MoeExpertsParams p{.experts = experts.data(),
                     .num_local = E,
                     .num_experts = E,
                     .shared = &m,
                     .x = x.data(),
                     .tokens = T,
                     .hidden = H,
                     .route_experts = route.data(),
                     .route_weights = w.data(),
                     .top_k = K,
                     .y = y.data()};
  MoePlan cpu, cuda;
  ASSERT_TRUE(MoeReplan(p, cpu).ok());
  p.backend = Backend::kCuda;
  ASSERT_TRUE(MoeReplan(p, cuda).ok());
  WorkspaceCarver want({});
  want.Take<float>(cpu.x_elems), want.Take<float>(cpu.h_elems), want.Take<float>(cpu.y_elems);
  EXPECT_EQ(cpu.workspace_bytes, want.used_bytes());
  want.Take<int32_t>(static_cast<size_t>(T * K)), want.Take<int64_t>(static_cast<size_t>(T * K));
  EXPECT_EQ(cuda.workspace_bytes, want.used_bytes());
}

// ---------------------------------------------------------------------------
// CUDA against CPU (skip without a GPU).

#define MLARUN_SKIP_WITHOUT_GPU()                                        \
  do {                                                                   \
    auto mlarun_devices_ = CudaDevices();                                \
    if (!mlarun_devices_.ok()) GTEST_SKIP() << mlarun_devices_.status(); \
  } while (0)

DeviceMemory& Gpu() { return *CudaMemory().value(); }

// A device copy of a host vector, and back.
template <class T>
struct DeviceVec {
  DeviceBuffer buf;
  T* data() const { return static_cast<T*>(buf.data()); }
};
template <class T>
DeviceVec<T> ToDevice(const std::vector<T>& host) {
  DeviceVec<T> d;
  auto b = DeviceBuffer::Allocate(Gpu(), std::max<size_t>(host.size(), 1) * sizeof(T), "a test buffer");
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return d;
  d.buf = std::move(*b);
  if (!host.empty()) {
    EXPECT_TRUE(Gpu().CopyIn(d.data(), host.data(), host.size() * sizeof(T)).ok());
  }
  return d;
}
template <class T>
std::vector<T> ToHost(const DeviceVec<T>& d, size_t n) {
  std::vector<T> host(n);
  if (n > 0) {
    EXPECT_TRUE(Gpu().CopyOut(host.data(), d.data(), n * sizeof(T)).ok());
  }
  return host;
}

// The worst agreement over one op's outputs in one dtype, printed once and
// held to its tolerances. NaN must sit exactly where the CPU has NaN (the
// padding the op must not write).
class Agreement {
 public:
  Agreement(std::string what, double max_err, double min_cosine)
      : what_(std::move(what)), max_err_(max_err), min_cosine_(min_cosine) {}
  ~Agreement() {
    std::printf("[ agree    ] %s: %lld outputs, normalized max error %.3g, min cosine %.9f\n", what_.c_str(),
                static_cast<long long>(outputs_), worst_err_, worst_cosine_);
  }
  void Add(const std::vector<float>& cpu, const std::vector<float>& cuda, const std::string& where) {
    ASSERT_EQ(cpu.size(), cuda.size()) << where;
    double scale = 0, err = 0, dot = 0, na = 0, nb = 0;
    for (size_t i = 0; i < cpu.size(); ++i) {
      if (std::isnan(cpu[i]) || std::isnan(cuda[i])) {
        ASSERT_TRUE(std::isnan(cpu[i]) && std::isnan(cuda[i]))
            << what_ << " " << where << " [" << i << "]: cpu " << cpu[i] << ", cuda " << cuda[i];
        continue;
      }
      const double a = cpu[i], b = cuda[i];
      scale = std::max(scale, std::abs(a));
      err = std::max(err, std::abs(a - b));
      dot += a * b, na += a * a, nb += b * b;
    }
    const double rel = scale > 0 ? err / scale : err;
    const double cosine = na > 0 && nb > 0 ? dot / std::sqrt(na * nb) : (na == nb ? 1.0 : 0.0);
    worst_err_ = std::max(worst_err_, rel);
    worst_cosine_ = std::min(worst_cosine_, cosine);
    ++outputs_;
    EXPECT_LE(rel, max_err_) << what_ << " " << where;
    EXPECT_GE(cosine, min_cosine_) << what_ << " " << where;
  }

 private:
  std::string what_;
  double max_err_, min_cosine_;
  double worst_err_ = 0, worst_cosine_ = 1;
  int64_t outputs_ = 0;
};

Linear OnGpu(const Linear& w) {
  Linear d = w;  // copies share the host bytes; Place gives this one its own
  const Status st = d.Place(Gpu(), "a test weight");
  EXPECT_TRUE(st.ok()) << st;
  return d;
}
Mlp RandomMlp(Random& r, int64_t hidden, int64_t inter, DType dt) {
  return Mlp{.gate = RandomLinear(r, inter, hidden, dt),
             .up = RandomLinear(r, inter, hidden, dt),
             .down = RandomLinear(r, hidden, inter, dt)};
}
Mlp OnGpu(const Mlp& m) { return Mlp{.gate = OnGpu(m.gate), .up = OnGpu(m.up), .down = OnGpu(m.down)}; }

// rows x cols of random values at row stride ld, NaN in the padding.
std::vector<float> Rows(Random& r, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<float> v(static_cast<size_t>(rows * ld), kNaN);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < cols; ++c) v[static_cast<size_t>(t * ld + c)] = r.Next();
  return v;
}

// Bit-equal outputs: the cosine is 1 up to its own rounding.
constexpr double kExactCosine = 1 - 1e-12;

// The MLP's hidden rows are rounded to bf16 for the down product: a hidden
// value within fp32 noise of a bf16 rounding boundary rounds the other way
// (1 bf16 ulp, 2^-8) on one side now and then, which moves its outputs by
// about 1e-3 of their scale.
double MlpTolerance(DType dt) { return dt == DType::kBF16 ? 3e-3 : 5e-5; }

std::string Shape(std::initializer_list<std::pair<const char*, int64_t>> dims) {
  std::string s;
  for (const auto& [name, v] : dims) s += std::string(s.empty() ? "" : " ") + name + "=" + std::to_string(v);
  return s;
}

TEST(OpsCuda, LinearMatchesCpu) {
  MLARUN_SKIP_WITHOUT_GPU();
  Random r(1);
  struct Dims {
    int64_t out, in;
  };
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Agreement agree(std::string("linear ") + std::string(DTypeName(dt)), 2e-5, 0.99999);
    for (const Dims d : {Dims{1, 1}, Dims{37, 61}, Dims{128, 256}, Dims{257, 129}}) {
      const Linear w = RandomLinear(r, d.out, d.in, dt);
      const Linear dw = OnGpu(w);
      for (int64_t rows : {1, 2, 7, 33, 300})
        for (bool range : {false, true})
          for (bool accumulate : {false, true}) {
            const int64_t c0 = range && d.out > 5 ? 3 : 0, c1 = range && d.out > 5 ? d.out - 2 : d.out;
            const int64_t n = c1 - c0, ldx = d.in + 5, ldy = n + 3;
            const std::vector<float> x = Rows(r, rows, d.in, ldx);
            // Accumulation starts from random values; otherwise from NaN
            // that the product must overwrite without reading.
            std::vector<float> y = accumulate ? Rows(r, rows, n, ldy) : std::vector<float>(rows * ldy, kNaN);
            const DeviceVec<float> dx = ToDevice(x), dy = ToDevice(y);
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
            const Status st = LinearRun({.w = &dw,
                                         .col_begin = c0,
                                         .col_end = c1,
                                         .x = dx.data(),
                                         .rows = rows,
                                         .ldx = ldx,
                                         .y = dy.data(),
                                         .ldy = ldy,
                                         .accumulate = accumulate,
                                         .backend = Backend::kCuda});
            ASSERT_TRUE(st.ok()) << st;
            agree.Add(y, ToHost(dy, y.size()),
                      Shape({{"out", d.out},
                             {"in", d.in},
                             {"rows", rows},
                             {"c0", c0},
                             {"c1", c1},
                             {"accumulate", accumulate}}));
          }
    }
  }
}

TEST(OpsCuda, SiluMulAndMlpMatchCpu) {
  MLARUN_SKIP_WITHOUT_GPU();
  Random r(2);
  {
    Agreement agree("silu_mul", 1e-6, 0.9999999);
    for (int64_t rows : {1, 5, 300})
      for (int64_t inter : {1, 37, 512}) {
        std::vector<float> h = r.Vector(static_cast<size_t>(rows * 2 * inter));
        const DeviceVec<float> dh = ToDevice(h);
        ASSERT_TRUE(SiluMulRun({.hidden = h.data(), .rows = rows, .inter = inter}).ok());
        ASSERT_TRUE(SiluMulRun({.hidden = dh.data(), .rows = rows, .inter = inter, .backend = Backend::kCuda}).ok());
        agree.Add(h, ToHost(dh, h.size()), Shape({{"rows", rows}, {"inter", inter}}));
      }
  }
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Agreement agree(std::string("mlp ") + std::string(DTypeName(dt)), MlpTolerance(dt), 0.9999);
    const int64_t H = 48, inter = 37;
    const Mlp m = RandomMlp(r, H, inter, dt);
    const Mlp dm = OnGpu(m);
    for (int64_t rows : {1, 9, 300})
      for (bool accumulate : {false, true}) {
        const int64_t ldx = H + 2, ldy = H + 3;
        const std::vector<float> x = Rows(r, rows, H, ldx);
        std::vector<float> y = accumulate ? Rows(r, rows, H, ldy) : std::vector<float>(rows * ldy, kNaN);
        std::vector<float> hidden(static_cast<size_t>(rows * 2 * inter), kNaN);
        const DeviceVec<float> dx = ToDevice(x), dy = ToDevice(y), dh = ToDevice(hidden);
        ASSERT_TRUE(MlpRun({.mlp = &m,
                            .x = x.data(),
                            .rows = rows,
                            .ldx = ldx,
                            .y = y.data(),
                            .ldy = ldy,
                            .accumulate = accumulate,
                            .hidden = hidden.data()})
                        .ok());
        const Status st = MlpRun({.mlp = &dm,
                                  .x = dx.data(),
                                  .rows = rows,
                                  .ldx = ldx,
                                  .y = dy.data(),
                                  .ldy = ldy,
                                  .accumulate = accumulate,
                                  .hidden = dh.data(),
                                  .backend = Backend::kCuda});
        ASSERT_TRUE(st.ok()) << st;
        agree.Add(y, ToHost(dy, y.size()), Shape({{"rows", rows}, {"accumulate", accumulate}}));
      }
  }
}

TEST(OpsCuda, RmsNormMatchesCpuInAndOutOfPlace) {
  MLARUN_SKIP_WITHOUT_GPU();
  Random r(3);
  Agreement agree("rms_norm", 2e-6, 0.9999999);
  for (int64_t rows : {1, 5, 300})
    for (int64_t n : {1, 7, 64, 1000, 7168})
      for (bool in_place : {false, true}) {
        const int64_t ldx = n + 3, ldy = in_place ? ldx : n + 2;
        std::vector<float> x = Rows(r, rows, n, ldx);
        const std::vector<float> weight = r.Vector(static_cast<size_t>(n));
        std::vector<float> y(static_cast<size_t>(rows * ldy), kNaN);
        const DeviceVec<float> dx = ToDevice(x), dy = ToDevice(y), dw = ToDevice(weight);
        ASSERT_TRUE(RmsNormRun({.x = x.data(),
                                .ldx = ldx,
                                .y = in_place ? x.data() : y.data(),
                                .ldy = ldy,
                                .rows = rows,
                                .n = n,
                                .weight = weight.data()})
                        .ok());
        const Status st = RmsNormRun({.x = dx.data(),
                                      .ldx = ldx,
                                      .y = in_place ? dx.data() : dy.data(),
                                      .ldy = ldy,
                                      .rows = rows,
                                      .n = n,
                                      .weight = dw.data(),
                                      .backend = Backend::kCuda});
        ASSERT_TRUE(st.ok()) << st;
        const std::string where = Shape({{"rows", rows}, {"n", n}, {"in_place", in_place}});
        if (in_place) {
          agree.Add(x, ToHost(dx, x.size()), where);
        } else {
          agree.Add(y, ToHost(dy, y.size()), where);
        }
      }
}

TEST(OpsCuda, EmbeddingMatchesCpuAndRefusesBadIdsWritingNothing) {
  MLARUN_SKIP_WITHOUT_GPU();
  Random r(4);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Agreement agree(std::string("embedding ") + std::string(DTypeName(dt)), 0, kExactCosine);
    for (int64_t width : {1, 37, 1024}) {
      const int64_t num_rows = 50, ld = width + 3, ld_out = width + 2;
      const std::vector<float> table_f32 = Rows(r, num_rows, width, ld);
      std::vector<std::byte> table(static_cast<size_t>(num_rows * ld) * DTypeSize(dt));
      StoreFromF32(table_f32.data(), table.data(), dt, num_rows * ld);
      const DeviceVec<std::byte> dtable = ToDevice(table);
      for (int64_t n : {1, 17, 300}) {
        std::vector<int32_t> ids(static_cast<size_t>(n));
        for (int32_t& id : ids) id = r.Int(0, num_rows - 1);
        ids.back() = num_rows - 1;
        std::vector<float> out(static_cast<size_t>(n * ld_out), kNaN);
        const DeviceVec<int32_t> dids = ToDevice(ids);
        const DeviceVec<float> dout = ToDevice(out);
        EmbeddingParams p{.table = table.data(),
                          .dtype = dt,
                          .num_rows = num_rows,
                          .width = width,
                          .ld = ld,
                          .ids = ids.data(),
                          .n = n,
                          .out = out.data(),
                          .ld_out = ld_out};
        ASSERT_TRUE(EmbeddingRun(p).ok());
        p.table = dtable.data(), p.ids = dids.data(), p.out = dout.data(), p.backend = Backend::kCuda;
        const Status st = EmbeddingRun(p);
        ASSERT_TRUE(st.ok()) << st;
        agree.Add(out, ToHost(dout, out.size()), Shape({{"width", width}, {"n", n}}));

        if (n < 17) continue;
        // Two bad ids: the first (lowest index) is named, nothing is written.
        ids[5] = static_cast<int32_t>(num_rows);
        ids[11] = -3;
        const DeviceVec<int32_t> dbad = ToDevice(ids);
        const std::vector<float> poisoned(out.size(), kNaN);
        const DeviceVec<float> dpoisoned = ToDevice(poisoned);
        p.ids = dbad.data(), p.out = dpoisoned.data();
        const Status bad = EmbeddingRun(p);
        EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
        EXPECT_NE(bad.message().find("ids[5] = 50"), std::string::npos) << bad;
        for (float v : ToHost(dpoisoned, poisoned.size())) ASSERT_TRUE(std::isnan(v)) << "a bad id wrote rows";
      }
    }
  }
}

TEST(OpsCuda, AddAndCopyRowsMatchCpu) {
  MLARUN_SKIP_WITHOUT_GPU();
  Random r(5);
  Agreement agree("add, copy_rows", 0, kExactCosine);
  for (int64_t n : {1, 1000, 1 << 20}) {
    std::vector<float> y = r.Vector(static_cast<size_t>(n));
    const std::vector<float> x = r.Vector(static_cast<size_t>(n));
    const DeviceVec<float> dy = ToDevice(y), dx = ToDevice(x);
    ASSERT_TRUE(AddRun({.y = y.data(), .x = x.data(), .n = n}).ok());
    ASSERT_TRUE(AddRun({.y = dy.data(), .x = dx.data(), .n = n, .backend = Backend::kCuda}).ok());
    agree.Add(y, ToHost(dy, y.size()), Shape({{"add n", n}}));
  }
  for (int64_t rows : {1, 7, 300})
    for (int64_t cols : {1, 64}) {
      const int64_t ldx = cols + 5, ldy = cols + 1;
      const std::vector<float> x = Rows(r, rows, cols, ldx);
      std::vector<float> y(static_cast<size_t>(rows * ldy), kNaN);
      const DeviceVec<float> dx = ToDevice(x), dy = ToDevice(y);
      ASSERT_TRUE(CopyRowsRun({.x = x.data(), .ldx = ldx, .y = y.data(), .ldy = ldy, .rows = rows, .cols = cols}).ok());
      ASSERT_TRUE(CopyRowsRun({.x = dx.data(),
                               .ldx = ldx,
                               .y = dy.data(),
                               .ldy = ldy,
                               .rows = rows,
                               .cols = cols,
                               .backend = Backend::kCuda})
                      .ok());
      agree.Add(y, ToHost(dy, y.size()), Shape({{"copy rows", rows}, {"cols", cols}}));
    }
}

TEST(OpsCuda, RopeMatchesCpuInEveryLayout) {
  MLARUN_SKIP_WITHOUT_GPU();
  Random r(6);
  Agreement agree("rope", 2e-6, 0.9999999);
  for (RopeLayout layout : {RopeLayout::kInterleavedToHalf, RopeLayout::kInterleaved, RopeLayout::kHalf})
    for (int64_t dim : {8, 64}) {
      RopeConfig config{.dim = dim, .theta = 10000.0, .layout = layout, .scaling = {}};
      config.scaling = RopeScaling{.type = RopeScaling::Type::kYarn,
                                   .factor = 40,
                                   .original_max_position_embeddings = 4096,
                                   .mscale = 1,
                                   .mscale_all_dim = 1};
      auto rope = Rope::Create(config);
      ASSERT_TRUE(rope.ok()) << rope.status();
      const DeviceVec<float> dfreq = ToDevice(rope->inv_freq());
      for (int64_t tokens : {1, 13, 300})
        for (int64_t heads : {1, 3, 16}) {
          // Each head's rope slice after `offset` floats; all else NaN and
          // never touched.
          const int64_t offset = 5, stride_head = dim + 7, stride_token = heads * stride_head + 3;
          std::vector<float> x(static_cast<size_t>(tokens * stride_token), kNaN);
          for (int64_t t = 0; t < tokens; ++t)
            for (int64_t h = 0; h < heads; ++h)
              for (int64_t j = 0; j < dim; ++j)
                x[static_cast<size_t>(t * stride_token + h * stride_head + offset + j)] = r.Next();
          std::vector<int32_t> positions(static_cast<size_t>(tokens));
          for (int32_t& p : positions) p = r.Int(0, 160000);
          const DeviceVec<float> dx = ToDevice(x);
          const DeviceVec<int32_t> dpos = ToDevice(positions);
          const RopeParams base{
              .n_tokens = tokens, .n_heads = heads, .stride_token = stride_token, .stride_head = stride_head};
          RopeParams p = WithRopeTables(base, *rope);
          p.x = x.data() + offset, p.positions = positions.data();
          ASSERT_TRUE(RopeRun(p).ok());
          RopeParams q = WithRopeTables(base, *rope, dfreq.data());
          q.x = dx.data() + offset, q.positions = dpos.data(), q.backend = Backend::kCuda;
          const Status st = RopeRun(q);
          ASSERT_TRUE(st.ok()) << st;
          agree.Add(x, ToHost(dx, x.size()),
                    Shape({{"layout", static_cast<int>(layout)}, {"dim", dim}, {"tokens", tokens}, {"heads", heads}}));
        }
    }
}

TEST(OpsCuda, MoeGateChoosesTheCpusExpertsAndWeights) {
  MLARUN_SKIP_WITHOUT_GPU();
  Random r(7);
  struct Case {
    const char* name;
    ScoringFunc scoring;
    TopkMethod method;
    int64_t experts, top_k, n_group, topk_group;
    bool bias, norm, ties;
  };
  for (const Case& c : {
           Case{"v2 greedy", ScoringFunc::kSoftmax, TopkMethod::kGreedy, 37, 5, 1, 1, false, false, false},
           Case{"v2 group-limited", ScoringFunc::kSoftmax, TopkMethod::kGroupLimitedGreedy, 160, 6, 8, 3, false, false,
                false},
           Case{"v2 group-limited ties", ScoringFunc::kSoftmax, TopkMethod::kGroupLimitedGreedy, 64, 6, 8, 3, false,
                true, true},
           Case{"v3 noaux_tc", ScoringFunc::kSigmoid, TopkMethod::kNoauxTc, 256, 8, 8, 4, true, true, false},
           Case{"v3 noaux_tc ties", ScoringFunc::kSigmoid, TopkMethod::kNoauxTc, 72, 8, 6, 2, true, true, true},
           Case{"v3 one group", ScoringFunc::kSigmoid, TopkMethod::kNoauxTc, 300, 7, 1, 1, true, false, false},
       }) {
    Agreement agree(std::string("moe_gate weights ") + c.name, 1e-6, 0.9999999);
    for (int64_t tokens : {1, 7, 300}) {
      const int64_t E = c.experts, K = c.top_k;
      std::vector<float> logits = r.Vector(static_cast<size_t>(tokens * E)), bias = r.Vector(static_cast<size_t>(E));
      if (c.ties) {  // few distinct values: equal scores, equal group scores
        for (float& v : logits) v = static_cast<float>(r.Int(-2, 2)) * 0.5f;
        for (float& v : bias) v = static_cast<float>(r.Int(0, 1)) * 0.25f;
      }
      std::vector<int32_t> experts(static_cast<size_t>(tokens * K), -7);
      std::vector<float> weights(experts.size(), kNaN);
      const DeviceVec<float> dlogits = ToDevice(logits), dbias = ToDevice(bias), dweights = ToDevice(weights);
      const DeviceVec<int32_t> dexperts = ToDevice(experts);
      MoeGateParams p{.logits = logits.data(),
                      .tokens = tokens,
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
      p.logits = dlogits.data(), p.bias = c.bias ? dbias.data() : nullptr, p.experts = dexperts.data(),
      p.weights = dweights.data(), p.backend = Backend::kCuda;
      const Status st = MoeGateRun(p);
      ASSERT_TRUE(st.ok()) << st;
      const std::vector<int32_t> got = ToHost(dexperts, experts.size());
      for (size_t i = 0; i < experts.size(); ++i)
        ASSERT_EQ(got[i], experts[i]) << c.name << " tokens " << tokens << " slot " << i;
      agree.Add(weights, ToHost(dweights, weights.size()), Shape({{"tokens", tokens}}));
    }
  }
}

TEST(OpsCuda, MoeExpertsMatchCpuWithEmptyOneAndManyTokenExperts) {
  MLARUN_SKIP_WITHOUT_GPU();
  Random r(8);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Agreement agree(std::string("moe_experts ") + std::string(DTypeName(dt)), MlpTolerance(dt), 0.9999);
    // Global experts 0..7; this rank holds 2..5: 2 gets no token, 3 one
    // (token 0), 4 every token, 5 all but token 0; slot 2 routes to
    // another rank's expert (adds 0).
    const int64_t H = 48, inter = 40, E = 8, K = 3, begin = 2, local = 4;
    std::vector<Mlp> experts, dexperts;
    for (int64_t e = 0; e < local; ++e) experts.push_back(RandomMlp(r, H, inter + e, dt));
    for (const Mlp& m : experts) dexperts.push_back(OnGpu(m));
    const Mlp shared = RandomMlp(r, H, 24, dt);
    const Mlp dshared = OnGpu(shared);
    for (int64_t tokens : {1, 5, 300})
      for (bool with_shared : {false, true}) {
        std::vector<int32_t> route(static_cast<size_t>(tokens * K));
        for (int64_t t = 0; t < tokens; ++t) {
          route[static_cast<size_t>(t * K)] = 4;
          route[static_cast<size_t>(t * K + 1)] = t == 0 ? 3 : 5;
          route[static_cast<size_t>(t * K + 2)] = static_cast<int32_t>(std::vector<int>{0, 1, 6, 7}[t % 4]);
        }
        const std::vector<float> x = r.Vector(static_cast<size_t>(tokens * H)), weights = r.Vector(route.size());
        std::vector<float> y(static_cast<size_t>(tokens * H), kNaN);
        const DeviceVec<float> dx = ToDevice(x), dweights = ToDevice(weights), dy = ToDevice(y);
        MoeExpertsParams p{.experts = experts.data(),
                           .num_local = local,
                           .expert_begin = begin,
                           .num_experts = E,
                           .shared = with_shared ? &shared : nullptr,
                           .x = x.data(),
                           .tokens = tokens,
                           .hidden = H,
                           .route_experts = route.data(),
                           .route_weights = weights.data(),
                           .top_k = K,
                           .y = y.data()};
        MoePlan plan;
        ASSERT_TRUE(MoeReplan(p, plan).ok());
        Workspace ws;
        ASSERT_TRUE(MoeExpertsRun(p, plan, ws.Reserve(plan.workspace_bytes)).ok());

        // The device run: its weights, its rows, route ids still on the host.
        p.experts = dexperts.data(), p.shared = with_shared ? &dshared : nullptr, p.x = dx.data(),
        p.route_weights = dweights.data(), p.y = dy.data(), p.backend = Backend::kCuda;
        MoePlan dplan;
        ASSERT_TRUE(MoeReplan(p, dplan).ok());
        EXPECT_EQ(dplan.routed_jobs, static_cast<size_t>(tokens > 1 ? 3 : 2));
        Workspace dws(&Gpu());
        const WorkspaceView view = dws.Reserve(dplan.workspace_bytes);
        ASSERT_NE(view.data, nullptr);
        ASSERT_TRUE(Gpu().CopyIn(view.data, std::vector<float>(view.bytes / 4, kNaN).data(), view.bytes / 4 * 4).ok());
        const Status st = MoeExpertsRun(p, dplan, view);
        ASSERT_TRUE(st.ok()) << st;
        agree.Add(y, ToHost(dy, y.size()), Shape({{"tokens", tokens}, {"shared", with_shared}}));

        // A plan made for the CPU is too small for the device run: refused.
        if (tokens == 5) {
          const Status small = MoeExpertsRun(p, plan, dws.Reserve(plan.workspace_bytes));
          EXPECT_EQ(small.code(), StatusCode::kInvalidArgument) << small;
        }
      }
  }
}

// The CUDA sampler's draws equal the CPU's bit for bit: token, logprob
// (its bytes) and most likely tokens, row by row.
void ExpectSameSamples(const std::vector<SampledToken>& want, const std::vector<SampledToken>& got, int step) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t row = 0; row < want.size(); ++row) {
    const SampledToken& a = want[row];
    const SampledToken& b = got[row];
    EXPECT_EQ(b.token, a.token) << "step " << step << " row " << row;
    EXPECT_EQ(std::memcmp(&a.logprob, &b.logprob, sizeof(double)), 0)
        << "step " << step << " row " << row << ": " << a.logprob << " vs " << b.logprob;
    ASSERT_EQ(b.num_top, a.num_top) << "step " << step << " row " << row;
    for (int32_t j = 0; j < a.num_top; ++j) EXPECT_EQ(b.top[j], a.top[j]) << "step " << step << " row " << row;
  }
}

TEST(OpsCuda, SampleGivesTheCpuSamplersTokensAndLogprobs) {
  MLARUN_SKIP_WITHOUT_GPU();
  Random r(9);
  const std::vector<SamplingParams> kinds = {
      SamplingParams{.temperature = 0.0},
      SamplingParams{.temperature = 0.8, .seed = 11},
      SamplingParams{.temperature = 1.0, .top_k = 40, .seed = 12},
      SamplingParams{.temperature = 0.6, .top_p = 0.9, .seed = 13},
      // Listing the most likely tokens: a greedy row then comes to the host whole.
      SamplingParams{.temperature = 0.0, .logprobs = 5},
      SamplingParams{.temperature = 0.8, .seed = 14, .logprobs = 3},
  };
  for (int64_t vocab : {0, 1, 7, 256, 257, 4099, 129280}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    const int64_t rows = 24, ld = vocab + 3;
    // Row r: edge kind r % 8 with sampler kind (r / 8 == 0 ? greedy : the
    // tempered ones in turn, then those that list their most likely tokens),
    // so every edge meets greedy and tempered samplers.
    std::vector<Sampler> cpu, cuda;
    for (int64_t row = 0; row < rows; ++row) {
      const size_t kind = row / 8 == 0   ? 0
                          : row / 8 == 1 ? 1 + static_cast<size_t>(row % 3)
                                         : 4 + static_cast<size_t>(row % 2);
      const SamplingParams& sp = kinds[kind];
      cpu.emplace_back(sp);
      cuda.emplace_back(sp);
    }
    std::vector<Sampler*> cpu_ptrs, cuda_ptrs;
    for (int64_t row = 0; row < rows; ++row) cpu_ptrs.push_back(&cpu[row]), cuda_ptrs.push_back(&cuda[row]);
    for (int step = 0; step < 3; ++step) {  // the streams stay aligned step after step
      // Padding that would win every row if it were read.
      std::vector<float> logits(static_cast<size_t>(rows * ld), 1e30f);
      for (int64_t row = 0; row < rows; ++row) {
        const std::vector<float> v = GreedyEdgeRow(r, static_cast<int>(row % 8), vocab);
        std::copy(v.begin(), v.end(), logits.begin() + row * ld);
      }
      const DeviceVec<float> dlogits = ToDevice(logits);
      std::vector<SampledToken> want(static_cast<size_t>(rows)), got(static_cast<size_t>(rows));
      ASSERT_TRUE(SampleRun({.logits = vocab > 0 ? logits.data() : nullptr,
                             .rows = rows,
                             .vocab = vocab,
                             .ld = ld,
                             .samplers = cpu_ptrs.data(),
                             .out = want.data()})
                      .ok());
      const Status st = SampleRun({.logits = vocab > 0 ? dlogits.data() : nullptr,
                                   .rows = rows,
                                   .vocab = vocab,
                                   .ld = ld,
                                   .samplers = cuda_ptrs.data(),
                                   .out = got.data(),
                                   .backend = Backend::kCuda});
      ASSERT_TRUE(st.ok()) << st;
      ExpectSameSamples(want, got, step);
    }
  }
}

// Penalties, biases and min_tokens on the device: greedy and tempered rows
// with them come to the host whole and give the CPU's tokens and logprobs,
// step after step as each request's output grows.
TEST(OpsCuda, PenalizedSampleGivesTheCpuSamplersTokens) {
  MLARUN_SKIP_WITHOUT_GPU();
  Random r(31);
  const int64_t vocab = 4099, rows = 6;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 50; ++i) prompt.push_back(r.Int(0, 59));
  const std::vector<int64_t> eos = {7};
  std::vector<SamplingParams> kinds(static_cast<size_t>(rows));
  kinds[0] = {.temperature = 0.0, .repetition_penalty = 1.5};
  kinds[1] = {.temperature = 0.0, .presence_penalty = 1.0, .frequency_penalty = 0.5};
  kinds[2] = {.temperature = 0.0, .logit_bias = {{3, 100.0}, {9, -50.0}}};
  kinds[3] = {.temperature = 0.0, .max_tokens = 8, .stop_token_ids = {11}, .min_tokens = 3};
  kinds[4] = {.temperature = 0.9, .seed = 4, .frequency_penalty = 0.3, .repetition_penalty = 1.2};
  kinds[5] = {.temperature = 0.0, .logprobs = 3, .presence_penalty = -1.0};
  std::vector<Sampler> cpu, cuda;
  for (const SamplingParams& sp : kinds) {
    cpu.emplace_back(sp, SamplerHistory{.prompt = prompt, .eos_token_ids = eos});
    cuda.emplace_back(sp, SamplerHistory{.prompt = prompt, .eos_token_ids = eos});
  }
  std::vector<Sampler*> cpu_ptrs, cuda_ptrs;
  for (int64_t row = 0; row < rows; ++row) cpu_ptrs.push_back(&cpu[row]), cuda_ptrs.push_back(&cuda[row]);
  for (int step = 0; step < 6; ++step) {
    std::vector<float> logits(static_cast<size_t>(rows * vocab));
    for (float& x : logits) x = r.Normal(3.f);
    for (int64_t row = 0; row < rows; ++row) {  // the EOS and stop ids lead
      logits[static_cast<size_t>(row * vocab + 7)] = 20.f;
      logits[static_cast<size_t>(row * vocab + 11)] = 19.f;
    }
    const DeviceVec<float> dlogits = ToDevice(logits);
    std::vector<SampledToken> want(static_cast<size_t>(rows)), got(static_cast<size_t>(rows));
    ASSERT_TRUE(SampleRun({.logits = logits.data(),
                           .rows = rows,
                           .vocab = vocab,
                           .ld = vocab,
                           .samplers = cpu_ptrs.data(),
                           .out = want.data()})
                    .ok());
    const Status st = SampleRun({.logits = dlogits.data(),
                                 .rows = rows,
                                 .vocab = vocab,
                                 .ld = vocab,
                                 .samplers = cuda_ptrs.data(),
                                 .out = got.data(),
                                 .backend = Backend::kCuda});
    ASSERT_TRUE(st.ok()) << st;
    ExpectSameSamples(want, got, step);
    if (step < 3) {
      EXPECT_NE(got[3].token, 7) << "min_tokens masks the EOS";
    }
    EXPECT_EQ(got[2].token, 3) << "a bias of 100 wins";
  }
}

// bad_words on the device: rows with them come to the host whole
// (modifies_logits) and give the CPU's tokens, as each output grows into
// and out of a banned sequence's prefix.
TEST(OpsCuda, BadWordsSampleGivesTheCpuSamplersTokens) {
  MLARUN_SKIP_WITHOUT_GPU();
  Random r(37);
  const int64_t vocab = 4099, rows = 3;
  std::vector<SamplingParams> kinds(static_cast<size_t>(rows));
  kinds[0] = {.temperature = 0.0, .bad_words = {{7}}};              // never 7
  kinds[1] = {.temperature = 0.0, .bad_words = {{7, 7}, {11, 7}}};  // 7 only first
  kinds[2] = {.temperature = 0.8, .seed = 5, .bad_words = {{7}, {11, 11}}};
  std::vector<Sampler> cpu, cuda;
  for (const SamplingParams& sp : kinds) cpu.emplace_back(sp), cuda.emplace_back(sp);
  std::vector<Sampler*> cpu_ptrs, cuda_ptrs;
  for (int64_t row = 0; row < rows; ++row) cpu_ptrs.push_back(&cpu[row]), cuda_ptrs.push_back(&cuda[row]);
  for (int step = 0; step < 6; ++step) {
    std::vector<float> logits(static_cast<size_t>(rows * vocab));
    for (float& x : logits) x = r.Normal(3.f);
    for (int64_t row = 0; row < rows; ++row) {  // 7 and 11 lead
      logits[static_cast<size_t>(row * vocab + 7)] = 30.f;
      logits[static_cast<size_t>(row * vocab + 11)] = 29.f;
    }
    const DeviceVec<float> dlogits = ToDevice(logits);
    std::vector<SampledToken> want(static_cast<size_t>(rows)), got(static_cast<size_t>(rows));
    ASSERT_TRUE(SampleRun({.logits = logits.data(),
                           .rows = rows,
                           .vocab = vocab,
                           .ld = vocab,
                           .samplers = cpu_ptrs.data(),
                           .out = want.data()})
                    .ok());
    const Status st = SampleRun({.logits = dlogits.data(),
                                 .rows = rows,
                                 .vocab = vocab,
                                 .ld = vocab,
                                 .samplers = cuda_ptrs.data(),
                                 .out = got.data(),
                                 .backend = Backend::kCuda});
    ASSERT_TRUE(st.ok()) << st;
    ExpectSameSamples(want, got, step);
    EXPECT_EQ(got[0].token, 11) << "step " << step;
    EXPECT_EQ(got[1].token, step == 0 ? 7 : 11) << "step " << step;
    EXPECT_NE(got[2].token, 7) << "step " << step;
  }
}

// Prompt tokens scored on the device: each row read back and scored as the
// CPU scores it, bit for bit.
TEST(OpsCuda, ScoreGivesTheCpusLogprobs) {
  MLARUN_SKIP_WITHOUT_GPU();
  Random r(10);
  for (int64_t vocab : {1, 7, 257, 129280}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    const int64_t rows = 5, ld = vocab + 3;
    std::vector<float> logits(static_cast<size_t>(rows * ld), 1e30f);  // padding that must not be read
    for (int64_t row = 0; row < rows; ++row) {
      const std::vector<float> v = GreedyEdgeRow(r, static_cast<int>(row % 8), vocab);
      std::copy(v.begin(), v.end(), logits.begin() + row * ld);
    }
    std::vector<int32_t> tokens;
    for (int64_t row = 0; row < rows; ++row) tokens.push_back(static_cast<int32_t>((row * 31) % vocab));
    const DeviceVec<float> dlogits = ToDevice(logits);
    std::vector<SampledToken> want(static_cast<size_t>(rows)), got(static_cast<size_t>(rows));
    ASSERT_TRUE(ScoreRun({.logits = logits.data(),
                          .rows = rows,
                          .vocab = vocab,
                          .ld = ld,
                          .tokens = tokens.data(),
                          .top = 4,
                          .out = want.data()})
                    .ok());
    const Status st = ScoreRun({.logits = dlogits.data(),
                                .rows = rows,
                                .vocab = vocab,
                                .ld = ld,
                                .tokens = tokens.data(),
                                .top = 4,
                                .out = got.data(),
                                .backend = Backend::kCuda});
    ASSERT_TRUE(st.ok()) << st;
    for (int64_t row = 0; row < rows; ++row) {
      const SampledToken& a = want[static_cast<size_t>(row)];
      const SampledToken& b = got[static_cast<size_t>(row)];
      EXPECT_EQ(b.token, a.token) << row;
      EXPECT_EQ(std::memcmp(&a.logprob, &b.logprob, sizeof(double)), 0) << row;
      ASSERT_EQ(b.num_top, a.num_top) << row;
      for (int32_t j = 0; j < a.num_top; ++j) EXPECT_EQ(b.top[j], a.top[j]) << row;
    }
  }
}

}  // namespace
}  // namespace mlarun
