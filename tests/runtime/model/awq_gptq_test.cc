// AWQ and GPTQ modules read into mlarun's int4 / int8 Linear
// (runtime/model/quant_awq.cc, quant_gptq.cc), against the weights the
// libraries themselves dequantize: tests/fixtures/quantized/{awq,gptq}, made
// by tests/runtime/model/make_awq_gptq_fixtures.py with autoawq's and
// auto-gptq's packing code.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "runtime/model/quantized_weights.h"
#include "runtime/model/safetensors.h"

namespace mlarun {
namespace {

namespace fs = std::filesystem;

// One fixture module and the scheme it was packed with (kept in step with
// make_awq_gptq_fixtures.py).
struct Module {
  const char* dir;
  const char* prefix;
  QuantFormat format;
  int bits;
  int64_t group;  // <= 0: per output channel
  bool symmetric;
  int64_t rows, cols;
};

const Module kModules[] = {
    {"awq", "model.layers.0.mlp.down_proj", QuantFormat::kAwq, 4, 64, false, 96, 256},
    {"awq", "model.layers.0.mlp.up_proj", QuantFormat::kAwq, 4, 128, false, 64, 256},
    {"awq", "model.layers.0.self_attn.o_proj", QuantFormat::kAwq, 4, 32, false, 32, 96},
    {"gptq", "model.layers.0.mlp.down_proj", QuantFormat::kGptq, 4, 64, true, 96, 256},
    {"gptq", "model.layers.0.mlp.gate_proj", QuantFormat::kGptq, 4, 64, false, 64, 224},
    {"gptq", "model.layers.1.self_attn.q_proj", QuantFormat::kGptq, 4, 36, false, 32, 160},
    {"gptq", "model.layers.0.mlp.up_proj", QuantFormat::kGptq, 8, 96, true, 64, 224},
    {"gptq", "model.layers.1.mlp.up_proj", QuantFormat::kGptq, 8, 32, false, 32, 128},
    {"gptq", "model.layers.0.self_attn.o_proj", QuantFormat::kGptq, 4, -1, false, 64, 96},
};
// desc_act with g_idx a real permutation of the groups.
const Module kActOrder = {"gptq", "model.layers.1.mlp.down_proj", QuantFormat::kGptq, 4, 32, true, 32, 128};

std::string FixtureDir(const char* dir) { return std::string(MLARUN_FIXTURES_DIR) + "/quantized/" + dir; }

QuantScheme SchemeOf(const Module& m) {
  QuantScheme s;
  s.format = m.format;
  s.bits = m.bits;
  s.group = m.group;
  s.symmetric = m.symmetric;
  return s;
}

StatusOr<Linear> Load(const Checkpoint& ckpt, const QuantScheme& s, const std::string& prefix, int64_t rows,
                      int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  return s.format == QuantFormat::kAwq ? quant_internal::LoadAwq(ckpt, s, prefix, rows, cols, r0, r1, c0, c1)
                                       : quant_internal::LoadGptq(ckpt, s, prefix, rows, cols, r0, r1, c0, c1);
}

bool Contains(const Status& st, std::initializer_list<const char*> needles) {
  for (const char* n : needles)
    if (st.message().find(n) == std::string::npos) return false;
  return true;
}

class AwqGptq : public testing::Test {
 protected:
  const Checkpoint& Open(const char* dir) {
    auto& slot = ckpts_[dir];
    if (!slot) {
      auto c = Checkpoint::Open(FixtureDir(dir));
      EXPECT_TRUE(c.ok()) << c.status();
      if (c.ok()) slot = std::move(*c);
    }
    return *slot;
  }
  // The library's dequantized weight [rows, cols].
  std::vector<float> Reference(const Module& m) {
    std::vector<float> ref(static_cast<size_t>(m.rows * m.cols), NAN);
    const std::vector<int64_t> shape = {m.rows, m.cols};
    const Status st = Open(m.dir).Load(std::string(m.prefix) + ".dequantized", shape, DType::kF32, ref.data());
    EXPECT_TRUE(st.ok()) << st;
    return ref;
  }
  // Loads rows [r0, r1) x cols [c0, c1) and compares every element with the
  // reference; (q - z) * s is exact in fp32, the offset form q * s - z * s too.
  void ExpectSlice(const Module& m, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    SCOPED_TRACE(std::string(m.dir) + " " + m.prefix + " rows [" + std::to_string(r0) + ", " + std::to_string(r1) +
                 ") cols [" + std::to_string(c0) + ", " + std::to_string(c1) + ")");
    const std::vector<float> ref = Reference(m);
    auto q = Load(Open(m.dir), SchemeOf(m), m.prefix, m.rows, m.cols, r0, r1, c0, c1);
    ASSERT_TRUE(q.ok()) << q.status();
    ASSERT_EQ(q->out, r1 - r0);
    ASSERT_EQ(q->in, c1 - c0);
    EXPECT_EQ(q->dtype, m.bits == 8 ? DType::kInt8 : DType::kInt4);
    EXPECT_EQ(q->group, m.group > 0 ? m.group : m.cols);
    // Symmetric checkpoints need no offsets: Linear's zero (8 / 0) says it.
    EXPECT_EQ(q->offset == nullptr, m.symmetric);
    int64_t bad = 0;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = c0; c < c1; ++c) {
        const float want = ref[r * m.cols + c], got = q->At(r - r0, c - c0);
        if (!(std::fabs(got - want) <= 1e-6f * std::fabs(want)) && ++bad <= 5)
          ADD_FAILURE() << "(" << r << ", " << c << "): " << got << " != " << want;
      }
    }
    EXPECT_EQ(bad, 0);
  }
  std::map<std::string, std::unique_ptr<Checkpoint>> ckpts_;
};

