// Fuzz target: a Hugging Face config.json (ParseHfConfigJson). A config that
// parses must validate and its sizes must be describable without overflow.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "runtime/model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto c = mlarun::ParseHfConfigJson(text, "fuzz/config.json");
  if (c.ok()) {
    if (!mlarun::ValidateModelConfig(*c).ok()) __builtin_trap();
    double total = 0;
    for (const mlarun::WeightTensorSize& t : mlarun::WeightTensorSizes(*c)) total += t.total_bytes();
    if (!(total <= static_cast<double>(mlarun::kMaxModelWeightBytes))) __builtin_trap();
  }
  return 0;
}
