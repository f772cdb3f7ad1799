// A worker rank's end of the transfer plane (transfer/block_transfer.h): one
// BlockTransfer over the rank's cache pool, a thread that keeps its UCX
// worker answering peers while the step loop runs (connection handshakes,
// and every get over TCP), and the BlockImporter through which the rank
// fetches a moved request's blocks from the ranks of its old group.
//
// Rank i of a group reads from rank i % n of the old group's n ranks, so a
// move's reads spread over the old group; each rank of the new group reads
// every block once (each holds the group's whole latent cache).
//
// Threading: the progress thread and the step loop share the BlockTransfer
// under one lock; a fetch holds it until its gets landed (the fetching
// rank's own worker needs no one else meanwhile).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "base/status.h"
#include "base/thread_annotations.h"
#include "runtime/runner/model_runner.h"
#include "transfer/block_transfer.h"

namespace mlarun {

// "shm" or "any" (TransferPath); INVALID_ARGUMENT naming the value otherwise.
StatusOr<TransferPath> ParseTransferPath(std::string_view name);
std::string_view TransferPathName(TransferPath path);

class TransferAgent final : public BlockImporter {
 public:
  explicit TransferAgent(TransferPath path) : path_(path) {}
  ~TransferAgent() override;
  TransferAgent(const TransferAgent&) = delete;
  TransferAgent& operator=(const TransferAgent&) = delete;

  // Registers `pool` (which must outlive this) with UCX and starts the
  // progress thread.
  Status Start(const LatentPool& pool);
  // This rank's descriptor, for the other groups (through the coordinator).
  std::string Descriptor() const;

  // Fetches import.src of the old group's rank rank_in_group % n into
  // import.dst of `pool` (the pool given to Start). A peer that failed is
  // connected again at the next import.
  Status Import(const StepPlan::Import& import, int rank_in_group, LatentPool& pool) override;

  // Imports that landed, their bytes, and those that failed (their
  // requests are computed instead).
  Counters counters() const override;
  TransferPath path() const { return path_; }

 private:
  void ProgressLoop();

  const TransferPath path_;
  mutable Mutex mu_;
  std::unique_ptr<BlockTransfer> transfer_ MLARUN_GUARDED_BY(mu_);
  const LatentPool* pool_ = nullptr;                         // set by Start
  std::map<std::string, int> peers_ MLARUN_GUARDED_BY(mu_);  // descriptor -> connected peer
  int64_t failures_ MLARUN_GUARDED_BY(mu_) = 0;
  std::atomic<bool> stop_{false};
  std::thread progress_;
};

}  // namespace mlarun
