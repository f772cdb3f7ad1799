// Fuzz target: a YAML model file (ParseModelYaml: yaml-cpp, the YAML-to-JSON
// conversion, the unknown-key check and the shared config parser).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "runtime/model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto m = mlarun::ParseModelYaml(text, "fuzz/model.yaml");
  if (m.ok() && !mlarun::ValidateModelConfig(m->config).ok()) __builtin_trap();
  return 0;
}
