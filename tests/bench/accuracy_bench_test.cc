// `mlarun bench accuracy`: the metrics against references written here
// (long double, the softmax taken naively, where float and double would
// overflow), the ids file, the options' errors, and whole runs on the tiny
// model with logits files written by this test.
#include "bench/accuracy_bench.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/local_cache.h"
#include "runtime/model/model.h"

namespace mlarun {
namespace {

const std::string kTiny = std::string(MLARUN_CONFIGS_DIR) + "/models/tiny.yaml";

std::vector<float> RandomLogits(std::mt19937& rng, size_t n, float scale, float shift = 0) {
  std::normal_distribution<float> d(0, 1);
  std::vector<float> v(n);
  for (float& x : v) x = shift + scale * d(rng);
  return v;
}

// The softmax taken as written, exp(x_i) / sum_j exp(x_j), in long double
// (whose range holds exp(11000)).
std::vector<long double> NaiveSoftmax(const std::vector<float>& x) {
  std::vector<long double> p(x.size());
  long double sum = 0;
  for (size_t i = 0; i < x.size(); ++i) sum += p[i] = std::exp(static_cast<long double>(x[i]));
  for (long double& e : p) e /= sum;
  return p;
}

double ReferenceKl(const std::vector<float>& ref, const std::vector<float>& x) {
  const auto pr = NaiveSoftmax(ref), px = NaiveSoftmax(x);
  long double kl = 0;
  for (size_t i = 0; i < pr.size(); ++i) kl += pr[i] * std::log(pr[i] / px[i]);
  return static_cast<double>(kl);
}

double ReferenceRelErr(const std::vector<float>& ref, const std::vector<float>& x) {
  long double d = 0, n = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    d += std::pow(static_cast<long double>(x[i]) - ref[i], 2);
    n += std::pow(static_cast<long double>(ref[i]), 2);
  }
  return static_cast<double>(std::sqrt(d / n));
}

TEST(AccuracyMetrics, RelativeErrorMatchesLongDouble) {
  std::mt19937 rng(1);
  for (float scale : {0.01f, 1.0f, 1000.0f}) {
    const auto ref = RandomLogits(rng, 4099, scale);
    auto x = ref;
    std::normal_distribution<float> noise(0, 0.03f * scale);
    for (float& v : x) v += noise(rng);
    const double want = ReferenceRelErr(ref, x);
    EXPECT_NEAR(RelativeError(ref, x), want, 1e-12 * want) << scale;
    EXPECT_GT(want, 0.02);  // the noise is there
  }
  EXPECT_EQ(RelativeError(std::vector<float>{1, 2}, std::vector<float>{1, 2}), 0.0);
  EXPECT_EQ(RelativeError(std::vector<float>{0, 0}, std::vector<float>{0, 0}), 0.0);
  EXPECT_TRUE(std::isinf(RelativeError(std::vector<float>{0, 0}, std::vector<float>{0, 1})));
}

TEST(AccuracyMetrics, KlMatchesNaiveSoftmaxInLongDouble) {
  std::mt19937 rng(2);
  // Logits around 3000: exp overflows float at 89 and double at 710; the
  // naive reference in long double does not.
  for (auto [scale, shift] : {std::pair{1.0f, 0.0f}, {4.0f, -7.0f}, {2.0f, 3000.0f}, {6.0f, -2500.0f}}) {
    const auto ref = RandomLogits(rng, 2053, scale, shift);
    auto x = ref;
    std::normal_distribution<float> noise(0, 0.2f);
    for (float& v : x) v += noise(rng);
    x[17] += 40;  // one token much more likely: a KL well above rounding
    const double want = ReferenceKl(ref, x);
    ASSERT_TRUE(std::isfinite(want));
    EXPECT_GT(want, 1e-3) << shift;
    EXPECT_NEAR(KlDivergence(ref, x), want, 1e-9 * want + 1e-12) << "scale " << scale << " shift " << shift;
  }
  // A constant shift leaves the distribution as it is.
  std::vector<float> a = {0.5f, -1.25f, 2.0f, 3.5f}, b = a;
  for (float& v : b) v += 1024;  // exact in float
  EXPECT_NEAR(KlDivergence(a, b), 0.0, 1e-12);
  // Two tokens: KL(p || q) = p log(p/q) + (1-p) log((1-p)/(1-q)).
  const std::vector<float> r2 = {0, 1}, x2 = {0, -2};
  const double p = 1 / (1 + std::exp(-1.0)), q = 1 / (1 + std::exp(2.0));
  EXPECT_NEAR(KlDivergence(r2, x2), p * std::log(p / q) + (1 - p) * std::log((1 - p) / (1 - q)), 1e-14);
}

TEST(AccuracyMetrics, Top1TiesTakeTheLowestIdOfTheModel) {
  const std::vector<float> ref = {0, 1, 2, 5, 1, 0, 2, 5};  // 3 and 7 tie for the reference's top
  EXPECT_EQ(Argmax(ref), 3);
  EXPECT_TRUE(Top1Agrees(ref, std::vector<float>{0, 0, 0, 0, 0, 0, 0, 9}));   // 7: one of the reference's top
  EXPECT_TRUE(Top1Agrees(ref, std::vector<float>{0, 0, 0, 9, 0, 0, 0, 0}));   // 3 as well
  EXPECT_FALSE(Top1Agrees(ref, std::vector<float>{0, 0, 9, 0, 0, 0, 0, 9}));  // greedy takes 2 of 2 and 7
  EXPECT_TRUE(Top1Agrees(ref, std::vector<float>{0, 0, 0, 9, 0, 0, 0, 9}));   // 3 of 3 and 7
  EXPECT_FALSE(Top1Agrees(ref, std::vector<float>{9, 0, 0, 0, 0, 0, 0, 0}));
}

TEST(AccuracyMetrics, QuantilesInterpolateAsNumpy) {
  EXPECT_DOUBLE_EQ(Quantile({4, 1, 3, 2}, 0.5), 2.5);
  EXPECT_DOUBLE_EQ(Quantile({4, 1, 3, 2}, 0.99), 3.97);  // numpy.quantile([1,2,3,4], 0.99)
  EXPECT_DOUBLE_EQ(Quantile({4, 1, 3, 2}, 1.0), 4);
  EXPECT_DOUBLE_EQ(Quantile({7}, 0.99), 7);
  EXPECT_DOUBLE_EQ(Quantile({}, 0.5), 0);
}

TEST(AccuracyMetrics, ComparisonSummarizesEveryPosition) {
  std::mt19937 rng(3);
  LogitComparison cmp;
  std::vector<double> rel, kl;
  int agree = 0;
  const int positions = 101;
  for (int p = 0; p < positions; ++p) {
    const auto ref = RandomLogits(rng, 301, 3);
    auto x = ref;
    std::normal_distribution<float> noise(0, 0.05f * static_cast<float>(p % 7 + 1));
    for (float& v : x) v += noise(rng);
    if (p % 5 == 0) std::swap(x[static_cast<size_t>(Argmax(ref))], x[0]);  // top-1 moved away
    rel.push_back(ReferenceRelErr(ref, x));
    kl.push_back(ReferenceKl(ref, x));
    agree += std::max_element(x.begin(), x.end()) - x.begin() == std::max_element(ref.begin(), ref.end()) - ref.begin();
    ASSERT_TRUE(cmp.Add(ref, x, "m").ok());
  }
  const auto s = cmp.Summarize();
  EXPECT_EQ(s.positions, positions);
  double rel_sum = 0, kl_sum = 0;
  for (int p = 0; p < positions; ++p) rel_sum += rel[p], kl_sum += kl[p];
  std::sort(rel.begin(), rel.end());
  std::sort(kl.begin(), kl.end());
  EXPECT_NEAR(s.rel_err_mean, rel_sum / positions, 1e-12);
  EXPECT_NEAR(s.rel_err_median, rel[50], 1e-12);  // 101 values: the 51st
  EXPECT_NEAR(s.rel_err_max, rel.back(), 1e-12);
  EXPECT_NEAR(s.kl_mean, kl_sum / positions, 1e-9 * kl_sum);
  EXPECT_NEAR(s.kl_p99, kl[99], 1e-9 * kl.back());  // 0.99 x 100 = rank 99 exactly
  EXPECT_NEAR(s.kl_max, kl.back(), 1e-9 * kl.back());
  EXPECT_NEAR(s.top1_percent, 100.0 * agree / positions, 1e-12);
  EXPECT_LT(s.top1_percent, 100);
}

TEST(AccuracyMetrics, NonFiniteOrMismatchedLogitsAreErrors) {
  LogitComparison cmp;
  const std::vector<float> ref = {1, 2, 3};
  ASSERT_TRUE(cmp.Add(ref, ref, "m").ok());
  const Status nan = cmp.Add(ref, std::vector<float>{1, std::nanf(""), 3}, "int4");
  EXPECT_EQ(nan.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(nan.message().find("int4: logit 1 at position 1"), std::string::npos) << nan;
  const Status inf = cmp.Add(std::vector<float>{1, 2, INFINITY}, ref, "int4");
  EXPECT_NE(inf.message().find("reference's logit 2"), std::string::npos) << inf;
  const Status width = cmp.Add(ref, std::vector<float>{1, 2}, "q8");
  EXPECT_NE(width.message().find("q8: position 1 has 2 logits, the reference 3"), std::string::npos) << width;
  EXPECT_EQ(cmp.Summarize().positions, 1);
}

AccuracyBenchOptions Valid() {
  return AccuracyBenchOptions{.models = {kTiny}, .reference = kTiny, .positions = 32, .sequence_length = 16};
}

void ExpectInvalid(const AccuracyBenchOptions& o, const std::string& text) {
  const Status st = ValidateAccuracyOptions(o);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << text;
  EXPECT_NE(st.message().find(text), std::string::npos) << st;
}

TEST(AccuracyOptions, ErrorsNameTheFlag) {
  EXPECT_TRUE(ValidateAccuracyOptions(Valid()).ok());
  AccuracyBenchOptions o = Valid();
  o.positions = 0;
  ExpectInvalid(o, "--positions must be positive, got 0");
  o = Valid();
  o.sequence_length = -3;
  ExpectInvalid(o, "--sequence-length must be positive, got -3");
  o = Valid();
  o.positions = 40;
  ExpectInvalid(o, "--positions (40) must be a multiple of --sequence-length (16)");
  o = Valid();
  o.reference.clear();
  ExpectInvalid(o, "--reference is required");
  o = Valid();
  o.models.clear();
  ExpectInvalid(o, "give --model or --llama-logits");
  o.write_ids = "/tmp/ids";
  EXPECT_TRUE(ValidateAccuracyOptions(o).ok());
  o = Valid();
  o.chunk_tokens = -1;
  ExpectInvalid(o, "--chunk-tokens must be 0 or positive, got -1");
}

class TempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("accuracy_bench_test_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  void Write(const std::string& name, const std::string& text) const { std::ofstream(Path(name)) << text; }
  std::filesystem::path dir_;
};

using AccuracyIdsTest = TempDir;

TEST_F(AccuracyIdsTest, RoundTripAndErrors) {
  const AccuracyIdsFile f{.sequence_length = 4, .ids = AccuracyIds(37, 102400, 9)};
  EXPECT_TRUE(std::all_of(f.ids.begin(), f.ids.end(), [](int32_t t) { return t >= 0 && t < 102400; }));
  EXPECT_NE(f.ids, AccuracyIds(37, 102400, 10));  // the seed matters
  ASSERT_TRUE(WriteAccuracyIds(Path("a.ids"), f).ok());
  const auto back = ReadAccuracyIds(Path("a.ids"));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->sequence_length, 4);
  EXPECT_EQ(back->ids, f.ids);

  const auto err = [&](const std::string& text) {
    Write("b.ids", text);
    const auto r = ReadAccuracyIds(Path("b.ids"));
    EXPECT_FALSE(r.ok()) << text;
    return r.ok() ? std::string() : r.status().message();
  };
  EXPECT_NE(err("hello 1\n").find("not an ids file"), std::string::npos);
  EXPECT_NE(err("mlarun-accuracy-ids 1\nsequence_length 0\n").find("'sequence_length L' with L > 0"),
            std::string::npos);
  EXPECT_NE(err("mlarun-accuracy-ids 1\nsequence_length 2\npos 3\n").find("'positions N'"), std::string::npos);
  EXPECT_NE(err("mlarun-accuracy-ids 1\nsequence_length 2\npositions 3\n1 2\n").find("'positions 3' but it holds 2"),
            std::string::npos);
  EXPECT_NE(err("mlarun-accuracy-ids 1\nsequence_length 2\npositions 3\n1 -2 3\n").find("id 1 is -2"),
            std::string::npos);
  EXPECT_NE(err("mlarun-accuracy-ids 1\nsequence_length 2\npositions 3\n1 x 3\n").find("id 1 is not an integer"),
            std::string::npos);
  EXPECT_EQ(ReadAccuracyIds(Path("missing.ids")).status().code(), StatusCode::kNotFound);
}

// Whole runs on the tiny model (vocab 512): 2 sequences of 16.
class AccuracyRunTest : public TempDir {
 protected:
  // The tiny model's logits for the run's ids, run as the bench runs them
  // (each sequence from an empty cache), [positions, vocab].
  std::vector<float> TinyLogits(const AccuracyBenchOptions& o) {
    auto model = std::move(Model::Load(kTiny)).value();
    const int64_t V = model->config().vocab_size;
    const auto ids = AccuracyIds(o.positions, V, o.seed);
    std::vector<float> all;
    for (int64_t s = 0; s < o.positions / o.sequence_length; ++s) {
      auto cache = std::move(LocalLatentCache::Create(model->CacheConfig(16 << 20, 16))).value();
      const std::span<const int32_t> tokens(ids.data() + s * o.sequence_length, static_cast<size_t>(o.sequence_length));
      const ForwardSeq fs = cache.Append(0, tokens, ForwardSeq::Logits::kAll).value();
      const auto logits = std::move(model->Forward(std::span<const ForwardSeq>(&fs, 1), *cache.pool)).value();
      all.insert(all.end(), logits.begin(), logits.end());
    }
    EXPECT_EQ(static_cast<int64_t>(all.size()), o.positions * V);
    return all;
  }
  void WriteLogits(const std::string& name, const std::vector<float>& l, const AccuracyBenchOptions& o,
                   uint64_t ids_seed) {
    std::ofstream(Path(name), std::ios::binary)
        .write(reinterpret_cast<const char*>(l.data()), static_cast<std::streamsize>(l.size() * sizeof(float)));
    ASSERT_TRUE(WriteAccuracyIds(Path(name) + ".ids",
                                 {.sequence_length = o.sequence_length, .ids = AccuracyIds(o.positions, 512, ids_seed)})
                    .ok());
  }
};

TEST_F(AccuracyRunTest, SameModelAndFilesAgainstTheReference) {
  AccuracyBenchOptions o = Valid();
  o.seed = 4;
  o.json = true;
  const auto exact = TinyLogits(o);
  auto noisy = exact;
  std::mt19937 rng(5);
  std::normal_distribution<float> noise(0, 0.05f);
  for (float& v : noisy) v += noise(rng);
  WriteLogits("exact.logits", exact, o, o.seed);
  WriteLogits("noisy.logits", noisy, o, o.seed);
  o.llama_logits = {Path("exact.logits"), Path("noisy.logits")};
  std::ostringstream out, err;
  const Status st = RunAccuracyBench(o, out, err);
  ASSERT_TRUE(st.ok()) << st << "\n" << err.str();
  const auto doc = nlohmann::json::parse(out.str());
  ASSERT_EQ(doc["rows"].size(), 3u);
  for (int r = 0; r < 2; ++r) {  // the model against itself, and its logits read back
    const auto& row = doc["rows"][r];
    EXPECT_EQ(row["rel_err_max"].get<double>(), 0.0) << row;
    EXPECT_NEAR(row["kl_max"].get<double>(), 0.0, 1e-12) << row;
    EXPECT_EQ(row["top1_percent"].get<double>(), 100.0) << row;
  }
  EXPECT_EQ(doc["rows"][1]["name"], "exact");
  EXPECT_EQ(doc["rows"][2]["source"], "llama.cpp");
  // The noisy file: every position's relative error, as computed here.
  std::vector<double> rel;
  double kl_sum = 0;
  for (int64_t p = 0; p < o.positions; ++p) {
    const std::vector<float> r(exact.begin() + p * 512, exact.begin() + (p + 1) * 512);
    const std::vector<float> x(noisy.begin() + p * 512, noisy.begin() + (p + 1) * 512);
    rel.push_back(ReferenceRelErr(r, x));
    kl_sum += ReferenceKl(r, x);
  }
  double rel_sum = 0;
  for (const double e : rel) rel_sum += e;
  EXPECT_NEAR(doc["rows"][2]["rel_err_mean"].get<double>(), rel_sum / o.positions, 1e-12);
  EXPECT_NEAR(doc["rows"][2]["rel_err_max"].get<double>(), *std::max_element(rel.begin(), rel.end()), 1e-12);
  EXPECT_NEAR(doc["rows"][2]["kl_mean"].get<double>(), kl_sum / o.positions, 1e-9 * kl_sum);
  EXPECT_GT(doc["rows"][2]["kl_mean"].get<double>(), 0.0);
  EXPECT_NE(err.str().find("| llama.cpp noisy |"), std::string::npos) << err.str();
}

// Sequences run in chunks (5 tokens, so the last chunk of 16 is short; and
// 1, every position a decode step) give the whole-sequence logits: the same
// model differs only in its sums' order and in reading earlier positions
// from the cache as stored (the worst position measured 4.2e-3, the median
// 5e-7). A broken chunking (positions lost, repeated or read against the
// wrong cache) is of the order of the logits themselves.
TEST_F(AccuracyRunTest, ChunkedSequencesGiveTheWholeSequencesLogits) {
  AccuracyBenchOptions o = Valid();
  o.seed = 6;
  o.json = true;
  WriteLogits("whole.logits", TinyLogits(o), o, o.seed);
  for (int64_t chunk : {5, 1}) {
    o.chunk_tokens = chunk;
    o.llama_logits = {Path("whole.logits")};
    std::ostringstream out, err;
    const Status st = RunAccuracyBench(o, out, err);
    ASSERT_TRUE(st.ok()) << st << "\n" << err.str();
    const auto doc = nlohmann::json::parse(out.str());
    ASSERT_EQ(doc["rows"].size(), 2u);
    const auto& row = doc["rows"][1];
    EXPECT_LT(row["rel_err_max"].get<double>(), 2e-2) << "chunks of " << chunk << ": " << row;
    EXPECT_LT(row["rel_err_median"].get<double>(), 1e-5) << "chunks of " << chunk << ": " << row;
    EXPECT_EQ(row["top1_percent"].get<double>(), 100.0) << "chunks of " << chunk;
  }
}

TEST_F(AccuracyRunTest, BadFilesGetTheirErrorInTheirRow) {
  AccuracyBenchOptions o = Valid();
  o.models.clear();
  const std::vector<float> l(static_cast<size_t>(o.positions * 512), 0.5f);
  WriteLogits("other_seed.logits", l, o, o.seed + 1);
  WriteLogits("short.logits", std::vector<float>(l.begin(), l.end() - 1), o, o.seed);
  o.llama_logits = {Path("other_seed.logits"), Path("short.logits"), Path("absent.logits")};
  std::ostringstream out, err;
  const Status st = RunAccuracyBench(o, out, err);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("other_seed.logits.ids: id 0 is"), std::string::npos) << st;
  EXPECT_NE(st.message().find("(other --seed?)"), std::string::npos) << st;
  EXPECT_NE(st.message().find("short.logits: 65532 bytes, expected 32 positions x 512 logits x 4 = 65536"),
            std::string::npos)
      << st;
  EXPECT_NE(st.message().find("cannot open the ids file " + Path("absent.logits.ids")), std::string::npos) << st;
  EXPECT_NE(out.str().find("| llama.cpp short | error: "), std::string::npos) << out.str();
}

TEST_F(AccuracyRunTest, WriteIdsWritesTheRunsIds) {
  AccuracyBenchOptions o = Valid();
  o.models.clear();
  o.seed = 11;
  o.write_ids = Path("run.ids");
  std::ostringstream out, err;
  ASSERT_TRUE(RunAccuracyBench(o, out, err).ok());
  const auto f = ReadAccuracyIds(o.write_ids);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->sequence_length, 16);
  EXPECT_EQ(f->ids, AccuracyIds(32, 512, 11));
}

TEST(AccuracyRun, MissingReferenceIsAnError) {
  AccuracyBenchOptions o = Valid();
  o.reference = "/nonexistent/model";
  std::ostringstream out, err;
  EXPECT_FALSE(RunAccuracyBench(o, out, err).ok());
}

}  // namespace
}  // namespace mlarun
