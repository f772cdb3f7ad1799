// Building a Model's weights: one walk over the architecture, fed either by a
// Hugging Face checkpoint or by a seeded random generator, so the two can never
// disagree on names, shapes, layouts or shards.
#include <omp.h>
#include <sys/sysinfo.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <limits>
#include <set>
#include <sstream>

#include "base/float8.h"
#include "base/hash.h"
#include "gemm/convert.h"
#include "runtime/model/model.h"
#include "runtime/model/weight_fit.h"

namespace mlarun {
namespace {

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // Rows [r0, r1) x columns [c0, c1) of the [rows, cols] tensor `name`, into
  // `out` row-major as `dtype`. `random_std`: what a random source draws with.
  virtual Status Slice(const std::string& name, int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0,
                       int64_t c1, DType dtype, void* out, double random_std) = 0;
  // [n] fp32. Random sources draw `center + spread * U`, U of unit variance.
  virtual Status Vector(const std::string& name, int64_t n, float* out, double center, double spread) = 0;
  // A tensor another rank holds: part of the architecture, not loaded here.
  virtual void Skip(const std::string& name) {}

  // Rows [r0, r1) x columns [c0, c1) of the [rows, cols] weight `name` as a
  // Linear in `dtype`: read in place where the source can (a checkpoint that
  // stores exactly that dtype), else a copy of its own.
  virtual StatusOr<Linear> LinearSlice(const std::string& name, int64_t rows, int64_t cols, int64_t r0, int64_t r1,
                                       int64_t c0, int64_t c1, DType dtype, double random_std) {
    Linear l = Linear::Owned(r1 - r0, c1 - c0, dtype);
    if (l.mutable_data() == nullptr && l.bytes() > 0)
      return ResourceExhaustedError("cannot allocate ", l.bytes(), " bytes for weight ", name);
    MLARUN_RETURN_IF_ERROR(Slice(name, rows, cols, r0, r1, c0, c1, dtype, l.mutable_data(), random_std));
    return l;
  }
  // The same for a decoder layer's projection: a checkpoint source may keep
  // it f8_e4m3 as stored (Fp8Weights::kKeep) instead of `dtype`.
  virtual StatusOr<Linear> ProjectionSlice(const std::string& name, int64_t rows, int64_t cols, int64_t r0, int64_t r1,
                                           int64_t c0, int64_t c1, DType dtype, double random_std) {
    return LinearSlice(name, rows, cols, r0, r1, c0, c1, dtype, random_std);
  }
};

// The first e4m3 NaN code (S.1111.111) of n bytes at p, or -1.
int64_t FirstNanCode(const uint8_t* p, int64_t n) {
  constexpr int64_t kBlock = 1 << 14;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    uint32_t bad = 0;
    for (int64_t i = b; i < e; ++i) bad |= static_cast<uint32_t>((p[i] & 0x7fu) == 0x7fu);
    if (bad == 0) continue;
    for (int64_t i = b; i < e; ++i)
      if ((p[i] & 0x7fu) == 0x7fu) return i;
  }
  return -1;
}

// The first non-finite element of n f32 or bf16 values at p, or -1. A branch-
// free exponent test per block (vectorised by the compiler), blocks spread
// over the threads; only a block that has one is searched element by element.
int64_t FirstNonFinite(const std::byte* p, DType dtype, int64_t n) {
  constexpr int64_t kBlock = 1 << 14;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  int64_t first = -1;
  auto block_bad = [&](int64_t b) {
    const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
    uint32_t bad = 0;
    if (dtype == DType::kBF16) {
      const uint16_t* v = reinterpret_cast<const uint16_t*>(p);
      for (int64_t i = begin; i < end; ++i) bad |= static_cast<uint32_t>((v[i] & 0x7f80u) == 0x7f80u);
    } else {
      const uint32_t* v = reinterpret_cast<const uint32_t*>(p);
      for (int64_t i = begin; i < end; ++i) bad |= static_cast<uint32_t>((v[i] & 0x7f800000u) == 0x7f800000u);
    }
    return bad != 0;
  };
#pragma omp parallel for schedule(static) if (blocks > 8)
  for (int64_t b = 0; b < blocks; ++b) {
    if (!block_bad(b)) continue;
#pragma omp critical(mlarun_first_non_finite)
    if (first < 0 || b * kBlock < first) first = b * kBlock;
  }
  if (first < 0) return -1;
  const int64_t end = std::min(n, first + kBlock);
  for (int64_t i = first; i < end; ++i) {
    float x = 0;
    LoadToF32(p + i * static_cast<int64_t>(DTypeSize(dtype)), dtype, &x, 1);
    if (!std::isfinite(x)) return i;
  }
  return first;
}

class CheckpointSource final : public WeightSource {
 public:
  CheckpointSource(std::shared_ptr<const Checkpoint> c, WeightLoading loading, Fp8Weights fp8, QuantScheme scheme,
                   IntWeights int_weights, std::function<void(const std::string&)> log)
      : owner_(std::move(c)),
        ckpt_(*owner_),
        loading_(loading),
        fp8_(fp8),
        scheme_(std::move(scheme)),
        int_weights_(int_weights),
        log_(std::move(log)) {}

