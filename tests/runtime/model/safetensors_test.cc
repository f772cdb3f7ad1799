#include "runtime/model/safetensors.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <tuple>

#include "base/float8.h"

namespace mlarun {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---------------------------------------------------------------------------
// Independent references, written from the format definitions in double.

// e4m3fn: bias 7, 3 mantissa bits, subnormals at exponent 0, no infinities,
// only S.1111.111 is NaN.
double E4M3Reference(uint8_t v) {
  const int sign = v >> 7, exponent = (v >> 3) & 0xf, mantissa = v & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::nan("");
  const double magnitude =
      exponent == 0 ? std::ldexp(mantissa / 8.0, 1 - 7) : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  return sign ? -magnitude : magnitude;
}

// IEEE binary16: bias 15, 10 mantissa bits.
double F16Reference(uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  double magnitude;
  if (exponent == 0x1f) {
    magnitude = mantissa ? std::nan("") : INFINITY;
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa / 1024.0, 1 - 15);
  } else {
    magnitude = std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
  }
  return sign ? -magnitude : magnitude;
}

float Bf16Reference(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

// Equal as values, -0 distinct from +0, NaN equal to NaN.
testing::AssertionResult SameFloat(float got, double want) {
  if (std::isnan(want) ? std::isnan(got)
                       : (got == static_cast<float>(want) && std::signbit(got) == std::signbit(want))) {
    return testing::AssertionSuccess();
  }
  return testing::AssertionFailure() << "got " << got << " (0x" << std::hex << std::bit_cast<uint32_t>(got)
                                     << "), want " << want;
}

testing::AssertionResult IsError(const Status& st, StatusCode code, std::initializer_list<std::string> needles) {
  if (st.code() != code) {
    return testing::AssertionFailure() << "code " << StatusCodeName(st.code()) << ", want " << StatusCodeName(code)
                                       << ": " << st;
  }
  for (const std::string& n : needles) {
    if (st.message().find(n) == std::string::npos) {
      return testing::AssertionFailure() << "message lacks '" << n << "': " << st;
    }
  }
  return testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------
// Building files.

std::string LengthPrefix(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

std::string SafetensorsBytes(std::string_view header, std::string_view data) {
  return LengthPrefix(header.size()) + std::string(header) + std::string(data);
}

template <typename T>
std::string RawBytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Appends tensors to the data section in order, with matching header entries.
class FileBuilder {
 public:
  FileBuilder& Add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
                   std::string_view bytes) {
    header_[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {data_.size(), data_.size() + bytes.size()}}};
    data_.append(bytes);
    return *this;
  }
  json& header() { return header_; }
  std::string& data() { return data_; }
  std::string Build() const { return SafetensorsBytes(header_.dump(), data_); }

 private:
  json header_ = json::object();
  std::string data_;
};

std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Random e4m3fn bytes, every non-NaN pattern equally likely.
std::vector<uint8_t> RandomFp8(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, 253);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) {
    const int k = d(rng);  // 0..253 -> skip 0x7f: 0..126, 128..254
    b = static_cast<uint8_t>(k < 127 ? k : k + 1);
  }
  return v;
}

class SafetensorsTest : public testing::Test {
 protected:
  void SetUp() override {
    const testing::TestInfo* info = testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(testing::TempDir()) / (std::string("mlarun_safetensors_") + info->test_suite_name() + "_" +
                                           info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // Writes `bytes` to dir_/relative (creating folders) and returns the path.
  std::string Write(const std::string& relative, std::string_view bytes) {
    const fs::path p = dir_ / relative;
    fs::create_directories(p.parent_path());
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(out.good()) << p;
    return p.string();
  }

  // Writes `bytes` as a file and expects Open to fail with `code`, naming the file and `needles`.
  void ExpectOpenError(std::string_view bytes, StatusCode code, std::initializer_list<std::string> needles,
                       const std::string& file_name = "bad.safetensors") {
    const std::string path = Write(file_name, bytes);
    const Status st = SafetensorsFile::Open(path).status();
    EXPECT_TRUE(IsError(st, code, {path})) << bytes.size() << "-byte file";
    EXPECT_TRUE(IsError(st, code, needles));
  }

  fs::path dir_;
};

// ---------------------------------------------------------------------------
// Float8

TEST(Float8, AllBytesMatchDefinition) {
  std::vector<uint8_t> all(256);
  std::iota(all.begin(), all.end(), 0);
  std::vector<float> bulk(256, -1.0f);
  ConvertF8E4M3ToF32(all.data(), bulk.data(), 256);
  int nans = 0;
  for (int v = 0; v < 256; ++v) {
    const double want = E4M3Reference(static_cast<uint8_t>(v));
    nans += std::isnan(want);
    EXPECT_TRUE(SameFloat(Float8E4M3ToFloat(static_cast<uint8_t>(v)), want)) << "byte 0x" << std::hex << v;
    EXPECT_TRUE(SameFloat(bulk[static_cast<size_t>(v)], want)) << "byte 0x" << std::hex << v;
  }
  EXPECT_EQ(nans, 2);  // 0x7f and 0xff only
  EXPECT_EQ(Float8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Float8E4M3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(Float8E4M3ToFloat(0x01), 0x1p-9f);
  EXPECT_EQ(Float8E4M3ToFloat(0x08), 0x1p-6f);  // smallest normal
  EXPECT_TRUE(std::signbit(Float8E4M3ToFloat(0x80)));
}

// ---------------------------------------------------------------------------
// SafetensorsFile: valid files

TEST_F(SafetensorsTest, RoundTripsF32Bf16F16) {
  const std::vector<float> f32 = RandomFloats(12, 1, 5.0f);
  std::vector<uint16_t> bf16;
  for (float x : RandomFloats(10, 2, 100.0f)) bf16.push_back(FloatToBf16(x));
  // Every binary16 pattern (subnormals, infinities, NaNs), shuffled, twice and
  // then some: 2 x 65536 + 256 elements span several conversion chunks.
  std::vector<uint16_t> f16(2 * 65536 + 256);
  for (size_t i = 0; i < f16.size(); ++i) f16[i] = static_cast<uint16_t>(i);
  std::shuffle(f16.begin(), f16.end(), std::mt19937(3));
  const std::vector<float> scalar = RandomFloats(1, 4);
  const std::vector<int64_t> i64 = {-5, 1LL << 40};

  FileBuilder b;
  b.Add("odd", "U8", {3}, "xyz");  // puts the next tensor at a misaligned offset
  b.Add("w.f32", "F32", {3, 4}, RawBytes(f32));
  b.Add("w.bf16", "BF16", {2, 5}, RawBytes(bf16));
  b.Add("w.f16", "F16", {513, 256}, RawBytes(f16));
  b.Add("scalar", "F32", {}, RawBytes(scalar));
  b.Add("empty", "F32", {0, 7}, "");
  b.Add("ids", "I64", {2}, RawBytes(i64));
  b.header()["__metadata__"] = {{"format", "pt"}, {"note", "hello"}};
  const std::string path = Write("ckpt/model.safetensors", b.Build());

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->path(), path);
  EXPECT_EQ((*file)->tensors().size(), 7u);
  EXPECT_EQ((*file)->metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"note", "hello"}}));
  EXPECT_EQ((*file)->Find("__metadata__"), nullptr);
  EXPECT_EQ((*file)->Find("nope"), nullptr);
  const TensorRef* t = (*file)->Find("w.f32");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->name, "w.f32");
  EXPECT_EQ(t->dtype, SafetensorsDType::kF32);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(t->numel(), 12);
  EXPECT_EQ(t->bytes, 48u);
  ASSERT_NE(t->file, nullptr);
  EXPECT_EQ(*t->file, path);
  EXPECT_EQ(std::memcmp(t->data, f32.data(), 48), 0);
  const TensorRef* f16_ref = (*file)->Find("w.f16");
  ASSERT_NE(f16_ref, nullptr);
  EXPECT_EQ(f16_ref->dtype, SafetensorsDType::kF16);
  EXPECT_EQ(f16_ref->numel(), 513 * 256);
  EXPECT_EQ(std::memcmp(f16_ref->data, f16.data(), f16.size() * 2), 0);
  EXPECT_EQ((*file)->Find("scalar")->numel(), 1);
  EXPECT_EQ((*file)->Find("empty")->numel(), 0);
  EXPECT_EQ((*file)->Find("ids")->dtype, SafetensorsDType::kI64);
  EXPECT_EQ(SafetensorsDTypeSize(SafetensorsDType::kI64), 8u);
  EXPECT_EQ(SafetensorsDTypeName(SafetensorsDType::kF8E4M3), "F8_E4M3");

  auto ckpt = Checkpoint::Open((dir_ / "ckpt").string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->Names(), (std::vector<std::string>{"empty", "ids", "odd", "scalar", "w.bf16", "w.f16", "w.f32"}));

  const std::vector<int64_t> s34 = {3, 4}, s25 = {2, 5}, s_f16 = {513, 256}, s_scalar = {}, s_empty = {0, 7};
  std::vector<float> out(f16.size());
  std::vector<uint16_t> out_bf16(f16.size());

  ASSERT_TRUE((*ckpt)->Load("w.f32", s34, DType::kF32, out.data()).ok());
  for (size_t i = 0; i < f32.size(); ++i) EXPECT_TRUE(SameFloat(out[i], f32[i])) << i;
  ASSERT_TRUE((*ckpt)->Load("w.f32", s34, DType::kBF16, out_bf16.data()).ok());
  for (size_t i = 0; i < f32.size(); ++i) EXPECT_EQ(out_bf16[i], FloatToBf16(f32[i])) << i;

  ASSERT_TRUE((*ckpt)->Load("w.bf16", s25, DType::kF32, out.data()).ok());
  for (size_t i = 0; i < bf16.size(); ++i) EXPECT_TRUE(SameFloat(out[i], Bf16Reference(bf16[i]))) << i;
  ASSERT_TRUE((*ckpt)->Load("w.bf16", s25, DType::kBF16, out_bf16.data()).ok());
  for (size_t i = 0; i < bf16.size(); ++i) EXPECT_EQ(out_bf16[i], bf16[i]) << i;

  ASSERT_TRUE((*ckpt)->Load("w.f16", s_f16, DType::kF32, out.data()).ok());
  for (size_t i = 0; i < f16.size(); ++i) {
    ASSERT_TRUE(SameFloat(out[i], F16Reference(f16[i]))) << "f16 0x" << std::hex << f16[i];
  }
  ASSERT_TRUE((*ckpt)->Load("w.f16", s_f16, DType::kBF16, out_bf16.data()).ok());
  for (size_t i = 0; i < f16.size(); ++i) {
    const float want = static_cast<float>(F16Reference(f16[i]));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(Bf16Reference(out_bf16[i]))) << i;
    } else {
      ASSERT_EQ(out_bf16[i], FloatToBf16(want)) << "f16 0x" << std::hex << f16[i];
    }
  }

  float scalar_out = 0.0f;
  ASSERT_TRUE((*ckpt)->Load("scalar", s_scalar, DType::kF32, &scalar_out).ok());
  EXPECT_EQ(scalar_out, scalar[0]);
  EXPECT_TRUE((*ckpt)->Load("empty", s_empty, DType::kF32, nullptr).ok());

  const std::vector<int64_t> s2 = {2}, s3 = {3};
  EXPECT_TRUE(IsError((*ckpt)->Load("ids", s2, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                      {"unsupported dtype for loading", "'ids'", path, "I64"}));
  EXPECT_TRUE(IsError((*ckpt)->Load("odd", s3, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                      {"unsupported dtype for loading", "'odd'", path}));
  EXPECT_TRUE(
      IsError((*ckpt)->Load("w.f32", s34, DType::kF16, out.data()), StatusCode::kInvalidArgument, {"w.f32", "f16"}));
}

TEST_F(SafetensorsTest, EmptyTensorInsideAnotherIsNotAnOverlap) {
  const std::vector<float> v = RandomFloats(4, 5);
  FileBuilder b;
  b.Add("a", "F32", {4}, RawBytes(v));
  b.header()["z"] = {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {8, 8}}};
  auto file = SafetensorsFile::Open(Write("f.safetensors", b.Build()));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->Find("z")->bytes, 0u);
}

