// Fuzz target: one JSON line of `--prompts` (ParseRequestLine), then the
// request check (ValidateRequest) under limits taken from the input's first
// bytes: unknown, small and large ones.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "runtime/request/request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  uint8_t pick = 0;
  if (size > 0) pick = data[0], ++data, --size;
  const std::string line(reinterpret_cast<const char*>(data), size);
  mlarun::SamplingParams defaults;
  auto r = mlarun::ParseRequestLine(line, defaults);
  if (!r.ok()) return 0;
  mlarun::RequestLimits limits;
  switch (pick % 4) {
    case 0:
      break;  // nothing known
    case 1:
      limits = {.vocab_size = 512, .max_position_embeddings = 4096, .block_size = 16, .cache_blocks_total = 64};
      break;
    case 2:
      limits = {.vocab_size = 129280, .max_position_embeddings = mlarun::kLimitUnknown, .block_size = 64};
      break;
    default:
      limits = {.vocab_size = INT64_MAX - 1,
                .max_position_embeddings = INT64_MAX - 1,
                .block_size = 1,
                .cache_blocks_total = INT64_MAX - 1};
  }
  (void)mlarun::ValidateGenerationRequest(*r, limits);
  return 0;
}
