// Collectives over a group of ranks, behind one interface with two backends:
// MPI (parallel/mpi/) for host buffers and NCCL (parallel/nccl/, CUDA builds)
// for device buffers. No MPI or NCCL header is visible here.
//
// Every operation is collective: each rank of the group calls it with the
// same operation, element type and (where stated) counts, in the same order.
// Calls block until this rank's part is complete. A rank with nothing to
// contribute still calls, with a count of 0: that is how idle ranks keep
// lockstep. While waiting for slower ranks the MPI backend sleeps in short
// back-off steps instead of spinning a core.
//
// Not thread-safe: one thread per communicator.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"

namespace mlarun {

// Element types of collective buffers. Values are frozen.
enum class CommType : uint8_t { kF32 = 0, kBF16 = 1, kI32 = 2, kI64 = 3, kU8 = 4 };
size_t CommTypeSize(CommType t);

// Bytes this rank sent into each kind of collective (its own contribution:
// count x element size; for a broadcast, the root counts the buffer, the
// others 0), and how many calls. For benchmarks that compare against the
// layout's prediction.
struct CommStats {
  struct Entry {
    int64_t calls = 0;
    int64_t bytes = 0;
  };
  Entry all_reduce, all_gather, reduce_scatter, broadcast, barrier;
  void Clear() { *this = CommStats{}; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "mpi" or "nccl".
  virtual std::string_view backend() const = 0;

  // Each collective below checks what every backend requires (a known type,
  // counts >= 0, one count per rank, a root inside the group), adds this
  // rank's contribution to stats(), and hands over to the backend. A call
  // refused here reaches no other rank and is not counted.

  // buf[0, count) <- sum over ranks, in place, on every rank. Any type (bf16
  // sums are accumulated in fp32 by the MPI backend, per step by NCCL).
  Status AllReduceSum(void* buf, int64_t count, CommType t);

  // recv[r * count, (r + 1) * count) <- rank r's send[0, count).
  Status AllGather(const void* send, int64_t count, void* recv, CommType t);

  // Variable counts: counts[r] is rank r's contribution (every rank passes
  // the same counts); rank r's elements land at offset sum(counts[0..r)).
  Status AllGatherV(const void* send, std::span<const int64_t> counts, void* recv, CommType t);

  // send holds sum(counts) elements on every rank; rank r receives, in
  // recv[0, counts[r]), the element-wise sum over ranks of the slice at offset
  // sum(counts[0..r)). Any type, as AllReduceSum.
  Status ReduceScatterSumV(const void* send, std::span<const int64_t> counts, void* recv, CommType t);

  // buf[0, count) <- root's buf.
  Status Broadcast(void* buf, int64_t count, CommType t, int root);

  Status Barrier();

  const CommStats& stats() const { return stats_; }
  CommStats& mutable_stats() { return stats_; }

 protected:
  // The backend's part, with arguments already checked as above (a backend
  // may refuse more, e.g. MPI's int counts).
  virtual Status DoAllReduceSum(void* buf, int64_t count, CommType t) = 0;
  virtual Status DoAllGather(const void* send, int64_t count, void* recv, CommType t) = 0;
  virtual Status DoAllGatherV(const void* send, std::span<const int64_t> counts, void* recv, CommType t) = 0;
  virtual Status DoReduceScatterSumV(const void* send, std::span<const int64_t> counts, void* recv, CommType t) = 0;
  virtual Status DoBroadcast(void* buf, int64_t count, CommType t, int root) = 0;
  virtual Status DoBarrier() = 0;

 private:
  CommStats stats_;
};

// Every rank's `mine`, on every rank, in rank order (a count exchange, then
// the bytes). For start-up facts and results, not for hot paths.
StatusOr<std::vector<std::string>> AllGatherStrings(Communicator& comm, const std::string& mine);

}  // namespace mlarun