// Files of 2 MiB and more are mapped at a 2 MiB-aligned address (so the page
// cache's 2 MiB folios can be mapped whole); every byte still reads back,
// across the 2 MiB boundaries and up to the file's last byte, and the
// mappings come and go without touching their neighbours.
TEST_F(SafetensorsTest, LargeFilesMapAlignedAndReadBack) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  for (const size_t floats : {size_t{524'288} - 40, size_t{1'300'001}, size_t{2'621'441}}) {
    const std::vector<float> head = RandomFloats(3, 7);
    const std::vector<float> big = RandomFloats(floats, static_cast<uint32_t>(floats));
    FileBuilder b;
    b.Add("head", "F32", {3}, RawBytes(head));
    b.Add("big", "F32", {static_cast<int64_t>(floats)}, RawBytes(big));
    const std::string bytes = b.Build();
    const std::string path = Write("large.safetensors", bytes);
    auto file = SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    const TensorRef* t = (*file)->Find("big");
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->bytes, floats * 4);
    EXPECT_EQ(std::memcmp(t->data, big.data(), floats * 4), 0) << bytes.size() << "-byte file";
    // Where the tensor's bytes sit in the file, found independently of the parser.
    const std::string_view needle(reinterpret_cast<const char*>(big.data()), 64);
    const size_t offset = bytes.find(needle);
    ASSERT_NE(offset, std::string::npos);
    const uintptr_t base = reinterpret_cast<uintptr_t>(t->data) - offset;
    if (bytes.size() < kHuge) {
      file->reset();
      continue;
    }
    EXPECT_EQ(base % kHuge, 0u) << bytes.size() << "-byte file mapped at " << base;
    // The page after the mapping's end was part of the reservation that
    // placed it: a fresh mapping there works once it was given back.
    const uintptr_t end = (base + bytes.size() + 4095) / 4096 * 4096;
    void* probe =
        ::mmap(reinterpret_cast<void*>(end), 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (probe != MAP_FAILED) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(probe), end);
      ::munmap(probe, 4096);
    } else {
      ADD_FAILURE() << "the page after a " << bytes.size() << "-byte mapping is still taken: " << std::strerror(errno);
    }
    file->reset();
  }
}
// ---------------------------------------------------------------------------
// SafetensorsFile: hostile files

TEST_F(SafetensorsTest, MissingFile) {
  const std::string path = (dir_ / "absent.safetensors").string();
  EXPECT_TRUE(IsError(SafetensorsFile::Open(path).status(), StatusCode::kNotFound, {path}));
}

TEST_F(SafetensorsTest, EmptyFile) { ExpectOpenError("", StatusCode::kInvalidArgument, {"too small"}); }

TEST_F(SafetensorsTest, ShortFile) {
  ExpectOpenError(std::string("\x02\0\0\0", 4), StatusCode::kInvalidArgument, {"4 bytes is too small"});
}

TEST_F(SafetensorsTest, HeaderLengthBeyondFile) {
  std::string bytes = SafetensorsBytes("{}", "");
  bytes[0] = 3;  // claims 3 bytes, file has 2 after the length
  ExpectOpenError(bytes, StatusCode::kInvalidArgument, {"header length 3"});
  // A length near 2^64 must not wrap around when added to 8.
  ExpectOpenError(LengthPrefix(~uint64_t{0} - 5) + "{}", StatusCode::kInvalidArgument,
                  {"header length 18446744073709551610 exceeds the 2 bytes"});
}

TEST_F(SafetensorsTest, HeaderLengthAboveCap) {
  // A sparse file that really is that long: only the cap stops a 100 MB parse.
  constexpr uint64_t kHeader = (uint64_t{100} << 20) + 1;
  const std::string path = Write("huge.safetensors", LengthPrefix(kHeader) + "{");
  fs::resize_file(path, 8 + kHeader);
  EXPECT_TRUE(IsError(SafetensorsFile::Open(path).status(), StatusCode::kInvalidArgument,
                      {path, "header length 104857601", "limit"}));
}

TEST_F(SafetensorsTest, HeaderNotJson) {
  ExpectOpenError(SafetensorsBytes("{\"a\": {\"dtype\": ", "12345678"), StatusCode::kInvalidArgument,
                  {"not valid JSON"});
  ExpectOpenError(SafetensorsBytes("", "1234"), StatusCode::kInvalidArgument, {"not valid JSON"});
}

