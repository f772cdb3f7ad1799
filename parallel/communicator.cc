#include "parallel/communicator.h"

namespace mlarun {

size_t CommTypeSize(CommType t) {
  switch (t) {
    case CommType::kF32: return 4;
    case CommType::kBF16: return 2;
    case CommType::kI32: return 4;
    case CommType::kI64: return 8;
    case CommType::kU8: return 1;
  }
  // A value cast from an out-of-range integer: the backends reject a size of 0.
  return 0;
}

StatusOr<std::vector<std::string>> AllGatherStrings(Communicator& comm, const std::string& mine) {
  const int64_t n = static_cast<int64_t>(mine.size());
  std::vector<int64_t> counts(static_cast<size_t>(comm.size()));
  MLARUN_RETURN_IF_ERROR(comm.AllGather(&n, 1, counts.data(), CommType::kI64));
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  std::string flat(static_cast<size_t>(total), '\0');
  MLARUN_RETURN_IF_ERROR(comm.AllGatherV(mine.data(), counts, flat.data(), CommType::kU8));
  std::vector<std::string> out;
  int64_t off = 0;
  for (int64_t c : counts) {
    out.push_back(flat.substr(static_cast<size_t>(off), static_cast<size_t>(c)));
    off += c;
  }
  return out;
}

}  // namespace mlarun
