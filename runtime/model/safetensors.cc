#include "runtime/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <utility>

#include "base/float8.h"
#include "gemm/convert.h"

namespace mlarun {
namespace {

// Maps a whole file read-only at a 2 MiB-aligned address and asks for huge
// pages. Weights are read in place from this mapping, one pass over ~all of
// it per decode step: with 4 KiB pages every page is a TLB miss and a point
// where the hardware prefetchers stop. A file offset that is a multiple of
// 2 MiB lands on a 2 MiB boundary, so the page cache's large folios (which
// the kernel allocates for faults in a MADV_HUGEPAGE range, and which a
// filesystem with large-folio support may already hold) are mapped by one
// PMD each. Where the kernel or filesystem offers none, this is an ordinary
// mapping of 4 KiB pages.
void* MapHugePageAligned(int fd, uint64_t bytes) {
  constexpr uint64_t kHuge = uint64_t{2} << 20;
  if (bytes < kHuge) return ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  void* reserved = ::mmap(nullptr, bytes + kHuge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserved == MAP_FAILED) return ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const uintptr_t begin = reinterpret_cast<uintptr_t>(reserved);
  const uintptr_t aligned = (begin + kHuge - 1) & ~(kHuge - 1);
  void* map = ::mmap(reinterpret_cast<void*>(aligned), bytes, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0);
  if (map == MAP_FAILED) {
    const int err = errno;
    ::munmap(reserved, bytes + kHuge);
    errno = err;
    return MAP_FAILED;
  }
  // Give back the reservation around the file's pages.
  if (aligned > begin) ::munmap(reserved, aligned - begin);
  const uintptr_t end = aligned + ((bytes + 4095) & ~uint64_t{4095});
  if (begin + bytes + kHuge > end) ::munmap(reinterpret_cast<void*>(end), begin + bytes + kHuge - end);
  (void)::madvise(map, bytes, MADV_HUGEPAGE);
  return map;
}

using json = nlohmann::json;

// The Rust safetensors crate refuses headers above 100 MB; a real header (one
// entry per tensor) stays far below that, and the cap bounds what a hostile
// length can make us parse.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Same cap for index.json, which we read into memory.
constexpr uint64_t kMaxIndexBytes = 100ull << 20;
// Elements converted per step when loading: big enough to amortize the loop,
// small enough that the scratch stays in L2 and no second full copy exists.
constexpr int64_t kChunkElements = int64_t{1} << 16;

constexpr std::string_view kIndexFileName = "model.safetensors.index.json";
constexpr std::string_view kSingleFileName = "model.safetensors";

struct DTypeEntry {
  SafetensorsDType dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DTypeEntry, 15> kDTypes = {{
    {SafetensorsDType::kBool, "BOOL", 1},
    {SafetensorsDType::kU8, "U8", 1},
    {SafetensorsDType::kI8, "I8", 1},
    {SafetensorsDType::kI16, "I16", 2},
    {SafetensorsDType::kU16, "U16", 2},
    {SafetensorsDType::kF16, "F16", 2},
    {SafetensorsDType::kBF16, "BF16", 2},
    {SafetensorsDType::kI32, "I32", 4},
    {SafetensorsDType::kU32, "U32", 4},
    {SafetensorsDType::kF32, "F32", 4},
    {SafetensorsDType::kF64, "F64", 8},
    {SafetensorsDType::kI64, "I64", 8},
    {SafetensorsDType::kU64, "U64", 8},
    {SafetensorsDType::kF8E4M3, "F8_E4M3", 1},
    {SafetensorsDType::kF8E5M2, "F8_E5M2", 1},
}};

bool ParseSafetensorsDType(std::string_view name, SafetensorsDType* out) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.name == name) {
      *out = e.dtype;
      return true;
    }
  }
  return false;
}

// A non-negative JSON integer as uint64; floats, negatives and anything else are rejected.
bool GetUnsigned(const json& j, uint64_t* out) {
  if (j.is_number_unsigned()) {
    *out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer()) {
    const int64_t v = j.get<int64_t>();
    if (v < 0) return false;
    *out = static_cast<uint64_t>(v);
    return true;
  }
  return false;
}