TEST_F(SafetensorsTest, HeaderNotObject) {
  ExpectOpenError(SafetensorsBytes("[1, 2, 3]", ""), StatusCode::kInvalidArgument, {"not a JSON object"});
  ExpectOpenError(SafetensorsBytes("\"x\"", ""), StatusCode::kInvalidArgument, {"not a JSON object"});
}

TEST_F(SafetensorsTest, EntryNotObjectOrIncomplete) {
  ExpectOpenError(SafetensorsBytes(R"({"w": 5})", ""), StatusCode::kInvalidArgument, {"'w'"});
  ExpectOpenError(SafetensorsBytes(R"({"w": {"dtype": "F32", "shape": [1]}})", "1234"), StatusCode::kInvalidArgument,
                  {"'w'", "data_offsets"});
}

TEST_F(SafetensorsTest, UnknownDtype) {
  FileBuilder b;
  b.Add("good", "F32", {1}, "abcd").Add("layers.0.q", "Q4_K", {4}, "abcd");
  ExpectOpenError(b.Build(), StatusCode::kInvalidArgument, {"unknown dtype", "'layers.0.q'", "Q4_K"});
  FileBuilder lower;
  lower.Add("t", "f32", {1}, "abcd");  // names are case-sensitive
  ExpectOpenError(lower.Build(), StatusCode::kInvalidArgument, {"unknown dtype", "'t'"});
}

TEST_F(SafetensorsTest, BadShapes) {
  FileBuilder negative;
  negative.Add("neg", "F32", {-1, 4}, "");
  ExpectOpenError(negative.Build(), StatusCode::kInvalidArgument, {"'neg'", "shape"});
  FileBuilder fractional;
  fractional.Add("frac", "U8", {2}, "ab");
  fractional.header()["frac"]["shape"] = {2.0};
  ExpectOpenError(fractional.Build(), StatusCode::kInvalidArgument, {"'frac'", "shape"});
  // 2^40 * 2^40 elements overflow 64 bits; without the check the product
  // wraps to 0 and would match empty offsets.
  FileBuilder overflow;
  overflow.Add("big", "U8", {int64_t{1} << 40, int64_t{1} << 40, int64_t{1} << 40}, "");
  ExpectOpenError(overflow.Build(), StatusCode::kInvalidArgument, {"'big'", "overflow"});
  FileBuilder not_array;
  not_array.Add("s", "U8", {2}, "ab");
  not_array.header()["s"]["shape"] = "2";
  ExpectOpenError(not_array.Build(), StatusCode::kInvalidArgument, {"'s'", "shape"});
}

TEST_F(SafetensorsTest, OffsetsPastEndOfTruncatedFile) {
  const std::vector<float> v = RandomFloats(16, 6);
  FileBuilder b;
  b.Add("first", "F32", {4}, RawBytes(v).substr(0, 16)).Add("cut", "F32", {12}, RawBytes(v).substr(16));
  std::string bytes = b.Build();
  bytes.resize(bytes.size() - 4);  // the last tensor loses its last element
  ExpectOpenError(bytes, StatusCode::kInvalidArgument, {"'cut'", "past"});
}

TEST_F(SafetensorsTest, BadOffsets) {
  FileBuilder mismatch;
  mismatch.Add("m", "F32", {4}, "0123456789ab");  // 12 bytes for 4 floats
  ExpectOpenError(mismatch.Build(), StatusCode::kInvalidArgument, {"'m'", "need 16"});
  FileBuilder bf16_mismatch;
  bf16_mismatch.Add("h", "BF16", {3}, "01234567");  // element size matters: 8 != 3 * 2
  ExpectOpenError(bf16_mismatch.Build(), StatusCode::kInvalidArgument, {"'h'", "need 6"});
  FileBuilder reversed;
  reversed.Add("r", "U8", {0}, "");
  reversed.data() = "abcd";
  reversed.header()["r"]["data_offsets"] = {3, 1};
  ExpectOpenError(reversed.Build(), StatusCode::kInvalidArgument, {"'r'", "[3, 1]", "begin after end"});
  FileBuilder negative;
  negative.Add("n", "U8", {2}, "ab");
  negative.header()["n"]["data_offsets"] = {-2, 0};
  ExpectOpenError(negative.Build(), StatusCode::kInvalidArgument, {"'n'", "data_offsets"});
  FileBuilder triple;
  triple.Add("t", "U8", {2}, "ab");
  triple.header()["t"]["data_offsets"] = {0, 2, 4};
  ExpectOpenError(triple.Build(), StatusCode::kInvalidArgument, {"'t'", "data_offsets"});
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  const std::vector<float> v = RandomFloats(6, 7);
  FileBuilder partial;
  partial.Add("a", "F32", {4}, RawBytes(v).substr(0, 16));
  partial.data() = RawBytes(v);
  partial.header()["b"] = {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {8, 24}}};  // shares 8 bytes with a
  ExpectOpenError(partial.Build(), StatusCode::kInvalidArgument, {"'a'", "'b'", "overlap"});

  // One range inside another, listed (by name order) before it.
  FileBuilder nested;
  nested.data() = RawBytes(v);
  nested.header()["inner"] = {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {10, 12}}};
  nested.header()["outer"] = {{"dtype", "F32"}, {"shape", {6}}, {"data_offsets", {0, 24}}};
  ExpectOpenError(nested.Build(), StatusCode::kInvalidArgument, {"'inner'", "'outer'", "overlap"});

  // Same range twice.
  FileBuilder same;
  same.Add("x", "F32", {2}, RawBytes(v).substr(0, 8));
  same.header()["y"] = same.header()["x"];
  ExpectOpenError(same.Build(), StatusCode::kInvalidArgument, {"'x'", "'y'", "overlap"});
}

TEST_F(SafetensorsTest, DuplicateTensorName) {
  // The second "w" would otherwise silently replace the first.
  const std::string header = R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},)"
                             R"( "w": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}})";
  ExpectOpenError(SafetensorsBytes(header, "abcd"), StatusCode::kInvalidArgument, {"'w'", "twice"});
}

TEST_F(SafetensorsTest, BadMetadata) {
  FileBuilder not_string;
  not_string.Add("t", "U8", {1}, "a");
  not_string.header()["__metadata__"] = {{"format", "pt"}, {"total", 5}};
  ExpectOpenError(not_string.Build(), StatusCode::kInvalidArgument, {"__metadata__", "'total'"});
  FileBuilder not_object;
  not_object.Add("t", "U8", {1}, "a");
  not_object.header()["__metadata__"] = "pt";
  ExpectOpenError(not_object.Build(), StatusCode::kInvalidArgument, {"__metadata__"});
}

