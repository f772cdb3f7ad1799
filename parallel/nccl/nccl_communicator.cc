// The NCCL backend: collectives on device buffers over a stream this
// communicator owns. Built only when CUDA and NCCL are found. Plain C++ (g++):
// only the CUDA runtime and NCCL host APIs are used, no kernels.
//
// The runner's kernels run on the legacy default stream and the collectives
// on this communicator's non-blocking stream, which does NOT wait for the
// legacy stream by itself: every collective first makes its stream wait for
// an event recorded on the legacy stream (the buffers it reads were written
// there), and returns after its own stream is done, so the kernels queued
// next see its result.
//
// Not yet run on a GPU: the build machines have none. scripts/gpu-check runs
// the NCCL test in tests/parallel/comm_test.cc when one is lent.
#include "parallel/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "base/cuda/cuda_check.h"

namespace mlarun {
namespace {

// The id travels over the bootstrap communicator as kU8 bytes.
static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES && NCCL_UNIQUE_ID_BYTES == 128);

Status NcclCallError(ncclResult_t rc, ncclComm_t comm, const char* expr, const char* file, int line) {
  const char* last = ncclGetLastError(comm);
  return InternalError(expr, " failed at ", file, ":", line, ": ", ncclGetErrorString(rc),
                       last != nullptr && last[0] != '\0' ? std::string(" (") + last + ")" : std::string());
}

}  // namespace
}  // namespace mlarun