TEST_F(AwqGptq, WholeModulesMatchTheLibrariesDequantization) {
  for (const Module& m : kModules) ExpectSlice(m, 0, m.rows, 0, m.cols);
}

TEST_F(AwqGptq, RowAndGroupAlignedColumnSlicesMatch) {
  for (const Module& m : kModules) {
    // Rows that start and end inside an int32 of 8 (AWQ) or 4 / 8 channels.
    ExpectSlice(m, 3, m.rows - 5, 0, m.cols);
    ExpectSlice(m, m.rows / 2 + 1, m.rows / 2 + 2, 0, m.cols);
    if (m.group <= 0) continue;
    // The second group to the end (the short last group included), then the
    // first group alone, then a middle one.
    ExpectSlice(m, 0, m.rows, m.group, m.cols);
    ExpectSlice(m, 5, m.rows - 3, 0, m.group);
    if (2 * m.group < m.cols) ExpectSlice(m, 1, m.rows, m.group, 2 * m.group);
  }
}

// checkpoint_format "gptq_v2": the same modules with zero points stored as
// they are, against the v1 modules' dequantized weights.
TEST_F(AwqGptq, GptqV2ZeroPointsAreReadAsStored) {
  for (const Module* v1 : {&kModules[4], &kModules[7]}) {
    Module m = *v1;
    m.dir = "gptq_v2";
    QuantScheme s = SchemeOf(m);
    s.gptq_v2 = true;
    auto q = quant_internal::LoadGptq(Open(m.dir), s, m.prefix, m.rows, m.cols, 1, m.rows, m.group, m.cols);
    ASSERT_TRUE(q.ok()) << q.status();
    const std::vector<float> ref = Reference(*v1);
    for (int64_t r = 1; r < m.rows; ++r)
      for (int64_t c = m.group; c < m.cols; ++c)
        ASSERT_NEAR(q->At(r - 1, c - m.group), ref[r * m.cols + c], 1e-6f * std::fabs(ref[r * m.cols + c]))
            << m.prefix << " (" << r << ", " << c << ")";
  }
}

TEST_F(AwqGptq, DescActWithTheTrivialGIdxIsRead) {
  Module m = kModules[3];  // GPTQ 4-bit symmetric, g_idx = c / 64
  QuantScheme s = SchemeOf(m);
  s.desc_act = true;
  auto q = quant_internal::LoadGptq(Open(m.dir), s, m.prefix, m.rows, m.cols, 0, m.rows, 0, m.cols);
  ASSERT_TRUE(q.ok()) << q.status();
  const std::vector<float> ref = Reference(m);
  for (int64_t r = 0; r < m.rows; r += 7)
    for (int64_t c = 0; c < m.cols; c += 3) ASSERT_EQ(q->At(r, c), ref[r * m.cols + c]) << r << ", " << c;
}

