// Whole small files (configs, tokenizers) read into memory.
#pragma once

#include <string>

#include "base/status.h"

namespace mlarun {

// The bytes of the file at `path`: NOT_FOUND ("cannot open PATH") when it
// cannot be opened, INVALID_ARGUMENT when reading fails part way.
StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace mlarun
