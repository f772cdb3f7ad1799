// Where the tests find the shipped configs (configs/ in the source tree).
// tests/CMakeLists.txt defines MLARUN_CONFIGS_DIR for every test target.
#pragma once

#include <string>
#include <string_view>

namespace mlarun {

// configs/<rel>, e.g. ConfigPath("models/tiny.yaml").
inline std::string ConfigPath(std::string_view rel) { return std::string(MLARUN_CONFIGS_DIR) + "/" + std::string(rel); }

// The tiny DeepSeek-V3-shaped model (random weights) most tests run.
inline std::string TinyYaml() { return ConfigPath("models/tiny.yaml"); }

}  // namespace mlarun
