// Memory-mapped safetensors files and Hugging Face checkpoint directories.
//
// This parser faces files from the internet: every offset, size and shape in a
// header is checked against the mapped file before any tensor byte is touched,
// and every error names the file (and the tensor). No read ever leaves the
// mapping.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"k": "v"}}
// then the data section; offsets are relative to its start.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"

namespace mlarun {

// Element types a safetensors header may declare. Only F32, BF16, F16 and
// F8_E4M3 can be loaded; the others are accepted in a header (so a checkpoint
// with, e.g., an I64 buffer opens) but rejected by the loaders.
enum class SafetensorsDType : uint8_t {
  kBool,
  kU8,
  kI8,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64,
  kF8E4M3,
  kF8E5M2,
};
size_t SafetensorsDTypeSize(SafetensorsDType t);
std::string_view SafetensorsDTypeName(SafetensorsDType t);
// "[2048, 128]", for messages.
std::string ShapeString(std::span<const int64_t> shape);

// One tensor of a mapped file. A view: valid while its SafetensorsFile lives.
struct TensorRef {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;    // inside the mapping
  size_t bytes = 0;                   // == numel * element size (checked at open)
  const std::string* file = nullptr;  // path, for messages

  int64_t numel() const;
};

// A read-only memory mapping of one .safetensors file (RAII: unmapped on
// destruction). Thread-safe after Open (immutable).
class SafetensorsFile {
 public:
  // Maps and validates the whole header: header length within the file, valid
  // JSON object, known dtypes, non-negative shapes whose byte size matches
  // data_offsets, offsets within the data section, no two tensors overlapping.
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorRef>& tensors() const { return tensors_; }
  const TensorRef* Find(std::string_view name) const;  // nullptr if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  // Open's second half: the header's JSON, `header_text` (the bytes after
  // the length field), into metadata_, tensors_ and index_, every entry
  // checked against the data section [data, data + data_bytes) and against
  // the others (no overlaps). Errors name path_.
  Status BuildTensorTable(std::string_view header_text, const std::byte* data, uint64_t data_bytes);
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::vector<TensorRef> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// A Hugging Face checkpoint directory: `model.safetensors`, or the shards that
// `model.safetensors.index.json` lists (its weight_map must name only files
// that exist inside the directory, and every tensor must be in the shard the
// map says). Thread-safe after Open.
class Checkpoint {
 public:
  static StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);
  ~Checkpoint();

  const std::string& dir() const { return dir_; }
  // nullptr if absent.
  const TensorRef* Find(std::string_view name) const;
  // All tensor names, sorted.
  std::vector<std::string> Names() const;

  // Copies tensor `name` into `out` as `out_dtype` (kF32 or kBF16), after
  // checking that its shape equals `expected_shape`. F8_E4M3 tensors are
  // dequantized with the tensor `<name>_scale_inv` (fp32 or bf16,
  // [ceil(rows/128), ceil(cols/128)] block scales for a 2-D weight:
  // w[i][j] = fp8[i][j] * scale_inv[i/128][j/128]), as DeepSeek-V3 ships them.
  // Errors name the file and tensor: missing, wrong shape, unsupported dtype,
  // missing or mis-shaped scale.
  Status Load(std::string_view name, std::span<const int64_t> expected_shape, DType out_dtype, void* out) const;

  // The bytes of tensor `name` (whose shape must equal `expected_shape`),
  // for reading it in place as `dtype`: a pointer into the mapping when the
  // tensor is stored as exactly that dtype (F32 or BF16) at an address
  // aligned to its element size; nullptr when it must be converted (through
  // Load or LoadSlice). Valid while this Checkpoint lives. Errors as Load.
  StatusOr<const std::byte*> InPlace(std::string_view name, std::span<const int64_t> expected_shape, DType dtype) const;

  // The e4m3 bytes of F8_E4M3 tensor `name` (2-D, shape `expected_shape`,
  // with a well-formed `<name>_scale_inv`), for keeping it fp8: a pointer into
  // the mapping (one byte per element, any alignment); nullptr when the
  // tensor is stored as another dtype. Valid while this Checkpoint lives.
  // Errors as Load (missing or mis-shaped scale included).
  StatusOr<const std::byte*> InPlaceFp8(std::string_view name, std::span<const int64_t> expected_shape) const;
  // The block scales of rows [row_begin, row_end) x columns [col_begin,
  // col_end) of F8_E4M3 tensor `name`: its `_scale_inv` blocks [row_begin /
  // 128, ceil(row_end / 128)) x [col_begin / 128, ceil(col_end / 128)), as
  // fp32 row-major into `out`. With a slice that starts on block boundaries
  // these are exactly the slice's own blocks. Errors as LoadSlice.
  Status LoadFp8Scales(std::string_view name, std::span<const int64_t> expected_shape, int64_t row_begin,
                       int64_t row_end, int64_t col_begin, int64_t col_end, float* out) const;

  // Drops this process's mapping of tensor `name`'s pages (madvise
  // MADV_DONTNEED on the whole pages it spans), after its bytes were copied:
  // they leave the resident set (the page cache keeps them as reclaimable).
  // Reading the tensor again maps them back. No-op for an unknown name.
  void Release(std::string_view name) const;

  // A rectangular piece of a 2-D tensor: rows [row_begin, row_end) and
  // columns [col_begin, col_end) of `name` (whose full shape must equal
  // `expected_shape`), into `out` ([rows, cols] row-major) as `out_dtype`.
  // F8_E4M3 tensors are dequantized with the block scales of the selected
  // elements. Reads only the bytes of the selected rows (a rank loading its
  // shard touches only its shard's pages). Errors as Load, plus ranges
  // outside the tensor.
  Status LoadSlice(std::string_view name, std::span<const int64_t> expected_shape, int64_t row_begin, int64_t row_end,
                   int64_t col_begin, int64_t col_end, DType out_dtype, void* out) const;

 private:
  Checkpoint() = default;
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorRef*, std::less<>> tensors_;
};

}  // namespace mlarun