  StatusOr<Linear> ProjectionSlice(const std::string& name, int64_t rows, int64_t cols, int64_t r0, int64_t r1,
                                   int64_t c0, int64_t c1, DType dtype, double random_std) override {
    if (const std::string m = QuantizedModule(name); !m.empty())
      return QuantizedSlice(name, m, rows, cols, r0, r1, c0, c1, dtype);
    if (fp8_ == Fp8Weights::kKeep) {
      const int64_t shape[2] = {rows, cols};
      MLARUN_ASSIGN_OR_RETURN(const std::byte* fp8, ckpt_.InPlaceFp8(name, shape));
      if (fp8 != nullptr) {
        if (Fp8SliceAligned(r0, c0)) return Fp8Slice(name, rows, cols, r0, r1, c0, c1, fp8);
        // Its scales' blocks would straddle the slice's edge.
        log_("weight " + name + ": this shard's slice [" + std::to_string(r0) + ", " + std::to_string(r1) + ") x [" +
             std::to_string(c0) + ", " + std::to_string(c1) + ") does not start on a 128 boundary; dequantized to " +
             std::string(DTypeName(dtype)) + " instead of kept f8_e4m3");
      }
    }
    return LinearSlice(name, rows, cols, r0, r1, c0, c1, dtype, random_std);
  }
  StatusOr<Linear> LinearSlice(const std::string& name, int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0,
                               int64_t c1, DType dtype, double random_std) override {
    // lm_head, when the checkpoint quantizes it.
    if (const std::string m = QuantizedModule(name); !m.empty())
      return QuantizedSlice(name, m, rows, cols, r0, r1, c0, c1, dtype);
    const int64_t shape[2] = {rows, cols};
    MLARUN_ASSIGN_OR_RETURN(const std::byte* in_place, ckpt_.InPlace(name, shape, dtype));
    if (in_place == nullptr || loading_ == WeightLoading::kCopied) {
      auto copy = WeightSource::LinearSlice(name, rows, cols, r0, r1, c0, c1, dtype, random_std);
      // The copy is the weight now: its file pages leave the resident set.
      if (copy.ok() && loading_ == WeightLoading::kCopied) ckpt_.Release(name);
      return copy;
    }
    if (r0 < 0 || r0 > r1 || r1 > rows || c0 < 0 || c0 > c1 || c1 > cols)
      return InvalidArgumentError("weight ", name, ": slice [", r0, ", ", r1, ") x [", c0, ", ", c1,
                                  ") outside its shape [", rows, ", ", cols, "]");
    used_.insert(name);
    const std::byte* first = in_place + (r0 * cols + c0) * static_cast<int64_t>(DTypeSize(dtype));
    MLARUN_RETURN_IF_ERROR(CheckFinite(name, first, dtype, r1 - r0, c1 - c0, cols, r0, c0));
    Linear l;
    l.out = r1 - r0, l.in = c1 - c0, l.dtype = dtype, l.ld = cols;
    l.data = first;
    l.storage = std::shared_ptr<const void>(owner_, l.data);  // keeps the mapping alive
    return l;
  }
  Status Slice(const std::string& name, int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
               DType dtype, void* out, double) override {
    if (const std::string m = QuantizedModule(name); !m.empty())
      return DequantizeSlice(m, rows, cols, r0, r1, c0, c1, dtype, out);
    used_.insert(name);
    const int64_t shape[2] = {rows, cols};
    if (r0 == 0 && r1 == rows && c0 == 0 && c1 == cols) {
      MLARUN_RETURN_IF_ERROR(ckpt_.Load(name, shape, dtype, out));
    } else {
      MLARUN_RETURN_IF_ERROR(ckpt_.LoadSlice(name, shape, r0, r1, c0, c1, dtype, out));
    }
    return CheckFinite(name, static_cast<const std::byte*>(out), dtype, r1 - r0, c1 - c0, c1 - c0, r0, c0);
  }
  Status Vector(const std::string& name, int64_t n, float* out, double, double) override {
    used_.insert(name);
    const int64_t shape[1] = {n};
    MLARUN_RETURN_IF_ERROR(ckpt_.Load(name, shape, DType::kF32, out));
    return CheckFinite(name, reinterpret_cast<const std::byte*>(out), DType::kF32, 1, n, n, 0, 0);
  }
  void Skip(const std::string& name) override {
    used_.insert(name);
    if (const std::string m = QuantizedModule(name); !m.empty())
      for (const std::string& t : QuantizedTensorNames(scheme_.For(m), m)) used_.insert(t);
  }

  // Tensors the checkpoint has that the architecture does not use.
  Status CheckNoneLeft(const ModelConfig& c) const {
    for (const std::string& name : ckpt_.Names()) {
      if (used_.count(name)) continue;
      static const std::string kScale = "_scale_inv";
      if (name.size() > kScale.size() && name.ends_with(kScale) &&
          used_.count(name.substr(0, name.size() - kScale.size())))
        continue;                                           // consumed with its fp8 weight
      if (name.ends_with("rotary_emb.inv_freq")) continue;  // a buffer some exports include
      int64_t layer = -1;
      if (std::sscanf(name.c_str(), "model.layers.%ld.", &layer) == 1 && layer >= c.num_hidden_layers &&
          layer < c.num_hidden_layers + c.num_nextn_predict_layers)
        continue;  // multi-token-prediction modules: not used for decoding
      return InvalidArgumentError("checkpoint ", ckpt_.dir(), ": unexpected tensor '", name,
                                  "' (not part of the architecture in config.json)");
    }
    return Status::Ok();
  }

 private:
  // NaN or Inf in the `rows` x `cols` values at `data` (rows `ld` elements
  // apart) of tensor `name`, whose element [0, 0] is [row0, col0] of the
  // tensor: an error naming the tensor, its file and the element. A checkpoint
  // with one would compute NaN logits for every request.
  Status CheckFinite(const std::string& name, const std::byte* data, DType dtype, int64_t rows, int64_t cols,
                     int64_t ld, int64_t row0, int64_t col0) const {
    const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
    int64_t bad_row = -1, bad_col = -1;
    if (ld == cols) {
      const int64_t i = FirstNonFinite(data, dtype, rows * cols);
      if (i >= 0) bad_row = i / cols, bad_col = i % cols;
    } else {
      for (int64_t r = 0; r < rows && bad_row < 0; ++r) {
        const int64_t j = FirstNonFinite(data + r * ld * es, dtype, cols);
        if (j >= 0) bad_row = r, bad_col = j;
      }
    }
    if (bad_row < 0) return Status::Ok();
    float x = 0;
    LoadToF32(data + (bad_row * ld + bad_col) * es, dtype, &x, 1);
    const TensorRef* t = ckpt_.Find(name);
    const bool vector = t != nullptr && t->shape.size() == 1;
    return InvalidArgumentError("checkpoint ", ckpt_.dir(), ": tensor '", name, "'",
                                t != nullptr && t->file != nullptr ? " in " + *t->file : std::string(), " has ",
                                std::isnan(x) ? "NaN" : "Inf", " at element [",
                                vector ? std::to_string(col0 + bad_col)
                                       : std::to_string(row0 + bad_row) + ", " + std::to_string(col0 + bad_col),
                                "]: the weights are not finite");
  }