TEST_F(AwqGptq, DescActWithAPermutedGIdxIsRefusedByName) {
  QuantScheme s = SchemeOf(kActOrder);
  for (bool desc_act : {true, false}) {
    s.desc_act = desc_act;
    const Status st = quant_internal::LoadGptq(Open(kActOrder.dir), s, kActOrder.prefix, kActOrder.rows, kActOrder.cols,
                                               0, kActOrder.rows, 0, kActOrder.cols)
                          .status();
    EXPECT_FALSE(st.ok());
    EXPECT_TRUE(Contains(st, {kActOrder.prefix, "g_idx", "desc_act"})) << st;
  }
}

TEST_F(AwqGptq, BadRequestsNameTheTensorAndField) {
  const Module& awq = kModules[0];
  const Module& gptq = kModules[4];
  struct Bad {
    const Module& m;
    QuantScheme s;
    int64_t rows, cols, r0, r1, c0, c1;
    std::vector<const char*> needles;
  };
  QuantScheme awq8 = SchemeOf(awq), gptq3 = SchemeOf(gptq), gptq_g32 = SchemeOf(gptq);
  awq8.bits = 8, gptq3.bits = 3, gptq_g32.group = 32;
  const Bad bads[] = {
      // Shapes that disagree with the stored tensors.
      {awq, SchemeOf(awq), awq.rows, awq.cols + 64, 0, awq.rows, 0, awq.cols, {"qweight", "shape"}},
      {awq, SchemeOf(awq), awq.rows + 8, awq.cols, 0, awq.rows, 0, awq.cols, {"qweight", "shape"}},
      {gptq, SchemeOf(gptq), gptq.rows, gptq.cols + 32, 0, gptq.rows, 0, gptq.cols + 32, {"qweight", "shape"}},
      {gptq, SchemeOf(gptq), gptq.rows + 32, gptq.cols, 0, gptq.rows, 0, gptq.cols, {"qweight", "shape"}},
      {gptq, gptq_g32, gptq.rows, gptq.cols, 0, gptq.rows, 0, gptq.cols, {"qzeros", "shape"}},
      // Bits, slices.
      {awq, awq8, awq.rows, awq.cols, 0, awq.rows, 0, awq.cols, {"bits"}},
      {gptq, gptq3, gptq.rows, gptq.cols, 0, gptq.rows, 0, gptq.cols, {"bits"}},
      {gptq, SchemeOf(gptq), gptq.rows, gptq.cols, 0, gptq.rows, 32, gptq.cols, {"group"}},
      {awq, SchemeOf(awq), awq.rows, awq.cols, 0, awq.rows + 1, 0, awq.cols, {"slice"}},
      {gptq, SchemeOf(gptq), gptq.rows, gptq.cols, 4, 4, 0, gptq.cols, {"slice"}},
  };
  for (const Bad& b : bads) {
    const Status st = Load(Open(b.m.dir), b.s, b.m.prefix, b.rows, b.cols, b.r0, b.r1, b.c0, b.c1).status();
    EXPECT_FALSE(st.ok());
    EXPECT_TRUE(Contains(st, {b.m.prefix})) << st;
    for (const char* n : b.needles) EXPECT_TRUE(Contains(st, {n})) << st << " lacks " << n;
  }
  // A module that is not there.
  const Status missing =
      quant_internal::LoadAwq(Open("awq"), SchemeOf(awq), "model.layers.9.mlp.down_proj", 96, 256, 0, 96, 0, 256)
          .status();
  EXPECT_TRUE(Contains(missing, {"model.layers.9.mlp.down_proj.qweight", "missing"})) << missing;
}