// Exact IEEE binary16 -> binary32: every half value is representable in fp32.
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h >> 15) << 31;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) {
    // Inf stays inf; NaN keeps its payload (shifted into the fp32 mantissa), quieted.
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0u));
  }
  if (exponent == 0) {
    // Subnormal (or zero): mantissa * 2^-24, exact in fp32; sign kept for -0.
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent - 15u + 127u) << 23) | (mantissa << 13));
}

std::string Quoted(std::string_view s) { return internal::StrCat('\'', s, '\''); }

// Tensor names and file names in messages: "tensor 'x' in /path/f.safetensors".
std::string Where(const TensorRef& t) { return internal::StrCat("tensor ", Quoted(t.name), " in ", *t.file); }

Status ReadSmallFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return FailedPreconditionError("cannot open ", path, ": ", std::strerror(errno));
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0) return InvalidArgumentError("cannot read ", path);
  if (static_cast<uint64_t>(size) > kMaxIndexBytes) {
    return InvalidArgumentError(path, ": ", size, " bytes is larger than the ", kMaxIndexBytes, "-byte limit");
  }
  out->assign(static_cast<size_t>(size), '\0');
  in.seekg(0, std::ios::beg);
  if (!in.read(out->data(), size)) return InvalidArgumentError("cannot read ", path);
  return Status::Ok();
}

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string JoinPath(const std::string& dir, std::string_view name) {
  if (dir.empty()) return std::string(name);
  return dir.back() == '/' ? dir + std::string(name) : internal::StrCat(dir, '/', name);
}

// A shard must be a plain file name inside the checkpoint directory: a hostile
// index could otherwise point us at any file on the machine.
bool IsPlainFileName(std::string_view name) {
  return !name.empty() && name.find('/') == std::string_view::npos && name.find('\\') == std::string_view::npos &&
         name.find("..") == std::string_view::npos && name != "." && name.find('\0') == std::string_view::npos;
}

}  // namespace

std::string ShapeString(std::span<const int64_t> shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

size_t SafetensorsDTypeSize(SafetensorsDType t) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.dtype == t) return e.size;
  }
  return 0;
}

std::string_view SafetensorsDTypeName(SafetensorsDType t) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.dtype == t) return e.name;
  }
  return "INVALID";
}

int64_t TensorRef::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // cannot overflow: Open checked the same product times the element size
  return n;
}

// ---------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;

  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) return NotFoundError("safetensors file ", path, " not found");
    return FailedPreconditionError("cannot open safetensors file ", path, ": ", std::strerror(err));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return FailedPreconditionError("cannot stat ", path, ": ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgumentError(path, " is not a regular file");
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < 8) {
    ::close(fd);
    return InvalidArgumentError(path, ": ", file_bytes, " bytes is too small for a safetensors file (need 8 + header)");
  }
  void* map = MapHugePageAligned(fd, file_bytes);
  const int mmap_errno = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) return FailedPreconditionError("cannot mmap ", path, ": ", std::strerror(mmap_errno));
  file->map_ = map;
  file->map_bytes_ = file_bytes;
  const auto* base = static_cast<const std::byte*>(map);

  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | static_cast<uint8_t>(base[i]);
  if (header_bytes > file_bytes - 8) {
    return InvalidArgumentError(path, ": header length ", header_bytes, " exceeds the ", file_bytes - 8,
                                " bytes after the length field");
  }
  if (header_bytes > kMaxHeaderBytes) {
    return InvalidArgumentError(path, ": header length ", header_bytes, " exceeds the ", kMaxHeaderBytes,
                                "-byte limit");
  }
  const uint64_t data_bytes = file_bytes - 8 - header_bytes;
  const std::byte* data = base + 8 + header_bytes;
  const char* header_begin = reinterpret_cast<const char*>(base + 8);
  MLARUN_RETURN_IF_ERROR(
      file->BuildTensorTable(std::string_view(header_begin, static_cast<size_t>(header_bytes)), data, data_bytes));
  return file;
}

namespace {

// One tensor's header entry (not __metadata__) of the file at `path`, checked
// against its data section [data, data + data_bytes): *t gets its name,
// dtype, shape, bytes and data (not its file), [*begin, *end) its offsets.
Status ParseTensorEntry(const std::string& name, const json& entry, const std::string& path, const std::byte* data,
                        uint64_t data_bytes, TensorRef* t, uint64_t* begin_out, uint64_t* end_out) {
  const std::string where = internal::StrCat("tensor ", Quoted(name), " in ", path);
  if (!entry.is_object()) return InvalidArgumentError(where, ": entry is not a JSON object");
  const auto dtype_it = entry.find("dtype");
  const auto shape_it = entry.find("shape");
  const auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end() || shape_it == entry.end() || offsets_it == entry.end()) {
    return InvalidArgumentError(where, ": entry needs dtype, shape and data_offsets");
  }