  // Rows [r0, r1) x columns [c0, c1) of F8_E4M3 tensor `name` (its e4m3
  // bytes at `fp8`), kept f8_e4m3: in place (a view into the mapping), or a
  // copy of its own with WeightLoading::kCopied; its block scales (small:
  // one fp32 per 16,384 elements) always in a buffer of its own.
  // REQUIRES: r0 and c0 on 128 boundaries.
  StatusOr<Linear> Fp8Slice(const std::string& name, int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0,
                            int64_t c1, const std::byte* fp8) {
    if (r0 < 0 || r0 > r1 || r1 > rows || c0 < 0 || c0 > c1 || c1 > cols)
      return InvalidArgumentError("weight ", name, ": slice [", r0, ", ", r1, ") x [", c0, ", ", c1,
                                  ") outside its shape [", rows, ", ", cols, "]");
    used_.insert(name);
    const int64_t out = r1 - r0, in = c1 - c0;
    const std::byte* first = fp8 + r0 * cols + c0;
    for (int64_t r = 0; r < out; ++r) {
      const int64_t j = FirstNanCode(reinterpret_cast<const uint8_t*>(first + r * cols), in);
      if (j >= 0)
        return InvalidArgumentError("checkpoint ", ckpt_.dir(), ": tensor '", name, "' has a NaN code (0x",
                                    (static_cast<unsigned>(first[r * cols + j]) & 0xffu) == 0xffu ? "ff" : "7f",
                                    ") at element [", r0 + r, ", ", c0 + j, "]: the weights are not finite");
    }
    Linear l;
    std::shared_ptr<float[]> own_scales;
    float* scales = nullptr;  // [ceil(out / 128), ceil(in / 128)]: the slice's own blocks
    if (loading_ == WeightLoading::kCopied) {
      l = Linear::Owned(out, in, DType::kF8E4M3);
      if (l.mutable_data() == nullptr && l.bytes() > 0)
        return ResourceExhaustedError("cannot allocate ", l.bytes(), " bytes for weight ", name);
      for (int64_t r = 0; r < out; ++r)
        std::memcpy(l.mutable_data() + r * in, first + r * cols, static_cast<size_t>(in));
      scales = l.mutable_scale();
    } else {
      l.out = out, l.in = in, l.dtype = DType::kF8E4M3, l.ld = cols;
      l.data = first;
      l.storage = std::shared_ptr<const void>(owner_, l.data);  // keeps the mapping alive
      l.scale_ld = Fp8Blocks(in);
      own_scales.reset(
          new (std::nothrow) float[static_cast<size_t>(std::max<int64_t>(1, Fp8Blocks(out) * l.scale_ld))]);
      if (own_scales == nullptr) return ResourceExhaustedError("cannot allocate the block scales of weight ", name);
      scales = own_scales.get();
      l.scale = scales;
      l.scale_storage = own_scales;
    }
    const int64_t shape[2] = {rows, cols};
    MLARUN_RETURN_IF_ERROR(ckpt_.LoadFp8Scales(name, shape, r0, r1, c0, c1, scales));
    const int64_t n_scales = Fp8Blocks(out) * l.scale_ld;
    for (int64_t i = 0; i < n_scales; ++i)
      if (!std::isfinite(scales[i]))
        return InvalidArgumentError("checkpoint ", ckpt_.dir(), ": the block scales of tensor '", name,
                                    "' (its _scale_inv) are not finite at block [", r0 / kFp8Block + i / l.scale_ld,
                                    ", ", c0 / kFp8Block + i % l.scale_ld, "]");
    if (loading_ == WeightLoading::kCopied) ckpt_.Release(name);  // the copy is the weight now
    return l;
  }

  // The module ("<prefix>") whose weight `name` ("<prefix>.weight") the
  // checkpoint stores quantized, or "".
  std::string QuantizedModule(const std::string& name) const {
    static const std::string kWeight = ".weight";
    if (scheme_.format == QuantFormat::kNone || !name.ends_with(kWeight)) return {};
    std::string prefix = name.substr(0, name.size() - kWeight.size());
    return scheme_.Covers(ckpt_, prefix) ? prefix : std::string();
  }

  // Rows [r0, r1) x columns [c0, c1) of the quantized module `m` (weight
  // `name`): an int8 / int4 Linear where the slice keeps its groups (in place
  // where the reader reads in place, unless kCopied), else dequantized to
  // `dtype` with one log line.
  StatusOr<Linear> QuantizedSlice(const std::string& name, const std::string& m, int64_t rows, int64_t cols, int64_t r0,
                                  int64_t r1, int64_t c0, int64_t c1, DType dtype) {
    const QuantScheme& s = scheme_.For(m);
    if (int_weights_ == IntWeights::kKeep && QuantizedSliceAligned(s, cols, c0, c1)) {
      MLARUN_ASSIGN_OR_RETURN(Linear l, LoadQuantizedLinear(ckpt_, s, m, rows, cols, r0, r1, c0, c1));
      for (const std::string& t : QuantizedTensorNames(s, m)) used_.insert(t);
      if (!l.in_place()) return l;
      if (loading_ == WeightLoading::kMapped) {
        l.storage = std::shared_ptr<const void>(owner_, l.data);  // keeps the mapping alive
        return l;
      }
      Linear copy = Linear::Owned(l.out, l.in, l.dtype, l.group, l.offset != nullptr);
      if (copy.mutable_data() == nullptr && copy.bytes() > 0)
        return ResourceExhaustedError("cannot allocate ", copy.bytes(), " bytes for weight ", name);
      const int64_t row_bytes = DTypeBytes(l.dtype, l.in), n = l.out * l.scale_ld;
      for (int64_t r = 0; r < l.out; ++r)
        std::memcpy(copy.mutable_data() + DTypeBytes(l.dtype, r * copy.ld), l.row(r), static_cast<size_t>(row_bytes));
      std::memcpy(copy.mutable_scale(), l.scale, static_cast<size_t>(n) * sizeof(float));
      if (l.offset != nullptr) std::memcpy(copy.mutable_offset(), l.offset, static_cast<size_t>(n) * sizeof(float));
      copy.zero = l.zero;
      for (const std::string& t : QuantizedTensorNames(s, m)) ckpt_.Release(t);  // the copy is the weight now
      return copy;
    }
    if (int_weights_ == IntWeights::kKeep)
      log_("weight " + m + ": this shard's columns [" + std::to_string(c0) + ", " + std::to_string(c1) +
           ") do not start and end on its quantization groups of " + std::to_string(s.group) + "; dequantized to " +
           std::string(DTypeName(dtype)) + " instead of kept " + std::string(DTypeName(s.dtype())));
    Linear l = Linear::Owned(r1 - r0, c1 - c0, dtype);
    if (l.mutable_data() == nullptr && l.bytes() > 0)
      return ResourceExhaustedError("cannot allocate ", l.bytes(), " bytes for weight ", name);
    MLARUN_RETURN_IF_ERROR(DequantizeSlice(m, rows, cols, r0, r1, c0, c1, dtype, l.mutable_data()));
    return l;
  }

  // Rows [r0, r1) x columns [c0, c1) of the quantized module `m`,
  // dequantized into `out` ([r1 - r0, c1 - c0] row-major) as `dtype`: its
  // whole rows read (always aligned), then the columns decoded.
  Status DequantizeSlice(const std::string& m, int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0,
                         int64_t c1, DType dtype, void* out) {
    if (c0 < 0 || c0 > c1 || c1 > cols)
      return InvalidArgumentError("weight ", m, ": columns [", c0, ", ", c1, ") outside [0, ", cols, ")");
    const QuantScheme& s = scheme_.For(m);
    MLARUN_ASSIGN_OR_RETURN(const Linear l, LoadQuantizedLinear(ckpt_, s, m, rows, cols, r0, r1, 0, cols));
    for (const std::string& t : QuantizedTensorNames(s, m)) used_.insert(t);
    const int64_t w = c1 - c0, es = static_cast<int64_t>(DTypeSize(dtype));
    std::vector<float> row(static_cast<size_t>(std::max<int64_t>(w, 1)));
    for (int64_t r = 0; r < l.out; ++r) {
      l.DequantizeRow(r, c0, c1, row.data());
      StoreFromF32(row.data(), static_cast<std::byte*>(out) + r * w * es, dtype, w);
    }
    return Status::Ok();
  }

  std::shared_ptr<const Checkpoint> owner_;
  const Checkpoint& ckpt_;
  const WeightLoading loading_;
  const Fp8Weights fp8_;
  const QuantScheme scheme_;
  const IntWeights int_weights_;
  const std::function<void(const std::string&)> log_;
  std::set<std::string> used_;
};