TEST_F(SafetensorsTest, CorruptedFilesFailCleanly) {
  // Random damage to a valid file: every result is OK or INVALID_ARGUMENT naming
  // the file, and whatever opens can be loaded in full without leaving the
  // mapping (a bad bound here crashes, under ASan or not).
  FileBuilder b;
  b.Add("a", "F32", {3, 5}, RawBytes(RandomFloats(15, 40)));
  b.Add("b", "BF16", {7}, RawBytes(std::vector<uint16_t>(7, 0x3f80)));
  b.Add("w", "F8_E4M3", {130, 3}, RawBytes(RandomFp8(390, 41)));
  b.Add("w_scale_inv", "F32", {2, 1}, RawBytes(RandomFloats(2, 42)));
  b.Add("c", "F16", {4}, RawBytes(std::vector<uint16_t>{0x3c00, 0x0001, 0x7bff, 0x8000}));
  const std::string good = b.Build();
  const size_t header_end = 8 + b.header().dump().size();
  std::mt19937 rng(43);
  auto pick = [&rng](size_t lo, size_t hi) { return std::uniform_int_distribution<size_t>(lo, hi)(rng); };
  int opened = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    std::string bytes = good;
    const int edits = 1 + static_cast<int>(pick(0, 2));
    for (int e = 0; e < edits; ++e) {
      switch (pick(0, 3)) {
        case 0: {  // a digit in the header becomes another digit: plausible offsets and shapes
          const size_t at = pick(8, header_end - 1);
          if (std::isdigit(static_cast<unsigned char>(bytes[at]))) bytes[at] = static_cast<char>('0' + pick(0, 9));
          break;
        }
        case 1:  // any header byte
          bytes[pick(0, header_end - 1)] = static_cast<char>(pick(0, 255));
          break;
        case 2:  // truncation
          bytes.resize(pick(0, bytes.size()));
          break;
        default:  // the length prefix off by a little
          bytes[0] = static_cast<char>(static_cast<uint8_t>(bytes[0]) + pick(0, 8) - 4);
          break;
      }
    }
    const std::string path = Write("ckpt/model.safetensors", bytes);
    auto ckpt = Checkpoint::Open((dir_ / "ckpt").string());
    if (!ckpt.ok()) {
      ASSERT_TRUE(IsError(ckpt.status(), StatusCode::kInvalidArgument, {path})) << "iteration " << iter;
      continue;
    }
    ++opened;
    for (const std::string& name : (*ckpt)->Names()) {
      const TensorRef* t = (*ckpt)->Find(name);
      std::vector<float> out(static_cast<size_t>(t->numel()));
      const Status st = (*ckpt)->Load(name, t->shape, DType::kF32, out.data());
      if (!st.ok()) {
        ASSERT_TRUE(IsError(st, StatusCode::kInvalidArgument, {name})) << "iteration " << iter;
      }
      if (t->shape.size() == 2) {
        // A slice from an interior row and column goes through the same checks.
        const int64_t rows = t->shape[0], cols = t->shape[1];
        const Status slice =
            (*ckpt)->LoadSlice(name, t->shape, rows / 3, rows, cols / 2, cols, DType::kF32, out.data());
        if (!slice.ok()) {
          ASSERT_TRUE(IsError(slice, StatusCode::kInvalidArgument, {name})) << "iteration " << iter;
        }
      }
    }
  }
  EXPECT_GT(opened, 10);  // the loop did exercise loading
}

// ---------------------------------------------------------------------------
// Checkpoint directories

class CheckpointTest : public SafetensorsTest {
 protected:
  // Two shards: shard 1 holds a.weight, b.weight; shard 2 holds c.weight.
  void WriteShards() {
    a_ = RandomFloats(6, 10);
    b_ = RandomFloats(4, 11);
    for (float x : RandomFloats(8, 12, 3.0f)) c_.push_back(FloatToBf16(x));
    FileBuilder s1;
    s1.Add("a.weight", "F32", {2, 3}, RawBytes(a_)).Add("b.weight", "F32", {4}, RawBytes(b_));
    FileBuilder s2;
    s2.Add("c.weight", "BF16", {8}, RawBytes(c_));
    shard1_ = Write("ckpt/model-00001-of-00002.safetensors", s1.Build());
    shard2_ = Write("ckpt/model-00002-of-00002.safetensors", s2.Build());
    index_ = {{"metadata", {{"total_size", 56}}},
              {"weight_map",
               {{"a.weight", "model-00001-of-00002.safetensors"},
                {"b.weight", "model-00001-of-00002.safetensors"},
                {"c.weight", "model-00002-of-00002.safetensors"}}}};
  }
  std::string WriteIndex() { return Write("ckpt/model.safetensors.index.json", index_.dump(2)); }
  std::string ckpt_dir() const { return (dir_ / "ckpt").string(); }

  std::vector<float> a_, b_;
  std::vector<uint16_t> c_;
  std::string shard1_, shard2_;
  json index_;
};

TEST_F(CheckpointTest, ShardedLoads) {
  WriteShards();
  WriteIndex();
  auto ckpt = Checkpoint::Open(ckpt_dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->dir(), ckpt_dir());
  EXPECT_EQ((*ckpt)->Names(), (std::vector<std::string>{"a.weight", "b.weight", "c.weight"}));
  ASSERT_NE((*ckpt)->Find("c.weight"), nullptr);
  EXPECT_EQ(*(*ckpt)->Find("c.weight")->file, shard2_);
  EXPECT_EQ(*(*ckpt)->Find("a.weight")->file, shard1_);

  const std::vector<int64_t> s23 = {2, 3}, s4 = {4}, s8 = {8};
  std::vector<float> out(8);
  ASSERT_TRUE((*ckpt)->Load("a.weight", s23, DType::kF32, out.data()).ok());
  for (size_t i = 0; i < a_.size(); ++i) EXPECT_EQ(out[i], a_[i]);
  ASSERT_TRUE((*ckpt)->Load("b.weight", s4, DType::kF32, out.data()).ok());
  for (size_t i = 0; i < b_.size(); ++i) EXPECT_EQ(out[i], b_[i]);
  ASSERT_TRUE((*ckpt)->Load("c.weight", s8, DType::kF32, out.data()).ok());
  for (size_t i = 0; i < c_.size(); ++i) EXPECT_EQ(out[i], Bf16Reference(c_[i]));
}

TEST_F(CheckpointTest, IndexPreferredOverSingleFile) {
  WriteShards();
  WriteIndex();
  FileBuilder stray;
  stray.Add("stray", "U8", {1}, "s");
  Write("ckpt/model.safetensors", stray.Build());
  auto ckpt = Checkpoint::Open(ckpt_dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->Find("stray"), nullptr);
  EXPECT_NE((*ckpt)->Find("a.weight"), nullptr);
}

TEST_F(CheckpointTest, NoCheckpoint) {
  fs::create_directories(dir_ / "ckpt");
  EXPECT_TRUE(IsError(Checkpoint::Open(ckpt_dir()).status(), StatusCode::kNotFound, {ckpt_dir()}));
  const std::string absent = (dir_ / "absent").string();
  EXPECT_TRUE(IsError(Checkpoint::Open(absent).status(), StatusCode::kNotFound, {absent}));
}

TEST_F(CheckpointTest, IndexNamesMissingShard) {
  WriteShards();
  index_["weight_map"]["d.weight"] = "model-00003-of-00003.safetensors";
  WriteIndex();
  EXPECT_TRUE(IsError(Checkpoint::Open(ckpt_dir()).status(), StatusCode::kNotFound,
                      {"model-00003-of-00003.safetensors", ckpt_dir()}));
}

TEST_F(CheckpointTest, IndexShardOutsideDirectory) {
  WriteShards();
  // Valid safetensors files outside the checkpoint: opening them must be refused, not merely fail.
  FileBuilder evil;
  evil.Add("a.weight", "F32", {2, 3}, RawBytes(RandomFloats(6, 13)));
  const std::string evil_path = Write("evil.safetensors", evil.Build());
  for (const std::string& shard :
       {std::string("../evil.safetensors"), evil_path, std::string("sub/../../evil.safetensors"), std::string("..")}) {
    index_["weight_map"]["a.weight"] = shard;
    WriteIndex();
    EXPECT_TRUE(IsError(Checkpoint::Open(ckpt_dir()).status(), StatusCode::kInvalidArgument,
                        {"'a.weight'", shard, "model.safetensors.index.json"}))
        << shard;
  }
}

TEST_F(CheckpointTest, TensorInIndexButNotInShard) {
  WriteShards();
  index_["weight_map"]["ghost.weight"] = "model-00002-of-00002.safetensors";
  WriteIndex();
  EXPECT_TRUE(
      IsError(Checkpoint::Open(ckpt_dir()).status(), StatusCode::kInvalidArgument, {"'ghost.weight'", shard2_}));
}

TEST_F(CheckpointTest, TensorInIndexPointsAtWrongShard) {
  WriteShards();
  index_["weight_map"]["c.weight"] = "model-00001-of-00002.safetensors";
  index_["weight_map"]["b.weight"] = "model-00002-of-00002.safetensors";
  WriteIndex();
  const Status st = Checkpoint::Open(ckpt_dir()).status();
  EXPECT_TRUE(IsError(st, StatusCode::kInvalidArgument, {"which does not contain it"}));
  EXPECT_TRUE(st.message().find("'b.weight'") != std::string::npos ||
              st.message().find("'c.weight'") != std::string::npos)
      << st;
}