  t->name = name;
  if (!dtype_it->is_string()) return InvalidArgumentError(where, ": dtype is not a string");
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  if (!ParseSafetensorsDType(dtype_name, &t->dtype)) {
    return InvalidArgumentError(where, ": unknown dtype ", Quoted(dtype_name));
  }

  if (!shape_it->is_array()) return InvalidArgumentError(where, ": shape is not an array");
  // Track numel * element size with overflow checks: the product must fit
  // in the file anyway, so anything that overflows is rejected.
  uint64_t bytes = SafetensorsDTypeSize(t->dtype);
  for (const json& d : *shape_it) {
    uint64_t dim = 0;
    if (!GetUnsigned(d, &dim) || dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return InvalidArgumentError(where, ": shape ", shape_it->dump(), " is not a list of non-negative integers");
    }
    if (__builtin_mul_overflow(bytes, dim, &bytes)) {
      return InvalidArgumentError(where, ": shape ", shape_it->dump(), " overflows the byte size");
    }
    t->shape.push_back(static_cast<int64_t>(dim));
  }

  uint64_t begin = 0, end = 0;
  if (!offsets_it->is_array() || offsets_it->size() != 2 || !GetUnsigned((*offsets_it)[0], &begin) ||
      !GetUnsigned((*offsets_it)[1], &end)) {
    return InvalidArgumentError(where, ": data_offsets ", offsets_it->dump(),
                                " is not a pair of non-negative integers");
  }
  if (begin > end) {
    return InvalidArgumentError(where, ": data_offsets [", begin, ", ", end, "] begin after end");
  }
  if (end > data_bytes) {
    return InvalidArgumentError(where, ": data_offsets [", begin, ", ", end, "] run past the ", data_bytes,
                                "-byte data section (file truncated?)");
  }
  if (end - begin != bytes) {
    return InvalidArgumentError(where, ": data_offsets [", begin, ", ", end, "] span ", end - begin,
                                " bytes but dtype ", dtype_name, " and shape ", ShapeString(t->shape), " need ", bytes);
  }
  t->data = data + begin;
  t->bytes = static_cast<size_t>(bytes);
  *begin_out = begin;
  *end_out = end;
  return Status::Ok();
}

}  // namespace

Status SafetensorsFile::BuildTensorTable(std::string_view header_text, const std::byte* data, uint64_t data_bytes) {
  const std::string& path = path_;
  // nlohmann's std::map objects would silently keep only one of two entries
  // with the same name; a parse callback sees every top-level key first.
  std::set<std::string> seen;
  std::string duplicate;
  const json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key && parsed.is_string()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };

  try {
    const json header = json::parse(header_text.data(), header_text.data() + header_text.size(), on_event,
                                    /*allow_exceptions=*/false);
    if (header.is_discarded()) return InvalidArgumentError(path, ": header is not valid JSON");
    if (!header.is_object()) return InvalidArgumentError(path, ": header is not a JSON object");
    if (!duplicate.empty()) return InvalidArgumentError(path, ": header lists ", Quoted(duplicate), " twice");

    struct Range {
      uint64_t begin, end;
      size_t tensor;
    };
    std::vector<Range> ranges;
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        if (!entry.is_object()) return InvalidArgumentError(path, ": __metadata__ is not a JSON object");
        for (const auto& [key, value] : entry.items()) {
          if (!value.is_string()) {
            return InvalidArgumentError(path, ": __metadata__ value for ", Quoted(key), " is not a string");
          }
          metadata_.emplace(key, value.get<std::string>());
        }
        continue;
      }
      TensorRef t;
      uint64_t begin = 0, end = 0;
      MLARUN_RETURN_IF_ERROR(ParseTensorEntry(name, entry, path, data, data_bytes, &t, &begin, &end));
      t.file = &path_;
      // Empty ranges cannot overlap anything.
      if (begin != end) ranges.push_back({begin, end, tensors_.size()});
      tensors_.push_back(std::move(t));
    }

    std::sort(ranges.begin(), ranges.end(),
              [](const Range& a, const Range& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
    for (size_t i = 1; i < ranges.size(); ++i) {
      if (ranges[i].begin < ranges[i - 1].end) {
        const TensorRef& a = tensors_[ranges[i - 1].tensor];
        const TensorRef& b = tensors_[ranges[i].tensor];
        return InvalidArgumentError(path, ": tensors ", Quoted(a.name), " [", ranges[i - 1].begin, ", ",
                                    ranges[i - 1].end, ") and ", Quoted(b.name), " [", ranges[i].begin, ", ",
                                    ranges[i].end, ") overlap");
      }
    }
    for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(path, ": out of memory parsing the header");
  } catch (const std::exception& e) {
    // allow_exceptions=false covers parse errors; this guards accessors.
    return InvalidArgumentError(path, ": malformed header: ", e.what());
  }
  return Status::Ok();
}