// Deterministic uniform draws (unit variance, scaled): element k of a tensor is
// a hash of (seed, name, k), so any shard of a random model equals the same
// piece of the whole model, whatever the thread count.
class RandomSource final : public WeightSource {
 public:
  explicit RandomSource(uint64_t seed) : seed_(seed) {}
  Status Slice(const std::string& name, int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
               DType dtype, void* out, double std) override {
    const uint64_t h = NameHash(name);
    const double a = std::sqrt(3.0) * std;  // U(-a, a) has standard deviation `std`
    const int64_t w = c1 - c0;
    const size_t es = DTypeSize(dtype);
#pragma omp parallel for schedule(static)
    for (int64_t i = r0; i < r1; ++i) {
      float buf[256];
      for (int64_t j = c0; j < c1; j += 256) {
        const int64_t m = std::min<int64_t>(256, c1 - j);
        for (int64_t t = 0; t < m; ++t)
          buf[t] = static_cast<float>(a * Unit(h, static_cast<uint64_t>(i * cols + j + t)));
        StoreFromF32(buf, static_cast<std::byte*>(out) + ((i - r0) * w + (j - c0)) * static_cast<int64_t>(es), dtype,
                     m);
      }
    }
    return Status::Ok();
  }
  Status Vector(const std::string& name, int64_t n, float* out, double center, double spread) override {
    const uint64_t h = NameHash(name);
    for (int64_t k = 0; k < n; ++k)
      out[k] = static_cast<float>(center + std::sqrt(3.0) * spread * Unit(h, static_cast<uint64_t>(k)));
    return Status::Ok();
  }

 private:
  uint64_t NameHash(const std::string& name) const {
    uint64_t h = seed_ ^ 0x6d6c6172756e5f77ull;
    for (char ch : name) h = (h ^ static_cast<unsigned char>(ch)) * 0x100000001b3ull;
    return h;
  }
  // Uniform in [-1, 1) from (tensor hash, element index): splitmix64's finalizer.
  static double Unit(uint64_t h, uint64_t k) {
    const uint64_t z = Mix64(h + (k + 1) * kGoldenGamma);
    return 2.0 * (static_cast<double>(z >> 11) * 0x1.0p-53) - 1.0;
  }
  uint64_t seed_;
};

// A decoder layer's projection (WeightSource::ProjectionSlice: may stay
// f8_e4m3), or another matrix (kept in `dtype`).
enum class Matrix : uint8_t { kOther, kProjection };

// Rows [r0, r1) of the [rows, in] weight `name` (a column-parallel shard).
Status LoadRows(WeightSource& src, const std::string& name, int64_t rows, int64_t in, int64_t r0, int64_t r1,
                DType dtype, Linear* l, Matrix kind = Matrix::kProjection) {
  const double std = 1.0 / std::sqrt(static_cast<double>(in));
  MLARUN_ASSIGN_OR_RETURN(*l, kind == Matrix::kProjection
                                  ? src.ProjectionSlice(name, rows, in, r0, r1, 0, in, dtype, std)
                                  : src.LinearSlice(name, rows, in, r0, r1, 0, in, dtype, std));
  return Status::Ok();
}

// Columns [c0, c1) of the [out, cols] projection `name` (a row-parallel
// shard: its partial products are summed across ranks).
Status LoadCols(WeightSource& src, const std::string& name, int64_t out, int64_t cols, int64_t c0, int64_t c1,
                DType dtype, Linear* l) {
  MLARUN_ASSIGN_OR_RETURN(
      *l, src.ProjectionSlice(name, out, cols, 0, out, c0, c1, dtype, 1.0 / std::sqrt(static_cast<double>(cols))));
  return Status::Ok();
}

// The MLP `prefix` {gate,up,down}_proj with intermediate size `inter`, this
// rank's intermediate slice [i0, i1).
Status LoadMlp(WeightSource& src, const std::string& prefix, int64_t hidden, int64_t inter, int64_t i0, int64_t i1,
               DType dtype, Mlp* m) {
  MLARUN_RETURN_IF_ERROR(LoadRows(src, prefix + "gate_proj.weight", inter, hidden, i0, i1, dtype, &m->gate));
  MLARUN_RETURN_IF_ERROR(LoadRows(src, prefix + "up_proj.weight", inter, hidden, i0, i1, dtype, &m->up));
  return LoadCols(src, prefix + "down_proj.weight", hidden, inter, i0, i1, dtype, &m->down);
}

void SkipMlp(WeightSource& src, const std::string& prefix) {
  for (const char* p : {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}) src.Skip(prefix + p);
}

Status LoadNorm(WeightSource& src, const std::string& name, int64_t n, std::vector<float>* v) {
  v->resize(static_cast<size_t>(n));
  return src.Vector(name, n, v->data(), 1.0, 0.1);
}

// Physical memory plus swap of this machine, or 0 if the kernel does not say.
int64_t MachineMemoryBytes() {
  struct sysinfo si {};
  if (sysinfo(&si) != 0) return 0;
  const long double bytes =
      (static_cast<long double>(si.totalram) + static_cast<long double>(si.totalswap)) * si.mem_unit;
  return bytes > static_cast<long double>(std::numeric_limits<int64_t>::max()) ? std::numeric_limits<int64_t>::max()
                                                                               : static_cast<int64_t>(bytes);
}

// The largest tensor of `c`, with the config fields of its shape.
std::string LargestTensor(const ModelConfig& c) {
  std::string largest;
  double largest_bytes = -1;
  for (const WeightTensorSize& t : WeightTensorSizes(c)) {
    if (t.total_bytes() <= largest_bytes) continue;
    largest_bytes = t.total_bytes();
    largest = t.tensor + " ([" + t.fields + "] = [" + std::to_string(static_cast<int64_t>(t.rows)) + ", " +
              std::to_string(static_cast<int64_t>(t.cols)) + "]" +
              (t.count > 1 ? " x " + std::to_string(static_cast<int64_t>(t.count)) + " tensors" : std::string()) +
              ", " + std::to_string(static_cast<int64_t>(largest_bytes)) + " bytes)";
  }
  return largest;
}

// [begin, end) of `n` split in `parts` equal pieces.
std::pair<int64_t, int64_t> Piece(int64_t n, int parts, int index) {
  return {n / parts * index, n / parts * (index + 1)};
}

}  // namespace

std::optional<DType> KeptProjectionDType(const Checkpoint& ckpt, Fp8Weights fp8) {
  if (fp8 != Fp8Weights::kKeep) return std::nullopt;
  // Every DeepSeek layer has kv_a; the release stores all its projections alike.
  const TensorRef* t = ckpt.Find("model.layers.0.self_attn.kv_a_proj_with_mqa.weight");
  if (t == nullptr || t->dtype != SafetensorsDType::kF8E4M3) return std::nullopt;
  return DType::kF8E4M3;
}