TEST_F(CheckpointTest, TensorInShardButNotInIndex) {
  WriteShards();
  index_["weight_map"].erase("b.weight");
  WriteIndex();
  EXPECT_TRUE(IsError(Checkpoint::Open(ckpt_dir()).status(), StatusCode::kInvalidArgument,
                      {"'b.weight'", shard1_, "not listed"}));
}

TEST_F(CheckpointTest, DuplicateTensorAcrossShards) {
  WriteShards();
  FileBuilder s2;
  s2.Add("c.weight", "BF16", {8}, RawBytes(c_)).Add("a.weight", "F32", {2, 3}, RawBytes(a_));
  Write("ckpt/model-00002-of-00002.safetensors", s2.Build());
  WriteIndex();
  EXPECT_TRUE(IsError(Checkpoint::Open(ckpt_dir()).status(), StatusCode::kInvalidArgument,
                      {"'a.weight'", shard1_, shard2_, "duplicate"}));
}

TEST_F(CheckpointTest, BadIndex) {
  WriteShards();
  const std::string index_path = Write("ckpt/model.safetensors.index.json", "{\"weight_map\": {");
  EXPECT_TRUE(IsError(Checkpoint::Open(ckpt_dir()).status(), StatusCode::kInvalidArgument, {index_path, "JSON"}));
  Write("ckpt/model.safetensors.index.json", R"({"metadata": {}})");
  EXPECT_TRUE(IsError(Checkpoint::Open(ckpt_dir()).status(), StatusCode::kInvalidArgument, {index_path, "weight_map"}));
  Write("ckpt/model.safetensors.index.json", R"({"weight_map": {}})");
  EXPECT_TRUE(IsError(Checkpoint::Open(ckpt_dir()).status(), StatusCode::kInvalidArgument, {index_path, "empty"}));
  Write("ckpt/model.safetensors.index.json", R"({"weight_map": {"a.weight": 1}})");
  EXPECT_TRUE(IsError(Checkpoint::Open(ckpt_dir()).status(), StatusCode::kInvalidArgument, {index_path, "'a.weight'"}));
}

TEST_F(CheckpointTest, BadShardReportsShardPath) {
  WriteShards();
  Write("ckpt/model-00002-of-00002.safetensors", SafetensorsBytes("[]", ""));
  WriteIndex();
  EXPECT_TRUE(
      IsError(Checkpoint::Open(ckpt_dir()).status(), StatusCode::kInvalidArgument, {shard2_, "not a JSON object"}));
}

TEST_F(CheckpointTest, LoadWrongShapeAndMissingTensor) {
  WriteShards();
  WriteIndex();
  auto ckpt = Checkpoint::Open(ckpt_dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  std::vector<float> out(64, 0.0f);
  const std::vector<int64_t> s32 = {3, 2}, s6 = {6}, s231 = {2, 3, 1};
  for (const std::vector<int64_t>& shape : {s32, s6, s231}) {
    EXPECT_TRUE(IsError((*ckpt)->Load("a.weight", shape, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                        {"'a.weight'", shard1_, "[2, 3]"}));
  }
  EXPECT_TRUE(
      IsError((*ckpt)->Load("a.weight", s32, DType::kF32, out.data()), StatusCode::kInvalidArgument, {"[3, 2]"}));
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.0f; }));  // untouched on error
  EXPECT_TRUE(IsError((*ckpt)->Load("model.norm.weight", s6, DType::kF32, out.data()), StatusCode::kNotFound,
                      {"'model.norm.weight'", ckpt_dir()}));
}

// ---------------------------------------------------------------------------
// FP8 block-scaled dequantization

// w[i][j] = e4m3(w[i][j]) * scale[i/128][j/128], in double. The fp8 value has
// at most 4 significant bits and the scale 24, so the double product is exact
// and rounding it to float is the one rounding an fp32 multiply does.
std::vector<float> DequantReference(const std::vector<uint8_t>& w, const std::vector<float>& scale, int64_t rows,
                                    int64_t cols) {
  const int64_t scale_cols = (cols + 127) / 128;
  std::vector<float> ref(w.size());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const double s = scale[static_cast<size_t>(i / 128 * scale_cols + j / 128)];
      ref[static_cast<size_t>(i * cols + j)] =
          static_cast<float>(E4M3Reference(w[static_cast<size_t>(i * cols + j)]) * s);
    }
  }
  return ref;
}

