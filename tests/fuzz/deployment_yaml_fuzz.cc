// Fuzz target: a deployment file (configs/deploy/*.yaml) through
// ParseDeploymentConfig.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "serving/client/client.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto c = mlarun::ParseDeploymentConfig(text, "fuzz/deploy.yaml");
  if (c.ok() && (c->cache_bytes < 0 || c->memory_gib < 0 || c->max_batched_tokens < 0)) __builtin_trap();
  return 0;
}
