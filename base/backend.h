// Where an op runs. Every op's params carry one; its entry point dispatches on
// it to the backend's implementation. Values are frozen (they travel in
// configs and plans).
#pragma once

#include <cstdint>
#include <string_view>

namespace mlarun {

enum class Backend : uint8_t { kCpu = 0, kCuda = 1 };

constexpr std::string_view BackendName(Backend b) {
  switch (b) {
    case Backend::kCpu:
      return "cpu";
    case Backend::kCuda:
      return "cuda";
  }
  return "invalid";
}

}  // namespace mlarun