const TensorRef* SafetensorsFile::Find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

// ---------------------------------------------------------------------------
// Checkpoint

Checkpoint::~Checkpoint() = default;

StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->dir_ = dir;
  const std::string index_path = JoinPath(dir, kIndexFileName);
  const std::string single_path = JoinPath(dir, kSingleFileName);

  if (!IsRegularFile(index_path)) {
    if (!IsRegularFile(single_path)) {
      return NotFoundError("checkpoint directory ", dir, " has neither ", kSingleFileName, " nor ", kIndexFileName);
    }
    MLARUN_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(single_path));
    for (const TensorRef& t : file->tensors()) ckpt->tensors_.emplace(t.name, &t);
    ckpt->files_.push_back(std::move(file));
    return ckpt;
  }

  std::string text;
  MLARUN_RETURN_IF_ERROR(ReadSmallFile(index_path, &text));
  // tensor name -> shard file name, as the index says.
  std::map<std::string, std::string, std::less<>> weight_map;
  try {
    const json index = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded()) return InvalidArgumentError(index_path, ": not valid JSON");
    if (!index.is_object()) return InvalidArgumentError(index_path, ": not a JSON object");
    const auto map_it = index.find("weight_map");
    if (map_it == index.end() || !map_it->is_object()) {
      return InvalidArgumentError(index_path, ": no \"weight_map\" object");
    }
    const auto meta_it = index.find("metadata");
    if (meta_it != index.end() && !meta_it->is_object() && !meta_it->is_null()) {
      return InvalidArgumentError(index_path, ": \"metadata\" is not an object");
    }
    for (const auto& [tensor, shard] : map_it->items()) {
      if (!shard.is_string()) {
        return InvalidArgumentError(index_path, ": weight_map entry for tensor ", Quoted(tensor),
                                    " is not a file name string");
      }
      const std::string& shard_name = shard.get_ref<const std::string&>();
      if (!IsPlainFileName(shard_name)) {
        return InvalidArgumentError(index_path, ": weight_map places tensor ", Quoted(tensor), " in ",
                                    Quoted(shard_name), ", which is not a plain file name inside ", dir);
      }
      weight_map.emplace(tensor, shard_name);
    }
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(index_path, ": out of memory parsing the index");
  } catch (const std::exception& e) {
    return InvalidArgumentError(index_path, ": malformed index: ", e.what());
  }
  if (weight_map.empty()) return InvalidArgumentError(index_path, ": weight_map is empty");

  std::map<std::string, const SafetensorsFile*> shards;  // shard name -> opened file
  for (const auto& [tensor, shard_name] : weight_map) {
    if (shards.count(shard_name)) continue;
    auto file = SafetensorsFile::Open(JoinPath(dir, shard_name));
    if (!file.ok()) {
      return file.status().WithContext(internal::StrCat(index_path, " lists shard ", Quoted(shard_name)));
    }
    shards.emplace(shard_name, file->get());
    ckpt->files_.push_back(std::move(file).value());
  }

  for (const auto& [tensor, shard_name] : weight_map) {
    const SafetensorsFile* shard = shards.at(shard_name);
    if (shard->Find(tensor) == nullptr) {
      return InvalidArgumentError(index_path, " places tensor ", Quoted(tensor), " in ", shard->path(),
                                  ", which does not contain it");
    }
  }
  for (const auto& file : ckpt->files_) {
    for (const TensorRef& t : file->tensors()) {
      const auto it = weight_map.find(t.name);
      if (it == weight_map.end()) {
        return InvalidArgumentError(Where(t), " is not listed in ", index_path);
      }
      const auto [pos, inserted] = ckpt->tensors_.emplace(t.name, &t);
      if (!inserted) {
        return InvalidArgumentError(Where(t), " is also in ", *pos->second->file,
                                    " (duplicate tensor name across shards)");
      }
    }
  }
  // Both directions hold and names are unique, so the maps now agree exactly.
  return ckpt;
}