TEST_F(CheckpointTest, Fp8BlockDequantization) {
  // 300 x 260: neither dim a multiple of 128 (3 x 3 blocks, ragged edges), and
  // more than one conversion chunk of rows, split mid-block.
  constexpr int64_t kRows = 300, kCols = 260;
  const std::vector<uint8_t> w = RandomFp8(kRows * kCols, 20);
  std::vector<float> scale;
  for (float x : RandomFloats(9, 21)) scale.push_back(std::abs(x) * 1e-3f + 1e-5f);
  // A second weight with bf16 scales.
  constexpr int64_t kRows2 = 129, kCols2 = 5;
  const std::vector<uint8_t> w2 = RandomFp8(kRows2 * kCols2, 22);
  std::vector<uint16_t> scale2_bf16;
  std::vector<float> scale2;
  for (float x : RandomFloats(2, 23)) {
    scale2_bf16.push_back(FloatToBf16(std::abs(x) + 0.1f));
    scale2.push_back(Bf16Reference(scale2_bf16.back()));
  }

  FileBuilder b;
  b.Add("model.layers.0.mlp.gate_proj.weight", "F8_E4M3", {kRows, kCols}, RawBytes(w));
  b.Add("model.layers.0.mlp.gate_proj.weight_scale_inv", "F32", {3, 3}, RawBytes(scale));
  b.Add("small.weight", "F8_E4M3", {kRows2, kCols2}, RawBytes(w2));
  b.Add("small.weight_scale_inv", "BF16", {2, 1}, RawBytes(scale2_bf16));
  Write("ckpt/model.safetensors", b.Build());
  auto ckpt = Checkpoint::Open(ckpt_dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();

  const std::vector<float> ref = DequantReference(w, scale, kRows, kCols);
  const std::vector<int64_t> shape = {kRows, kCols};
  std::vector<float> out(ref.size());
  ASSERT_TRUE((*ckpt)->Load("model.layers.0.mlp.gate_proj.weight", shape, DType::kF32, out.data()).ok());
  for (size_t i = 0; i < ref.size(); ++i) ASSERT_TRUE(SameFloat(out[i], ref[i])) << "element " << i;
  std::vector<uint16_t> out_bf16(ref.size());
  ASSERT_TRUE((*ckpt)->Load("model.layers.0.mlp.gate_proj.weight", shape, DType::kBF16, out_bf16.data()).ok());
  for (size_t i = 0; i < ref.size(); ++i) ASSERT_EQ(out_bf16[i], FloatToBf16(ref[i])) << "element " << i;

  const std::vector<float> ref2 = DequantReference(w2, scale2, kRows2, kCols2);
  const std::vector<int64_t> shape2 = {kRows2, kCols2};
  std::vector<float> out2(ref2.size());
  ASSERT_TRUE((*ckpt)->Load("small.weight", shape2, DType::kF32, out2.data()).ok());
  for (size_t i = 0; i < ref2.size(); ++i) ASSERT_TRUE(SameFloat(out2[i], ref2[i])) << "element " << i;
}

TEST_F(CheckpointTest, Fp8ScaleProblems) {
  const std::vector<uint8_t> w = RandomFp8(130 * 260, 30);
  const std::vector<float> scale = RandomFloats(6, 31);
  FileBuilder b;
  b.Add("no_scale.weight", "F8_E4M3", {130, 260}, RawBytes(w));
  b.Add("short.weight", "F8_E4M3", {130, 260}, RawBytes(w));
  b.Add("short.weight_scale_inv", "F32", {1, 3}, RawBytes(scale).substr(0, 12));  // floor instead of ceil
  b.Add("transposed.weight", "F8_E4M3", {130, 260}, RawBytes(w));
  b.Add("transposed.weight_scale_inv", "F32", {3, 2}, RawBytes(scale));
  b.Add("f16scale.weight", "F8_E4M3", {130, 260}, RawBytes(w));
  b.Add("f16scale.weight_scale_inv", "F16", {2, 3}, RawBytes(scale).substr(0, 12));
  b.Add("flat.weight", "F8_E4M3", {64}, RawBytes(w).substr(0, 64));
  b.Add("flat.weight_scale_inv", "F32", {1}, RawBytes(scale).substr(0, 4));
  b.Add("e5m2.weight", "F8_E5M2", {2, 2}, "abcd");
  const std::string path = Write("ckpt/model.safetensors", b.Build());
  auto ckpt = Checkpoint::Open(ckpt_dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();

  std::vector<float> out(130 * 260);
  const std::vector<int64_t> shape = {130, 260}, flat = {64}, s22 = {2, 2};
  EXPECT_TRUE(IsError((*ckpt)->Load("no_scale.weight", shape, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                      {"'no_scale.weight'", "'no_scale.weight_scale_inv'", path}));
  EXPECT_TRUE(IsError((*ckpt)->Load("short.weight", shape, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                      {"'short.weight_scale_inv'", path, "[1, 3]", "[2, 3]"}));
  EXPECT_TRUE(IsError((*ckpt)->Load("transposed.weight", shape, DType::kBF16, out.data()), StatusCode::kInvalidArgument,
                      {"'transposed.weight_scale_inv'", "[3, 2]", "[2, 3]"}));
  EXPECT_TRUE(IsError((*ckpt)->Load("f16scale.weight", shape, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                      {"'f16scale.weight_scale_inv'", path, "F16"}));
  EXPECT_TRUE(IsError((*ckpt)->Load("flat.weight", flat, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                      {"'flat.weight'", path, "2-D"}));
  EXPECT_TRUE(IsError((*ckpt)->Load("e5m2.weight", s22, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                      {"unsupported dtype for loading", "'e5m2.weight'", "F8_E5M2"}));
}

// ---------------------------------------------------------------------------
// LoadSlice

// Rows [row_begin, row_end) x columns [col_begin, col_end).
struct SliceCase {
  int64_t row_begin, row_end, col_begin, col_end;

  int64_t rows() const { return row_end - row_begin; }
  int64_t cols() const { return col_end - col_begin; }
  size_t numel() const { return static_cast<size_t>(rows() * cols()); }
};

std::ostream& operator<<(std::ostream& os, const SliceCase& s) {
  return os << "rows [" << s.row_begin << ", " << s.row_end << ") x columns [" << s.col_begin << ", " << s.col_end
            << ")";
}

// Slices of a [rows, cols] tensor with rows > 200, cols > 200, chosen around
// the 128 boundaries of the fp8 blocks.
std::vector<SliceCase> SliceCases(int64_t rows, int64_t cols) {
  return {
      {100, 200, 0, cols},               // rows crossing 128, full width
      {100, 128, 0, cols},               // rows ending on the block boundary
      {0, rows, 100, 200},               // columns crossing 128, every row
      {120, 140, 125, 131},              // a window across both boundaries
      {1, rows - 1, 1, cols - 1},        // > 65536 elements: chunks split rows
      {rows - 1, rows, cols - 1, cols},  // one element: the ragged corner
      {129, 130, 3, 4},                  // one element
      {0, rows, 0, cols},                // the full tensor
      {5, 5, 0, cols},                   // empty: no rows
      {0, rows, 7, 7},                   // empty: no columns
  };
}

// LoadSlice into a buffer with guard elements on both sides: fails the test if
// it errors or writes outside the [rows, cols] output. `Bits` is uint32_t for
// f32 output, uint16_t for bf16.
template <typename Bits>
void LoadSliceGuarded(const Checkpoint& ckpt, const std::string& name, const std::vector<int64_t>& shape,
                      const SliceCase& s, DType out_dtype, std::vector<Bits>* out) {
  constexpr size_t kGuard = 64;
  constexpr Bits kSentinel = static_cast<Bits>(0x7fa5a5a5u);
  std::vector<Bits> buf(s.numel() + 2 * kGuard, kSentinel);
  const Status st =
      ckpt.LoadSlice(name, shape, s.row_begin, s.row_end, s.col_begin, s.col_end, out_dtype, buf.data() + kGuard);
  ASSERT_TRUE(st.ok()) << st;
  for (size_t i = 0; i < kGuard; ++i) {
    ASSERT_EQ(buf[i], kSentinel) << "wrote before the output";
    ASSERT_EQ(buf[buf.size() - 1 - i], kSentinel) << "wrote past the output";
  }
  out->assign(buf.begin() + kGuard, buf.end() - kGuard);
}

// Loads every SliceCases region of the 2-D tensor `name`, as f32 and as bf16,
// and compares each element with the same element of the full Load (bit for
// bit) and with reference(i, j), computed from the raw bytes at the global
// indices.
void ExpectSlicesMatch(const Checkpoint& ckpt, const std::string& name, int64_t rows, int64_t cols,
                       const std::function<double(int64_t, int64_t)>& reference) {
  const std::vector<int64_t> shape = {rows, cols};
  std::vector<uint32_t> full_f32(static_cast<size_t>(rows * cols));
  std::vector<uint16_t> full_bf16(full_f32.size());
  ASSERT_TRUE(ckpt.Load(name, shape, DType::kF32, full_f32.data()).ok());
  ASSERT_TRUE(ckpt.Load(name, shape, DType::kBF16, full_bf16.data()).ok());
  for (const SliceCase& s : SliceCases(rows, cols)) {
    SCOPED_TRACE(testing::Message() << name << ", " << s);
    std::vector<uint32_t> got_f32;
    std::vector<uint16_t> got_bf16;
    ASSERT_NO_FATAL_FAILURE(LoadSliceGuarded(ckpt, name, shape, s, DType::kF32, &got_f32));
    ASSERT_NO_FATAL_FAILURE(LoadSliceGuarded(ckpt, name, shape, s, DType::kBF16, &got_bf16));
    for (int64_t i = 0; i < s.rows(); ++i) {
      for (int64_t j = 0; j < s.cols(); ++j) {
        const int64_t gi = s.row_begin + i, gj = s.col_begin + j;
        const size_t at = static_cast<size_t>(i * s.cols() + j);
        const size_t full_at = static_cast<size_t>(gi * cols + gj);
        ASSERT_EQ(got_f32[at], full_f32[full_at]) << "element (" << gi << ", " << gj << ")";
        ASSERT_EQ(got_bf16[at], full_bf16[full_at]) << "element (" << gi << ", " << gj << ")";
        const double want = reference(gi, gj);
        ASSERT_TRUE(SameFloat(std::bit_cast<float>(got_f32[at]), want)) << "element (" << gi << ", " << gj << ")";
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(Bf16Reference(got_bf16[at])));
        } else {
          ASSERT_EQ(got_bf16[at], FloatToBf16(static_cast<float>(want))) << "element (" << gi << ", " << gj << ")";
        }
      }
    }
  }
  // An empty slice needs no buffer at all.
  EXPECT_TRUE(ckpt.LoadSlice(name, shape, 3, 3, 0, cols, DType::kF32, nullptr).ok());
}

TEST_F(CheckpointTest, SliceFloatTensors) {
  constexpr int64_t kF32Rows = 300, kF32Cols = 260;
  constexpr int64_t kBf16Rows = 290, kBf16Cols = 201;
  constexpr int64_t kF16Rows = 257, kF16Cols = 270;
  const std::vector<float> f32 = RandomFloats(kF32Rows * kF32Cols, 50, 3.0f);
  std::vector<uint16_t> bf16;
  for (float x : RandomFloats(kBf16Rows * kBf16Cols, 51, 100.0f)) bf16.push_back(FloatToBf16(x));
  // Any binary16 pattern: subnormals, infinities and NaNs included.
  std::vector<uint16_t> f16(kF16Rows * kF16Cols);
  std::mt19937 rng(52);
  std::uniform_int_distribution<int> any16(0, 0xffff);
  for (uint16_t& h : f16) h = static_cast<uint16_t>(any16(rng));

  FileBuilder b;
  b.Add("odd", "U8", {3}, "xyz");  // every tensor after it sits at an odd offset
  b.Add("w.f32", "F32", {kF32Rows, kF32Cols}, RawBytes(f32));
  b.Add("w.bf16", "BF16", {kBf16Rows, kBf16Cols}, RawBytes(bf16));
  b.Add("w.f16", "F16", {kF16Rows, kF16Cols}, RawBytes(f16));
  Write("ckpt/model.safetensors", b.Build());
  auto ckpt = Checkpoint::Open(ckpt_dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();

  ExpectSlicesMatch(**ckpt, "w.f32", kF32Rows, kF32Cols,
                    [&](int64_t i, int64_t j) { return f32[static_cast<size_t>(i * kF32Cols + j)]; });
  ExpectSlicesMatch(**ckpt, "w.bf16", kBf16Rows, kBf16Cols,
                    [&](int64_t i, int64_t j) { return Bf16Reference(bf16[static_cast<size_t>(i * kBf16Cols + j)]); });
  ExpectSlicesMatch(**ckpt, "w.f16", kF16Rows, kF16Cols,
                    [&](int64_t i, int64_t j) { return F16Reference(f16[static_cast<size_t>(i * kF16Cols + j)]); });
}

TEST_F(CheckpointTest, SliceFp8UsesGlobalBlockIndices) {
  // Ragged blocks in both dimensions; one weight with F32 scales, one with BF16.
  constexpr int64_t kRows = 300, kCols = 260;
  const std::vector<uint8_t> w = RandomFp8(kRows * kCols, 60);
  std::vector<float> scale;
  for (float x : RandomFloats(9, 61)) scale.push_back(std::abs(x) * 1e-3f + 1e-5f);
  constexpr int64_t kRows2 = 257, kCols2 = 201;
  const std::vector<uint8_t> w2 = RandomFp8(kRows2 * kCols2, 62);
  std::vector<uint16_t> scale2_bf16;
  for (float x : RandomFloats(6, 63)) scale2_bf16.push_back(FloatToBf16(std::abs(x) + 0.1f));

  FileBuilder b;
  b.Add("odd", "U8", {1}, "x");
  b.Add("a.weight", "F8_E4M3", {kRows, kCols}, RawBytes(w));
  b.Add("a.weight_scale_inv", "F32", {3, 3}, RawBytes(scale));
  b.Add("b.weight", "F8_E4M3", {kRows2, kCols2}, RawBytes(w2));
  b.Add("b.weight_scale_inv", "BF16", {3, 2}, RawBytes(scale2_bf16));
  Write("ckpt/model.safetensors", b.Build());
  auto ckpt = Checkpoint::Open(ckpt_dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();

  // In double from the raw bytes: the fp8 value has 4 significant bits and the
  // scale 24, so the product is exact and its rounding to float is the one
  // rounding an fp32 multiply does.
  const auto reference_a = [&](int64_t i, int64_t j) {
    return E4M3Reference(w[static_cast<size_t>(i * kCols + j)]) * scale[static_cast<size_t>(i / 128 * 3 + j / 128)];
  };
  ExpectSlicesMatch(**ckpt, "a.weight", kRows, kCols, reference_a);
  ExpectSlicesMatch(**ckpt, "b.weight", kRows2, kCols2, [&](int64_t i, int64_t j) {
    return E4M3Reference(w2[static_cast<size_t>(i * kCols2 + j)]) *
           Bf16Reference(scale2_bf16[static_cast<size_t>(i / 128 * 2 + j / 128)]);
  });

  // The comparisons above have teeth: scales indexed from the slice's own
  // origin (block 0 for slice rows 0..127) disagree with the global ones on
  // most of rows [100, 200) and columns [100, 200).
  int64_t local_differs = 0;
  for (int64_t i = 100; i < 200; ++i) {
    for (int64_t j = 100; j < 200; ++j) {
      const double local = E4M3Reference(w[static_cast<size_t>(i * kCols + j)]) *
                           scale[static_cast<size_t>((i - 100) / 128 * 3 + (j - 100) / 128)];
      local_differs += local != reference_a(i, j);
    }
  }
  EXPECT_GT(local_differs, 5000);
}

TEST_F(CheckpointTest, SliceErrors) {
  FileBuilder b;
  b.Add("w.2d", "F32", {6, 5}, RawBytes(RandomFloats(30, 70)));
  b.Add("w.1d", "F32", {6}, RawBytes(RandomFloats(6, 71)));
  b.Add("ids", "I64", {2, 2}, RawBytes(std::vector<int64_t>{1, 2, 3, 4}));
  b.Add("fp8.weight", "F8_E4M3", {4, 4}, RawBytes(RandomFp8(16, 72)));  // no scale
  b.Add("empty", "F32", {0, 5}, "");
  const std::string path = Write("ckpt/model.safetensors", b.Build());
  auto ckpt = Checkpoint::Open(ckpt_dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const Checkpoint& c = **ckpt;

  std::vector<float> out(64, 0.0f);
  const std::vector<int64_t> s65 = {6, 5}, s56 = {5, 6}, s6 = {6}, s22 = {2, 2}, s44 = {4, 4}, s05 = {0, 5};
  struct BadRange {
    int64_t row_begin, row_end, col_begin, col_end;
    std::string needle;
  };
  for (const BadRange& r : std::vector<BadRange>{
           {-1, 3, 0, 5, "rows [-1, 3)"},     // row_begin < 0
           {4, 3, 0, 5, "rows [4, 3)"},       // row_begin > row_end
           {0, 7, 0, 5, "rows [0, 7)"},       // row_end > rows
           {7, 7, 0, 5, "rows [7, 7)"},       // empty, but outside
           {0, 6, -2, 5, "columns [-2, 5)"},  // col_begin < 0
           {0, 6, 3, 2, "columns [3, 2)"},    // col_begin > col_end
           {0, 6, 0, 6, "columns [0, 6)"},    // col_end > cols
           {2, 3, 6, 6, "columns [6, 6)"},    // empty, but outside
       }) {
    EXPECT_TRUE(
        IsError(c.LoadSlice("w.2d", s65, r.row_begin, r.row_end, r.col_begin, r.col_end, DType::kF32, out.data()),
                StatusCode::kInvalidArgument, {"'w.2d'", path, r.needle}))
        << r.needle;
  }
  EXPECT_TRUE(IsError(c.LoadSlice("w.2d", s56, 0, 1, 0, 1, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                      {"'w.2d'", path, "[6, 5]", "[5, 6]"}));
  EXPECT_TRUE(IsError(c.LoadSlice("nope", s65, 0, 1, 0, 1, DType::kF32, out.data()), StatusCode::kNotFound,
                      {"'nope'", ckpt_dir()}));
  EXPECT_TRUE(IsError(c.LoadSlice("w.1d", s6, 0, 1, 0, 1, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                      {"'w.1d'", path, "[6]", "2-D"}));
  EXPECT_TRUE(IsError(c.LoadSlice("w.2d", s65, 0, 1, 0, 1, DType::kF16, out.data()), StatusCode::kInvalidArgument,
                      {"'w.2d'", "f16"}));
  EXPECT_TRUE(IsError(c.LoadSlice("ids", s22, 0, 1, 0, 1, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                      {"'ids'", path, "I64", "unsupported"}));
  EXPECT_TRUE(IsError(c.LoadSlice("fp8.weight", s44, 0, 1, 0, 1, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                      {"'fp8.weight'", "'fp8.weight_scale_inv'", path}));
  EXPECT_TRUE(IsError(c.LoadSlice("w.2d", s65, 0, 1, 0, 1, DType::kF32, nullptr), StatusCode::kInvalidArgument,
                      {"'w.2d'", "null"}));
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.0f; }));  // untouched on error

  // A tensor with no rows: only the empty row range exists.
  EXPECT_TRUE(c.LoadSlice("empty", s05, 0, 0, 1, 4, DType::kF32, nullptr).ok());
  EXPECT_TRUE(IsError(c.LoadSlice("empty", s05, 0, 1, 0, 5, DType::kF32, out.data()), StatusCode::kInvalidArgument,
                      {"'empty'", "rows [0, 1)"}));
}

// Marks PROT_NONE every page of the mapping that lies wholly inside `t`'s
// bytes and holds none of the bytes of slice `s` (of a [rows, cols] tensor).
// Returns the number of pages protected, or -1 if mprotect fails.
int64_t ProtectUnselectedPages(const TensorRef& t, const SliceCase& s) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data), end = begin + t.bytes;
  const uintptr_t element = SafetensorsDTypeSize(t.dtype);
  const uintptr_t row_bytes = static_cast<uintptr_t>(t.shape[1]) * element;
  int64_t protected_pages = 0;
  for (uintptr_t p = (begin + page - 1) / page * page; p + page <= end; p += page) {
    bool selected = false;
    const int64_t first_row = static_cast<int64_t>((p - begin) / row_bytes);
    const int64_t last_row = static_cast<int64_t>((p + page - 1 - begin) / row_bytes);
    for (int64_t r = std::max(first_row, s.row_begin); r <= std::min(last_row, s.row_end - 1) && !selected; ++r) {
      const uintptr_t row = begin + static_cast<uintptr_t>(r) * row_bytes;
      const uintptr_t sel_begin = row + static_cast<uintptr_t>(s.col_begin) * element;
      const uintptr_t sel_end = row + static_cast<uintptr_t>(s.col_end) * element;
      selected = sel_begin < sel_end && sel_begin < p + page && p < sel_end;
    }
    if (selected) continue;
    if (::mprotect(reinterpret_cast<void*>(p), page, PROT_NONE) != 0) return -1;
    ++protected_pages;
  }
  return protected_pages;
}

// LoadSlice computes every source address from a selected row and column
// (the memcpy per row, or the conversion of each piece of a row), so no other
// byte of the tensor is read. Here that is enforced by the MMU: in a forked
// child, every page of the tensor's mapping that holds no selected byte is made
// unreadable, and the slice must still load and match the unprotected full
// Load. Reading one protected byte kills the child with SIGSEGV; the control
// at the end shows a full Load under the same protection does exactly that.
using CheckpointDeathTest = CheckpointTest;

TEST_F(CheckpointDeathTest, SliceReadsOnlySelectedBytes) {
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  // Rows of three pages, so the columns of one page leave two pages per row
  // unread; F32 takes the memcpy path, BF16 the conversion, fp8 the scaling.
  const int64_t f32_cols = 3 * page / 4, bf16_cols = 3 * page / 2, fp8_cols = 3 * page;
  constexpr int64_t kRows = 40, kFp8Rows = 260;
  std::vector<uint16_t> bf16;
  for (float x : RandomFloats(static_cast<size_t>(kRows * bf16_cols), 81)) bf16.push_back(FloatToBf16(x));
  const int64_t scale_cols = (fp8_cols + 127) / 128;
  std::vector<float> scale;
  for (float x : RandomFloats(static_cast<size_t>(3 * scale_cols), 83)) scale.push_back(std::abs(x) + 0.5f);
  FileBuilder b;
  b.Add("f32", "F32", {kRows, f32_cols}, RawBytes(RandomFloats(static_cast<size_t>(kRows * f32_cols), 80)));
  b.Add("bf16", "BF16", {kRows, bf16_cols}, RawBytes(bf16));
  b.Add("fp8", "F8_E4M3", {kFp8Rows, fp8_cols}, RawBytes(RandomFp8(static_cast<size_t>(kFp8Rows * fp8_cols), 82)));
  b.Add("fp8_scale_inv", "F32", {3, scale_cols}, RawBytes(scale));
  Write("ckpt/model.safetensors", b.Build());
  auto ckpt = Checkpoint::Open(ckpt_dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const Checkpoint& c = **ckpt;

  for (const auto& [name, rows, cols] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
           {"f32", kRows, f32_cols}, {"bf16", kRows, bf16_cols}, {"fp8", kFp8Rows, fp8_cols}}) {
    const std::vector<int64_t> shape = {rows, cols};
    std::vector<uint32_t> full(static_cast<size_t>(rows * cols));
    ASSERT_TRUE(c.Load(name, shape, DType::kF32, full.data()).ok());
    const int64_t mid = rows / 2;
    for (const SliceCase& s : std::vector<SliceCase>{
             {mid - 10, mid + 10, 0, cols},                         // whole rows
             {mid - 10, mid + 10, cols / 3 + 1, 2 * cols / 3 - 1},  // the middle of each row
             {mid, mid + 1, cols / 2, cols / 2 + 1},                // one element
         }) {
      SCOPED_TRACE(testing::Message() << name << ", " << s);
      // Exit codes: 0 match, 1 mismatch, 2 LoadSlice failed, 3 nothing protected.
      const auto slice_under_protection = [&]() -> int {
        if (ProtectUnselectedPages(*c.Find(name), s) <= 0) return 3;
        std::vector<uint32_t> got(s.numel());
        if (!c.LoadSlice(name, shape, s.row_begin, s.row_end, s.col_begin, s.col_end, DType::kF32, got.data()).ok()) {
          return 2;
        }
        for (int64_t i = 0; i < s.rows(); ++i) {
          for (int64_t j = 0; j < s.cols(); ++j) {
            if (got[static_cast<size_t>(i * s.cols() + j)] !=
                full[static_cast<size_t>((s.row_begin + i) * cols + s.col_begin + j)]) {
              return 1;
            }
          }
        }
        return 0;
      };
      EXPECT_EXIT(std::exit(slice_under_protection()), testing::ExitedWithCode(0), "");
    }
    // Control: the protection of the narrowest slice above is really in force.
    const auto full_load_under_protection = [&]() {
      const SliceCase s = {mid, mid + 1, cols / 2, cols / 2 + 1};
      if (ProtectUnselectedPages(*c.Find(name), s) <= 0) std::exit(3);
      std::vector<uint32_t> got(full.size());
      std::exit(c.Load(name, shape, DType::kF32, got.data()).ok() ? 0 : 2);
    };
#if defined(__SANITIZE_ADDRESS__)
    // AddressSanitizer (-DMLARUN_SANITIZE=address) reports the fault and exits.
    EXPECT_EXIT(full_load_under_protection(), testing::ExitedWithCode(1), "SEGV on unknown address") << name;
#else
    EXPECT_EXIT(full_load_under_protection(), testing::KilledBySignal(SIGSEGV), "") << name;
#endif
  }
}

// ---------------------------------------------------------------------------
// Compatibility with files the Python safetensors library writes
// (tests/fixtures/safetensors/gen_fixture.py).

TEST_F(CheckpointTest, PythonFixture) {
  const std::string fixture_dir = std::string(MLARUN_FIXTURES_DIR) + "/safetensors";
  const std::string path = fixture_dir + "/small.safetensors";
  std::ifstream expected_in(fixture_dir + "/small_expected.json");
  ASSERT_TRUE(expected_in.good()) << fixture_dir;
  const json expected = json::parse(expected_in, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(expected.is_object());
  ASSERT_EQ(expected["tensors"].size(), 5u);

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  using StringMap = std::map<std::string, std::string>;
  EXPECT_EQ((*file)->metadata(), expected["metadata"].get<StringMap>());
  EXPECT_EQ((*file)->tensors().size(), 5u);

  std::ifstream raw(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(raw)), std::istreambuf_iterator<char>());
  Write("ckpt/model.safetensors", bytes);
  auto ckpt = Checkpoint::Open(ckpt_dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();

  for (const auto& [name, want] : expected["tensors"].items()) {
    SCOPED_TRACE(name);
    const TensorRef* t = (*file)->Find(name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(SafetensorsDTypeName(t->dtype), want["dtype"].get<std::string>());
    const auto shape = want["shape"].get<std::vector<int64_t>>();
    EXPECT_EQ(t->shape, shape);
    const auto bits = want["f32_bits"].get<std::vector<uint32_t>>();
    ASSERT_EQ(static_cast<size_t>(t->numel()), bits.size());

    std::vector<float> out(bits.size());
    const Status st = (*ckpt)->Load(name, shape, DType::kF32, out.data());
    ASSERT_TRUE(st.ok()) << st;
    for (size_t i = 0; i < bits.size(); ++i) {
      // Bit-exact, fp8 included: torch's fp32 multiply and ours round the same exact product.
      ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), bits[i]) << "element " << i;
    }
    std::vector<uint16_t> out_bf16(bits.size());
    ASSERT_TRUE((*ckpt)->Load(name, shape, DType::kBF16, out_bf16.data()).ok());
    for (size_t i = 0; i < bits.size(); ++i) {
      ASSERT_EQ(out_bf16[i], FloatToBf16(std::bit_cast<float>(bits[i]))) << "element " << i;
    }
  }
}

}  // namespace
}  // namespace mlarun
