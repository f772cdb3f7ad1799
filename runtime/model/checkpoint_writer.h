// Writes a Hugging Face safetensors checkpoint directory whose tensors are
// known up front (names, dtypes, shapes) but produced one at a time, in any
// order: the layout is fixed first, then each tensor's bytes go straight to
// their place in the file, so no more than one tensor per writing thread is
// ever in memory.
//
// Output: `model.safetensors`, or shards `model-0000N-of-0000M.safetensors`
// and `model.safetensors.index.json` ({"metadata": {"total_size": bytes},
// "weight_map": {name: file}}) when the tensors exceed one shard, as
// transformers' save_pretrained names them. Each file is a plain safetensors
// file (runtime/model/safetensors.h): header padded with spaces to a multiple
// of 8 bytes, __metadata__ {"format": "pt"}, tensors back to back in order of
// decreasing element size, then name, so that every tensor starts at a
// multiple of its element size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "runtime/model/safetensors.h"

namespace mlarun {

// One tensor of the checkpoint being written.
struct TensorSpec {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;
  int64_t bytes() const;  // elements x element size
};

// Thread-safe after Create: Write may be called from several threads at once.
class CheckpointWriter {
 public:
  // Creates the files in `dir` (an existing directory), each at its final
  // size. Tensors are put in shards in the order given, a new shard starting
  // when the next tensor would take the current one past `max_shard_bytes`
  // (a larger tensor gets a shard of its own). Names must be unique and
  // non-empty, shapes non-negative.
  static StatusOr<std::unique_ptr<CheckpointWriter>> Create(const std::string& dir, std::vector<TensorSpec> tensors,
                                                            int64_t max_shard_bytes);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Writes the bytes of tensor `name` (exactly its bytes(); each tensor once).
  // Blocks until they are handed to the kernel. Errors name the tensor and
  // the file.
  Status Write(std::string_view name, const void* data, size_t bytes);
  // Checks that every tensor was written, writes the index (several shards)
  // and closes the files. Call once, after the last Write.
  Status Finish();

  int shards() const { return static_cast<int>(files_.size()); }
  int64_t tensor_bytes() const { return tensor_bytes_; }  // sum of the tensors' bytes

 private:
  struct Placed {
    TensorSpec spec;
    int file = 0;
    uint64_t offset = 0;  // in the file, from its first byte
    bool written = false;
  };
  struct File {
    std::string name;  // inside dir_
    int fd = -1;
  };
  CheckpointWriter() = default;
  Status Layout(int64_t max_shard_bytes);
  Status WriteHeaders();

  // Constant after Create.
  std::string dir_;
  std::vector<File> files_;
  int64_t tensor_bytes_ = 0;
  std::vector<size_t> order_;  // indices into placed_, sorted by name (for lookup)

  std::mutex mutex_;
  std::vector<Placed> placed_;  // `written` MLARUN_GUARDED_BY(mutex_); the rest constant
};

}  // namespace mlarun
