#include "parallel/communicator.h"

namespace mlarun {

size_t CommTypeSize(CommType t) {
  switch (t) {
    case CommType::kF32:
      return 4;
    case CommType::kBF16:
      return 2;
    case CommType::kI32:
      return 4;
    case CommType::kI64:
      return 8;
    case CommType::kU8:
      return 1;
  }
  // A value cast from an out-of-range integer: the backends reject a size of 0.
  return 0;
}

namespace {

Status CheckType(CommType t) {
  if (CommTypeSize(t) == 0) return InvalidArgumentError("unknown CommType ", static_cast<int>(t));
  return Status::Ok();
}

Status CheckCount(int64_t count, const char* what) {
  if (count < 0) return InvalidArgumentError(what, " count ", count, " is negative");
  return Status::Ok();
}

// One count per rank, none negative; returns their sum.
StatusOr<int64_t> CheckCounts(std::span<const int64_t> counts, int size, const char* what) {
  if (static_cast<int64_t>(counts.size()) != size)
    return InvalidArgumentError(what, ": ", counts.size(), " counts for a group of ", size, " ranks");
  int64_t total = 0;
  for (const int64_t c : counts) {
    MLARUN_RETURN_IF_ERROR(CheckCount(c, what));
    total += c;
  }
  return total;
}

void Count(CommStats::Entry& entry, int64_t bytes) {
  ++entry.calls;
  entry.bytes += bytes;
}

int64_t Bytes(int64_t count, CommType t) { return count * static_cast<int64_t>(CommTypeSize(t)); }

}  // namespace

Status Communicator::AllReduceSum(void* buf, int64_t count, CommType t) {
  MLARUN_RETURN_IF_ERROR(CheckType(t));
  MLARUN_RETURN_IF_ERROR(CheckCount(count, "AllReduceSum"));
  Count(stats_.all_reduce, Bytes(count, t));
  return DoAllReduceSum(buf, count, t);
}

Status Communicator::AllGather(const void* send, int64_t count, void* recv, CommType t) {
  MLARUN_RETURN_IF_ERROR(CheckType(t));
  MLARUN_RETURN_IF_ERROR(CheckCount(count, "AllGather"));
  Count(stats_.all_gather, Bytes(count, t));
  return DoAllGather(send, count, recv, t);
}

Status Communicator::AllGatherV(const void* send, std::span<const int64_t> counts, void* recv, CommType t) {
  MLARUN_RETURN_IF_ERROR(CheckType(t));
  MLARUN_RETURN_IF_ERROR(CheckCounts(counts, size(), "AllGatherV").status());
  Count(stats_.all_gather, Bytes(counts[static_cast<size_t>(rank())], t));
  return DoAllGatherV(send, counts, recv, t);
}

Status Communicator::ReduceScatterSumV(const void* send, std::span<const int64_t> counts, void* recv, CommType t) {
  MLARUN_RETURN_IF_ERROR(CheckType(t));
  MLARUN_ASSIGN_OR_RETURN(const int64_t total, CheckCounts(counts, size(), "ReduceScatterSumV"));
  Count(stats_.reduce_scatter, Bytes(total, t));
  return DoReduceScatterSumV(send, counts, recv, t);
}

Status Communicator::Broadcast(void* buf, int64_t count, CommType t, int root) {
  MLARUN_RETURN_IF_ERROR(CheckType(t));
  MLARUN_RETURN_IF_ERROR(CheckCount(count, "Broadcast"));
  if (root < 0 || root >= size())
    return InvalidArgumentError("Broadcast root ", root, " is outside a group of ", size(), " ranks");
  Count(stats_.broadcast, rank() == root ? Bytes(count, t) : 0);
  return DoBroadcast(buf, count, t, root);
}

Status Communicator::Barrier() {
  Count(stats_.barrier, 0);
  return DoBarrier();
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