const TensorRef* Checkpoint::Find(std::string_view name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second;
}

std::vector<std::string> Checkpoint::Names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, t] : tensors_) names.push_back(name);
  return names;
}

namespace {

// A rectangle of a row-major matrix: rows [row_begin, row_end) x columns
// [col_begin, col_end), in the matrix's own (global) indices.
struct Region {
  int64_t row_begin = 0, row_end = 0, col_begin = 0, col_end = 0;

  int64_t rows() const { return row_end - row_begin; }
  int64_t cols() const { return col_end - col_begin; }
  bool empty() const { return rows() == 0 || cols() == 0; }
};

// The fp8 block scales a region needs: block rows [first_block_row, ..) and
// block columns [first_block_col, first_block_col + block_cols) of the
// `_scale_inv` tensor, as fp32, row-major.
struct BlockScales {
  std::vector<float> values;
  int64_t first_block_row = 0, first_block_col = 0, block_cols = 0;
};

// m elements of `dtype` (F32/BF16/F16/F8_E4M3) at `src` to fp32 `dst`. Wider
// types are copied to aligned scratch (`u16`, or `dst` itself for F32) before
// they are read as numbers: a crafted header may put a tensor at any byte offset.
void ConvertToF32(SafetensorsDType dtype, const std::byte* src, int64_t m, uint16_t* u16, float* dst) {
  switch (dtype) {
    case SafetensorsDType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(m) * 4);
      break;
    case SafetensorsDType::kBF16:
      std::memcpy(u16, src, static_cast<size_t>(m) * 2);
      ConvertBf16ToF32(u16, dst, m);
      break;
    case SafetensorsDType::kF16:
      std::memcpy(u16, src, static_cast<size_t>(m) * 2);
      for (int64_t i = 0; i < m; ++i) dst[i] = HalfToFloat(u16[i]);
      break;
    default:  // kF8E4M3: bytes need no alignment
      ConvertF8E4M3ToF32(reinterpret_cast<const uint8_t*>(src), dst, m);
      break;
  }
}