Status CheckWeightsFit(const ModelConfig& c, const ModelShard& s, const WeightFormat& held, int64_t mapped_bytes,
                       int64_t machine_bytes) {
  if (machine_bytes <= 0) return Status::Ok();  // the kernel did not say
  const int64_t need = PredictWeightBytes(c, s, held).total();
  if (need <= machine_bytes || need - machine_bytes <= mapped_bytes) return Status::Ok();
  return ResourceExhaustedError("model: the weights would need ", need, " bytes (", need >> 30, " GiB)",
                                mapped_bytes > 0 ? " beyond the checkpoint's mapped files" : "",
                                ", more than this machine's memory and swap (", machine_bytes,
                                " bytes); the largest: ", LargestTensor(c));
}

Status ValidateModelShard(const ModelConfig& c, const ModelShard& s) {
  if (s.attn_tp_size < 1 || s.attn_tp_rank < 0 || s.attn_tp_rank >= s.attn_tp_size || s.mlp_size < 1 ||
      s.mlp_rank < 0 || s.mlp_rank >= s.mlp_size)
    return InvalidArgumentError("shard: ranks outside their groups");
  if (c.num_attention_heads % s.attn_tp_size != 0)
    return InvalidArgumentError("num_attention_heads (", c.num_attention_heads, ") is not divisible by attn_tp (",
                                s.attn_tp_size, ")");
  const int64_t W = s.mlp_size;
  bool dense = false;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) dense |= !c.IsMoeLayer(i);
  if (dense && c.intermediate_size % W != 0)
    return InvalidArgumentError("intermediate_size (", c.intermediate_size, ") is not divisible by the ", W,
                                " ranks that share the dense MLP");
  if (c.n_routed_experts > 0) {
    if (s.moe == MoeSharding::kByExpert && c.n_routed_experts % W != 0)
      return InvalidArgumentError("n_routed_experts (", c.n_routed_experts, ") cannot be split over ", W,
                                  " ranks by expert; use moe=intermediate");
    if (s.moe == MoeSharding::kByIntermediate && c.moe_intermediate_size % W != 0)
      return InvalidArgumentError("moe_intermediate_size (", c.moe_intermediate_size, ") is not divisible by ", W,
                                  " ranks (moe=intermediate)");
    if (c.n_shared_experts > 0 && (c.moe_intermediate_size * c.n_shared_experts) % W != 0)
      return InvalidArgumentError("the shared experts' intermediate size (",
                                  c.moe_intermediate_size * c.n_shared_experts, ") is not divisible by ", W, " ranks");
  }
  return Status::Ok();
}

WeightBytes PredictWeightBytes(const ModelConfig& c, const ModelShard& s, std::optional<DType> projection_dtype) {
  return PredictWeightBytes(c, s, WeightFormat{.projection_dtype = projection_dtype});
}

WeightFormat WeightFormatOf(const QuantScheme& q) {
  WeightFormat f;
  if (q.format == QuantFormat::kNone) return f;
  f.projection_dtype = q.dtype();
  f.group = q.group;
  f.offsets = !q.symmetric;
  f.quantized = [q](std::string_view module) { return q.Quantizes(module); };
  if (q.lm_head != nullptr) f.lm_head = std::make_shared<const WeightFormat>(WeightFormatOf(*q.lm_head));
  return f;
}

int64_t DefaultQuantizeGroup(DType dtype) { return dtype == DType::kInt4 ? 128 : 0; }

StatusOr<LmHeadMode> ParseLmHeadMode(std::string_view name) {
  if (name == "keep") return LmHeadMode::kKeep;
  if (name == "int8") return LmHeadMode::kInt8;
  if (name == "int4") return LmHeadMode::kInt4;
  return InvalidArgumentError("--lm-head must be keep, int8 or int4, got '", std::string(name), "'");
}

namespace {

// How loading quantizes an lm_head under `mode` (not kKeep).
QuantizeOptions LmHeadQuantization(LmHeadMode mode) {
  const DType dtype = mode == LmHeadMode::kInt8 ? DType::kInt8 : DType::kInt4;
  return {.dtype = dtype, .group = DefaultQuantizeGroup(dtype), .symmetric = true};
}

// A loader's note (a shard's fp8 tensor dequantized, lm_head quantized):
// through the progress callback where there is one, else to stderr.
void LoaderNote(const ModelOptions& o, const std::string& line) {
  if (o.progress)
    o.progress(line);
  else
    std::fprintf(stderr, "mlarun: %s\n", line.c_str());
}

}  // namespace

WeightFormat WithLmHead(WeightFormat f, LmHeadMode mode) {
  if (mode == LmHeadMode::kKeep || (f.quantized && f.quantized("lm_head"))) return f;
  const QuantizeOptions q = LmHeadQuantization(mode);
  f.lm_head = std::make_shared<const WeightFormat>(
      WeightFormat{.projection_dtype = q.dtype, .group = q.group, .offsets = !q.symmetric});
  // Empty `quantized` meant every decoder-layer projection: kept so.
  f.quantized = [prev = std::move(f.quantized)](std::string_view module) {
    return module == "lm_head" || !prev || prev(module);
  };
  return f;
}

WeightFormat HeldWeightFormat(const Checkpoint& ckpt, const QuantScheme& scheme, Fp8Weights fp8, IntWeights ints) {
  WeightFormat held = ints == IntWeights::kKeep ? WeightFormatOf(scheme) : WeightFormat{};
  if (!held.projection_dtype) held.projection_dtype = KeptProjectionDType(ckpt, fp8);
  return held;
}

StatusOr<QuantScheme> CheckpointQuantScheme(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::path(dir) / "config.json", ec)) return QuantScheme{};
  return ReadQuantScheme(dir);
}

StatusOr<WeightFormat> CheckpointWeightFormat(const std::string& path, Fp8Weights fp8, IntWeights ints) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) return WeightFormat{};  // a config.json or YAML: no weights to look at
  MLARUN_ASSIGN_OR_RETURN(const QuantScheme s, CheckpointQuantScheme(path));
  if (ints == IntWeights::kKeep && s.format != QuantFormat::kNone) return WeightFormatOf(s);
  auto ckpt = Checkpoint::Open(path);  // maps the files and reads their headers only
  if (!ckpt.ok()) return WeightFormat{};
  return HeldWeightFormat(**ckpt, s, fp8, ints);
}

namespace {

// The bytes one matrix of [rows, cols] takes as this rank holds it, its slice
// starting at row r0, column c0 of a tensor `full_cols` wide, under `f`:
// what the loader keeps (Linear::bytes).
class MatrixBytes {
 public:
  MatrixBytes(const ModelConfig& c, const WeightFormat& f) : f_(f) {
    w_ = static_cast<int64_t>(DTypeSize(c.weight_dtype));
    const std::optional<DType> p = f.projection_dtype;
    fp8_ = p == DType::kF8E4M3;
    int_ = p && IsIntWeight(*p);
    pw_ = p && !fp8_ && !int_ ? static_cast<int64_t>(DTypeSize(*p)) : w_;
  }
  // A decoder-layer projection `module` ("model.layers.3.self_attn.o_proj").
  int64_t Projection(const std::string& module, int64_t rows, int64_t cols, int64_t r0 = 0, int64_t c0 = 0,
                     int64_t full_cols = -1) const {
    if (fp8_ && Fp8SliceAligned(r0, c0)) return rows * cols + Fp8Blocks(rows) * Fp8Blocks(cols) * 4;
    if (int_ && (!f_.quantized || f_.quantized(module)) && GroupAligned(cols, c0, full_cols < 0 ? cols : full_cols))
      return Int(rows, cols);
    return rows * cols * pw_;
  }
  // lm_head: weight_dtype unless quantized (under a format of its own
  // where it has one: a checkpoint's, or quantizing at load).
  bool HeadQuantized() const { return f_.quantized && f_.quantized("lm_head") && (f_.lm_head != nullptr || int_); }
  int64_t Head(int64_t rows, int64_t cols) const {
    if (!HeadQuantized()) return rows * cols * w_;
    return f_.lm_head != nullptr ? IntBytes(*f_.lm_head, rows, cols) : Int(rows, cols);
  }

