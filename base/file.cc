#include "base/file.h"

#include <fstream>
#include <sstream>

namespace mlarun {

StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError("cannot open ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return InvalidArgumentError("error reading ", path);
  return ss.str();
}

}  // namespace mlarun