// `comm` (may be nullptr) only adds NCCL's last warning to the message.
#define MLARUN_NCCL_RETURN_IF_ERROR(expr, comm)                                         \
  do {                                                                                  \
    const ncclResult_t mlarun_nccl_rc_ = (expr);                                        \
    if (mlarun_nccl_rc_ != ncclSuccess)                                                 \
      return ::mlarun::NcclCallError(mlarun_nccl_rc_, comm, #expr, __FILE__, __LINE__); \
  } while (0)

namespace mlarun {
namespace {

StatusOr<ncclDataType_t> NcclType(CommType t) {
  switch (t) {
    case CommType::kF32:
      return ncclFloat32;
    case CommType::kBF16:
      return ncclBfloat16;
    case CommType::kI32:
      return ncclInt32;
    case CommType::kI64:
      return ncclInt64;
    case CommType::kU8:
      return ncclUint8;
  }
  return InvalidArgumentError("unknown CommType ", static_cast<int>(t));
}

bool AllEqual(std::span<const int64_t> counts) {
  return std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts.front(); });
}

class NcclCommunicator final : public Communicator {
 public:
  // Owns nothing yet; Create() fills the members in, and the destructor frees
  // whatever was created, so every failure path of Create() cleans up.
  explicit NcclCommunicator(int device) : device_(device) {}
  ~NcclCommunicator() override {
    // Teardown on the device the resources live on. Errors are ignored: there
    // is nobody to report them to, and the process is usually ending.
    cudaSetDevice(device_);
    // Blocks until this rank's outstanding work is done (finalizes internally).
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (inputs_ready_ != nullptr) cudaEventDestroy(inputs_ready_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // Joins the clique: `id` is the same on every rank.
  Status Create(const ncclUniqueId& id, int rank, int size) {
    rank_ = rank;
    size_ = size;
    MLARUN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    // Non-blocking w.r.t. the legacy default stream, so other libraries'
    // default-stream work does not serialize with the collectives.
    MLARUN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MLARUN_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming));
    MLARUN_CUDA_RETURN_IF_ERROR(cudaMalloc(&scratch_, sizeof(float)));
    MLARUN_CUDA_RETURN_IF_ERROR(cudaMemset(scratch_, 0, sizeof(float)));
    MLARUN_NCCL_RETURN_IF_ERROR(ncclCommInitRank(&comm_, size, id, rank), nullptr);
    return Status::Ok();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "nccl"; }

  // Note: NCCL reduces bf16 in bf16 steps (rounding after each partial sum);
  // the MPI backend sums in fp32. Both are exact for small integers.
  Status DoAllReduceSum(void* buf, int64_t count, CommType t) override {
    MLARUN_RETURN_IF_ERROR(WaitForInputs());
    MLARUN_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(t));
    MLARUN_NCCL_RETURN_IF_ERROR(ncclAllReduce(buf, buf, static_cast<size_t>(count), type, ncclSum, comm_, stream_),
                                comm_);
    return Synchronize();
  }

  Status DoAllGather(const void* send, int64_t count, void* recv, CommType t) override {
    MLARUN_RETURN_IF_ERROR(WaitForInputs());
    MLARUN_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(t));
    MLARUN_NCCL_RETURN_IF_ERROR(ncclAllGather(send, recv, static_cast<size_t>(count), type, comm_, stream_), comm_);
    return Synchronize();
  }

  Status DoAllGatherV(const void* send, std::span<const int64_t> counts, void* recv, CommType t) override {
    MLARUN_RETURN_IF_ERROR(WaitForInputs());
    MLARUN_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(t));
    const size_t elem = CommTypeSize(t);
    if (AllEqual(counts)) {
      MLARUN_NCCL_RETURN_IF_ERROR(ncclAllGather(send, recv, static_cast<size_t>(counts[0]), type, comm_, stream_),
                                  comm_);
      return Synchronize();
    }
    // Unequal counts: one broadcast per contributing rank into its offset,
    // fused into one launch by the group. Every rank skips the same empty
    // roots, since every rank passes the same counts.
    MLARUN_RETURN_IF_ERROR(Grouped([&]() -> Status {
      size_t offset = 0;
      for (int r = 0; r < size_; ++r) {
        const size_t n = static_cast<size_t>(counts[r]);
        if (n > 0) {
          // sendbuff is read only on the root.
          MLARUN_NCCL_RETURN_IF_ERROR(
              ncclBroadcast(r == rank_ ? send : nullptr, static_cast<char*>(recv) + offset * elem, n, type, r, comm_,
                            stream_),
              comm_);
        }
        offset += n;
      }
      return Status::Ok();
    }));
    return Synchronize();
  }

  Status DoReduceScatterSumV(const void* send, std::span<const int64_t> counts, void* recv, CommType t) override {
    MLARUN_RETURN_IF_ERROR(WaitForInputs());
    MLARUN_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(t));
    const size_t elem = CommTypeSize(t);
    if (AllEqual(counts)) {
      MLARUN_NCCL_RETURN_IF_ERROR(
          ncclReduceScatter(send, recv, static_cast<size_t>(counts[0]), type, ncclSum, comm_, stream_), comm_);
      return Synchronize();
    }
    // Unequal counts: one reduce per receiving rank of its slice, grouped.
    MLARUN_RETURN_IF_ERROR(Grouped([&]() -> Status {
      size_t offset = 0;
      for (int r = 0; r < size_; ++r) {
        const size_t n = static_cast<size_t>(counts[r]);
        if (n > 0) {
          // recvbuff is written only on the root.
          MLARUN_NCCL_RETURN_IF_ERROR(ncclReduce(static_cast<const char*>(send) + offset * elem,
                                                 r == rank_ ? recv : nullptr, n, type, ncclSum, r, comm_, stream_),
                                      comm_);
        }
        offset += n;
      }
      return Status::Ok();
    }));
    return Synchronize();
  }

  Status DoBroadcast(void* buf, int64_t count, CommType t, int root) override {
    MLARUN_RETURN_IF_ERROR(WaitForInputs());
    MLARUN_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(t));
    MLARUN_NCCL_RETURN_IF_ERROR(ncclBroadcast(buf, buf, static_cast<size_t>(count), type, root, comm_, stream_), comm_);
    return Synchronize();
  }

  // An all-reduce of one float in the communicator's own device scratch
  // word: it cannot complete on any rank before every rank has issued it, and
  // it needs no host communicator (the bootstrap may be gone by now).
  Status DoBarrier() override {
    MLARUN_RETURN_IF_ERROR(WaitForInputs());
    MLARUN_NCCL_RETURN_IF_ERROR(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_), comm_);
    return Synchronize();
  }

 private:
  // The collective's stream waits for what the legacy default stream has
  // queued so far (the kernels that wrote its inputs), on the device.
  Status WaitForInputs() {
    MLARUN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    MLARUN_CUDA_RETURN_IF_ERROR(cudaEventRecord(inputs_ready_, cudaStreamLegacy));
    MLARUN_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, inputs_ready_, 0));
    return Status::Ok();
  }

  // Runs `enqueue` between ncclGroupStart and ncclGroupEnd. The group is
  // closed even when an enqueue fails, so the next call starts clean.
  template <typename F>
  Status Grouped(F&& enqueue) {
    MLARUN_NCCL_RETURN_IF_ERROR(ncclGroupStart(), comm_);
    const Status st = enqueue();
    const ncclResult_t end = ncclGroupEnd();
    MLARUN_RETURN_IF_ERROR(st);
    MLARUN_NCCL_RETURN_IF_ERROR(end, comm_);
    return Status::Ok();
  }

  // Operations are synchronous: wait for the stream. A failure there may be a
  // peer's (network, a rank that died): ask NCCL for its asynchronous error.
  Status Synchronize() {
    const cudaError_t rc = cudaStreamSynchronize(stream_);
    if (rc != cudaSuccess) {
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess) {
        return NcclCallError(async, comm_, "ncclCommGetAsyncError", __FILE__, __LINE__)
            .WithContext(std::string("cudaStreamSynchronize: ") + cudaGetErrorName(rc));
      }
      MLARUN_CUDA_RETURN_IF_ERROR(rc);
    }
    return Status::Ok();
  }

  const int device_;
  int rank_ = 0, size_ = 1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t inputs_ready_ = nullptr;  // recorded on the legacy stream before each collective
  void* scratch_ = nullptr;             // one float, for Barrier()
};