 private:
  bool GroupAligned(int64_t cols, int64_t c0, int64_t full_cols) const {
    if (f_.group <= 0) return c0 % 2 == 0;
    return c0 % f_.group == 0 && ((c0 + cols) % f_.group == 0 || c0 + cols == full_cols);
  }
  int64_t Int(int64_t rows, int64_t cols) const { return IntBytes(f_, rows, cols); }
  static int64_t IntBytes(const WeightFormat& f, int64_t rows, int64_t cols) {
    const int64_t groups = f.group > 0 ? (cols + f.group - 1) / f.group : 1;
    return rows * DTypeBytes(*f.projection_dtype, cols) + rows * groups * 4 * (f.offsets ? 2 : 1);
  }
  const WeightFormat& f_;
  int64_t w_ = 0, pw_ = 0;
  bool fp8_ = false, int_ = false;
};

}  // namespace

WeightBytes PredictWeightBytes(const ModelConfig& c, const ModelShard& s, const WeightFormat& format) {
  const int64_t w = static_cast<int64_t>(DTypeSize(c.weight_dtype)), kv = static_cast<int64_t>(DTypeSize(c.kv_dtype));
  const int64_t f = 4;  // norms, router, score bias: fp32
  const int64_t H = c.hidden_size, N = c.num_attention_heads / s.attn_tp_size, L = c.kv_lora_rank;
  const int64_t R = c.qk_rope_head_dim, Dq = c.q_head_dim(), P = c.qk_nope_head_dim, V = c.v_head_dim;
  const int64_t W = s.mlp_size;
  // fp8 as the loader keeps it (ModelShard's slice on 128 boundaries: e4m3 +
  // an fp32 scale per 128 x 128 block of the slice, Linear::bytes), int8 /
  // int4 where the slice keeps its groups, else dequantized.
  const MatrixBytes m(c, format);
  // gate, up (rows [i0, i0 + inter)); down (columns [i0, i0 + inter) of `full`).
  auto mlp = [&](const std::string& p, int64_t inter, int64_t i0, int64_t full) {
    return m.Projection(p + "gate_proj", inter, H, i0, 0) + m.Projection(p + "up_proj", inter, H, i0, 0) +
           m.Projection(p + "down_proj", H, inter, 0, i0, full);
  };
  const int64_t h0 = c.num_attention_heads / s.attn_tp_size * s.attn_tp_rank;  // this rank's first head
  WeightBytes b;
  // A tied lm_head quantized at load is a matrix of its own.
  const bool own_head = !c.tie_word_embeddings || m.HeadQuantized();
  b.embedding_and_head = c.vocab_size * H * w + (own_head ? m.Head(c.vocab_size, H) : 0) + H * f;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string lp = "model.layers." + std::to_string(i) + ".", ap = lp + "self_attn.";
    int64_t replicated = m.Projection(ap + "kv_a_proj_with_mqa", L + R, H) + L * f + 2 * H * f;  // + norms
    // W_UK, W_UV, o_proj
    int64_t split = N * (P + V) * L * kv + m.Projection(ap + "o_proj", H, N * V, 0, h0 * V, c.num_attention_heads * V);
    if (c.q_lora_rank > 0) {
      replicated += m.Projection(ap + "q_a_proj", c.q_lora_rank, H) + c.q_lora_rank * f;
      split += m.Projection(ap + "q_b_proj", N * Dq, c.q_lora_rank, h0 * Dq, 0);
    } else {
      split += m.Projection(ap + "q_proj", N * Dq, H, h0 * Dq, 0);
    }
    if (c.has_indexer()) {  // wq_b, wk, k_norm (weight and bias), weights_proj
      const int64_t ih = c.index_n_heads, id = c.index_head_dim;
      const std::string ip = ap + "indexer.";
      replicated += m.Projection(ip + "wq_b", ih * id, c.q_lora_rank) + m.Projection(ip + "wk", id, H) + 2 * id * f +
                    m.Projection(ip + "weights_proj", ih, H);
    }
    b.attention += replicated + split;
    b.attention_replicated += replicated;
    const std::string mp = lp + "mlp.";
    if (!c.IsMoeLayer(i)) {
      b.dense_mlp += mlp(mp, c.intermediate_size / W, c.intermediate_size / W * s.mlp_rank, c.intermediate_size);
      continue;
    }
    const bool by_expert = s.moe == MoeSharding::kByExpert;
    const int64_t experts = by_expert ? c.n_routed_experts / W : c.n_routed_experts;
    const int64_t e0 = by_expert ? experts * s.mlp_rank : 0;
    const int64_t inter = by_expert ? c.moe_intermediate_size : c.moe_intermediate_size / W;
    const int64_t shared = c.moe_intermediate_size * c.n_shared_experts / W;
    b.moe += c.n_routed_experts * H * f + (c.model_type == ModelType::kDeepSeekV3 ? c.n_routed_experts * f : 0) +
             (c.n_shared_experts > 0 ? mlp(mp + "shared_experts.", shared, shared * s.mlp_rank, shared * W) : 0);
    if (!format.quantized) {  // every expert alike
      b.moe += experts * mlp(mp + "experts.0.", inter, by_expert ? 0 : inter * s.mlp_rank, c.moe_intermediate_size);
      continue;
    }
    for (int64_t e = e0; e < e0 + experts; ++e)
      b.moe += mlp(mp + "experts." + std::to_string(e) + ".", inter, by_expert ? 0 : inter * s.mlp_rank,
                   c.moe_intermediate_size);
  }
  return b;
}

class ModelLoader {
 public:
  // lm_head quantized at load (ModelOptions::lm_head) where it is held
  // unquantized; the model's weight format says so from then on.
  static Status QuantizeHead(Model& m) {
    const LmHeadMode mode = m.options_.lm_head;
    if (mode == LmHeadMode::kKeep || IsIntWeight(m.lm_head_.dtype)) return Status::Ok();
    QuantizeOptions how = LmHeadQuantization(mode);
    how.parallel = true;  // one matrix at a time here: its rows over the threads
    const auto start = std::chrono::steady_clock::now();
    const int64_t before = m.lm_head_.bytes();
    auto q = QuantizeLinear(m.lm_head_, how);
    if (!q.ok()) return q.status().WithContext("quantizing lm_head at load");
    m.lm_head_ = *std::move(q);
    m.weight_format_ = WithLmHead(std::move(m.weight_format_), mode);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::ostringstream os;
    os << "lm_head quantized at load to " << DTypeName(how.dtype) << ": " << (before >> 20) << " -> "
       << (m.lm_head_.bytes() >> 20) << " MiB in " << std::fixed << std::setprecision(1) << s << " s";
    LoaderNote(m.options_, os.str());
    return Status::Ok();
  }

