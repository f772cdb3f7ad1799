// Non-owning views shared by the kernels and the containers that feed them.
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace mlarun {

// Rows stored in fixed-size blocks of a pool: one layer of a paged cache.
// The row of slot `t` of block `b` starts at
//   data + (b * stride_block + t * stride_token) elements of `dtype`.
// Never owns memory.
struct PagedRowsView {
  const void* data = nullptr;
  DType dtype = DType::kBF16;
  int64_t num_blocks = 0;  // valid block ids are [0, num_blocks)
  int64_t block_size = 0;  // rows per block
  int64_t row_width = 0;   // elements per row
  int64_t stride_block = 0;
  int64_t stride_token = 0;
};

}  // namespace mlarun