// A checkpoint written by the test: tensors of random bytes with any dtype
// and shape.
class WrittenCheckpoint {
 public:
  struct Tensor {
    std::string name, dtype;
    std::vector<int64_t> shape;
    size_t elem_bytes;
  };
  explicit WrittenCheckpoint(const std::vector<Tensor>& tensors, const std::string& tag) {
    dir_ = fs::path(testing::TempDir()) / ("mlarun_awq_gptq_" + tag + "_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    std::string header = "{", data;
    std::mt19937 rng(7);
    for (const Tensor& t : tensors) {
      size_t n = t.elem_bytes;
      std::string shape;
      for (int64_t d : t.shape) {
        n *= static_cast<size_t>(d);
        if (!shape.empty()) shape += ',';
        shape += std::to_string(d);
      }
      if (header.size() > 1) header += ',';
      header += "\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[" + shape + "],\"data_offsets\":[" +
                std::to_string(data.size()) + "," + std::to_string(data.size() + n) + "]}";
      // Integers: any bits. Floats: bytes below 0x40, so finite, positive and small.
      const uint32_t mask = t.dtype[0] == 'F' ? 0x3f : 0xff;
      for (size_t i = 0; i < n; ++i) data.push_back(static_cast<char>(rng() & mask));
    }
    header += "}";
    while (header.size() % 8 != 0) header += ' ';
    std::ofstream out(dir_ / "model.safetensors", std::ios::binary);
    const uint64_t len = header.size();
    out.write(reinterpret_cast<const char*>(&len), 8);
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
  }
  ~WrittenCheckpoint() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string dir() const { return dir_.string(); }

 private:
  fs::path dir_;
};

TEST(AwqGptqDtypes, WrongDtypesAreRefusedByTensorName) {
  // AWQ [rows 32, cols 64], group 32; GPTQ the same, 4-bit.
  const WrittenCheckpoint ck(
      {
          {"awq.qweight", "F16", {64, 4}, 2},
          {"awq.qzeros", "I32", {2, 4}, 4},
          {"awq.scales", "F16", {2, 32}, 2},
          {"awq_z.qweight", "I32", {64, 4}, 4},
          {"awq_z.qzeros", "F32", {2, 4}, 4},
          {"awq_z.scales", "F16", {2, 32}, 2},
          {"gptq.qweight", "I32", {8, 32}, 4},
          {"gptq.qzeros", "I32", {2, 4}, 4},
          {"gptq.scales", "I32", {2, 32}, 4},
          {"gptq_g.qweight", "I32", {8, 32}, 4},
          {"gptq_g.qzeros", "I32", {2, 4}, 4},
          {"gptq_g.scales", "F16", {2, 32}, 2},
          {"gptq_g.g_idx", "F32", {64}, 4},
      },
      "dtypes");
  auto ckpt = Checkpoint::Open(ck.dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  QuantScheme s;
  s.bits = 4, s.group = 32, s.symmetric = false;
  const struct {
    bool awq;
    const char* prefix;
    const char* tensor;
  } cases[] = {{true, "awq", "awq.qweight"},
               {true, "awq_z", "awq_z.qzeros"},
               {false, "gptq", "gptq.scales"},
               {false, "gptq_g", "gptq_g.g_idx"}};
  for (const auto& c : cases) {
    const Status st = c.awq ? quant_internal::LoadAwq(**ckpt, s, c.prefix, 32, 64, 0, 32, 0, 64).status()
                            : quant_internal::LoadGptq(**ckpt, s, c.prefix, 32, 64, 0, 32, 0, 64).status();
    EXPECT_FALSE(st.ok());
    EXPECT_TRUE(Contains(st, {c.tensor, "dtype"})) << st;
  }
}

uint32_t WordAt(const TensorRef& t, int64_t i) { return quant_internal::Word32(t.data, i); }

// Random words for three modules "awq" (4-bit), "gptq" (4-bit) and "gptq8"
// (8-bit), each of logical weight [rows, cols] in groups of `group`.
std::vector<WrittenCheckpoint::Tensor> ThreeModules(int64_t rows, int64_t cols, int64_t group) {
  const int64_t groups = cols / group;
  return {
      {"awq.qweight", "I32", {cols, rows / 8}, 4},   {"awq.qzeros", "I32", {groups, rows / 8}, 4},
      {"awq.scales", "F16", {groups, rows}, 2},      {"gptq.qweight", "I32", {cols / 8, rows}, 4},
      {"gptq.qzeros", "I32", {groups, rows / 8}, 4}, {"gptq.scales", "F16", {groups, rows}, 2},
      {"gptq8.qweight", "I32", {cols / 4, rows}, 4}, {"gptq8.qzeros", "I32", {groups, rows / 4}, 4},
      {"gptq8.scales", "F16", {groups, rows}, 2},
  };
}

// The asymmetric scheme of one of ThreeModules' modules.
QuantScheme SchemeOf(const std::string& module, int64_t group) {
  QuantScheme s;
  s.format = module == "awq" ? QuantFormat::kAwq : QuantFormat::kGptq;
  s.bits = module == "gptq8" ? 8 : 4, s.group = group, s.symmetric = false;
  return s;
}

// Modules large enough for several thread blocks and column tiles, random
// words, against an element-by-element decoding written here from the
// formats' descriptions: AWQ channel 8k + e at bit 4 * {0 4 1 5 2 6 3 7}[e]
// of its int32; GPTQ input c at bit bits * (c % p) of word [c / p], zero
// points stored minus one.
TEST(AwqGptqLarge, RandomWordsMatchAnElementwiseDecoding) {
  const int64_t rows = 400, cols = 384, group = 128, groups = cols / group;
  const WrittenCheckpoint ck(ThreeModules(rows, cols, group), "large");
  auto ckpt = Checkpoint::Open(ck.dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const int awq_position[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  for (const char* prefix : {"awq", "gptq", "gptq8"}) {
    const std::string p = prefix;
    const QuantScheme s = SchemeOf(p, group);
    const TensorRef& qw = *(*ckpt)->Find(p + ".qweight");
    const TensorRef& qz = *(*ckpt)->Find(p + ".qzeros");
    std::vector<float> scales(static_cast<size_t>(groups * rows));
    const std::vector<int64_t> scale_shape = {groups, rows};
    ASSERT_TRUE((*ckpt)->Load(p + ".scales", scale_shape, DType::kF32, scales.data()).ok());
    const int64_t r0 = 13, r1 = rows - 3, c0 = group, c1 = cols;
    auto q = Load(**ckpt, s, p, rows, cols, r0, r1, c0, c1);
    ASSERT_TRUE(q.ok()) << q.status();
    const uint32_t mask = (1u << s.bits) - 1;
    const int64_t per = 32 / s.bits;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t g = c / group;
        double qv, zv;
        if (s.format == QuantFormat::kAwq) {
          const int shift = 4 * awq_position[r % 8];
          qv = (WordAt(qw, c * (rows / 8) + r / 8) >> shift) & 15u;
          zv = (WordAt(qz, g * (rows / 8) + r / 8) >> shift) & 15u;
        } else {
          qv = (WordAt(qw, (c / per) * rows + r) >> (s.bits * (c % per))) & mask;
          zv = ((WordAt(qz, g * (rows / per) + r / per) >> (s.bits * (r % per))) & mask) + 1.0;
        }
        const double want = (qv - zv) * scales[g * rows + r];
        ASSERT_NEAR(q->At(r - r0, c - c0), want, 1e-6 * std::fabs(want)) << p << " (" << r << ", " << c << ")";
      }
    }
  }
}

// The repack rate on a projection of a 15B-class model (4096 x 11008), run by
// hand: awq_gptq_test --gtest_also_run_disabled_tests --gtest_filter='*Rate*'.
TEST(AwqGptqRate, DISABLED_RepackMegabytesPerSecond) {
  const int64_t rows = 11008, cols = 4096, group = 128;
  const WrittenCheckpoint ck(ThreeModules(rows, cols, group), "rate");
  auto ckpt = Checkpoint::Open(ck.dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  for (const char* prefix : {"awq", "gptq", "gptq8"}) {
    const QuantScheme s = SchemeOf(prefix, group);
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      auto q = Load(**ckpt, s, prefix, rows, cols, 0, rows, 0, cols);
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ASSERT_TRUE(q.ok()) << q.status();
      best = std::min(best, sec);
    }
    const double mb = static_cast<double>(rows) * cols * s.bits / 8 / 1e6;
    std::printf("%-6s %lld x %lld %d-bit: %.1f MB packed in %.2f ms: %.0f MB/s\n", prefix, static_cast<long long>(rows),
                static_cast<long long>(cols), s.bits, mb, best * 1e3, mb / best);
  }
}

}  // namespace
}  // namespace mlarun
