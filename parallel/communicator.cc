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

}  // namespace mlarun
