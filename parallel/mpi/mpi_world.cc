// The MPI backend: MpiSession and MpiCommunicator (host buffers). The only
// translation unit that includes <mpi.h>.
#include "parallel/mpi/mpi_world.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>

#include "base/dtype.h"
#include "gemm/convert.h"

namespace mlarun {
namespace {

// Set once by MpiSession::Init; error messages name this rank.
int g_world_rank = -1;

// The ranks of this process's job: MPI_COMM_WORLD, or, when Init was asked
// to split an MPMD launch (`mpirun -np 2 A : -np 2 B`), the ranks of this
// process's application context (MPI_APPNUM). Set once by Init.
MPI_Comm g_job = MPI_COMM_WORLD;

const std::string& LocalHostName() {
  static const std::string host = [] {
    char buf[256] = {};
    if (gethostname(buf, sizeof(buf) - 1) != 0) return std::string("unknown-host");
    return std::string(buf);
  }();
  return host;
}

Status MpiCallError(int code, const char* expr, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  return InternalError(expr, " failed at ", file, ":", line, ": ",
                       len > 0 ? std::string(text, len) : "MPI error " + std::to_string(code), " (rank ", g_world_rank,
                       " on ", LocalHostName(), ")");
}

}  // namespace
}  // namespace mlarun

// Every MPI call goes through this. It relies on MPI_ERRORS_RETURN being set on
// the communicator (the default, MPI_ERRORS_ARE_FATAL, would end the job first).
#define MLARUN_MPI_RETURN_IF_ERROR(expr)                                                                         \
  do {                                                                                                           \
    const int mlarun_mpi_rc_ = (expr);                                                                           \
    if (mlarun_mpi_rc_ != MPI_SUCCESS) return ::mlarun::MpiCallError(mlarun_mpi_rc_, #expr, __FILE__, __LINE__); \
  } while (0)

namespace mlarun {
namespace {

// Tests of a request before the waiter starts sleeping: a collective whose
// peers are already there completes within a few microseconds, and sleeping
// would only add latency to it.
constexpr int kBusyTests = 50;
// Back-off between tests once sleeping: doubles from the first to the last
// step. A rank waiting for a slow peer (weight loading, a longer prefill)
// wakes ~1000 times a second for a few microseconds each, so it costs ~no
// CPU; the price is up to 1 ms of extra latency on a long wait.
constexpr long kFirstSleepNs = 20'000;
constexpr long kMaxSleepNs = 1'000'000;

// Completes `request` without spinning a core (see the constants above).
// MPI progresses non-blocking collectives inside MPI_Test, so this loop is
// also what drives the transfer.
Status WaitForRequest(MPI_Request* request) {
  int done = 0;
  for (int i = 0; i < kBusyTests; ++i) {
    MLARUN_MPI_RETURN_IF_ERROR(MPI_Test(request, &done, MPI_STATUS_IGNORE));
    if (done) return Status::Ok();
  }
  long sleep_ns = kFirstSleepNs;
  while (true) {
    timespec ts{.tv_sec = 0, .tv_nsec = sleep_ns};
    // An early wake-up (EINTR) only means one more test.
    nanosleep(&ts, nullptr);
    MLARUN_MPI_RETURN_IF_ERROR(MPI_Test(request, &done, MPI_STATUS_IGNORE));
    if (done) return Status::Ok();
    sleep_ns = std::min(sleep_ns * 2, kMaxSleepNs);
  }
}

// The MPI datatype carrying `t`. bf16 has none: it travels as 16-bit words
// (gathers, broadcast) or is widened to fp32 (sums).
MPI_Datatype MpiType(CommType t) {
  switch (t) {
    case CommType::kF32:
      return MPI_FLOAT;
    case CommType::kBF16:
      return MPI_UINT16_T;
    case CommType::kI32:
      return MPI_INT32_T;
    case CommType::kI64:
      return MPI_INT64_T;
    case CommType::kU8:
      return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

// MPI counts are int. Larger counts are refused rather than truncated: no
// single collective in this project comes near 2^31 elements. (Negative
// counts and unknown types never get here: Communicator checks them.)
Status CheckCount(int64_t count, const char* what) {
  if (count > INT_MAX) return InvalidArgumentError(what, " count ", count, " exceeds the MPI limit ", INT_MAX);
  return Status::Ok();
}

// Fills `ints` (the counts) and `displs` (their prefix sums), both as MPI
// ints, and returns the total in `total`.
Status CountsAsInts(std::span<const int64_t> counts, const char* what, std::vector<int>* ints, std::vector<int>* displs,
                    int64_t* total) {
  ints->resize(counts.size());
  displs->resize(counts.size());
  int64_t sum = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    MLARUN_RETURN_IF_ERROR(CheckCount(counts[r], what));
    (*ints)[r] = static_cast<int>(counts[r]);
    (*displs)[r] = static_cast<int>(sum);
    sum += counts[r];
    // Displacements are ints too.
    if (sum > INT_MAX) return InvalidArgumentError(what, ": total count ", sum, " exceeds the MPI limit ", INT_MAX);
  }
  *total = sum;
  return Status::Ok();
}

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm`. Its error handler must already be MPI_ERRORS_RETURN.
  MpiCommunicator(MPI_Comm comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}
  ~MpiCommunicator() override {
    // A communicator that outlives the session must not call into a
    // finalized MPI (erroneous); the handle is gone with it anyway.
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }

  Status DoAllReduceSum(void* buf, int64_t count, CommType t) override {
    MLARUN_RETURN_IF_ERROR(CheckCount(count, "AllReduceSum"));
    MPI_Request request;
    if (t == CommType::kBF16) {
      // Sum in fp32: exact for the partial sums bf16 can hold, and one
      // rounding at the end instead of one per rank.
      std::vector<float> wide(count);
      ConvertBf16ToF32(static_cast<const bf16_t*>(buf), wide.data(), count);
      MLARUN_MPI_RETURN_IF_ERROR(
          MPI_Iallreduce(MPI_IN_PLACE, wide.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, comm_, &request));
      MLARUN_RETURN_IF_ERROR(WaitForRequest(&request));
      ConvertF32ToBf16(wide.data(), static_cast<bf16_t*>(buf), count);
      return Status::Ok();
    }
    MLARUN_MPI_RETURN_IF_ERROR(
        MPI_Iallreduce(MPI_IN_PLACE, buf, static_cast<int>(count), MpiType(t), MPI_SUM, comm_, &request));
    return WaitForRequest(&request);
  }

  Status DoAllGather(const void* send, int64_t count, void* recv, CommType t) override {
    MLARUN_RETURN_IF_ERROR(CheckCount(count, "AllGather"));
    MPI_Request request;
    const int n = static_cast<int>(count);
    MLARUN_MPI_RETURN_IF_ERROR(MPI_Iallgather(send, n, MpiType(t), recv, n, MpiType(t), comm_, &request));
    return WaitForRequest(&request);
  }

  Status DoAllGatherV(const void* send, std::span<const int64_t> counts, void* recv, CommType t) override {
    std::vector<int> ints, displs;
    int64_t total = 0;
    MLARUN_RETURN_IF_ERROR(CountsAsInts(counts, "AllGatherV", &ints, &displs, &total));
    MPI_Request request;
    MLARUN_MPI_RETURN_IF_ERROR(
        MPI_Iallgatherv(send, ints[rank_], MpiType(t), recv, ints.data(), displs.data(), MpiType(t), comm_, &request));
    return WaitForRequest(&request);
  }

  Status DoReduceScatterSumV(const void* send, std::span<const int64_t> counts, void* recv, CommType t) override {
    std::vector<int> ints, displs;
    int64_t total = 0;
    MLARUN_RETURN_IF_ERROR(CountsAsInts(counts, "ReduceScatterSumV", &ints, &displs, &total));
    MPI_Request request;
    if (t == CommType::kBF16) {
      // As in AllReduceSum: widen, reduce in fp32, round once.
      std::vector<float> wide_send(total), wide_recv(counts[rank_]);
      ConvertBf16ToF32(static_cast<const bf16_t*>(send), wide_send.data(), total);
      MLARUN_MPI_RETURN_IF_ERROR(
          MPI_Ireduce_scatter(wide_send.data(), wide_recv.data(), ints.data(), MPI_FLOAT, MPI_SUM, comm_, &request));
      MLARUN_RETURN_IF_ERROR(WaitForRequest(&request));
      ConvertF32ToBf16(wide_recv.data(), static_cast<bf16_t*>(recv), counts[rank_]);
      return Status::Ok();
    }
    MLARUN_MPI_RETURN_IF_ERROR(MPI_Ireduce_scatter(send, recv, ints.data(), MpiType(t), MPI_SUM, comm_, &request));
    return WaitForRequest(&request);
  }

  Status DoBroadcast(void* buf, int64_t count, CommType t, int root) override {
    MLARUN_RETURN_IF_ERROR(CheckCount(count, "Broadcast"));
    MPI_Request request;
    MLARUN_MPI_RETURN_IF_ERROR(MPI_Ibcast(buf, static_cast<int>(count), MpiType(t), root, comm_, &request));
    return WaitForRequest(&request);
  }

  Status DoBarrier() override {
    MPI_Request request;
    MLARUN_MPI_RETURN_IF_ERROR(MPI_Ibarrier(comm_, &request));
    return WaitForRequest(&request);
  }

 private:
  MPI_Comm comm_;
  int rank_, size_;
};

// Wraps a communicator this process just created, after switching it to
// error codes. Frees it if anything fails.
StatusOr<std::unique_ptr<Communicator>> Adopt(MPI_Comm comm) {
  int rank = 0, size = 0;
  Status st = [&]() -> Status {
    MLARUN_MPI_RETURN_IF_ERROR(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    MLARUN_MPI_RETURN_IF_ERROR(MPI_Comm_rank(comm, &rank));
    MLARUN_MPI_RETURN_IF_ERROR(MPI_Comm_size(comm, &size));
    return Status::Ok();
  }();
  if (!st.ok()) {
    MPI_Comm_free(&comm);
    return st;
  }
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(comm, rank, size));
}

// MPI_Comm_split is blocking and spins; waiting at a sleeping barrier first
// means the split itself only starts once every rank has arrived.
StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) {
  MPI_Request request;
  MLARUN_MPI_RETURN_IF_ERROR(MPI_Ibarrier(g_job, &request));
  MLARUN_RETURN_IF_ERROR(WaitForRequest(&request));
  MPI_Comm comm = MPI_COMM_NULL;
  MLARUN_MPI_RETURN_IF_ERROR(MPI_Comm_split(g_job, color, key, &comm));
  return Adopt(comm);
}

// This process's application context under an MPMD launch: MPI_APPNUM (0
// when the launcher sets none), and whether the world is to be split into
// one job per context: it has more than one and any rank asked for it.
Status AppContext(bool job_per_context, int* appnum, bool* split) {
  int* value = nullptr;
  int flag = 0;
  MLARUN_MPI_RETURN_IF_ERROR(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &value, &flag));
  *appnum = flag != 0 && value != nullptr ? *value : 0;
  int mine[2] = {*appnum, job_per_context ? 1 : 0}, highest[2] = {0, 0};
  MLARUN_MPI_RETURN_IF_ERROR(MPI_Allreduce(mine, highest, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  *split = highest[0] > 0 && highest[1] > 0;
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<MpiSession>> MpiSession::Init(int* argc, char*** argv, bool job_per_context) {
  int initialized = 0;
  MLARUN_MPI_RETURN_IF_ERROR(MPI_Initialized(&initialized));
  if (initialized) return FailedPreconditionError("MPI is already initialized: one MpiSession per process");
  int finalized = 0;
  MLARUN_MPI_RETURN_IF_ERROR(MPI_Finalized(&finalized));
  if (finalized) return FailedPreconditionError("MPI was already finalized: it cannot be initialized again");
  // FUNNELED: the engine may run threads (OpenMP, gRPC), but only the thread
  // that initialized MPI calls into it.
  int provided = 0;
  MLARUN_MPI_RETURN_IF_ERROR(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
  std::unique_ptr<MpiSession> session(new MpiSession());
  // From here on the session's destructor finalizes MPI on every error path.
  if (provided < MPI_THREAD_FUNNELED) {
    return FailedPreconditionError("MPI provides thread level ", provided, ", below MPI_THREAD_FUNNELED");
  }
  // Errors come back as codes (and then as a Status) instead of ending the job.
  MLARUN_MPI_RETURN_IF_ERROR(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  // Asked for, every context of an MPMD launch is a job of its own: its
  // ranks, its layout, its world (as if each had its own mpirun).
  int appnum = 0;
  bool split = false;
  MLARUN_RETURN_IF_ERROR(AppContext(job_per_context, &appnum, &split));
  session->appnum_ = appnum;
  if (split) {
    int world_rank = 0;
    MLARUN_MPI_RETURN_IF_ERROR(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
    MLARUN_MPI_RETURN_IF_ERROR(MPI_Comm_split(MPI_COMM_WORLD, appnum, world_rank, &g_job));
    MLARUN_MPI_RETURN_IF_ERROR(MPI_Comm_set_errhandler(g_job, MPI_ERRORS_RETURN));
  }
  MLARUN_MPI_RETURN_IF_ERROR(MPI_Comm_rank(g_job, &session->rank_));
  MLARUN_MPI_RETURN_IF_ERROR(MPI_Comm_size(g_job, &session->size_));
  g_world_rank = session->rank_;
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  if (MPI_Get_processor_name(name, &len) == MPI_SUCCESS && len > 0) {
    session->host_.assign(name, len);
  } else {
    session->host_ = LocalHostName();
  }
  return session;
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (g_job != MPI_COMM_WORLD) MPI_Comm_free(&g_job);
  g_job = MPI_COMM_WORLD;
  MPI_Finalize();
}

StatusOr<std::unique_ptr<Communicator>> MpiSession::World() const {
  // The non-blocking dup lets ranks that arrive early sleep instead of spin.
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Request request;
  MLARUN_MPI_RETURN_IF_ERROR(MPI_Comm_idup(g_job, &comm, &request));
  MLARUN_RETURN_IF_ERROR(WaitForRequest(&request));
  return Adopt(comm);
}

StatusOr<ProcessGroups> MpiSession::Groups(const ParallelLayout& layout) const {
  // Every rank has the same layout and world size, so every rank returns this
  // error before any collective: nobody is left waiting.
  if (layout.dp < 1 || layout.attn_tp < 1 || layout.world() != size_) {
    return InvalidArgumentError("layout dp=", layout.dp, " x attn_tp=", layout.attn_tp, " needs ", layout.world(),
                                " ranks, mpirun started ", size_);
  }
  ProcessGroups groups;
  groups.layout = layout;
  groups.rank = rank_;
  MLARUN_ASSIGN_OR_RETURN(groups.world, World());
  MLARUN_ASSIGN_OR_RETURN(groups.attn_tp, Split(layout.dp_rank(rank_), layout.attn_tp_rank(rank_)));
  MLARUN_ASSIGN_OR_RETURN(groups.dp_peers, Split(layout.attn_tp_rank(rank_), layout.dp_rank(rank_)));
  return groups;
}

void MpiSession::Abort(const std::string& message, int code) const {
  std::fprintf(stderr, "mlarun: rank %d on %s: %s\n", rank_, host_.c_str(), message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  // MPI_Abort does not return in Open MPI; the standard does not promise it.
  std::_Exit(code != 0 ? code : 1);
}

}  // namespace mlarun