// Copies `region` of `t`, viewed as a row-major matrix with `cols` columns,
// into `out` ([region.rows(), region.cols()] row-major) as `out_dtype`.
// `scales` is set exactly for F8_E4M3 and holds the blocks the region touches.
// Every source address is computed from a selected row and column, so only
// the selected columns of the selected rows are read: a rank loading its
// shard touches only its shard's pages of the mapping.
// REQUIRES: t is F32/BF16/F16/F8_E4M3, the region is non-empty and inside the
// matrix, out_dtype is kF32 or kBF16, out is not null.
void CopyRegion(const TensorRef& t, int64_t cols, const Region& region, const BlockScales* scales, DType out_dtype,
                std::byte* out) {
  const size_t in_size = SafetensorsDTypeSize(t.dtype);
  const size_t out_size = DTypeSize(out_dtype);
  // First byte of the first selected row; rows below are relative to it.
  const std::byte* base = t.data + static_cast<size_t>(region.row_begin * cols) * in_size;
  int64_t rows = region.rows(), col_begin = region.col_begin, col_end = region.col_end;
  if (scales == nullptr && col_begin == 0 && col_end == cols) {
    // A full-width band is one contiguous run: treat it as a single row so
    // copies and conversion chunks stay long even for narrow rows (fp8 keeps
    // its rows: each row's block-row scale is looked up per row).
    col_end = cols = rows * cols;
    rows = 1;
  }
  const int64_t width = col_end - col_begin;

  if ((t.dtype == SafetensorsDType::kF32 && out_dtype == DType::kF32) ||
      (t.dtype == SafetensorsDType::kBF16 && out_dtype == DType::kBF16)) {
    // Same type: bit-exact copy, one memcpy per row.
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(out + static_cast<size_t>(r * width) * out_size,
                  base + static_cast<size_t>(r * cols + col_begin) * in_size, static_cast<size_t>(width) * in_size);
    }
    return;
  }

  // Converted elements gather in `f32` across row boundaries (the output is
  // contiguous) and are stored whenever it fills, so narrow slices still
  // store in long runs and no second full-size copy ever exists.
  const int64_t capacity = std::min(rows * width, kChunkElements);
  std::vector<float> f32(static_cast<size_t>(capacity));
  std::vector<uint16_t> u16(in_size == 2 ? static_cast<size_t>(capacity) : 0);
  int64_t filled = 0;  // converted elements in f32 not yet stored
  std::byte* dst = out;
  for (int64_t r = 0; r < rows; ++r) {
    // The global row picks the block row: a slice starting at row 100 uses
    // block row 0 up to row 127 and block row 1 from row 128.
    const float* row_scales =
        scales == nullptr ? nullptr
                          : scales->values.data() +
                                ((region.row_begin + r) / kFp8Block - scales->first_block_row) * scales->block_cols;
    for (int64_t c = col_begin; c < col_end;) {
      const int64_t m = std::min(col_end - c, capacity - filled);
      float* piece = f32.data() + filled;
      ConvertToF32(t.dtype, base + static_cast<size_t>(r * cols + c) * in_size, m, u16.data(), piece);
      if (row_scales != nullptr) {
        // Global column j is in block column j / 128. One fp32 multiply per
        // element (the rounding torch's dequantization does), one lookup per block.
        for (int64_t j = c; j < c + m;) {
          const int64_t block = j / kFp8Block;
          const int64_t block_end = std::min(c + m, (block + 1) * kFp8Block);
          const float s = row_scales[block - scales->first_block_col];
          for (; j < block_end; ++j) piece[j - c] *= s;
        }
      }
      filled += m;
      c += m;
      if (filled == capacity) {
        StoreFromF32(f32.data(), dst, out_dtype, filled);
        dst += static_cast<size_t>(filled) * out_size;
        filled = 0;
      }
    }
  }
  if (filled > 0) StoreFromF32(f32.data(), dst, out_dtype, filled);
}

// The checks Load and LoadSlice make before any range: the output dtype, that
// the tensor exists and that its full shape is the expected one.
StatusOr<const TensorRef*> FindForLoad(const Checkpoint& ckpt, std::string_view name,
                                       std::span<const int64_t> expected_shape, DType out_dtype) {
  if (out_dtype != DType::kF32 && out_dtype != DType::kBF16) {
    return InvalidArgumentError("loading tensor ", Quoted(name), " from ", ckpt.dir(),
                                ": output dtype must be f32 or bf16", ", not ",
                                IsValidDType(out_dtype) ? DTypeName(out_dtype) : "invalid");
  }
  const TensorRef* t = ckpt.Find(name);
  if (t == nullptr) return NotFoundError("tensor ", Quoted(name), " not found in checkpoint ", ckpt.dir());
  if (!std::equal(t->shape.begin(), t->shape.end(), expected_shape.begin(), expected_shape.end())) {
    return InvalidArgumentError(Where(*t), " has shape ", ShapeString(t->shape), ", expected ",
                                ShapeString(expected_shape));
  }
  return t;
}

