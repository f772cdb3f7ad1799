#include "runtime/model/checkpoint_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

namespace mlarun {
namespace {

using json = nlohmann::json;

std::string JoinPath(const std::string& dir, std::string_view name) {
  return dir.empty() || dir.back() == '/' ? dir + std::string(name) : dir + "/" + std::string(name);
}

std::string ShardName(int i, int n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05d-of-%05d.safetensors", i + 1, n);
  return buf;
}

// Writes all of [data, data + bytes) at `offset` of `fd` (pwrite may write less).
Status WriteAll(int fd, const void* data, size_t bytes, uint64_t offset, const std::string& what) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return FailedPreconditionError("cannot write ", what, ": ", std::strerror(n < 0 ? errno : EIO));
    p += n, bytes -= static_cast<size_t>(n), offset += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status WriteTextFile(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return FailedPreconditionError("cannot create ", path, ": ", std::strerror(errno));
  Status s = WriteAll(fd, text.data(), text.size(), 0, path);
  if (::close(fd) != 0 && s.ok()) s = FailedPreconditionError("cannot close ", path, ": ", std::strerror(errno));
  return s;
}

}  // namespace

int64_t TensorSpec::bytes() const {
  int64_t n = static_cast<int64_t>(SafetensorsDTypeSize(dtype));
  for (int64_t d : shape) n *= d;
  return n;
}

CheckpointWriter::~CheckpointWriter() {
  for (File& f : files_)
    if (f.fd >= 0) ::close(f.fd);
}

StatusOr<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Create(const std::string& dir,
                                                                     std::vector<TensorSpec> tensors,
                                                                     int64_t max_shard_bytes) {
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter());
  w->dir_ = dir;
  std::set<std::string_view> names;
  for (const TensorSpec& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      return InvalidArgumentError("checkpoint writer: bad tensor name '", t.name, "'");
    if (!names.insert(t.name).second)
      return InvalidArgumentError("checkpoint writer: tensor ", t.name, " listed twice");
    for (int64_t d : t.shape)
      if (d < 0) return InvalidArgumentError("checkpoint writer: tensor ", t.name, " has a negative dimension");
  }
  for (TensorSpec& t : tensors) w->placed_.push_back({.spec = std::move(t)});
  MLARUN_RETURN_IF_ERROR(w->Layout(max_shard_bytes));
  MLARUN_RETURN_IF_ERROR(w->WriteHeaders());
  return w;
}

// Shards in the given order; offsets within each shard after its header.
Status CheckpointWriter::Layout(int64_t max_shard_bytes) {
  int file = 0;
  int64_t in_file = 0;
  for (Placed& p : placed_) {
    const int64_t b = p.spec.bytes();
    if (in_file > 0 && in_file + b > max_shard_bytes) ++file, in_file = 0;
    p.file = file;
    in_file += b;
    tensor_bytes_ += b;
  }
  const int n = placed_.empty() ? 1 : file + 1;
  for (int i = 0; i < n; ++i) files_.push_back({.name = n == 1 ? "model.safetensors" : ShardName(i, n)});
  order_.resize(placed_.size());
  for (size_t i = 0; i < order_.size(); ++i) order_[i] = i;
  std::sort(order_.begin(), order_.end(),
            [&](size_t a, size_t b) { return placed_[a].spec.name < placed_[b].spec.name; });
  return Status::Ok();
}

// Each shard's header, the file created at its full size.
Status CheckpointWriter::WriteHeaders() {
  for (int f = 0; f < shards(); ++f) {
    std::vector<Placed*> in;
    for (Placed& p : placed_)
      if (p.file == f) in.push_back(&p);
    std::stable_sort(in.begin(), in.end(), [](const Placed* a, const Placed* b) {
      const size_t ea = SafetensorsDTypeSize(a->spec.dtype), eb = SafetensorsDTypeSize(b->spec.dtype);
      return ea != eb ? ea > eb : a->spec.name < b->spec.name;
    });
    json header = json::object();
    header["__metadata__"] = {{"format", "pt"}};
    uint64_t at = 0;
    for (Placed* p : in) {
      const uint64_t b = static_cast<uint64_t>(p->spec.bytes());
      header[p->spec.name] = {{"dtype", std::string(SafetensorsDTypeName(p->spec.dtype))},
                              {"shape", p->spec.shape},
                              {"data_offsets", {at, at + b}}};
      p->offset = at;
      at += b;
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const uint64_t head = 8 + text.size();
    for (Placed* p : in) p->offset += head;
    File& file = files_[static_cast<size_t>(f)];
    const std::string path = JoinPath(dir_, file.name);
    file.fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (file.fd < 0) return FailedPreconditionError("cannot create ", path, ": ", std::strerror(errno));
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(text.size() >> (8 * i));
    MLARUN_RETURN_IF_ERROR(WriteAll(file.fd, len, 8, 0, path));
    MLARUN_RETURN_IF_ERROR(WriteAll(file.fd, text.data(), text.size(), 8, path));
    if (::ftruncate(file.fd, static_cast<off_t>(head + at)) != 0)
      return FailedPreconditionError("cannot size ", path, " to ", head + at, " bytes: ", std::strerror(errno));
  }
  return Status::Ok();
}

Status CheckpointWriter::Write(std::string_view name, const void* data, size_t bytes) {
  const auto it = std::lower_bound(order_.begin(), order_.end(), name,
                                   [&](size_t i, std::string_view n) { return placed_[i].spec.name < n; });
  if (it == order_.end() || placed_[*it].spec.name != name)
    return InvalidArgumentError("checkpoint writer: tensor ", name, " is not in the planned checkpoint");
  Placed& p = placed_[*it];
  if (bytes != static_cast<size_t>(p.spec.bytes()))
    return InvalidArgumentError("checkpoint writer: tensor ", name, " has ", bytes, " bytes, planned ", p.spec.bytes());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (p.written) return FailedPreconditionError("checkpoint writer: tensor ", name, " written twice");
    p.written = true;
  }
  const File& f = files_[static_cast<size_t>(p.file)];
  return WriteAll(f.fd, data, bytes, p.offset, "tensor " + std::string(name) + " to " + JoinPath(dir_, f.name));
}

Status CheckpointWriter::Finish() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Placed& p : placed_)
      if (!p.written) return FailedPreconditionError("checkpoint writer: tensor ", p.spec.name, " was never written");
  }
  for (File& f : files_) {
    const int fd = f.fd;
    f.fd = -1;
    if (fd >= 0 && ::close(fd) != 0)
      return FailedPreconditionError("cannot close ", JoinPath(dir_, f.name), ": ", std::strerror(errno));
  }
  if (shards() == 1) return Status::Ok();
  json map = json::object();
  for (const Placed& p : placed_) map[p.spec.name] = files_[static_cast<size_t>(p.file)].name;
  const json index = {{"metadata", {{"total_size", tensor_bytes_}}}, {"weight_map", map}};
  return WriteTextFile(JoinPath(dir_, "model.safetensors.index.json"), index.dump(2) + "\n");
}

}  // namespace mlarun