  static Status Build(Model& m, WeightSource& src) {
    const ModelConfig& c = m.config_;
    const ModelShard& s = m.options_.shard;
    MLARUN_RETURN_IF_ERROR(ValidateModelShard(c, s));
    const DType wt = c.weight_dtype, kv = c.kv_dtype;
    const int64_t H = c.hidden_size, N = c.num_attention_heads, L = c.kv_lora_rank, R = c.qk_rope_head_dim;
    const int64_t P = c.qk_nope_head_dim, V = c.v_head_dim, Dq = c.q_head_dim();
    const auto [h0, h1] = Piece(N, s.attn_tp_size, s.attn_tp_rank);
    const int64_t n_local = h1 - h0;
    auto progress = [&](const std::string& msg) {
      if (m.options_.progress) m.options_.progress(msg);
    };
    MLARUN_ASSIGN_OR_RETURN(
        m.embed_, src.LinearSlice("model.embed_tokens.weight", c.vocab_size, H, 0, c.vocab_size, 0, H, wt, 1.0));
    MLARUN_RETURN_IF_ERROR(LoadNorm(src, "model.norm.weight", H, &m.final_norm_.host));
    if (c.tie_word_embeddings) {
      m.lm_head_ = m.embed_;  // the same bytes
    } else {
      MLARUN_RETURN_IF_ERROR(
          LoadRows(src, "lm_head.weight", c.vocab_size, H, 0, c.vocab_size, wt, &m.lm_head_, Matrix::kOther));
    }
    MLARUN_RETURN_IF_ERROR(QuantizeHead(m));
    m.layers_.resize(static_cast<size_t>(c.num_hidden_layers));
    std::vector<float> kv_b;
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      progress("loading layer " + std::to_string(i + 1) + "/" + std::to_string(c.num_hidden_layers));
      if (i > 0 && m.options_.on_layer) m.options_.on_layer(i, c.num_hidden_layers);
      DecoderLayer& layer = m.layers_[static_cast<size_t>(i)];
      const std::string p = "model.layers." + std::to_string(i) + ".";
      MLARUN_RETURN_IF_ERROR(LoadNorm(src, p + "input_layernorm.weight", H, &layer.input_norm.host));
      MLARUN_RETURN_IF_ERROR(LoadNorm(src, p + "post_attention_layernorm.weight", H, &layer.post_attention_norm.host));
      AttentionLayer& a = layer.attn;
      const std::string ap = p + "self_attn.";
      // Replicated: q_a, kv_a and their norms. Split by head: q_b (or q), W_UK, W_UV, o_proj.
      if (c.q_lora_rank > 0) {
        MLARUN_RETURN_IF_ERROR(LoadRows(src, ap + "q_a_proj.weight", c.q_lora_rank, H, 0, c.q_lora_rank, wt, &a.q_a));
        MLARUN_RETURN_IF_ERROR(LoadNorm(src, ap + "q_a_layernorm.weight", c.q_lora_rank, &a.q_a_norm.host));
        MLARUN_RETURN_IF_ERROR(
            LoadRows(src, ap + "q_b_proj.weight", N * Dq, c.q_lora_rank, h0 * Dq, h1 * Dq, wt, &a.q_b));
      } else {
        MLARUN_RETURN_IF_ERROR(LoadRows(src, ap + "q_proj.weight", N * Dq, H, h0 * Dq, h1 * Dq, wt, &a.q));
      }
      MLARUN_RETURN_IF_ERROR(LoadRows(src, ap + "kv_a_proj_with_mqa.weight", L + R, H, 0, L + R, wt, &a.kv_a));
      MLARUN_RETURN_IF_ERROR(LoadNorm(src, ap + "kv_a_layernorm.weight", L, &a.kv_a_norm.host));
      // kv_b_proj [N (P + V), L]: per head P rows of W_UK^T, then V rows of W_UV^T.
      kv_b.resize(static_cast<size_t>(n_local * (P + V) * L));
      MLARUN_RETURN_IF_ERROR(src.Slice(ap + "kv_b_proj.weight", N * (P + V), L, h0 * (P + V), h1 * (P + V), 0, L,
                                       DType::kF32, kv_b.data(), 1.0 / std::sqrt(static_cast<double>(L))));
      const size_t kes = DTypeSize(kv);
      a.w_uk_t.host.resize(static_cast<size_t>(n_local * P * L) * kes);
      a.w_uv.host.resize(static_cast<size_t>(n_local * L * V) * kes);
      std::vector<float> col(static_cast<size_t>(V));
      for (int64_t h = 0; h < n_local; ++h) {
        const float* head = kv_b.data() + h * (P + V) * L;
        StoreFromF32(head, a.w_uk_t.host.data() + static_cast<size_t>(h * P * L) * kes, kv, P * L);
        for (int64_t l = 0; l < L; ++l) {  // W_UV[h][l][v] = kv_b[h * (P + V) + P + v][l]
          for (int64_t v = 0; v < V; ++v) col[static_cast<size_t>(v)] = head[(P + v) * L + l];
          StoreFromF32(col.data(), a.w_uv.host.data() + static_cast<size_t>((h * L + l) * V) * kes, kv, V);
        }
      }
      MLARUN_RETURN_IF_ERROR(LoadCols(src, ap + "o_proj.weight", H, N * V, h0 * V, h1 * V, wt, &a.o));

      // The MLP / MoE, split over the world.
      const std::string mp = p + "mlp.";
      layer.moe = c.IsMoeLayer(i);
      if (!layer.moe) {
        const auto [i0, i1] = Piece(c.intermediate_size, s.mlp_size, s.mlp_rank);
        MLARUN_RETURN_IF_ERROR(LoadMlp(src, mp, H, c.intermediate_size, i0, i1, wt, &layer.mlp));
        continue;
      }
      MoeLayer& moe = layer.moe_mlp;
      const int64_t E = c.n_routed_experts, Im = c.moe_intermediate_size;
      MLARUN_RETURN_IF_ERROR(LoadRows(src, mp + "gate.weight", E, H, 0, E, DType::kF32, &moe.router, Matrix::kOther));
      if (c.model_type == ModelType::kDeepSeekV3) {
        moe.score_bias.host.resize(static_cast<size_t>(E));
        MLARUN_RETURN_IF_ERROR(
            src.Vector(mp + "gate.e_score_correction_bias", E, moe.score_bias.host.data(), 0.0, 0.1));
      }
      const bool by_expert = s.moe == MoeSharding::kByExpert;
      const auto [e0, e1] = by_expert ? Piece(E, s.mlp_size, s.mlp_rank) : std::pair<int64_t, int64_t>{0, E};
      const auto [i0, i1] = by_expert ? std::pair<int64_t, int64_t>{0, Im} : Piece(Im, s.mlp_size, s.mlp_rank);
      moe.expert_begin = e0;
      moe.experts.resize(static_cast<size_t>(e1 - e0));
      for (int64_t e = 0; e < E; ++e) {
        const std::string ep = mp + "experts." + std::to_string(e) + ".";
        if (e < e0 || e >= e1) {
          SkipMlp(src, ep);
          continue;
        }
        MLARUN_RETURN_IF_ERROR(LoadMlp(src, ep, H, Im, i0, i1, wt, &moe.experts[static_cast<size_t>(e - e0)]));
      }
      moe.has_shared = c.n_shared_experts > 0;
      if (moe.has_shared) {
        const int64_t Is = Im * c.n_shared_experts;
        const auto [s0, s1] = Piece(Is, s.mlp_size, s.mlp_rank);
        MLARUN_RETURN_IF_ERROR(LoadMlp(src, mp + "shared_experts.", H, Is, s0, s1, wt, &moe.shared));
      }
    }
    return Status::Ok();
  }
};