// F8_E4M3 tensor t's block scales `<name>_scale_inv`, checked: t is 2-D, the
// scale exists, is F32 or BF16 and has shape [ceil(rows / 128), ceil(cols /
// 128)]. Checked even for an empty region so a broken checkpoint fails the
// same way whatever is asked.
StatusOr<const TensorRef*> Fp8ScaleOf(const Checkpoint& ckpt, const TensorRef& t) {
  if (t.shape.size() != 2) {
    return InvalidArgumentError(Where(t), " is F8_E4M3 with shape ", ShapeString(t.shape),
                                "; block-scaled dequantization needs a 2-D weight");
  }
  const std::string scale_name = internal::StrCat(t.name, "_scale_inv");
  const TensorRef* scale = ckpt.Find(scale_name);
  if (scale == nullptr) {
    // Not NotFound: that code means "no such tensor", and the weight exists.
    return InvalidArgumentError(Where(t), " is F8_E4M3 but its scale tensor ", Quoted(scale_name),
                                " is not in checkpoint ", ckpt.dir());
  }
  const std::array<int64_t, 2> scale_shape = {Fp8Blocks(t.shape[0]), Fp8Blocks(t.shape[1])};
  if (scale->dtype != SafetensorsDType::kF32 && scale->dtype != SafetensorsDType::kBF16) {
    return InvalidArgumentError("scale ", Where(*scale), " for F8_E4M3 tensor ", Quoted(t.name), " is ",
                                SafetensorsDTypeName(scale->dtype), "; expected F32 or BF16");
  }
  if (!std::equal(scale->shape.begin(), scale->shape.end(), scale_shape.begin(), scale_shape.end())) {
    return InvalidArgumentError("scale ", Where(*scale), " has shape ", ShapeString(scale->shape), ", expected ",
                                ShapeString(scale_shape), " (128x128 blocks of ", Quoted(t.name), " with shape ",
                                ShapeString(t.shape), ")");
  }
  return scale;
}

// The blocks of 128 x 128 a non-empty region touches.
Region BlocksOf(const Region& r) {
  return {r.row_begin / kFp8Block, (r.row_end - 1) / kFp8Block + 1, r.col_begin / kFp8Block,
          (r.col_end - 1) / kFp8Block + 1};
}

// The rest of Load and LoadSlice, one implementation for both: checks the
// dtype (and for F8_E4M3 its block scales), then copies `region` of `t`,
// viewed as a row-major matrix with `cols` columns (a 2-D tensor's own shape;
// [1, numel] for a whole tensor of another rank).
Status LoadRegion(const Checkpoint& ckpt, const TensorRef& t, int64_t cols, const Region& region, DType out_dtype,
                  void* out) {
  switch (t.dtype) {
    case SafetensorsDType::kF32:
    case SafetensorsDType::kBF16:
    case SafetensorsDType::kF16:
      if (region.empty()) return Status::Ok();
      if (out == nullptr) return InvalidArgumentError("loading ", Where(t), ": output buffer is null");
      CopyRegion(t, cols, region, /*scales=*/nullptr, out_dtype, static_cast<std::byte*>(out));
      return Status::Ok();
    case SafetensorsDType::kF8E4M3:
      break;
    default:
      return InvalidArgumentError("unsupported dtype for loading: ", Where(t), " is ", SafetensorsDTypeName(t.dtype),
                                  " (loadable: F32, BF16, F16, F8_E4M3)");
  }

  MLARUN_ASSIGN_OR_RETURN(const TensorRef* scale, Fp8ScaleOf(ckpt, t));
  if (region.empty()) return Status::Ok();
  if (out == nullptr) return InvalidArgumentError("loading ", Where(t), ": output buffer is null");

  // Only the blocks the region touches, loaded by the same copy (the scale is
  // a 2-D F32/BF16 tensor), so a shard reads only its own scale rows too.
  BlockScales scales;
  const Region blocks = BlocksOf(region);
  scales.first_block_row = blocks.row_begin;
  scales.first_block_col = blocks.col_begin;
  scales.block_cols = blocks.cols();
  scales.values.resize(static_cast<size_t>(blocks.rows() * blocks.cols()));
  CopyRegion(*scale, scale->shape[1], blocks, /*scales=*/nullptr, DType::kF32,
             reinterpret_cast<std::byte*>(scales.values.data()));
  CopyRegion(t, cols, region, &scales, out_dtype, static_cast<std::byte*>(out));
  return Status::Ok();
}

}  // namespace

Status Checkpoint::Load(std::string_view name, std::span<const int64_t> expected_shape, DType out_dtype,
                        void* out) const {
  MLARUN_ASSIGN_OR_RETURN(const TensorRef* t, FindForLoad(*this, name, expected_shape, out_dtype));
  // A 2-D tensor loads as its whole slice. Any other rank is one contiguous
  // run, loaded as a single row (LoadRegion refuses it for F8_E4M3, whose
  // block scales need two dimensions).
  if (t->shape.size() == 2) {
    return LoadRegion(*this, *t, t->shape[1], {0, t->shape[0], 0, t->shape[1]}, out_dtype, out);
  }
  const int64_t n = t->numel();
  return LoadRegion(*this, *t, n, {0, 1, 0, n}, out_dtype, out);
}