// This rank's part before any collective: a usable device, and on rank 0
// the clique's unique id.
Status PrepareLocal(int device, bool make_id, ncclUniqueId* id) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    cudaGetLastError();  // clear the error so later CUDA calls start clean
    return UnavailableError("no usable CUDA device: ", cudaGetErrorName(rc), " (", cudaGetErrorString(rc), ")");
  }
  if (count == 0) return UnavailableError("no CUDA device visible");
  if (device < 0 || device >= count) {
    return InvalidArgumentError("CUDA device ", device, " requested, ", count, " visible");
  }
  MLARUN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  if (make_id) MLARUN_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(id), nullptr);
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap, int device) {
  const int rank = bootstrap.rank(), size = bootstrap.size();
  ncclUniqueId id{};
  const Status local = PrepareLocal(device, rank == 0, &id);
  // Agree before the broadcast: if any rank (rank 0 above all) cannot take
  // part, every rank returns an error instead of some waiting forever for the
  // id or inside ncclCommInitRank.
  int32_t failed_ranks = local.ok() ? 0 : 1;
  MLARUN_RETURN_IF_ERROR(bootstrap.AllReduceSum(&failed_ranks, 1, CommType::kI32)
                             .WithContext("CreateNcclCommunicator: agreeing on device availability"));
  if (!local.ok()) return local;
  if (failed_ranks > 0) {
    return UnavailableError(failed_ranks, " of ", size, " ranks cannot join the NCCL communicator (rank ", rank,
                            " could, on CUDA device ", device, ")");
  }
  MLARUN_RETURN_IF_ERROR(bootstrap.Broadcast(&id, sizeof(id), CommType::kU8, 0)
                             .WithContext("CreateNcclCommunicator: broadcasting the NCCL unique id"));
  auto comm = std::make_unique<NcclCommunicator>(device);
  MLARUN_RETURN_IF_ERROR(comm->Create(id, rank, size));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace mlarun
