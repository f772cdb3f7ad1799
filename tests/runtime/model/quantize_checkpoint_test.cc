// `mlarun quantize` (runtime/model/quantize_checkpoint.h) and QuantizeLinear
// against the compressed-tensors library: tests/fixtures/quantize/, written by
// tests/runtime/model/make_quantize_reference.py with the library's own
// calculate_qparams and compressors.
#include "runtime/model/quantize_checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/model/quantized_weights.h"
#include "runtime/model/safetensors.h"
#include "runtime/ops/linear.h"

namespace mlarun {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kFixtures = MLARUN_FIXTURES_DIR;
const std::string kReference = kFixtures + "/quantize/reference.safetensors";

std::unique_ptr<SafetensorsFile> OpenOrDie(const std::string& path) {
  auto f = SafetensorsFile::Open(path);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  return f.ok() ? std::move(*f) : nullptr;
}

// A fresh empty directory path (not created) under the test's temp dir.
std::string TempOut(const std::string& name) {
  const fs::path p = fs::path(::testing::TempDir()) / ("mlarun_quantize_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  return p.string();
}

json ReadJson(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

double Bf16(const std::byte* p, int64_t i) {
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return static_cast<double>(Bf16ToFloat(h));
}

// Element (r, c) of a compressed-tensors module, decoded here in float64
// straight from the stored tensors (the library's dequantize: (q - zp) * s).
struct Decoded {
  const TensorRef* packed = nullptr;  // int4 weight_packed, or int8 weight
  const TensorRef* scale = nullptr;
  const TensorRef* zero = nullptr;  // may be nullptr
  bool int4 = true;
  int64_t out = 0, in = 0, groups = 1;

  double Scale(int64_t r, int64_t g) const {
    if (scale->dtype == SafetensorsDType::kBF16) return Bf16(scale->data, r * groups + g);
    float f;
    std::memcpy(&f, scale->data + 4 * (r * groups + g), 4);
    return f;
  }
  int Zero(int64_t r, int64_t g) const {
    if (zero == nullptr) return 0;
    if (!int4) return static_cast<int8_t>(zero->data[r * groups + g]);
    uint32_t w;
    std::memcpy(&w, zero->data + 4 * ((r / 8) * groups + g), 4);
    return static_cast<int>((w >> (4 * (r % 8))) & 15) - 8;
  }
  int Q(int64_t r, int64_t c) const {
    if (!int4) return static_cast<int8_t>(packed->data[r * in + c]);
    uint32_t w;
    std::memcpy(&w, packed->data + 4 * (r * ((in + 7) / 8) + c / 8), 4);
    return static_cast<int>((w >> (4 * (c % 8))) & 15) - 8;
  }
  double At(int64_t r, int64_t c) const {
    const int64_t g = c / ((in + groups - 1) / groups);
    return (Q(r, c) - Zero(r, g)) * Scale(r, g);
  }
};

// ---------------------------------------------------------------------------
// QuantizeLinear + the encoding, byte for byte against the library.

struct Scheme {
  std::string name;
  DType dtype;
  int64_t group;
  bool symmetric;
  std::string weights;
};
const Scheme kSchemes[] = {
    {"int4_sym_g32", DType::kInt4, 32, true, "ab"},     {"int4_asym_g32", DType::kInt4, 32, false, "ab"},
    {"int8_sym_channel", DType::kInt8, 0, true, "abc"}, {"int4_sym_channel", DType::kInt4, 0, true, "c"},
    {"int8_asym_channel", DType::kInt8, 0, false, "c"},
};

// The fixture's bf16 input as an owned bf16 Linear (the mapping may not be
// 2-byte aligned).
Linear InputLinear(const TensorRef& t, std::vector<uint16_t>& keep) {
  keep.resize(static_cast<size_t>(t.numel()));
  std::memcpy(keep.data(), t.data, t.bytes);
  Linear w;
  w.out = t.shape[0], w.in = t.shape[1], w.dtype = DType::kBF16, w.ld = w.in;
  w.data = reinterpret_cast<const std::byte*>(keep.data());
  return w;
}

TEST(QuantizeLinear, BytesMatchCompressedTensors) {
  auto ref = OpenOrDie(kReference);
  ASSERT_NE(ref, nullptr);
  int compared = 0;
  for (const Scheme& s : kSchemes) {
    for (char wname : s.weights) {
      const std::string key = s.name + "." + wname;
      SCOPED_TRACE(key);
      const TensorRef* in = ref->Find(std::string("in.") + wname);
      ASSERT_NE(in, nullptr);
      std::vector<uint16_t> keep;
      auto q = QuantizeLinear(InputLinear(*in, keep), {.dtype = s.dtype, .group = s.group, .symmetric = s.symmetric});
      ASSERT_TRUE(q.ok()) << q.status().ToString();
      const std::vector<EncodedTensor> enc = EncodeCompressedTensors(key, *q, DType::kBF16);
      size_t expected = 0;
      for (const TensorRef& t : ref->tensors()) expected += t.name.rfind(key + ".", 0) == 0;
      EXPECT_EQ(enc.size(), expected);
      for (const EncodedTensor& e : enc) {
        const TensorRef* t = ref->Find(e.spec.name);
        ASSERT_NE(t, nullptr) << e.spec.name << " is not what the library stores";
        EXPECT_EQ(SafetensorsDTypeName(e.spec.dtype), SafetensorsDTypeName(t->dtype)) << e.spec.name;
        EXPECT_EQ(e.spec.shape, t->shape) << e.spec.name;
        ASSERT_EQ(e.data.size(), t->bytes) << e.spec.name;
        size_t differ = 0;
        for (size_t i = 0; i < t->bytes; ++i) differ += e.data[i] != t->data[i];
        EXPECT_EQ(differ, 0u) << e.spec.name << ": bytes differ from the library's";
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 26);
}

// Linear's own reading of its int weights (At: zero / offset) means what the
// library's stored integers mean: (q - zp) * s, decoded here in float64.
TEST(QuantizeLinear, LinearValuesAreTheLibrarysDequantization) {
  auto ref = OpenOrDie(kReference);
  ASSERT_NE(ref, nullptr);
  for (const Scheme& s : kSchemes) {
    for (char wname : s.weights) {
      const std::string key = s.name + "." + wname;
      SCOPED_TRACE(key);
      std::vector<uint16_t> keep;
      const TensorRef* in = ref->Find(std::string("in.") + wname);
      auto q = QuantizeLinear(InputLinear(*in, keep), {.dtype = s.dtype, .group = s.group, .symmetric = s.symmetric});
      ASSERT_TRUE(q.ok());
      const bool int4 = s.dtype == DType::kInt4;
      Decoded d{.packed = ref->Find(key + (int4 ? ".weight_packed" : ".weight")),
                .scale = ref->Find(key + ".weight_scale"),
                .zero = ref->Find(key + ".weight_zero_point"),
                .int4 = int4,
                .out = in->shape[0],
                .in = in->shape[1]};
      d.groups = d.scale->shape[1];
      int64_t bad = 0;
      for (int64_t r = 0; r < d.out; ++r)
        for (int64_t c = 0; c < d.in; ++c) {
          const double want = d.At(r, c), got = q->At(r, c);
          bad += std::abs(got - want) > 1e-6 * std::abs(want) + 1e-30;
        }
      EXPECT_EQ(bad, 0);
    }
  }
}

// ---------------------------------------------------------------------------
// The command on the tiny checkpoints.

struct RunArgs {
  DType dtype;
  int64_t group;
  bool symmetric;
};

RunArgs ParseRunArgs(const json& args) {
  RunArgs r{DType::kInt4, -1, true};
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string a = args[i];
    if (a == "--format") r.dtype = args[++i] == "int8" ? DType::kInt8 : DType::kInt4;
    if (a == "--group-size") r.group = std::stoll(args[++i].get<std::string>());
    if (a == "--asymmetric") r.symmetric = false;
  }
  if (r.group < 0) r.group = DefaultQuantizeGroup(r.dtype);
  return r;
}

bool IsTargeted(const std::string& name) {
  static const char* const kEnds[] = {"q_a_proj.weight",           "q_b_proj.weight",  "q_proj.weight",
                                      "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight",
                                      "gate_proj.weight",          "up_proj.weight",   "down_proj.weight"};
  for (const char* e : kEnds) {
    const std::string s(e);
    if (name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}

// How far (in steps) an element x / s = v may land from the original: half a
// step of rounding, plus what the library's arithmetic in bf16 adds (8
// significant bits, relative error 2^-8 per rounding: the scale and x / s,
// |v| 2^-7; x / s + zp, |v + zp| 2^-8), plus, asymmetric, half a step more at
// the two clamped ends (the zero point is rounded to an integer, which moves
// the window [qmin, qmax] by up to half a step against [min, max]). The
// rounded scale can also push the largest |x| past qmax and clamp it, which
// the |v| terms cover. make_quantize_reference.py --check measured the
// library's own worst cases on v3_bf16: 0.54 steps int4, 1.10 int8.
double StepBound(double v, int q, int zp, int qmax, bool symmetric) {
  const bool end = q == qmax || q == -qmax - 1;
  return 0.5 + std::abs(v) * 0x1p-7 + std::abs(v + zp) * 0x1p-8 + (!symmetric && end ? 0.5 : 0.0) + 1e-9;
}

// Every tensor of `in` is in `out`: the projections quantized and within
// StepBound of the original (read as bf16: fp8 dequantized), the rest copied as
// stored (fp8 as bf16). Returns the number of quantized modules.
int CheckAgainstInput(const std::string& in_dir, const std::string& out_dir, const RunArgs& run) {
  auto in = Checkpoint::Open(in_dir);
  auto out = Checkpoint::Open(out_dir);
  EXPECT_TRUE(in.ok() && out.ok());
  if (!in.ok() || !out.ok()) return -1;
  int quantized = 0;
  for (const std::string& name : (*in)->Names()) {
    SCOPED_TRACE(name);
    if (name.size() > 10 && name.compare(name.size() - 10, 10, "_scale_inv") == 0) {
      EXPECT_EQ((*out)->Find(name), nullptr);
      continue;
    }
    const TensorRef* t = (*in)->Find(name);
    std::vector<uint16_t> w(static_cast<size_t>(t->numel()));
    const bool fp8 = t->dtype == SafetensorsDType::kF8E4M3;
    const std::string m = name.substr(0, name.size() - 7);
    if (!IsTargeted(name)) {
      const TensorRef* o = (*out)->Find(name);
      EXPECT_NE(o, nullptr);
      if (o == nullptr) continue;
      EXPECT_EQ(SafetensorsDTypeName(o->dtype), fp8 ? "BF16" : SafetensorsDTypeName(t->dtype));
      std::vector<uint16_t> o16(w.size());
      if (fp8) {
        EXPECT_TRUE((*in)->Load(name, t->shape, DType::kBF16, w.data()).ok());
        EXPECT_TRUE((*out)->Load(name, t->shape, DType::kBF16, o16.data()).ok());
        EXPECT_EQ(w, o16);
      } else {
        EXPECT_EQ(o->bytes, t->bytes);
        EXPECT_EQ(std::memcmp(o->data, t->data, t->bytes), 0) << "not copied as stored";
      }
      continue;
    }
    const bool int4 = run.dtype == DType::kInt4;
    if (int4) EXPECT_EQ((*out)->Find(name), nullptr) << "an int4 module keeps its weight";
    Decoded d{.packed = (*out)->Find(m + (int4 ? ".weight_packed" : ".weight")),
              .scale = (*out)->Find(m + ".weight_scale"),
              .zero = (*out)->Find(m + ".weight_zero_point"),
              .int4 = int4,
              .out = t->shape[0],
              .in = t->shape[1]};
    if (d.packed == nullptr || d.scale == nullptr) {
      ADD_FAILURE() << "missing quantized tensors";
      continue;
    }
    EXPECT_EQ(d.zero != nullptr, !run.symmetric);
    EXPECT_EQ(d.packed->dtype, int4 ? SafetensorsDType::kI32 : SafetensorsDType::kI8);
    d.groups = d.scale->shape[1];
    EXPECT_EQ(d.groups, run.group > 0 ? d.in / run.group : 1);
    EXPECT_TRUE((*in)->Load(name, t->shape, DType::kBF16, w.data()).ok());
    int64_t bad = 0;
    const int64_t group = d.in / d.groups;
    const int qmax = int4 ? 7 : 127;
    for (int64_t r = 0; r < d.out; ++r)
      for (int64_t c = 0; c < d.in; ++c) {
        const double x = Bf16ToFloat(w[static_cast<size_t>(r * d.in + c)]);
        const double s = d.Scale(r, c / group), steps = std::abs(x / s - (d.Q(r, c) - d.Zero(r, c / group)));
        bad += steps > StepBound(x / s, d.Q(r, c), d.Zero(r, c / group), qmax, run.symmetric);
      }
    EXPECT_EQ(bad, 0) << "elements further than half a step from the original";
    ++quantized;
  }
  return quantized;
}

TEST(QuantizeCheckpoint, TinyBf16MatchesLibraryConfigAndDequantizesWithinTheStepBound) {
  const json ref = ReadJson(kFixtures + "/quantize/reference.json");
  const std::string model = kFixtures + "/models/v3_bf16";
  ASSERT_TRUE(ref["runs"].is_object());
  for (const auto& [name, r] : ref["runs"].items()) {
    SCOPED_TRACE(name);
    const RunArgs run = ParseRunArgs(r["args"]);
    QuantizeCheckpointOptions o{.model_dir = model, .out_dir = TempOut(name), .dtype = run.dtype};
    o.group = run.group, o.symmetric = run.symmetric, o.threads = 3;
    o.max_shard_bytes = 40000;  // several shards and an index
    int64_t calls = 0;
    o.progress = [&](const QuantizeProgress& p) {
      ++calls;
      EXPECT_LE(p.tensors_done, p.tensors_total);
    };
    const Status s = QuantizeCheckpoint(o);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_GT(calls, 10);
    const json config = ReadJson(fs::path(o.out_dir) / "config.json");
    EXPECT_EQ(config["quantization_config"], r["quantization_config"]) << config["quantization_config"].dump(2);
    json rest = config, orig = ReadJson(fs::path(model) / "config.json");
    rest.erase("quantization_config");
    EXPECT_EQ(rest, orig);
    EXPECT_TRUE(fs::exists(fs::path(o.out_dir) / "model.safetensors.index.json"));
    EXPECT_EQ(CheckAgainstInput(model, o.out_dir, run), 3 * 5 + 3 + 2 * 8 * 3 + 2 * 3);
    fs::remove_all(o.out_dir);
  }
}

TEST(QuantizeCheckpoint, Fp8ReleaseFormatIsDequantizedThenQuantized) {
  const std::string model = kFixtures + "/models/v3_fp8";
  QuantizeCheckpointOptions o{.model_dir = model, .out_dir = TempOut("fp8"), .dtype = DType::kInt4, .group = 32};
  const Status s = QuantizeCheckpoint(o);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(fs::exists(fs::path(o.out_dir) / "model.safetensors"));  // one file below 5 GiB
  EXPECT_EQ(CheckAgainstInput(model, o.out_dir, {DType::kInt4, 32, true}), 3 * 5 + 3 + 2 * 8 * 3 + 2 * 3);
  const json q = ReadJson(fs::path(o.out_dir) / "config.json")["quantization_config"];
  EXPECT_EQ(q["quant_method"], "compressed-tensors");
  fs::remove_all(o.out_dir);
}

TEST(QuantizeCheckpoint, LmHeadQuantizedWhenAsked) {
  const std::string model = kFixtures + "/models/v3_bf16";
  QuantizeCheckpointOptions o{.model_dir = model, .out_dir = TempOut("lm"), .dtype = DType::kInt4, .group = 32};
  o.lm_head = LmHeadMode::kInt8;
  ASSERT_TRUE(QuantizeCheckpoint(o).ok());
  auto out = Checkpoint::Open(o.out_dir);
  ASSERT_TRUE(out.ok());
  ASSERT_NE((*out)->Find("lm_head.weight"), nullptr);
  EXPECT_EQ((*out)->Find("lm_head.weight")->dtype, SafetensorsDType::kI8);
  ASSERT_NE((*out)->Find("lm_head.weight_scale"), nullptr);
  EXPECT_EQ((*out)->Find("lm_head.weight_scale")->shape, (std::vector<int64_t>{256, 1}));  // int8 per channel
  const json q = ReadJson(fs::path(o.out_dir) / "config.json")["quantization_config"];
  EXPECT_EQ(q["format"], "mixed-precision");
  EXPECT_EQ(q["config_groups"]["group_1"]["targets"], json::array({"lm_head"}));
  EXPECT_EQ(q["ignore"], json::array({"re:.*mlp.gate$"}));
  fs::remove_all(o.out_dir);
}

TEST(QuantizeCheckpoint, UndividedWidthsStayUnquantizedAndAreIgnored) {
  const std::string model = kFixtures + "/models/v3_bf16";
  QuantizeCheckpointOptions o{.model_dir = model, .out_dir = TempOut("undivided"), .dtype = DType::kInt4};
  o.group = 64;  // intermediate_size 96 and the 32-wide projections are not multiples
  std::vector<std::string> notes;
  o.note = [&](const std::string& n) { notes.push_back(n); };
  ASSERT_TRUE(QuantizeCheckpoint(o).ok());
  const json q = ReadJson(fs::path(o.out_dir) / "config.json")["quantization_config"];
  const json& ignore = q["ignore"];
  EXPECT_NE(std::find(ignore.begin(), ignore.end(), "model.layers.0.mlp.down_proj"), ignore.end());
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find(std::to_string(ignore.size() - 2) + " modules stay unquantized"), std::string::npos)
      << notes[0];
  auto out = Checkpoint::Open(o.out_dir);
  ASSERT_TRUE(out.ok());
  EXPECT_NE((*out)->Find("model.layers.0.mlp.down_proj.weight"), nullptr);
  EXPECT_NE((*out)->Find("model.layers.0.mlp.up_proj.weight_packed"), nullptr);
  fs::remove_all(o.out_dir);
}

TEST(QuantizeCheckpoint, BadArgumentsAreClearErrors) {
  const std::string model = kFixtures + "/models/v3_bf16";
  const std::string busy = TempOut("busy");
  fs::create_directories(busy);
  std::ofstream(fs::path(busy) / "x") << "x";
  struct Case {
    QuantizeCheckpointOptions o;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({{.model_dir = kFixtures + "/models/absent", .out_dir = TempOut("e1")}, "is not a directory"});
  cases.push_back({{.model_dir = model, .out_dir = busy}, "exists and is not an empty directory"});
  cases.push_back({{.model_dir = model, .out_dir = TempOut("e3"), .dtype = DType::kF32}, "int8 or int4"});
  cases.push_back({{.model_dir = model, .out_dir = TempOut("e4"), .group = 33}, "--group-size 33"});
  cases.push_back({{.model_dir = model, .out_dir = TempOut("e5"), .group = -2}, "--group-size -2"});
  cases.push_back({{.model_dir = kFixtures + "/quantize", .out_dir = TempOut("e6")}, "has no config.json"});
  cases.push_back({{.model_dir = model, .out_dir = TempOut("e7"), .group = 128}, "choose a smaller group size"});
  for (const Case& c : cases) {
    const Status s = QuantizeCheckpoint(c.o);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s.ToString();
  }
  fs::remove_all(busy);
}

// Loading what `mlarun quantize` writes back into mlarun (and comparing a
// step with the bf16 model's) needs the compressed-tensors reader
// (runtime/model/quant_compressed_tensors.cc); enable this once it lands.
// What `mlarun quantize` writes loads back as exactly what QuantizeLinear
// made of the input: every projection the reader returns equals, element for
// element, QuantizeLinear of the same bf16 weight (sharded output, several
// threads, int4 symmetric and asymmetric, int8 per channel).
TEST(QuantizeCheckpoint, RoundTripLoadsTheQuantizedValues) {
  const std::string model = kFixtures + "/models/v3_bf16";
  auto in = Checkpoint::Open(model);
  ASSERT_TRUE(in.ok()) << in.status();
  const QuantizeOptions runs[] = {{.dtype = DType::kInt4, .group = 32, .symmetric = true},
                                  {.dtype = DType::kInt4, .group = 32, .symmetric = false},
                                  {.dtype = DType::kInt8, .group = 0, .symmetric = true}};
  for (const QuantizeOptions& run : runs) {
    const std::string tag = std::string(DTypeName(run.dtype)) + (run.symmetric ? "_sym" : "_asym");
    SCOPED_TRACE(tag);
    QuantizeCheckpointOptions o{.model_dir = model, .out_dir = TempOut("roundtrip_" + tag), .dtype = run.dtype};
    o.group = run.group, o.symmetric = run.symmetric, o.threads = 2, o.max_shard_bytes = 40000;
    ASSERT_TRUE(QuantizeCheckpoint(o).ok());
    auto out = Checkpoint::Open(o.out_dir);
    ASSERT_TRUE(out.ok()) << out.status();
    auto scheme = ReadQuantScheme(o.out_dir);
    ASSERT_TRUE(scheme.ok()) << scheme.status();
    int modules = 0;
    for (const std::string& name : (*out)->Names()) {
      static const std::string kScale = ".weight_scale";
      if (!name.ends_with(kScale)) continue;
      const std::string prefix = name.substr(0, name.size() - kScale.size());
      const TensorRef* w = (*in)->Find(prefix + ".weight");
      ASSERT_NE(w, nullptr) << prefix;
      const int64_t rows = w->shape[0], cols = w->shape[1];
      Linear src = Linear::Owned(rows, cols, DType::kBF16);
      ASSERT_TRUE((*in)->Load(w->name, w->shape, DType::kBF16, src.mutable_data()).ok());
      auto want = QuantizeLinear(src, run);
      ASSERT_TRUE(want.ok()) << want.status();
      auto got = LoadQuantizedLinear(**out, *scheme, prefix, rows, cols, 0, rows, 0, cols);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->dtype, run.dtype) << prefix;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          ASSERT_EQ(got->At(r, c), want->At(r, c)) << prefix << " [" << r << ", " << c << "]";
      ++modules;
    }
    EXPECT_EQ(modules, 3 * 5 + 3 + 2 * 8 * 3 + 2 * 3);  // every projection CheckAgainstInput counts
    fs::remove_all(o.out_dir);
  }
}

}  // namespace
}  // namespace mlarun