StatusOr<std::unique_ptr<Model>> Model::FromCheckpoint(const ModelConfig& config,
                                                       std::shared_ptr<const Checkpoint> ckpt,
                                                       const ModelOptions& options) {
  if (!ckpt) return InvalidArgumentError("model: no checkpoint given");
  std::unique_ptr<Model> m(new Model(config, options));
  MLARUN_RETURN_IF_ERROR(m->Init());
  MLARUN_RETURN_IF_ERROR(ValidateModelShard(config, options.shard));
  int64_t mapped_bytes = 0;
  if (options.weights == WeightLoading::kMapped)
    for (const std::string& name : ckpt->Names()) mapped_bytes += static_cast<int64_t>(ckpt->Find(name)->bytes);
  MLARUN_ASSIGN_OR_RETURN(const QuantScheme scheme, CheckpointQuantScheme(ckpt->dir()));
  // Sized as loading holds them: int8 / int4 as stored, a checkpoint's fp8
  // projections kept fp8.
  const WeightFormat held =
      WithLmHead(HeldWeightFormat(*ckpt, scheme, options.fp8_weights, options.int_weights), options.lm_head);
  MLARUN_RETURN_IF_ERROR(CheckWeightsFit(config, options.shard, held, mapped_bytes, MachineMemoryBytes()));
  auto log = [&options](const std::string& line) { LoaderNote(options, line); };
  if (scheme.int8_activations)
    log("checkpoint " + ckpt->dir() + ": W8A8 (dynamic per-token int8 activations): the activations stay fp32");
  if (options.int_weights == IntWeights::kKeep) m->weight_format_ = WeightFormatOf(scheme);
  CheckpointSource src(std::move(ckpt), options.weights, options.fp8_weights, scheme, options.int_weights, log);
  MLARUN_RETURN_IF_ERROR(ModelLoader::Build(*m, src));
  if (m->holds_fp8_projections()) m->weight_format_.projection_dtype = DType::kF8E4M3;
  MLARUN_RETURN_IF_ERROR(src.CheckNoneLeft(config));
  MLARUN_RETURN_IF_ERROR(m->PlaceWeights());
  return m;
}

StatusOr<std::unique_ptr<Model>> Model::Random(const ModelConfig& config, uint64_t seed, const ModelOptions& options) {
  std::unique_ptr<Model> m(new Model(config, options));
  MLARUN_RETURN_IF_ERROR(m->Init());
  MLARUN_RETURN_IF_ERROR(ValidateModelShard(config, options.shard));
  MLARUN_RETURN_IF_ERROR(CheckWeightsFit(config, options.shard, WeightFormat{}, 0, MachineMemoryBytes()));
  RandomSource src(seed);
  MLARUN_RETURN_IF_ERROR(ModelLoader::Build(*m, src));
  MLARUN_RETURN_IF_ERROR(m->PlaceWeights());
  return m;
}

StatusOr<WeightLoading> ParseWeightLoading(std::string_view name) {
  if (name == "mapped") return WeightLoading::kMapped;
  if (name == "copied") return WeightLoading::kCopied;
  return InvalidArgumentError("--weights must be mapped or copied, got '", std::string(name), "'");
}

std::string_view WeightLoadingName(WeightLoading w) { return w == WeightLoading::kCopied ? "copied" : "mapped"; }

StatusOr<ModelOverrides> ParseModelOverrides(const std::string& kv_dtype, int64_t num_layers) {
  ModelOverrides ov;
  if (!kv_dtype.empty()) {
    auto dt = ParseDType(kv_dtype);
    if (!dt.ok() || (*dt != DType::kBF16 && *dt != DType::kF32))
      return InvalidArgumentError("--kv-dtype must be bf16 or fp32, got '", kv_dtype, "'");
    ov.kv_dtype = *dt;
  }
  if (num_layers > 0) ov.num_layers = num_layers;
  return ov;
}

StatusOr<ModelConfig> Model::LoadConfig(const std::string& path, const ModelOverrides& overrides, uint64_t* seed) {
  ModelConfig config;
  const bool yaml = path.ends_with(".yaml") || path.ends_with(".yml");
  if (yaml) {
    MLARUN_ASSIGN_OR_RETURN(YamlModel ym, LoadModelYaml(path));
    config = ym.config;
    if (seed) *seed = ym.seed;
  } else {
    MLARUN_ASSIGN_OR_RETURN(config, LoadHfConfig(path));
  }
  if (overrides.kv_dtype) config.kv_dtype = *overrides.kv_dtype;
  if (overrides.num_layers) {
    if (!yaml)
      return InvalidArgumentError("model ", path,
                                  ": --num-layers applies to YAML models only (a checkpoint has all its layers)");
    if (*overrides.num_layers < 1 || *overrides.num_layers > config.num_hidden_layers)
      return InvalidArgumentError("model ", path, ": --num-layers must be in [1, ", config.num_hidden_layers, "], got ",
                                  *overrides.num_layers);
    config.num_hidden_layers = *overrides.num_layers;
    config.first_k_dense_replace = std::min(config.first_k_dense_replace, config.num_hidden_layers);
  }
  return config;
}

StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& path, const ModelOverrides& overrides,
                                             const ModelOptions& options) {
  uint64_t seed = 0;
  MLARUN_ASSIGN_OR_RETURN(const ModelConfig config, LoadConfig(path, overrides, &seed));
  return FromConfig(path, config, seed, options);
}

StatusOr<std::unique_ptr<Model>> Model::FromConfig(const std::string& path, const ModelConfig& config, uint64_t seed,
                                                   const ModelOptions& options) {
  if (path.ends_with(".yaml") || path.ends_with(".yml")) return Random(config, seed, options);
  if (path.ends_with(".json"))
    return InvalidArgumentError("model ", path, ": a config.json alone has no weights; give its checkpoint directory");
  MLARUN_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(path));
  return FromCheckpoint(config, std::shared_ptr<const Checkpoint>(std::move(ckpt)), options);
}

}  // namespace mlarun