void Checkpoint::Release(std::string_view name) const {
  const TensorRef* t = Find(name);
  if (t == nullptr || t->bytes == 0) return;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(t->data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(t->data) + t->bytes) / page * page;
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

StatusOr<const std::byte*> Checkpoint::InPlace(std::string_view name, std::span<const int64_t> expected_shape,
                                               DType dtype) const {
  MLARUN_ASSIGN_OR_RETURN(const TensorRef* t, FindForLoad(*this, name, expected_shape, dtype));
  const bool same = (t->dtype == SafetensorsDType::kF32 && dtype == DType::kF32) ||
                    (t->dtype == SafetensorsDType::kBF16 && dtype == DType::kBF16);
  if (!same || reinterpret_cast<uintptr_t>(t->data) % DTypeSize(dtype) != 0) return nullptr;
  return t->data;
}

StatusOr<const std::byte*> Checkpoint::InPlaceFp8(std::string_view name,
                                                  std::span<const int64_t> expected_shape) const {
  MLARUN_ASSIGN_OR_RETURN(const TensorRef* t, FindForLoad(*this, name, expected_shape, DType::kF32));
  if (t->dtype != SafetensorsDType::kF8E4M3) return nullptr;
  MLARUN_RETURN_IF_ERROR(Fp8ScaleOf(*this, *t).status());
  return t->data;
}

Status Checkpoint::LoadFp8Scales(std::string_view name, std::span<const int64_t> expected_shape, int64_t row_begin,
                                 int64_t row_end, int64_t col_begin, int64_t col_end, float* out) const {
  MLARUN_ASSIGN_OR_RETURN(const TensorRef* t, FindForLoad(*this, name, expected_shape, DType::kF32));
  if (t->dtype != SafetensorsDType::kF8E4M3)
    return InvalidArgumentError(Where(*t), " is ", SafetensorsDTypeName(t->dtype),
                                ", not F8_E4M3: it has no block scales");
  MLARUN_ASSIGN_OR_RETURN(const TensorRef* scale, Fp8ScaleOf(*this, *t));
  const Region region{row_begin, row_end, col_begin, col_end};
  if (row_begin < 0 || row_begin > row_end || row_end > t->shape[0] || col_begin < 0 || col_begin > col_end ||
      col_end > t->shape[1])
    return InvalidArgumentError("block scales of ", Where(*t), " with shape ", ShapeString(t->shape), ": rows [",
                                row_begin, ", ", row_end, ") x columns [", col_begin, ", ", col_end,
                                ") are not ordered ranges within it");
  if (region.empty()) return Status::Ok();
  if (out == nullptr) return InvalidArgumentError("block scales of ", Where(*t), ": output buffer is null");
  CopyRegion(*scale, scale->shape[1], BlocksOf(region), /*scales=*/nullptr, DType::kF32,
             reinterpret_cast<std::byte*>(out));
  return Status::Ok();
}

Status Checkpoint::LoadSlice(std::string_view name, std::span<const int64_t> expected_shape, int64_t row_begin,
                             int64_t row_end, int64_t col_begin, int64_t col_end, DType out_dtype, void* out) const {
  MLARUN_ASSIGN_OR_RETURN(const TensorRef* t, FindForLoad(*this, name, expected_shape, out_dtype));
  if (t->shape.size() != 2) {
    return InvalidArgumentError("slicing ", Where(*t), ": it has shape ", ShapeString(t->shape),
                                "; LoadSlice needs a 2-D tensor");
  }
  const int64_t rows = t->shape[0], cols = t->shape[1];
  if (row_begin < 0 || row_begin > row_end || row_end > rows) {
    return InvalidArgumentError("slicing ", Where(*t), " with shape ", ShapeString(t->shape), ": rows [", row_begin,
                                ", ", row_end, ") are not an ordered range within [0, ", rows, ")");
  }
  if (col_begin < 0 || col_begin > col_end || col_end > cols) {
    return InvalidArgumentError("slicing ", Where(*t), " with shape ", ShapeString(t->shape), ": columns [", col_begin,
                                ", ", col_end, ") are not an ordered range within [0, ", cols, ")");
  }
  return LoadRegion(*this, *t, cols, {row_begin, row_end, col_begin, col_end}, out_dtype, out);
}

}  // namespace mlarun
